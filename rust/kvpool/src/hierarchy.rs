//! `HierarchyBlockManagerPool`: a [`BlockManagerPool`] with a host-memory KV tier per rank (R26).
//!
//! Each rank has a host [`BlockManagerImpl`] with its own ids (1..host_num_blocks, 0 is padding)
//! and its own prefix cache, same block size and hasher as the device. Data moves in
//! [`TransferPlan`]s (one per rank per direction per take, shaped for one `swap_blocks` call):
//!
//! - **load** (host -> device), planned by `allocate` of a sequence that holds nothing: after the
//!   device match (R8) the chain continues in the host cache; host hits get the fresh device blocks
//!   of their table entries. The pending record holds the chain from block 0 on both tiers
//!   (host: the hit; device: matched blocks plus destinations). `complete_loads` publishes the
//!   device chain in the device cache and marks the sequence's [`LoadTicket`] done.
//! - **offload** (device -> host), planned by `deallocate`: the sequence's full computed blocks
//!   after the longest prefix already on host (and before the first block already being
//!   offloaded) get host blocks (host LRU may evict; if the host is short, the longest prefix that
//!   fits). The record holds the chain from block 0 on both tiers (device: the sequence's blocks;
//!   host: the pinned host prefix plus destinations). `complete_offloads` publishes the host
//!   chain in the host cache. Holding whole chains keeps R15 exact: no held block ever has a
//!   cache-only ancestor, which would count as available but could not be evicted (R10).
//!
//! - **fetch** (remote -> host), planned by [`HierarchyBlockManagerPool::allocate_with_remote`]:
//!   the caller (the Python binding) asked the remote tier, in one batched existence query, about
//!   the chain blocks past the device+host reach that [`HierarchyBlockManagerPool::remote_query`]
//!   reported, and passes the answer as [`RemoteHits`]. Remote hits get device blocks (their
//!   table entries) and fresh host *staging* blocks (never published in the host cache; freed
//!   when the load completes); the record is the load record of the whole hit (host hits plus
//!   remote hits) and becomes a load only after `complete_fetches`, truncated to the blocks that
//!   really arrived (`fail_fetches`: none did). Its ticket then says how far the sequence got.
//!   The core does no I/O: the fetch plan names the chain hashes (`keys`) and host ids.
//!
//! The ticket scheme: the caller owns the [`Sequence`], so `complete_loads` cannot reach it. A load
//! shares an `Arc<LoadTicket>` (a done flag and the token count the load brings the sequence to)
//! with the sequence. Until done the sequence counts only its device hit; once done its
//! `num_cached_tokens()` / `num_computed_tokens()` getters report the loaded tokens, and the
//! next pool call that takes the sequence (or `set_num_computed_tokens`) folds them into its
//! fields and drops the ticket. `deallocate` / reset drop the ticket, so a load confirmed after
//! its sequence was released or reallocated never touches the new allocation.
//!
//! Invariants (checked by [`HierarchyBlockManagerPool::check`]):
//! - both tiers of every rank keep R1-R12 (each manager's own `check`);
//! - every block named by a pending plan (taken or not) is held by that plan's record until
//!   `complete_*`, on both tiers: a plan never names a block that is free or owned by someone else;
//! - the destinations of pending loads are distinct device blocks, those of pending offloads
//!   distinct host blocks that are not cached (published only at completion); host staging
//!   blocks of pending fetches are distinct and never cached;
//! - a pending fetch's ticket is not done and promises exactly the record's chain; a fetch that
//!   fails (wholly or in part) shrinks the record and its ticket to what arrived, or marks the
//!   ticket done at the device hit when nothing is left to load;
//! - `offloading` holds exactly the hashes of the blocks in pending offloads, so a block is never
//!   offloaded twice; a plan id is completed at most once, and only by the pool that made it.

use std::collections::{HashMap, HashSet};

use crate::block::Block;
use crate::error::{ensure_arg, ensure_invariant, KvPoolError, Result};
use crate::hash::BlockHash;
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig};
use crate::pool::{BlockManagerPool, KvCacheManager, KvEvent, PoolConfig, PoolStats};
use crate::prefix_cache::ExtraKey;
use crate::sequence::Sequence;
// std atomics, not the loom shim: ids and load tickets are not part of the loom models.
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

static NEXT_PLAN_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_HIERARCHY_ID: AtomicU64 = AtomicU64::new(1);

/// When device blocks go to the host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// At `deallocate`: every full computed block of the sequence not yet on host (xLLM).
    #[default]
    OnDeallocate,
    /// At `deallocate`, but only blocks that this release makes evictable (held by nothing but
    /// the device cache afterwards); a block another sequence still holds goes to host when its
    /// last holder releases it. Nothing is copied for blocks that stay in use.
    OnEvict,
}

impl OffloadPolicy {
    /// Parses "on_deallocate" / "on_evict".
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "on_deallocate" => Ok(Self::OnDeallocate),
            "on_evict" => Ok(Self::OnEvict),
            other => Err(KvPoolError::invalid(
                "offload_policy",
                format!("must be 'on_deallocate' or 'on_evict', got {other:?}"),
            )),
        }
    }

    /// "on_deallocate" or "on_evict".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OnDeallocate => "on_deallocate",
            Self::OnEvict => "on_evict",
        }
    }
}

/// Options of a [`HierarchyBlockManagerPool`].
#[derive(Clone, Copy, Debug)]
pub struct HierarchyConfig {
    /// The device pool.
    pub pool: PoolConfig,
    /// Host block ids per rank, padding block included (>= 2).
    pub host_num_blocks: usize,
    /// When blocks are offloaded.
    pub offload_policy: OffloadPolicy,
}

impl HierarchyConfig {
    /// Defaults of DESIGN.md 2b.
    pub fn new(num_blocks: usize, host_num_blocks: usize, block_size: usize) -> Self {
        Self {
            pool: PoolConfig::new(num_blocks, block_size),
            host_num_blocks,
            offload_policy: OffloadPolicy::default(),
        }
    }
}

/// Direction of a [`TransferPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferDirection {
    /// Host -> device (`src` host ids, `dst` device ids).
    Load,
    /// Device -> host (`src` device ids, `dst` host ids).
    Offload,
    /// Remote -> host (`keys` chain hashes, `dst` host staging ids, `src` empty).
    Fetch,
}

impl TransferDirection {
    fn name(self) -> &'static str {
        match self {
            Self::Load => "load",
            Self::Offload => "offload",
            Self::Fetch => "fetch",
        }
    }
}

/// What to ask the remote tier before a first allocation: the chain hashes of blocks
/// `from..from + hashes.len()` (past the device and host matches, up to the R8 limit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteQuery {
    /// First chain position asked about (the device+host reach).
    pub from: usize,
    /// Chain hashes (R6) of the positions asked about.
    pub hashes: Vec<BlockHash>,
}

/// The remote tier's answer: chain blocks `from..to` exist there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteHits {
    /// First chain position that exists remotely.
    pub from: usize,
    /// One past the last (the leading run of hits).
    pub to: usize,
}

/// Block copies of one rank in one direction: copy block `src[i]` to block `dst[i]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferPlan {
    /// The rank whose caches the ids index.
    pub dp_rank: usize,
    /// Source block ids.
    pub src: Vec<i32>,
    /// Destination block ids (distinct).
    pub dst: Vec<i32>,
    /// Chain hashes (R6) of the blocks copied, one per `dst` entry: the remote keys of a fetch,
    /// the hashes of the blocks an offload puts on host (what a write-through sends on).
    pub keys: Vec<BlockHash>,
    id: u64,
    pool: u64,
    direction: TransferDirection,
}

impl TransferPlan {
    /// Process-unique id of the plan.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Load or offload.
    pub fn direction(&self) -> TransferDirection {
        self.direction
    }

    /// Number of block copies.
    pub fn len(&self) -> usize {
        self.dst.len()
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.dst.is_empty()
    }
}

/// Shared by a pending load and the sequence it fills (see the module doc).
pub struct LoadTicket {
    done: AtomicU32,
    /// Shrinks when a fetch fails in part; written only before `done` is set.
    tokens: AtomicUsize,
}

impl LoadTicket {
    fn new(tokens: usize) -> Self {
        Self {
            done: AtomicU32::new(0),
            tokens: AtomicUsize::new(tokens),
        }
    }

    /// Tokens the sequence counts as cached once the load is done, or `None` before.
    fn done_tokens(&self) -> Option<usize> {
        // Acquire: pairs with the Release of `finish`.
        (self.done.load(Ordering::Acquire) != 0).then(|| self.tokens.load(Ordering::Relaxed))
    }

    /// Marks the load done at `tokens`.
    fn finish(&self, tokens: usize) {
        // Relaxed: published by the Release store below.
        self.tokens.store(tokens, Ordering::Relaxed);
        // Release: the sequence's reader sees the load as done, with its token count.
        self.done.store(1, Ordering::Release);
    }

    fn promised(&self) -> usize {
        self.tokens.load(Ordering::Relaxed)
    }
}

impl Sequence {
    /// host tier (R26): tokens a confirmed host load brought the sequence to (0 if none).
    pub(crate) fn host_loaded_tokens(&self) -> usize {
        self.host_load
            .as_ref()
            .and_then(|t| t.done_tokens())
            .unwrap_or(0)
    }

    /// host tier (R26): folds a confirmed host load into the counts and drops the ticket.
    pub(crate) fn fold_host_load(&mut self) {
        if let Some(tokens) = self.host_load.as_ref().and_then(|t| t.done_tokens()) {
            self.num_cached_tokens = self.num_cached_tokens.max(tokens);
            self.num_computed_tokens = self.num_computed_tokens.max(tokens);
            self.host_load = None;
        }
    }
}

/// A chain of blocks in transfer: blocks `start..hashes.len()` are copied from
/// `src[start - src_offset..]` to `chain[start..]`. The destination tier holds the whole chain
/// from block 0, and so does the source tier for every *cached* source block (`src_offset` is 0
/// whenever the record pins host cache hits), so no pinned cached block ever has a cache-only
/// ancestor (which would count as evictable but could not be evicted, R10).
///
/// Loads with remote hits: positions `fetch_start..` of `src` are host staging blocks (fresh,
/// never cached) that the fetch fills; until `complete_fetches` the record is a fetch. Without
/// a host hit before them, `src_offset` is that first fetched position, and it stays so when
/// the completed fetch turns the record into a load: its source is then staging blocks only.
struct Pending {
    hashes: Vec<BlockHash>,
    tokens: Vec<u32>,
    extra_key: Option<ExtraKey>,
    /// Destination tier: the whole chain (prefix plus destinations).
    chain: Vec<Block>,
    /// Source tier: chain positions `src_offset..` (prefix plus sources).
    src: Vec<Block>,
    start: usize,
    /// First chain position of `src`: 0, or `fetch_start` when no host hit precedes the fetch.
    src_offset: usize,
    /// First chain position filled from the remote tier (`hashes.len()` when none).
    fetch_start: usize,
    /// Loads: the ticket of the sequence.
    ticket: Option<Arc<LoadTicket>>,
}

impl Drop for Pending {
    /// Releases both chains tail first, so a chain's tail is older on the LRU than its head
    /// (R10, R11; see `Sequence`'s `Drop`).
    fn drop(&mut self) {
        while self.chain.pop().is_some() {}
        while self.src.pop().is_some() {}
    }
}

impl Pending {
    /// Blocks this record still has to move in `direction`.
    fn pending(&self, direction: TransferDirection) -> usize {
        match direction {
            TransferDirection::Fetch => self.hashes.len() - self.fetch_start,
            _ => self.hashes.len() - self.start,
        }
    }

    /// Keeps chain positions `..end` (a fetch that delivered only part of its blocks); what
    /// remains is all on host, so no fetch part is left.
    fn truncate(&mut self, end: usize, block_size: usize) {
        self.hashes.truncate(end);
        self.tokens.truncate(end * block_size);
        self.chain.truncate(end);
        self.src.truncate(end.saturating_sub(self.src_offset));
        self.fetch_start = end;
    }
}

/// Counters of one rank's host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostStats {
    /// Host block counts (R2).
    pub counts: BlockCounts,
    /// Tokens of full blocks looked up in the host cache (past the device hit).
    pub query_tokens: u64,
    /// Tokens of those that hit (and were planned for loading).
    pub hit_tokens: u64,
    /// Blocks whose load was confirmed.
    pub loaded_blocks: u64,
    /// Blocks whose offload was confirmed.
    pub offloaded_blocks: u64,
    /// Host blocks evicted from the host cache.
    pub evictions: u64,
    /// Blocks in loads planned but not confirmed.
    pub pending_load_blocks: usize,
    /// Blocks in offloads planned but not confirmed.
    pub pending_offload_blocks: usize,
    /// Remote tier: blocks planned for fetching (remote hits past the device+host reach).
    pub remote_hit_blocks: u64,
    /// Remote tier: blocks whose fetch was confirmed (arrived and verified).
    pub fetched_blocks: u64,
    /// Remote tier: blocks whose fetch failed (the sequence recomputes them).
    pub failed_fetch_blocks: u64,
    /// Remote tier: blocks in fetches planned but not confirmed.
    pub pending_fetch_blocks: usize,
}

impl HostStats {
    fn add(&mut self, o: &HostStats) {
        self.counts.total += o.counts.total;
        self.counts.free += o.counts.free;
        self.counts.cached += o.counts.cached;
        self.counts.used += o.counts.used;
        self.query_tokens += o.query_tokens;
        self.hit_tokens += o.hit_tokens;
        self.loaded_blocks += o.loaded_blocks;
        self.offloaded_blocks += o.offloaded_blocks;
        self.evictions += o.evictions;
        self.pending_load_blocks += o.pending_load_blocks;
        self.pending_offload_blocks += o.pending_offload_blocks;
        self.remote_hit_blocks += o.remote_hit_blocks;
        self.fetched_blocks += o.fetched_blocks;
        self.failed_fetch_blocks += o.failed_fetch_blocks;
        self.pending_fetch_blocks += o.pending_fetch_blocks;
    }
}

/// Statistics of a hierarchy pool: the device pool's and the host tier's (totals and per rank).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HierarchyStats {
    /// Device tier (R20).
    pub device: PoolStats,
    /// Host tier, summed over ranks.
    pub host: HostStats,
    /// Host tier per rank.
    pub host_ranks: Vec<HostStats>,
}

struct HostRank {
    host: BlockManagerImpl,
    /// Planned, not yet taken.
    loads: Vec<Pending>,
    offloads: Vec<Pending>,
    /// Loads with remote hits, planned, not yet taken.
    fetches: Vec<Pending>,
    /// Hashes of the blocks of every pending offload (taken or not).
    offloading: HashSet<u128>,
    query_tokens: u64,
    hit_tokens: u64,
    loaded_blocks: u64,
    offloaded_blocks: u64,
    remote_hit_blocks: u64,
    fetched_blocks: u64,
    failed_fetch_blocks: u64,
}

/// Taken, unconfirmed plans.
struct Taken {
    rank: usize,
    direction: TransferDirection,
    records: Vec<Pending>,
}

/// A device pool plus a host tier per rank, with load and offload plans (R26).
pub struct HierarchyBlockManagerPool {
    id: u64,
    pool: BlockManagerPool,
    policy: OffloadPolicy,
    host_num_blocks: usize,
    hosts: Vec<HostRank>,
    taken: HashMap<u64, Taken>,
}

fn pending_len(records: &[Pending], direction: TransferDirection) -> usize {
    records.iter().map(|r| r.pending(direction)).sum()
}

impl HierarchyBlockManagerPool {
    /// A hierarchy pool per `config`.
    pub fn new(config: HierarchyConfig) -> Result<Self> {
        ensure_arg!(
            config.pool.linear_state_slots == 0,
            "linear_state_slots",
            "linear-state caching with a host tier is not available in this kvpool build"
        );
        ensure_arg!(
            config.pool.sliding_window.is_none(),
            "sliding_window",
            "sliding-window groups with a host tier are not available in this kvpool build"
        );
        let pool = BlockManagerPool::new(config.pool)?;
        let host_config = ManagerConfig {
            num_blocks: config.host_num_blocks,
            block_size: config.pool.block_size,
            enable_prefix_cache: true,
            hasher: config.pool.hasher,
        };
        let host_error = |e| match e {
            KvPoolError::InvalidArgument { message, .. } => {
                KvPoolError::invalid("host_num_blocks", message)
            }
            other => other,
        };
        host_config.validate().map_err(host_error)?;
        crate::alloc::probe(
            pool.dp_size() as u128 * host_config.footprint(),
            "host_num_blocks",
        )?;
        let mut hosts = Vec::with_capacity(pool.dp_size());
        for _ in 0..pool.dp_size() {
            hosts.push(HostRank {
                host: BlockManagerImpl::new(host_config).map_err(host_error)?,
                loads: Vec::new(),
                offloads: Vec::new(),
                fetches: Vec::new(),
                offloading: HashSet::new(),
                query_tokens: 0,
                hit_tokens: 0,
                loaded_blocks: 0,
                offloaded_blocks: 0,
                remote_hit_blocks: 0,
                fetched_blocks: 0,
                failed_fetch_blocks: 0,
            });
        }
        Ok(Self {
            // Relaxed: only uniqueness matters.
            id: NEXT_HIERARCHY_ID.fetch_add(1, Ordering::Relaxed),
            pool,
            policy: config.offload_policy,
            host_num_blocks: config.host_num_blocks,
            hosts,
            taken: HashMap::new(),
        })
    }

    /// The device pool (read-only: every mutation goes through this pool).
    pub fn device(&self) -> &BlockManagerPool {
        &self.pool
    }

    /// The host block manager of `rank`.
    pub fn host_manager(&self, rank: usize) -> Option<&BlockManagerImpl> {
        self.hosts.get(rank).map(|h| &h.host)
    }

    /// Host block ids per rank, padding included.
    pub fn host_num_blocks(&self) -> usize {
        self.host_num_blocks
    }

    /// The offload policy.
    pub fn offload_policy(&self) -> OffloadPolicy {
        self.policy
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Number of dp ranks.
    pub fn dp_size(&self) -> usize {
        self.pool.dp_size()
    }

    fn device_cache_on(&self) -> bool {
        self.pool.config().enable_prefix_cache
    }

    /// Plans the host and remote part of a first allocation that just succeeded on the device:
    /// host hits past the device hit, then the remote hits `remote` reports past the
    /// device+host reach (ignored unless they start at or before that reach). Best effort: the
    /// allocation already succeeded, so shortages only trim the hit (R14, R15).
    fn plan_loads(&mut self, seq: &mut Sequence, remote: Option<RemoteHits>) {
        if !self.device_cache_on() {
            return;
        }
        let Some(rank) = seq.dp_rank else { return };
        let bs = self.pool.block_size();
        let device_hit = seq.num_cached_tokens / bs;
        let query = (seq.len() - 1) / bs; // R8
        if device_hit >= query {
            return;
        }
        let hasher = self.pool.config().hasher;
        seq.ensure_hashes(&hasher, bs, query * bs);
        let host = &mut self.hosts[rank];
        let Some(cache) = host.host.prefix_cache_mut() else {
            return;
        };
        let hashes = seq.hashes(query);
        let probe = cache.probe(hashes, seq.tokens(), seq.extra_key(), query);
        host.query_tokens += ((query - device_hit) * bs) as u64;
        let reach = probe.matched.max(device_hit);
        let wanted = match remote {
            Some(hits) if hits.from <= reach && reach < hits.to => hits.to.min(query),
            _ => reach,
        };
        if wanted <= device_hit {
            return;
        }
        // The device needs one fresh block per hit: trim the hit to what it can have.
        let table = seq.blocks.len();
        let available = self
            .pool
            .block_manager(rank)
            .map_or(0, |m| m.num_available());
        let mut loads = (wanted - device_hit).min(table - device_hit + available);
        if device_hit + loads > table {
            let grown = self
                .pool
                .allocate(seq, Some((device_hit + loads) * bs))
                .unwrap_or(false);
            if !grown {
                loads = table - device_hit;
            }
        }
        if loads == 0 {
            return;
        }
        let mut end = device_hit + loads;
        let host = &mut self.hosts[rank];
        let cache = host.host.prefix_cache_mut().expect("host cache is on");
        let hashes = seq.hashes(end).to_vec();
        // Host hits: pin the host chain from block 0 (so src_offset is 0).
        let host_end = reach.min(end);
        let mut src = Vec::with_capacity(end);
        let src_offset = if host_end > device_hit {
            let matched =
                cache.match_prefix(&hashes, seq.tokens(), seq.extra_key(), host_end, &mut src);
            debug_assert_eq!(matched, host_end);
            0
        } else {
            host_end
        };
        // Remote hits: fresh host staging blocks (the longest run that fits).
        if end > host_end {
            let n = (end - host_end).min(host.host.num_available());
            end = if n > 0 && host.host.allocate_into(n, &mut src).is_ok() {
                host_end + n
            } else {
                host_end
            };
        }
        if end <= device_hit {
            drop(src);
            if let Some(cache) = host.host.prefix_cache_mut() {
                cache.drain_released();
            }
            return;
        }
        host.hit_tokens += ((host_end - device_hit) * bs) as u64;
        let ticket = Arc::new(LoadTicket::new(end * bs));
        seq.host_load = Some(Arc::clone(&ticket));
        let record = Pending {
            hashes: hashes[..end].to_vec(),
            tokens: seq.tokens()[..end * bs].to_vec(),
            extra_key: seq.extra_key_arc().cloned(),
            chain: seq.blocks[..end].to_vec(),
            src,
            start: device_hit,
            src_offset,
            fetch_start: host_end,
            ticket: Some(ticket),
        };
        if end > host_end {
            host.remote_hit_blocks += (end - host_end) as u64;
            host.fetches.push(record);
        } else {
            host.loads.push(record);
        }
    }

    /// Remote tier: what to ask the remote tier before allocating `seq` (a sequence that holds
    /// nothing): the chain hashes past the device and host matches of the rank it would go to,
    /// up to the R8 limit. `None` when there is nothing to ask: the sequence holds blocks, the
    /// device cache is off, `allocate(seq, num_tokens)` would fail, or the local tiers cover the
    /// whole prompt. No side effect on either tier (the sequence caches its hashes).
    pub fn remote_query(
        &mut self,
        seq: &mut Sequence,
        num_tokens: Option<usize>,
    ) -> Result<Option<RemoteQuery>> {
        seq.fold_host_load();
        if !self.device_cache_on()
            || self.pool.check_owner(seq)?
            || !self.pool.can_allocate(seq, num_tokens)?
        {
            return Ok(None);
        }
        let Some(rank) = self.pool.choose_rank(seq) else {
            return Ok(None);
        };
        let bs = self.pool.block_size();
        let query = seq.len().saturating_sub(1) / bs; // R8
        if query == 0 {
            return Ok(None);
        }
        let hasher = self.pool.config().hasher;
        seq.ensure_hashes(&hasher, bs, query * bs);
        let hashes = seq.hashes(query);
        let probe = |m: Option<&BlockManagerImpl>| {
            m.and_then(|m| m.prefix_cache()).map_or(0, |c| {
                c.probe(hashes, seq.tokens(), seq.extra_key(), query)
                    .matched
            })
        };
        let from = probe(self.pool.block_manager(rank)).max(probe(Some(&self.hosts[rank].host)));
        Ok((from < query).then(|| RemoteQuery {
            from,
            hashes: hashes[from..query].to_vec(),
        }))
    }

    /// Remote tier: `allocate(seq, num_tokens)` where chain blocks `remote.from..remote.to`
    /// exist on the remote tier (the answer to [`Self::remote_query`]). Exactly as
    /// all-or-nothing as `allocate` and with the same answer (R14, R15): the remote part only
    /// trims itself to the device and host blocks there are. Remote hits past the device+host
    /// reach get device blocks, host staging blocks and a fetch plan ([`Self::take_fetch_plans`]);
    /// hits that do not start at or before that reach are ignored (the tiers changed since the
    /// query).
    pub fn allocate_with_remote(
        &mut self,
        seq: &mut Sequence,
        num_tokens: Option<usize>,
        remote: Option<RemoteHits>,
    ) -> Result<bool> {
        seq.fold_host_load();
        if self.pool.check_owner(seq)? {
            return self.pool.allocate(seq, num_tokens);
        }
        if !self.pool.allocate(seq, num_tokens)? {
            return Ok(false);
        }
        self.plan_loads(seq, remote);
        Ok(true)
    }

    /// Plans the offload of `seq`'s full computed blocks (before it releases them).
    fn plan_offload(&mut self, seq: &mut Sequence) {
        if !self.device_cache_on() {
            return;
        }
        let Some(rank) = seq.dp_rank else { return };
        let bs = self.pool.block_size();
        let full = (seq.num_computed_tokens / bs).min(seq.blocks.len());
        if full == 0 {
            return;
        }
        let hasher = self.pool.config().hasher;
        seq.ensure_hashes(&hasher, bs, full * bs);
        let hashes = seq.hashes(full);
        let host = &mut self.hosts[rank];
        let cache = host.host.prefix_cache_mut().expect("host cache is on");
        let on_host = cache
            .probe(hashes, seq.tokens(), seq.extra_key(), full)
            .matched;
        let evictable_only = self.policy == OffloadPolicy::OnEvict;
        let mut end = on_host;
        while end < full && !host.offloading.contains(&hashes[end].0) {
            let block = &seq.blocks[end];
            // A block is never offloaded twice; OnEvict: only what becomes evictable now.
            if evictable_only && !(block.is_cached() && block.ref_count() == 2) {
                break;
            }
            end += 1;
        }
        if end == on_host {
            return;
        }
        // Pin the host prefix the chain hangs from, then take the destinations (longest prefix
        // that fits when the host is short).
        let mut chain = Vec::with_capacity(end);
        let pinned = cache.match_prefix(hashes, seq.tokens(), seq.extra_key(), on_host, &mut chain);
        debug_assert_eq!(pinned, on_host);
        let n = (end - on_host).min(host.host.num_available());
        if n == 0 || host.host.allocate_into(n, &mut chain).is_err() {
            drop(chain);
            if let Some(cache) = host.host.prefix_cache_mut() {
                cache.drain_released();
            }
            return;
        }
        let end = on_host + n;
        for hash in &hashes[on_host..end] {
            host.offloading.insert(hash.0);
        }
        host.offloads.push(Pending {
            hashes: hashes[..end].to_vec(),
            tokens: seq.tokens()[..end * bs].to_vec(),
            extra_key: seq.extra_key_arc().cloned(),
            chain,
            src: seq.blocks[..end].to_vec(),
            start: on_host,
            src_offset: 0,
            fetch_start: end,
            ticket: None,
        });
    }

    fn take(&mut self, direction: TransferDirection) -> Vec<TransferPlan> {
        let mut plans = Vec::new();
        for (rank, host) in self.hosts.iter_mut().enumerate() {
            let records = match direction {
                TransferDirection::Load => std::mem::take(&mut host.loads),
                TransferDirection::Offload => std::mem::take(&mut host.offloads),
                TransferDirection::Fetch => std::mem::take(&mut host.fetches),
            };
            if records.is_empty() {
                continue;
            }
            let n = pending_len(&records, direction);
            let (mut src, mut dst, mut keys) = (
                Vec::with_capacity(n),
                Vec::with_capacity(n),
                Vec::with_capacity(n),
            );
            for r in &records {
                if direction == TransferDirection::Fetch {
                    let staging = &r.src[r.fetch_start - r.src_offset..];
                    dst.extend(staging.iter().map(|b| b.id() as i32));
                    keys.extend_from_slice(&r.hashes[r.fetch_start..]);
                } else {
                    src.extend(
                        r.src[r.start - r.src_offset..]
                            .iter()
                            .map(|b| b.id() as i32),
                    );
                    dst.extend(r.chain[r.start..].iter().map(|b| b.id() as i32));
                    keys.extend_from_slice(&r.hashes[r.start..]);
                }
            }
            // Relaxed: only uniqueness matters.
            let id = NEXT_PLAN_ID.fetch_add(1, Ordering::Relaxed);
            self.taken.insert(
                id,
                Taken {
                    rank,
                    direction,
                    records,
                },
            );
            plans.push(TransferPlan {
                dp_rank: rank,
                src,
                dst,
                keys,
                id,
                pool: self.id,
                direction,
            });
        }
        plans
    }

    /// The load plans made since the last take, one per rank that has any (R26). Run them before
    /// the step that needs them, then confirm with [`Self::complete_loads`].
    pub fn take_load_plans(&mut self) -> Vec<TransferPlan> {
        self.take(TransferDirection::Load)
    }

    /// The offload plans made since the last take, one per rank that has any (R26); confirm with
    /// [`Self::complete_offloads`]. Loads and offloads never share a block, so they may run in
    /// either order.
    pub fn take_offload_plans(&mut self) -> Vec<TransferPlan> {
        self.take(TransferDirection::Offload)
    }

    /// The fetch plans (remote -> host staging) made since the last take, one per rank that has
    /// any. Run them (the remote tier's `get_many` of `keys`, verified, into host ids `dst`),
    /// then report what arrived with [`Self::complete_fetches`] or [`Self::fail_fetches`]; the
    /// loads that follow are taken with [`Self::take_load_plans`].
    pub fn take_fetch_plans(&mut self) -> Vec<TransferPlan> {
        self.take(TransferDirection::Fetch)
    }

    fn validate_plans(&self, plans: &[&TransferPlan], direction: TransferDirection) -> Result<()> {
        let what = direction.name();
        let mut seen = HashSet::with_capacity(plans.len());
        for (i, plan) in plans.iter().enumerate() {
            ensure_arg!(
                plan.pool == self.id,
                "plans",
                "plans[{i}] was made by another pool"
            );
            ensure_arg!(
                plan.direction == direction,
                "plans",
                "plans[{i}] is not a {what} plan"
            );
            ensure_arg!(
                seen.insert(plan.id),
                "plans",
                "plans[{i}] appears twice in the list"
            );
            ensure_arg!(
                self.taken.contains_key(&plan.id),
                "plans",
                "plans[{i}] was already completed"
            );
        }
        Ok(())
    }

    /// Confirms that the engine ran these load plans: the loaded blocks are published in the
    /// device cache and their sequences count the loaded tokens as cached and computed (R26).
    /// Foreign, repeated or already-completed plans are an `InvalidArgument`; nothing changes then.
    pub fn complete_loads(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        self.validate_plans(plans, TransferDirection::Load)?;
        for plan in plans {
            let taken = self.taken.remove(&plan.id).expect("validated");
            let rank = taken.rank;
            let bs = self.pool.block_size();
            let device = self
                .pool
                .block_manager_mut(rank)
                .and_then(|m| m.prefix_cache_mut())
                .expect("loads need the device cache");
            for record in &taken.records {
                device.insert(
                    &record.hashes,
                    &record.tokens,
                    &record.chain,
                    0,
                    record.extra_key.as_ref(),
                    false,
                );
                if let Some(ticket) = &record.ticket {
                    ticket.finish(record.hashes.len() * bs);
                }
            }
            self.hosts[rank].loaded_blocks +=
                pending_len(&taken.records, TransferDirection::Load) as u64;
            drop(taken);
            self.drain(rank);
            self.pool.collect_events(rank);
        }
        Ok(())
    }

    /// Confirms that the engine ran these offload plans: the host blocks are published in the
    /// host cache (matchable from now on) and the device blocks are released (R26).
    /// Foreign, repeated or already-completed plans are an `InvalidArgument`; nothing changes then.
    pub fn complete_offloads(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        self.validate_plans(plans, TransferDirection::Offload)?;
        for plan in plans {
            let taken = self.taken.remove(&plan.id).expect("validated");
            let rank = taken.rank;
            let host = &mut self.hosts[rank];
            let cache = host.host.prefix_cache_mut().expect("host cache is on");
            for record in &taken.records {
                cache.insert(
                    &record.hashes,
                    &record.tokens,
                    &record.chain,
                    0,
                    record.extra_key.as_ref(),
                    false,
                );
                for hash in &record.hashes[record.start..] {
                    host.offloading.remove(&hash.0);
                }
            }
            host.offloaded_blocks += pending_len(&taken.records, TransferDirection::Offload) as u64;
            drop(taken);
            self.drain(rank);
        }
        Ok(())
    }

    /// Confirms that the engine ran these fetch plans: `arrived[i][j]` says whether block `j` of
    /// `plans[i]` arrived intact in its host staging block (`None`: all did). Each record keeps
    /// the leading run of arrived blocks and becomes a load (taken by
    /// [`Self::take_load_plans`]); its sequence's ticket then promises only that much. A record
    /// with nothing left to load is dropped and its ticket marked done at the device hit: the
    /// sequence recomputes the rest. Staging blocks past the kept run are freed.
    /// Foreign, repeated or already-completed plans, or `arrived` of the wrong shape, are an
    /// `InvalidArgument`; nothing changes then.
    pub fn complete_fetches(
        &mut self,
        plans: &[&TransferPlan],
        arrived: Option<&[Vec<bool>]>,
    ) -> Result<()> {
        self.validate_plans(plans, TransferDirection::Fetch)?;
        if let Some(arrived) = arrived {
            ensure_arg!(
                arrived.len() == plans.len(),
                "arrived",
                "has {} entries for {} plans",
                arrived.len(),
                plans.len()
            );
            for (i, (a, plan)) in arrived.iter().zip(plans).enumerate() {
                ensure_arg!(
                    a.len() == plan.len(),
                    "arrived",
                    "arrived[{i}] has {} entries, plans[{i}] fetches {} blocks",
                    a.len(),
                    plan.len()
                );
            }
        }
        let bs = self.pool.block_size();
        for (i, plan) in plans.iter().enumerate() {
            let taken = self.taken.remove(&plan.id).expect("validated");
            let rank = taken.rank;
            let host = &mut self.hosts[rank];
            let mut offset = 0;
            for mut record in taken.records {
                let k = record.pending(TransferDirection::Fetch);
                let ok = match arrived {
                    Some(arrived) => arrived[i][offset..offset + k]
                        .iter()
                        .take_while(|&&ok| ok)
                        .count(),
                    None => k,
                };
                offset += k;
                host.fetched_blocks += ok as u64;
                host.failed_fetch_blocks += (k - ok) as u64;
                let end = record.fetch_start + ok;
                if end > record.start {
                    record.truncate(end, bs);
                    if let Some(ticket) = &record.ticket {
                        // Not done yet: the sequence reads it only after `finish`.
                        ticket.tokens.store(end * bs, Ordering::Relaxed);
                    }
                    host.loads.push(record);
                } else if let Some(ticket) = &record.ticket {
                    ticket.finish(record.start * bs);
                }
            }
            self.drain(rank);
        }
        Ok(())
    }

    /// [`Self::complete_fetches`] with nothing arrived: the remote tier failed (timeout, lost
    /// connection, corrupt payloads). The host parts of the records still load.
    pub fn fail_fetches(&mut self, plans: &[&TransferPlan]) -> Result<()> {
        let arrived: Vec<Vec<bool>> = plans.iter().map(|p| vec![false; p.len()]).collect();
        self.complete_fetches(plans, Some(&arrived))
    }

    /// Puts the blocks whose last outside handle went onto both tiers' LRU lists.
    fn drain(&mut self, rank: usize) {
        if let Some(cache) = self
            .pool
            .block_manager_mut(rank)
            .and_then(|m| m.prefix_cache_mut())
        {
            cache.drain_released();
        }
        if let Some(cache) = self.hosts[rank].host.prefix_cache_mut() {
            cache.drain_released();
        }
    }

    /// Drops every cached entry of both tiers (R12, R26). Blocks that sequences or pending plans
    /// hold stay with them; a pending plan's chain is published again when it completes.
    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_prefix_cache();
        for host in &mut self.hosts {
            host.host.reset_prefix_cache();
        }
    }

    /// Takes the recorded KV events of the device tier (R21).
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.pool.drain_events()
    }

    /// R19: the block tables of `seqs` (see [`BlockManagerPool::block_tables`]).
    pub fn block_tables(&self, seqs: &[&Sequence]) -> Result<(Vec<i32>, usize)> {
        self.pool.block_tables(seqs, 0)
    }

    /// R19: the cache slots of tokens `[num_computed_tokens, len)`; tokens a confirmed host
    /// load brought count as computed, so they are not computed again.
    pub fn slot_mapping(&self, seqs: &[&Sequence]) -> Result<Vec<i64>> {
        self.pool.slot_mapping(seqs, 0)
    }

    /// Checks a sequence against the device pool.
    pub fn check_sequence(&self, seq: &Sequence) -> Result<()> {
        self.pool.check_sequence(seq)
    }

    /// Statistics of both tiers.
    pub fn stats(&self) -> HierarchyStats {
        let mut stats = HierarchyStats {
            device: self.pool.stats(),
            ..HierarchyStats::default()
        };
        let mut pending_loads = vec![0; self.hosts.len()];
        let mut pending_offloads = vec![0; self.hosts.len()];
        let mut pending_fetches = vec![0; self.hosts.len()];
        for taken in self.taken.values() {
            let n = pending_len(&taken.records, taken.direction);
            match taken.direction {
                TransferDirection::Load => pending_loads[taken.rank] += n,
                TransferDirection::Offload => pending_offloads[taken.rank] += n,
                TransferDirection::Fetch => pending_fetches[taken.rank] += n,
            }
        }
        for (rank, host) in self.hosts.iter().enumerate() {
            let r = HostStats {
                counts: host.host.counts(),
                query_tokens: host.query_tokens,
                hit_tokens: host.hit_tokens,
                loaded_blocks: host.loaded_blocks,
                offloaded_blocks: host.offloaded_blocks,
                evictions: host.host.prefix_cache().map_or(0, |c| c.stats().evictions),
                pending_load_blocks: pending_loads[rank]
                    + pending_len(&host.loads, TransferDirection::Load),
                pending_offload_blocks: pending_offloads[rank]
                    + pending_len(&host.offloads, TransferDirection::Offload),
                remote_hit_blocks: host.remote_hit_blocks,
                fetched_blocks: host.fetched_blocks,
                failed_fetch_blocks: host.failed_fetch_blocks,
                pending_fetch_blocks: pending_fetches[rank]
                    + pending_len(&host.fetches, TransferDirection::Fetch),
            };
            stats.host.add(&r);
            stats.host_ranks.push(r);
        }
        stats
    }

    /// Walks both tiers of every rank and every pending plan (R20, R26).
    pub fn check(&self) -> Result<()> {
        self.pool.check()?;
        let mut records: Vec<Vec<(TransferDirection, &Pending)>> =
            (0..self.hosts.len()).map(|_| Vec::new()).collect();
        for (rank, host) in self.hosts.iter().enumerate() {
            host.host
                .check()
                .map_err(|e| in_rank(e, rank, "host tier"))?;
            records[rank].extend(host.loads.iter().map(|r| (TransferDirection::Load, r)));
            records[rank].extend(
                host.offloads
                    .iter()
                    .map(|r| (TransferDirection::Offload, r)),
            );
            records[rank].extend(host.fetches.iter().map(|r| (TransferDirection::Fetch, r)));
        }
        for taken in self.taken.values() {
            ensure_invariant!(
                taken.rank < self.hosts.len(),
                "plan of rank {} out of range",
                taken.rank
            );
            records[taken.rank].extend(taken.records.iter().map(|r| (taken.direction, r)));
        }
        let bs = self.pool.block_size();
        for (rank, records) in records.iter().enumerate() {
            let host = &self.hosts[rank];
            let device = self.pool.block_manager(rank).expect("rank exists");
            let mut load_dst = HashSet::new();
            let mut offload_dst = HashSet::new();
            let mut staging = HashSet::new();
            let mut offloading = HashSet::new();
            for &(direction, r) in records {
                let n = r.hashes.len();
                ensure_invariant!(
                    r.chain.len() == n
                        && r.src_offset + r.src.len() == n
                        && r.start < n
                        && r.tokens.len() == n * bs,
                    "dp rank {rank}: pending {direction:?} record has inconsistent lengths"
                );
                let is_fetch = direction == TransferDirection::Fetch;
                // A source that starts past block 0 holds only staging blocks: a fetch, or a load
                // that a completed fetch left (see `Pending`).
                let staging_only = r.src.iter().all(|b| !b.is_cached());
                ensure_invariant!(
                    r.start <= r.fetch_start
                        && r.fetch_start <= n
                        && (r.fetch_start < n) == is_fetch
                        && (r.src_offset == 0
                            || (staging_only && (!is_fetch || r.src_offset == r.fetch_start))),
                    "dp rank {rank}: pending {direction:?} record has an inconsistent fetch part"
                );
                let (src_tier, dst_tier): (&BlockManagerImpl, &BlockManagerImpl) = match direction {
                    TransferDirection::Load | TransferDirection::Fetch => (&host.host, device),
                    TransferDirection::Offload => (device, &host.host),
                };
                for b in &r.src[r.fetch_start.min(n) - r.src_offset..] {
                    ensure_invariant!(
                        !b.is_cached() && staging.insert(b.id()),
                        "dp rank {rank}: host staging block {} is cached or staged twice",
                        b.id()
                    );
                }
                ensure_invariant!(
                    r.src.iter().all(|b| src_tier.owns(b) && b.ref_count() >= 1)
                        && r.chain
                            .iter()
                            .all(|b| dst_tier.owns(b) && b.ref_count() >= 1),
                    "dp rank {rank}: pending {direction:?} names a block of the wrong tier (R26)"
                );
                for b in &r.chain[r.start..] {
                    let fresh = match direction {
                        TransferDirection::Load | TransferDirection::Fetch => {
                            load_dst.insert(b.id())
                        }
                        TransferDirection::Offload => {
                            ensure_invariant!(
                                !b.is_cached(),
                                "dp rank {rank}: host block {} is cached before its offload completed",
                                b.id()
                            );
                            offload_dst.insert(b.id())
                        }
                    };
                    ensure_invariant!(
                        fresh,
                        "dp rank {rank}: block {} is the destination of two pending copies",
                        b.id()
                    );
                }
                if direction == TransferDirection::Offload {
                    for h in &r.hashes[r.start..] {
                        ensure_invariant!(
                            offloading.insert(h.0),
                            "dp rank {rank}: a block is offloaded twice (R26)"
                        );
                    }
                }
                if let Some(ticket) = &r.ticket {
                    ensure_invariant!(
                        ticket.promised() == n * bs && ticket.done_tokens().is_none(),
                        "dp rank {rank}: load ticket out of step with its record"
                    );
                }
            }
            ensure_invariant!(
                offloading == host.offloading,
                "dp rank {rank}: offloading set differs from the pending offloads"
            );
        }
        Ok(())
    }
}

fn in_rank(error: KvPoolError, rank: usize, what: &str) -> KvPoolError {
    match error {
        KvPoolError::Invariant(message) => {
            KvPoolError::Invariant(format!("dp rank {rank} {what}: {message}"))
        }
        other => other,
    }
}

impl KvCacheManager for HierarchyBlockManagerPool {
    /// R15: the host part never changes the answer (host hits are trimmed to what the device can
    /// hold), so this is exactly the device pool's answer.
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        seq.fold_host_load();
        self.pool.can_allocate(seq, num_tokens)
    }

    fn allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        self.allocate_with_remote(seq, num_tokens, None)
    }

    fn can_append(&self, seq: &Sequence, lookahead: usize) -> Result<bool> {
        self.pool.can_append(seq, lookahead)
    }

    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool> {
        seq.fold_host_load();
        self.pool.may_append(seq, lookahead)
    }

    fn cache(&mut self, seq: &mut Sequence) -> Result<()> {
        seq.fold_host_load();
        self.pool.cache(seq)
    }

    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()> {
        seq.fold_host_load();
        if !self.pool.check_owner(seq)? {
            return Ok(());
        }
        if self.policy == OffloadPolicy::OnEvict {
            self.pool.cache(seq)?; // publish first: evictable = cached and held only by seq
        }
        self.plan_offload(seq);
        // A pending offload keeps the blocks: publish without skipping recomputed duplicates,
        // or a cached duplicate could get a held child and be counted evictable (R9).
        self.pool.release(seq, false)
    }
}
