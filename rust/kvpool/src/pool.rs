//! `BlockManagerPool`: the sequence-level KV-cache manager (the seed's `KVCacheManager`), one
//! block manager and one single-block manager per data-parallel rank.
//!
//! Invariants: a sequence holds blocks of at most one pool (`owner`) and one rank (R13); every
//! entry point is all-or-nothing (R14, R16, R29): it either succeeds or leaves the pool and the
//! sequence as they were (blocks, LRU, single blocks, statistics, dp rank); counts of every rank
//! obey R2; blocks are published only once their KV exists (R17).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::block::Block;
use crate::error::{ensure_arg, ensure_invariant, KvPoolError, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::linear_state::LinearStatePrefixCache;
use crate::manager::{
    BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig, SingleBlockManager,
};
use crate::prefix_cache::{CacheEvent, ExtraKey, Probe};
use crate::sequence::Sequence;
use crate::sliding_window::{SlidingWindowBlockManager, WindowTable};

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Options of a [`BlockManagerPool`].
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// Block ids per rank, padding block included.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Data-parallel ranks.
    pub dp_size: usize,
    /// Keep a prefix cache per rank.
    pub enable_prefix_cache: bool,
    /// Single blocks per rank, padding included (default: `num_blocks`).
    pub num_single_blocks: Option<usize>,
    /// Hasher (seed) of the chains.
    pub hasher: BlockHasher,
    /// Record KV events (R21).
    pub enable_events: bool,
    /// Recurrent-state slots per rank, padding slot 0 included; 0 disables linear state (R22).
    pub linear_state_slots: usize,
    /// Save a checkpoint every this many computed tokens (a multiple of `block_size`), besides
    /// the prompt's last block boundary (R24). `None`: only that boundary.
    pub checkpoint_interval: Option<usize>,
    /// How a KV prefix hit is trimmed to checkpointed boundaries (R23).
    pub linear_state_match: LinearStateMatch,
    /// How a checkpoint is saved (R22).
    pub linear_state_save: LinearStateSave,
    /// Sliding window in tokens of the second group (R25); `None`: one full-attention group.
    pub sliding_window: Option<usize>,
    /// Block ids per rank of the sliding-window group, padding included (default `num_blocks`).
    pub swa_num_blocks: Option<usize>,
}

/// R23: which checkpointed boundary a KV prefix hit is trimmed to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearStateMatch {
    /// The deepest boundary inside the KV hit whose prefix has a committed checkpoint.
    #[default]
    Deepest,
    /// The end of the longest run of checkpointed boundaries from block 0 (the seed's rule).
    Contiguous,
}

impl LinearStateMatch {
    /// From "deepest" or "contiguous".
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "deepest" => Ok(Self::Deepest),
            "contiguous" => Ok(Self::Contiguous),
            other => Err(KvPoolError::invalid(
                "linear_state_match",
                format!("must be \"deepest\" or \"contiguous\", got {other:?}"),
            )),
        }
    }
}

/// R22: how the pool saves a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LinearStateSave {
    /// Reserve a pending slot; the worker copies the live state into it, then the plan's commit
    /// makes it matchable.
    #[default]
    Copy,
    /// Zero-copy promotion: the live slot becomes the committed checkpoint at once and the
    /// sequence continues in a fresh slot (the worker copies the old slot into the new one
    /// before the next step, listed with the restores).
    Promote,
}

impl LinearStateSave {
    /// From "copy" or "promote".
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "copy" => Ok(Self::Copy),
            "promote" => Ok(Self::Promote),
            other => Err(KvPoolError::invalid(
                "linear_state_save",
                format!("must be \"copy\" or \"promote\", got {other:?}"),
            )),
        }
    }
}

/// The recurrent-state copies the worker must make before the next forward step (R24), for all
/// ranks: first every restore (`restore_src -> restore_dst`), then every save
/// (`save_src -> save_dst`, the checkpoint of `save_hashes[i]`). Confirm with
/// `commit_linear_state_plan` once copied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinearStatePlan {
    pool_id: u64,
    plan_id: u64,
    ops: Vec<u64>,
    /// dp rank of each restore.
    pub restore_dp_rank: Vec<i32>,
    /// Checkpoint slots to read.
    pub restore_src: Vec<i32>,
    /// Live slots to write.
    pub restore_dst: Vec<i32>,
    /// dp rank of each save.
    pub save_dp_rank: Vec<i32>,
    /// Live slots to read.
    pub save_src: Vec<i32>,
    /// Pending checkpoint slots to write.
    pub save_dst: Vec<i32>,
    /// Prefix hash of each saved checkpoint.
    pub save_hashes: Vec<BlockHash>,
}

impl LinearStatePlan {
    /// Number of copies (restores plus saves).
    pub fn len(&self) -> usize {
        self.restore_src.len() + self.save_src.len()
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    /// Copy a committed checkpoint (pinned) into a live slot.
    Restore,
    /// Copy a live slot into a pending checkpoint.
    Save,
    /// Copy a promoted (committed, pinned) checkpoint into the sequence's fresh live slot.
    Promote,
}

/// One planned copy; it holds the live slot it touches so the slot cannot be reused before the
/// copy is confirmed, even if the sequence is dropped.
struct LinearOp {
    rank: usize,
    kind: OpKind,
    hash: BlockHash,
    src: u32,
    dst: u32,
    /// Saves: the computed tokens whose state the save reads (its boundary, R24).
    boundary: usize,
    taken: bool,
    cancelled: bool,
    /// Checkpoints the held slot became (promoted) while this copy was in flight: pinned until
    /// the copy is confirmed, since evicting them would free nothing (F2).
    pins: Vec<BlockHash>,
    live: Block,
}

impl LinearOp {
    fn new(rank: usize, kind: OpKind, hash: BlockHash, src: u32, live: Block) -> Self {
        Self {
            rank,
            kind,
            hash,
            src,
            dst: live.id(),
            boundary: 0,
            taken: false,
            cancelled: false,
            pins: Vec::new(),
            live,
        }
    }
}

impl PoolConfig {
    /// Defaults of DESIGN.md 2b.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            dp_size: 1,
            enable_prefix_cache: true,
            num_single_blocks: None,
            hasher: BlockHasher::default(),
            enable_events: false,
            linear_state_slots: 0,
            checkpoint_interval: None,
            linear_state_match: LinearStateMatch::Deepest,
            linear_state_save: LinearStateSave::Copy,
            sliding_window: None,
            swa_num_blocks: None,
        }
    }
}

/// Kind of a [`KvEvent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvEventKind {
    /// Blocks became matchable.
    Stored,
    /// Blocks left the cache.
    Removed,
    /// The cache was reset.
    Cleared,
}

impl KvEventKind {
    /// "stored", "removed" or "cleared".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Removed => "removed",
            Self::Cleared => "cleared",
        }
    }
}

/// A KV event for external KV-aware routers (R21).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    pub kind: KvEventKind,
    pub block_hashes: Vec<BlockHash>,
    pub parent_hash: Option<BlockHash>,
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    pub dp_rank: usize,
    pub extra_key: Option<ExtraKey>,
}

/// Statistics of one rank (R20).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankStats {
    pub counts: BlockCounts,
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub num_evictions: u64,
    pub num_free_single_blocks: usize,
    pub num_live_slots: usize,
    pub num_pending_checkpoints: usize,
    pub num_committed_checkpoints: usize,
    /// Free recurrent-state slots (R22).
    pub num_free_linear_state_slots: usize,
    /// Allocations whose state is restored from a checkpoint (R23).
    pub linear_state_hits: u64,
    /// Committed checkpoints evicted.
    pub num_checkpoint_evictions: u64,
    /// Checkpoints committed.
    pub num_checkpoint_commits: u64,
    /// Block counts of the sliding-window group (R25), when there is one.
    pub window: Option<BlockCounts>,
    /// Window blocks released behind the window.
    pub num_window_releases: u64,
}

impl RankStats {
    fn add(&mut self, other: &RankStats) {
        self.counts.total += other.counts.total;
        self.counts.free += other.counts.free;
        self.counts.cached += other.counts.cached;
        self.counts.used += other.counts.used;
        self.prefix_query_tokens += other.prefix_query_tokens;
        self.prefix_hit_tokens += other.prefix_hit_tokens;
        self.num_evictions += other.num_evictions;
        self.num_free_single_blocks += other.num_free_single_blocks;
        self.num_live_slots += other.num_live_slots;
        self.num_pending_checkpoints += other.num_pending_checkpoints;
        self.num_committed_checkpoints += other.num_committed_checkpoints;
        self.num_free_linear_state_slots += other.num_free_linear_state_slots;
        self.linear_state_hits += other.linear_state_hits;
        self.num_checkpoint_evictions += other.num_checkpoint_evictions;
        self.num_checkpoint_commits += other.num_checkpoint_commits;
        self.num_window_releases += other.num_window_releases;
        if let Some(w) = other.window {
            let sum = self.window.get_or_insert_with(BlockCounts::default);
            sum.total += w.total;
            sum.free += w.free;
            sum.cached += w.cached;
            sum.used += w.used;
        }
    }
}

/// Statistics of a pool: totals and one entry per rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolStats {
    pub total: RankStats,
    pub ranks: Vec<RankStats>,
}

/// The sequence-level interface (the seed's `KVCacheManager`).
pub trait KvCacheManager {
    /// R15: what `allocate` would answer, with no side effect.
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool>;
    /// R14.
    fn allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool>;
    /// R16.
    fn can_append(&self, seq: &Sequence, lookahead: usize) -> Result<bool>;
    /// R16.
    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool>;
    /// R17.
    fn cache(&mut self, seq: &mut Sequence) -> Result<()>;
    /// R18.
    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()>;
}

struct Rank {
    blocks: BlockManagerImpl,
    single: SingleBlockManager,
    linear: Option<LinearStatePrefixCache>,
    window: Option<SlidingWindowBlockManager>,
    query_tokens: u64,
    hit_tokens: u64,
    linear_hits: u64,
    window_releases: u64,
}

impl Rank {
    /// Whether a sequence could get its single block and live slot here (R13).
    fn has_sequence_slots(&self) -> bool {
        self.single.counts().free > 0
            && self
                .linear
                .as_ref()
                .is_none_or(|l| l.num_available_slots() > 0)
    }
}

/// When the pool publishes a sequence's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Publish {
    /// `cache(seq)` after a step: may plan a checkpoint save.
    Step,
    /// `deallocate(seq)`.
    Release { all_released: bool },
}

/// A planned first allocation (computed without side effects).
struct Plan {
    rank: usize,
    /// Probe of the kept prefix (after the R23 / R25 trims).
    probe: Probe,
    query_blocks: usize,
    new_blocks: usize,
    /// Prefix hash of the checkpoint to restore the linear state from.
    restore: Option<BlockHash>,
}

/// Per-rank block managers behind the sequence-level API.
///
/// Concurrency (R27): the pool is `Send + Sync`; methods that change it take `&mut self`, so
/// threads share it behind a lock (the Python class does, and with `concurrent=True` releases the
/// GIL while it waits and works). Handles are released lock-free: a sequence dropped on any
/// thread returns its blocks without touching the pool or its lock.
pub struct BlockManagerPool {
    id: u64,
    config: PoolConfig,
    ranks: Vec<Rank>,
    events: Option<Vec<KvEvent>>,
    ops: HashMap<u64, LinearOp>,
    untaken: Vec<u64>,
    open_plans: HashSet<u64>,
    next_op: u64,
    next_plan: u64,
}

// R27: the pool can be shared between threads (behind a lock).
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<BlockManagerPool>();
    assert_send_sync::<Sequence>();
};

fn rename(error: KvPoolError, from: &str, to: &'static str) -> KvPoolError {
    match error {
        KvPoolError::InvalidArgument { name, message } if name == from => {
            KvPoolError::invalid(to, message)
        }
        other => other,
    }
}

impl BlockManagerPool {
    /// A pool per `config`.
    pub fn new(config: PoolConfig) -> Result<Self> {
        ensure_arg!(
            config.dp_size >= 1,
            "dp_size",
            "must be at least 1, got {}",
            config.dp_size
        );
        ensure_arg!(
            config.dp_size <= 1024,
            "dp_size",
            "must be at most 1024, got {}",
            config.dp_size
        );
        let manager = ManagerConfig {
            num_blocks: config.num_blocks,
            block_size: config.block_size,
            enable_prefix_cache: config.enable_prefix_cache,
            hasher: config.hasher,
        };
        manager.validate()?;
        ensure_arg!(
            config.linear_state_slots != 1,
            "linear_state_slots",
            "must be 0 (off) or at least 2 (slot 0 is padding), got 1"
        );
        if let Some(interval) = config.checkpoint_interval {
            ensure_arg!(
                config.linear_state_slots > 0,
                "checkpoint_interval",
                "needs linear_state_slots > 0"
            );
            ensure_arg!(
                interval >= config.block_size && interval % config.block_size == 0,
                "checkpoint_interval",
                "must be a positive multiple of block_size {}, got {interval}",
                config.block_size
            );
        }
        ensure_arg!(
            config.swa_num_blocks.is_none() || config.sliding_window.is_some(),
            "swa_num_blocks",
            "needs sliding_window"
        );
        let num_single = config.num_single_blocks.unwrap_or(config.num_blocks);
        // Every count within its cap before anything is sized by it (F1).
        let within_caps = |n: usize, block_size: usize, name: &'static str| {
            ManagerConfig::new(n, block_size)
                .validate()
                .map_err(|e| rename(rename(e, "num_blocks", name), "block_size", name))
        };
        within_caps(num_single, 1, "num_single_blocks")?;
        if config.linear_state_slots > 0 {
            within_caps(config.linear_state_slots, 1, "linear_state_slots")?;
        }
        if config.sliding_window.is_some() {
            let swa = config.swa_num_blocks.unwrap_or(config.num_blocks);
            within_caps(swa, config.block_size, "swa_num_blocks")?;
        }
        // F1: the whole footprint of every rank in one request, before anything is filled.
        let per_rank = manager.footprint()
            + num_single as u128 * crate::block::BlockStore::BYTES_PER_ID
            + LinearStatePrefixCache::footprint(config.linear_state_slots)
            + config.sliding_window.map_or(0, |_| {
                SlidingWindowBlockManager::footprint(
                    config.swa_num_blocks.unwrap_or(config.num_blocks),
                    config.block_size,
                    config.enable_prefix_cache,
                )
            });
        crate::alloc::probe(config.dp_size as u128 * per_rank, "num_blocks")?;
        let mut ranks = Vec::with_capacity(config.dp_size);
        for _ in 0..config.dp_size {
            let mut blocks = BlockManagerImpl::new(manager)?;
            if let Some(cache) = blocks.prefix_cache_mut() {
                cache.set_record_events(config.enable_events);
            }
            let single = SingleBlockManager::new(num_single)
                .map_err(|e| rename(e, "num_slots", "num_single_blocks"))?;
            let linear = match config.linear_state_slots {
                0 => None,
                n => Some(
                    LinearStatePrefixCache::new(n)
                        .map_err(|e| rename(e, "num_slots", "linear_state_slots"))?,
                ),
            };
            let window = match config.sliding_window {
                None => None,
                Some(w) => Some(
                    SlidingWindowBlockManager::new(
                        config.swa_num_blocks.unwrap_or(config.num_blocks),
                        config.block_size,
                        w,
                        config.enable_prefix_cache,
                    )
                    .map_err(|e| {
                        rename(
                            rename(e, "num_blocks", "swa_num_blocks"),
                            "window",
                            "sliding_window",
                        )
                    })?,
                ),
            };
            ranks.push(Rank {
                blocks,
                single,
                linear,
                window,
                query_tokens: 0,
                hit_tokens: 0,
                linear_hits: 0,
                window_releases: 0,
            });
        }
        Ok(Self {
            // Relaxed: only uniqueness matters.
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            config,
            ranks,
            events: config.enable_events.then(Vec::new),
            ops: HashMap::new(),
            untaken: Vec::new(),
            open_plans: HashSet::new(),
            next_op: 1,
            next_plan: 1,
        })
    }

    /// The options.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Number of dp ranks.
    pub fn dp_size(&self) -> usize {
        self.ranks.len()
    }

    /// Block groups of every sequence: 1, or 2 with a sliding window (R25).
    pub fn num_groups(&self) -> usize {
        1 + usize::from(self.config.sliding_window.is_some())
    }

    /// The block manager of `rank`.
    pub fn block_manager(&self, rank: usize) -> Option<&BlockManagerImpl> {
        self.ranks.get(rank).map(|r| &r.blocks)
    }

    /// The sliding-window group's manager of `rank`, if any.
    pub fn window_manager(&self, rank: usize) -> Option<&SlidingWindowBlockManager> {
        self.ranks.get(rank).and_then(|r| r.window.as_ref())
    }

    /// The sliding-window group's manager of `rank`, if any (to evict kept tails).
    pub fn window_manager_mut(&mut self, rank: usize) -> Option<&mut SlidingWindowBlockManager> {
        self.ranks.get_mut(rank).and_then(|r| r.window.as_mut())
    }

    /// The linear-state cache of `rank`, if linear state is enabled (R22).
    pub fn linear_state_cache(&self, rank: usize) -> Option<&LinearStatePrefixCache> {
        self.ranks.get(rank).and_then(|r| r.linear.as_ref())
    }

    /// The linear-state cache of `rank`, if linear state is enabled (R22).
    pub fn linear_state_cache_mut(&mut self, rank: usize) -> Option<&mut LinearStatePrefixCache> {
        self.ranks.get_mut(rank).and_then(|r| r.linear.as_mut())
    }

    /// host tier (R26): the block manager of `rank`, mutable (hierarchy.rs publishes loads).
    pub(crate) fn block_manager_mut(&mut self, rank: usize) -> Option<&mut BlockManagerImpl> {
        self.ranks.get_mut(rank).map(|r| &mut r.blocks)
    }

    /// Block counts of `rank`.
    pub fn counts(&self, rank: usize) -> BlockCounts {
        self.ranks[rank].blocks.counts()
    }

    // host tier (R26): pub(crate) for hierarchy.rs
    pub(crate) fn check_owner(&self, seq: &Sequence) -> Result<bool> {
        self.check_owner_as(seq, "seq")
    }

    /// [`Self::check_owner`] for a sequence passed as argument `name` (`seqs` in batch calls).
    fn check_owner_as(&self, seq: &Sequence, name: &'static str) -> Result<bool> {
        match seq.owner {
            None => Ok(false),
            Some(owner) if owner == self.id => Ok(true),
            Some(_) => Err(KvPoolError::invalid(
                name,
                format!("sequence {} holds blocks of another pool", seq.seq_id()),
            )),
        }
    }

    fn check_group(&self, group: usize) -> Result<()> {
        ensure_arg!(
            group < self.num_groups(),
            "group",
            "this pool has {} group(s), got {group}",
            self.num_groups()
        );
        Ok(())
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    /// R13: the rank a sequence without one goes to, or `None` if no rank has a single block
    /// (and a linear-state slot, when enabled).
    pub(crate) fn choose_rank(&self, seq: &Sequence) -> Option<usize> {
        if let Some(rank) = seq.dp_rank.filter(|&r| r < self.ranks.len()) {
            return Some(rank);
        }
        let mut best: Option<(usize, usize)> = None;
        for (index, rank) in self.ranks.iter().enumerate() {
            if !rank.has_sequence_slots() {
                continue;
            }
            let available = rank.blocks.num_available();
            if best.is_none_or(|(_, b)| available > b) {
                best = Some((index, available));
            }
        }
        best.map(|(index, _)| index)
    }

    /// R23 and R25: the deepest boundary `k <= matched` of a KV hit whose linear state can be
    /// restored (a committed checkpoint of the prefix) and whose sliding-window blocks are still
    /// held; with the checkpoint to restore from and the window hit's cost (kept window blocks
    /// the hit makes used).
    fn trim(
        &self,
        rank: &Rank,
        hashes: &[BlockHash],
        tokens: &[u32],
        matched: usize,
    ) -> (usize, Option<BlockHash>, usize) {
        let mut limit = matched;
        if let Some(linear) = &rank.linear {
            if self.config.linear_state_match == LinearStateMatch::Contiguous {
                limit = (0..matched)
                    .take_while(|&i| linear.contains(hashes[i]))
                    .count();
            }
        }
        for k in (1..=limit).rev() {
            let state_ok = rank
                .linear
                .as_ref()
                .is_none_or(|l| l.contains(hashes[k - 1]));
            if !state_ok {
                continue;
            }
            let window_cost = match &rank.window {
                None => Some(0),
                Some(w) => w.hit_cost(hashes, tokens, k),
            };
            if let Some(cost) = window_cost {
                return (k, rank.linear.as_ref().map(|_| hashes[k - 1]), cost);
            }
        }
        (0, None, 0)
    }

    /// Plans a first allocation of `num_tokens` tokens; `None` if it cannot succeed (R14, R15).
    fn plan(&self, seq: &mut Sequence, num_tokens: usize) -> Option<Plan> {
        let rank_index = self.choose_rank(seq)?;
        let rank = &self.ranks[rank_index];
        if !rank.has_sequence_slots() {
            return None;
        }
        let block_size = self.config.block_size;
        let (mut probe, query_blocks) = match rank.blocks.prefix_cache() {
            Some(cache) => {
                // R8: leave at least one token to compute.
                let query_blocks = (seq.len() - 1) / block_size;
                seq.ensure_hashes(cache.hasher(), block_size, query_blocks * block_size);
                let hashes = seq.hashes(query_blocks);
                let probe = cache.probe(hashes, seq.tokens(), seq.extra_key(), query_blocks);
                (probe, query_blocks)
            }
            None => (Probe::default(), 0),
        };
        let mut restore = None;
        let mut window_cost = 0;
        if probe.matched > 0 && (rank.linear.is_some() || rank.window.is_some()) {
            let hashes = seq.hashes(query_blocks);
            let (kept, checkpoint, cost) = self.trim(rank, hashes, seq.tokens(), probe.matched);
            restore = checkpoint;
            window_cost = cost;
            if kept != probe.matched {
                let cache = rank.blocks.prefix_cache().expect("a hit needs the cache");
                probe = cache.probe(hashes, seq.tokens(), seq.extra_key(), kept);
            }
        }
        let new_blocks = self.blocks_for(num_tokens).saturating_sub(probe.matched);
        let mut feasible = new_blocks <= rank.blocks.num_available() - probe.cache_only;
        if let Some(window) = &rank.window {
            feasible &= new_blocks <= window.num_available() - window_cost;
        }
        if let Some(linear) = &rank.linear {
            let pin_cost = restore.map_or(0, |h| usize::from(!linear.is_pinned(h)));
            feasible &= linear.num_available_slots() > pin_cost;
        }
        feasible.then_some(Plan {
            rank: rank_index,
            probe,
            query_blocks,
            new_blocks,
            restore,
        })
    }

    fn validate_num_tokens(seq: &Sequence, num_tokens: Option<usize>) -> Result<usize> {
        let n = num_tokens.unwrap_or(seq.len());
        ensure_arg!(
            n >= 1 && n <= seq.len(),
            "num_tokens",
            "must be in 1..={} (len(seq)), got {n}",
            seq.len()
        );
        Ok(n)
    }

    /// Moves the caches' events into the pool's list (R21).
    // host tier (R26): pub(crate) for hierarchy.rs
    pub(crate) fn collect_events(&mut self, rank_index: usize) {
        let Some(events) = self.events.as_mut() else {
            return;
        };
        let block_size = self.config.block_size;
        let Some(cache) = self.ranks[rank_index].blocks.prefix_cache_mut() else {
            return;
        };
        for event in cache.take_events() {
            events.push(match event {
                CacheEvent::Stored {
                    block_hashes,
                    parent_hash,
                    token_ids,
                    extra_key,
                } => KvEvent {
                    kind: KvEventKind::Stored,
                    block_hashes,
                    parent_hash,
                    token_ids,
                    block_size,
                    dp_rank: rank_index,
                    extra_key,
                },
                CacheEvent::Removed {
                    block_hashes,
                    extra_key,
                } => KvEvent {
                    kind: KvEventKind::Removed,
                    block_hashes,
                    parent_hash: None,
                    token_ids: Vec::new(),
                    block_size,
                    dp_rank: rank_index,
                    extra_key,
                },
                CacheEvent::Cleared => KvEvent {
                    kind: KvEventKind::Cleared,
                    block_hashes: Vec::new(),
                    parent_hash: None,
                    token_ids: Vec::new(),
                    block_size,
                    dp_rank: rank_index,
                    extra_key: None,
                },
            });
        }
    }

    /// Takes the recorded KV events (R21); empty unless `enable_events`.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Drops every cached entry of every rank (R12), every committed checkpoint nothing pins
    /// (R24) and every sliding-window publication.
    pub fn reset_prefix_cache(&mut self) {
        for index in 0..self.ranks.len() {
            let rank = &mut self.ranks[index];
            rank.blocks.reset_prefix_cache();
            if let Some(linear) = rank.linear.as_mut() {
                linear.reset();
            }
            if let Some(window) = rank.window.as_mut() {
                window.reset_sharing();
            }
            self.collect_events(index);
        }
    }

    /// R19: the block tables of `seqs` in group `group`, row-major
    /// `[len(seqs), max_blocks]`, padded with 0 (released window entries are 0 too).
    pub fn block_tables(&self, seqs: &[&Sequence], group: usize) -> Result<(Vec<i32>, usize)> {
        self.check_group(group)?;
        for seq in seqs {
            self.check_owner_as(seq, "seqs")?;
        }
        let width = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
        let mut table = vec![0i32; seqs.len() * width];
        for (row, seq) in table.chunks_exact_mut(width.max(1)).zip(seqs) {
            if group == 0 {
                for (slot, id) in row.iter_mut().zip(seq.block_ids()) {
                    *slot = id as i32;
                }
            } else if let Some(window) = &seq.window {
                for (slot, id) in row.iter_mut().zip(window.ids()) {
                    *slot = id as i32;
                }
            }
        }
        Ok((table, width))
    }

    /// R19: the cache slots, in group `group`, of tokens `[num_computed_tokens, len)` of every
    /// sequence.
    pub fn slot_mapping(&self, seqs: &[&Sequence], group: usize) -> Result<Vec<i64>> {
        self.check_group(group)?;
        let block_size = self.config.block_size;
        let mut total = 0;
        for seq in seqs {
            self.check_sequence_owned(seq)?;
            total += seq.len() - seq.num_computed_tokens();
        }
        let mut slots = Vec::with_capacity(total);
        for seq in seqs {
            // `num_computed_tokens()`: tokens a confirmed host load brought count as computed.
            for position in seq.num_computed_tokens()..seq.len() {
                let index = position / block_size;
                let id = if group == 0 {
                    seq.blocks[index].id()
                } else {
                    // Held: released entries lie before `num_computed_tokens` (R25).
                    seq.window
                        .as_ref()
                        .and_then(|w| w.get(index))
                        .map_or(0, Block::id)
                };
                slots.push(id as i64 * block_size as i64 + (position % block_size) as i64);
            }
        }
        Ok(slots)
    }

    /// Statistics (R20).
    pub fn stats(&self) -> PoolStats {
        let mut stats = PoolStats::default();
        for rank in &self.ranks {
            let cache = rank
                .blocks
                .prefix_cache()
                .map(|c| c.stats())
                .unwrap_or_default();
            let mut r = RankStats {
                counts: rank.blocks.counts(),
                prefix_query_tokens: rank.query_tokens,
                prefix_hit_tokens: rank.hit_tokens,
                num_evictions: cache.evictions,
                num_free_single_blocks: rank.single.counts().free,
                linear_state_hits: rank.linear_hits,
                window: rank.window.as_ref().map(|w| w.counts()),
                num_window_releases: rank.window_releases,
                ..RankStats::default()
            };
            if let Some(linear) = &rank.linear {
                let s = linear.stats();
                r.num_live_slots = linear.num_live_slots();
                r.num_pending_checkpoints = linear.num_pending_checkpoints();
                r.num_committed_checkpoints = linear.num_committed_checkpoints();
                r.num_free_linear_state_slots = linear.num_free_slots();
                r.num_checkpoint_evictions = s.evictions;
                r.num_checkpoint_commits = s.commits;
            }
            stats.total.add(&r);
            stats.ranks.push(r);
        }
        stats
    }

    /// Walks every structure of every rank (R20), and the planned linear-state copies.
    pub fn check(&self) -> Result<()> {
        for (index, rank) in self.ranks.iter().enumerate() {
            rank.blocks.check().map_err(|e| prefix_rank(e, index))?;
            rank.single.check().map_err(|e| prefix_rank(e, index))?;
            if let Some(linear) = &rank.linear {
                linear.check().map_err(|e| prefix_rank(e, index))?;
            }
            if let Some(window) = &rank.window {
                window.check().map_err(|e| prefix_rank(e, index))?;
            }
        }
        for (id, op) in &self.ops {
            let linear = self.ranks[op.rank]
                .linear
                .as_ref()
                .expect("linear ops need linear state");
            let ok = match op.kind {
                OpKind::Restore | OpKind::Promote => linear.is_pinned(op.hash),
                OpKind::Save => linear.is_pending(op.hash) && linear.is_planned(op.hash),
            };
            ensure_invariant!(
                ok,
                "linear-state copy {id} ({:?}) lost its checkpoint (R24)",
                op.kind
            );
            ensure_invariant!(
                op.pins.iter().all(|&h| linear.is_pinned(h)),
                "linear-state copy {id} lost a checkpoint it pins (F2)"
            );
            ensure_invariant!(
                op.taken || !op.cancelled,
                "an untaken linear-state copy {id} is cancelled"
            );
        }
        ensure_invariant!(
            self.untaken.iter().all(|id| self.ops.contains_key(id)),
            "an untaken linear-state copy is missing"
        );
        for (index, rank) in self.ranks.iter().enumerate() {
            let Some(linear) = &rank.linear else { continue };
            let saves = self
                .ops
                .values()
                .filter(|op| op.rank == index && op.kind == OpKind::Save)
                .count();
            ensure_invariant!(
                saves == linear.num_planned_checkpoints(),
                "dp rank {index}: {} planned checkpoints for {saves} planned saves (R24)",
                linear.num_planned_checkpoints()
            );
        }
        Ok(())
    }

    /// Checks a sequence against this pool: its tables, slots, counts and ownership.
    pub fn check_sequence(&self, seq: &Sequence) -> Result<()> {
        if !self.check_owner(seq)? {
            ensure_invariant!(
                seq.blocks.is_empty()
                    && seq.linear_slot.is_none()
                    && seq.window.as_ref().is_none_or(|w| w.is_empty()),
                "unallocated sequence holds blocks"
            );
            return Ok(());
        }
        let rank = seq.dp_rank.unwrap_or(usize::MAX);
        ensure_invariant!(
            rank < self.ranks.len(),
            "allocated sequence has no valid dp rank"
        );
        let rank = &self.ranks[rank];
        ensure_invariant!(
            seq.blocks.iter().all(|b| rank.blocks.owns(b)),
            "sequence holds foreign blocks"
        );
        ensure_invariant!(
            seq.num_cached_tokens <= seq.num_computed_tokens
                && seq.num_computed_tokens <= seq.len()
                && seq.num_computed_tokens <= seq.capacity(),
            "sequence {} token counts out of order (R17)",
            seq.seq_id()
        );
        if let Some(linear) = &rank.linear {
            ensure_invariant!(
                seq.linear_slot.as_ref().is_some_and(|s| linear.owns(s)),
                "sequence {} has no live slot of its rank (R22)",
                seq.seq_id()
            );
        }
        if let Some(window) = &rank.window {
            let table = seq.window.as_ref();
            ensure_invariant!(
                table
                    .is_some_and(|t| t.len() == seq.blocks.len()
                        && t.blocks().iter().all(|b| window.owns(b))),
                "sequence {}: the window table does not match the full table (R25)",
                seq.seq_id()
            );
        }
        Ok(())
    }

    fn new_op(&mut self, seq: &mut Sequence, op: LinearOp) {
        let id = self.next_op;
        self.next_op += 1;
        self.ops.insert(id, op);
        self.untaken.push(id);
        let ops = &self.ops;
        seq.linear_ops.retain(|id| ops.contains_key(id));
        seq.linear_ops.push(id);
    }

    /// Undoes what an op holds in the linear-state cache (a cancelled copy).
    fn cancel_op(&mut self, op: &LinearOp) {
        let Some(linear) = self.ranks[op.rank].linear.as_mut() else {
            return;
        };
        // Errors are impossible by the op's invariant (checked by `check`); ignore them.
        let _ = match op.kind {
            OpKind::Restore | OpKind::Promote => linear.unpin(op.hash),
            OpKind::Save => linear.cancel_planned(op.hash),
        };
        for &hash in &op.pins {
            let _ = linear.unpin(hash);
        }
    }

    fn finish_op(&mut self, op: LinearOp) {
        if op.cancelled {
            self.cancel_op(&op);
            return;
        }
        let Some(linear) = self.ranks[op.rank].linear.as_mut() else {
            return;
        };
        let _ = match op.kind {
            OpKind::Restore | OpKind::Promote => linear.unpin(op.hash),
            OpKind::Save => linear.commit_planned(op.hash).map(|_| ()),
        };
        for &hash in &op.pins {
            let _ = linear.unpin(hash);
        }
        drop(op); // its handle of the live slot goes last, after the pins
    }

    /// F6 (R24): a save not yet taken whose boundary the sequence's state has moved past would
    /// read the live slot's later state into the earlier boundary's checkpoint. It is dropped
    /// (its pending slot freed) the next time the pool sees the sequence at a step.
    fn drop_stale_saves(&mut self, seq: &mut Sequence) {
        let computed = seq.num_computed_tokens;
        let ops = &self.ops;
        let stale: Vec<u64> = seq
            .linear_ops
            .iter()
            .copied()
            .filter(|id| {
                ops.get(id).is_some_and(|op| {
                    op.kind == OpKind::Save && !op.taken && op.boundary != computed
                })
            })
            .collect();
        for id in stale {
            let op = self.ops.remove(&id).expect("present");
            self.untaken.retain(|&u| u != id);
            seq.linear_ops.retain(|&o| o != id);
            self.cancel_op(&op);
        }
    }

    /// Cancels the sequence's unconfirmed copies (R24): untaken ones at once; taken ones when
    /// their plan is committed (the worker may be copying them now).
    fn cancel_ops(&mut self, seq: &mut Sequence) {
        for id in std::mem::take(&mut seq.linear_ops) {
            let Some(op) = self.ops.get_mut(&id) else {
                continue;
            };
            if op.taken {
                op.cancelled = true;
            } else {
                let op = self.ops.remove(&id).expect("present");
                self.untaken.retain(|&u| u != id);
                self.cancel_op(&op);
            }
        }
    }

    /// R24: the recurrent-state copies planned since the last call, for every rank.
    pub fn take_linear_state_plan(&mut self) -> LinearStatePlan {
        let plan_id = self.next_plan;
        self.next_plan += 1;
        let mut plan = LinearStatePlan {
            pool_id: self.id,
            plan_id,
            ..LinearStatePlan::default()
        };
        for id in std::mem::take(&mut self.untaken) {
            let op = self.ops.get_mut(&id).expect("untaken ops are registered");
            op.taken = true;
            let rank = op.rank as i32;
            match op.kind {
                OpKind::Restore | OpKind::Promote => {
                    plan.restore_dp_rank.push(rank);
                    plan.restore_src.push(op.src as i32);
                    plan.restore_dst.push(op.dst as i32);
                }
                OpKind::Save => {
                    plan.save_dp_rank.push(rank);
                    plan.save_src.push(op.src as i32);
                    plan.save_dst.push(op.dst as i32);
                    plan.save_hashes.push(op.hash);
                }
            }
            plan.ops.push(id);
        }
        self.open_plans.insert(plan_id);
        plan
    }

    /// R24: the worker made the copies of `plan`: saved checkpoints become matchable, restored
    /// checkpoints are unpinned, cancelled saves free their slots.
    pub fn commit_linear_state_plan(&mut self, plan: &LinearStatePlan) -> Result<()> {
        ensure_arg!(
            plan.pool_id == self.id,
            "plan",
            "was taken from another pool"
        );
        ensure_arg!(
            self.open_plans.remove(&plan.plan_id),
            "plan",
            "was already committed"
        );
        for id in &plan.ops {
            if let Some(op) = self.ops.remove(id) {
                self.finish_op(op);
            }
        }
        Ok(())
    }

    /// Copies planned and not yet confirmed.
    pub fn num_pending_linear_state_copies(&self) -> usize {
        self.ops.len()
    }

    /// R24: plans a checkpoint of the live state if `num_computed_tokens` sits on a boundary
    /// that gets one.
    fn plan_save(&mut self, seq: &mut Sequence) {
        let Some(rank_index) = seq.dp_rank else {
            return;
        };
        let block_size = self.config.block_size;
        let computed = seq.num_computed_tokens;
        if computed == 0 || computed % block_size != 0 || computed == seq.last_saved_boundary {
            return;
        }
        let at_interval = self
            .config
            .checkpoint_interval
            .is_some_and(|t| computed % t == 0);
        let at_prompt_end = computed == seq.num_prompt_tokens() / block_size * block_size;
        if !(at_interval || at_prompt_end) {
            return;
        }
        let rank = &mut self.ranks[rank_index];
        let (Some(linear), Some(cache)) = (rank.linear.as_mut(), rank.blocks.prefix_cache()) else {
            return;
        };
        seq.ensure_hashes(cache.hasher(), block_size, computed);
        let hash = seq.hashes(computed / block_size)[computed / block_size - 1];
        if linear.contains(hash) || linear.is_pending(hash) {
            seq.last_saved_boundary = computed; // someone saved this prefix already
            return;
        }
        let Some(live) = seq.linear_slot.take() else {
            return;
        };
        let op = match self.config.linear_state_save {
            LinearStateSave::Copy => {
                let op = linear.reserve_planned(hash).map(|dst| LinearOp {
                    dst,
                    boundary: computed,
                    ..LinearOp::new(rank_index, OpKind::Save, hash, live.id(), live.clone())
                });
                seq.linear_slot = Some(live);
                op
            }
            LinearStateSave::Promote => {
                let promoted = live.id();
                match linear.promote_slot(live, hash) {
                    Ok(fresh) => {
                        let old = linear.pin(hash).expect("just promoted");
                        // F2: an earlier copy into the promoted slot may still be in flight; it
                        // holds the slot, so the new checkpoint stays pinned until it is done.
                        let writer = seq.linear_ops.iter().copied().find(|id| {
                            self.ops
                                .get(id)
                                .is_some_and(|op| op.rank == rank_index && op.live.id() == promoted)
                        });
                        if let Some(id) = writer {
                            linear.pin(hash).expect("just promoted");
                            self.ops.get_mut(&id).expect("found").pins.push(hash);
                        }
                        let op =
                            LinearOp::new(rank_index, OpKind::Promote, hash, old, fresh.clone());
                        seq.linear_slot = Some(fresh);
                        Some(op)
                    }
                    Err(live) => {
                        seq.linear_slot = Some(live);
                        None
                    }
                }
            }
        };
        // F7 (R24): the boundary counts as saved only once its save is planned; a reservation
        // that failed (every slot live) is retried by the next cache() at this boundary.
        if let Some(op) = op {
            seq.last_saved_boundary = computed;
            self.new_op(seq, op);
        }
    }

    /// Releases the window blocks of `seq` no future query can attend to (R25).
    fn slide(&mut self, seq: &mut Sequence) {
        let Some(rank) = seq.dp_rank else { return };
        let rank = &mut self.ranks[rank];
        if let (Some(window), Some(table)) = (rank.window.as_ref(), seq.window.as_mut()) {
            rank.window_releases += window.slide(table, seq.num_computed_tokens) as u64;
        }
    }

    /// The blocks missing for `seq`'s tables to hold `tokens` tokens, or `None` if a group
    /// cannot supply them. The one computation behind both the question (`can_append`,
    /// `can_allocate` on an allocated sequence) and the action (`may_append`, `allocate`), so
    /// they agree exactly (R15, R16). In the window group the slide that `grow` does first
    /// counts with exactly what it frees or makes evictable (F4).
    fn growth(&self, seq: &Sequence, tokens: usize) -> Option<usize> {
        let rank = &self.ranks[seq.dp_rank?];
        let need = self.blocks_for(tokens).saturating_sub(seq.blocks.len());
        if need == 0 {
            return Some(0);
        }
        if need > rank.blocks.num_available() {
            return None;
        }
        if let (Some(window), Some(table)) = (&rank.window, &seq.window) {
            if need > window.available_after_slide(table, seq.num_computed_tokens) {
                return None;
            }
        }
        Some(need)
    }

    /// Whether [`Self::grow`] would succeed (no side effect).
    fn can_grow(&self, seq: &Sequence, tokens: usize) -> bool {
        self.growth(seq, tokens).is_some()
    }

    /// Grows `seq`'s tables to hold `tokens` tokens: all-or-nothing (R14, R16). On success it
    /// first publishes the window blocks and slides the window (R25); a failure changes nothing.
    fn grow(&mut self, seq: &mut Sequence, tokens: usize) -> bool {
        let Some(need) = self.growth(seq, tokens) else {
            return false;
        };
        let rank_index = seq.dp_rank.expect("allocated sequence has a rank");
        if seq.window.is_some() {
            self.publish_window(seq); // before the slide releases them (R25)
        }
        self.slide(seq);
        if need == 0 {
            return true;
        }
        let entries = self.blocks_for(tokens);
        let rank = &mut self.ranks[rank_index];
        let mut ok = rank.blocks.allocate_into(need, &mut seq.blocks).is_ok();
        if ok {
            if let (Some(window), Some(table)) = (rank.window.as_mut(), seq.window.as_mut()) {
                ok = window.grow(table, entries).is_ok();
                if !ok {
                    // Unreachable: `growth` counted the window group's blocks after the slide.
                    let kept = seq.blocks.len() - need;
                    seq.blocks.truncate(kept);
                }
            }
        }
        debug_assert!(ok, "growth() promised {need} blocks");
        self.collect_events(rank_index);
        ok
    }

    /// Whether `publish` would change nothing (most decode steps): no window or linear state to
    /// serve, and no full computed block left to publish in the cache's current epoch. Tested
    /// first, without the division `publish` needs.
    fn publish_is_noop(&self, seq: &Sequence) -> bool {
        if seq.window.is_some() || seq.linear_slot.is_some() {
            return false;
        }
        let Some(rank) = seq.dp_rank else {
            return true;
        };
        match self.ranks[rank].blocks.prefix_cache() {
            None => true,
            Some(cache) => {
                seq.published_epoch == cache.epoch()
                    && (seq.blocks.len() <= seq.num_published
                        || seq.num_computed_tokens
                            < (seq.num_published + 1) * self.config.block_size)
            }
        }
    }

    /// Publishes the full computed blocks (R17) in the prefix cache and the window index, then
    /// slides the window; at a step, plans a checkpoint save (R24).
    fn publish(&mut self, seq: &mut Sequence, when: Publish) {
        if self.publish_is_noop(seq) {
            return;
        }
        let Some(rank_index) = seq.dp_rank else {
            return;
        };
        let block_size = self.config.block_size;
        let full = (seq.num_computed_tokens / block_size).min(seq.blocks.len());
        let rank = &mut self.ranks[rank_index];
        if let Some(cache) = rank.blocks.prefix_cache_mut() {
            if seq.published_epoch != cache.epoch() {
                seq.num_published = 0;
                seq.published_epoch = cache.epoch();
            }
            let hasher = *cache.hasher();
            if seq.num_published < full {
                let key: Option<ExtraKey> = seq.extra_key_arc().cloned();
                seq.ensure_hashes(&hasher, block_size, full * block_size);
                let hashes: &[BlockHash] = seq.hashes(full);
                let (_, stop) = cache.insert(
                    hashes,
                    seq.tokens(),
                    &seq.blocks[..full],
                    seq.num_published,
                    key.as_ref(),
                    matches!(when, Publish::Release { all_released: true }),
                );
                seq.num_published = stop;
            }
        }
        if seq.window.is_some() {
            self.publish_window(seq);
        }
        self.collect_events(rank_index);
        self.slide(seq);
        if when == Publish::Step && seq.linear_slot.is_some() {
            self.drop_stale_saves(seq);
            self.plan_save(seq);
        }
    }

    /// Gives back what a failed first allocation took (R14: all-or-nothing).
    fn undo_allocation(&mut self, rank_index: usize, restore: Option<BlockHash>) {
        let rank = &mut self.ranks[rank_index];
        if let (Some(linear), Some(hash)) = (rank.linear.as_mut(), restore) {
            let _ = linear.unpin(hash);
        }
        if let Some(cache) = rank.blocks.prefix_cache_mut() {
            cache.drain_released();
        }
    }
}

/// `len(seq) + lookahead`, the tokens R16 asks room for; `None` past `usize::MAX` (F5).
fn appended_len(seq: &Sequence, lookahead: usize) -> Option<usize> {
    seq.len().checked_add(lookahead)
}

fn prefix_rank(error: KvPoolError, rank: usize) -> KvPoolError {
    match error {
        KvPoolError::Invariant(message) => {
            KvPoolError::Invariant(format!("dp rank {rank}: {message}"))
        }
        other => other,
    }
}

impl KvCacheManager for BlockManagerPool {
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        let n = Self::validate_num_tokens(seq, num_tokens)?;
        if self.check_owner(seq)? {
            return Ok(self.can_grow(seq, n));
        }
        Ok(self.plan(seq, n).is_some())
    }

    fn allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        let n = Self::validate_num_tokens(seq, num_tokens)?;
        if self.check_owner(seq)? {
            return Ok(self.grow(seq, n));
        }
        let Some(plan) = self.plan(seq, n) else {
            return Ok(false);
        };
        let block_size = self.config.block_size;
        let kept = plan.probe.matched;
        let entries = self.blocks_for(n);
        let rank = &mut self.ranks[plan.rank];
        // Match and pin first (R14), then take the single block, the live slot, new blocks.
        let mut blocks = Vec::with_capacity(entries);
        if let Some(cache) = rank.blocks.prefix_cache_mut() {
            let hasher = *cache.hasher();
            seq.ensure_hashes(&hasher, block_size, plan.query_blocks * block_size);
            let hashes = seq.hashes(plan.query_blocks);
            let matched =
                cache.match_prefix(hashes, seq.tokens(), seq.extra_key(), kept, &mut blocks);
            debug_assert_eq!(matched, kept);
        }
        let mut restore_slot = None;
        if let (Some(linear), Some(hash)) = (rank.linear.as_mut(), plan.restore) {
            linear.lookup(hash);
            restore_slot = Some(linear.pin(hash).expect("the plan saw the checkpoint"));
        }
        let mut window_table = rank.window.as_ref().map(|_| WindowTable::default());
        if let (Some(window), Some(table)) = (rank.window.as_ref(), window_table.as_mut()) {
            if kept > 0 && !window.take_hit(table, seq.hashes(kept), seq.tokens(), kept) {
                drop(blocks);
                self.undo_allocation(plan.rank, plan.restore);
                return Ok(false); // a window block was released by another thread meanwhile
            }
        }
        let single = rank.single.allocate_one();
        let live = match rank.linear.as_mut() {
            Some(linear) => linear.acquire_slot().map(Some),
            None => Some(None),
        };
        let (Some(single), Some(live)) = (single, live) else {
            drop(blocks);
            drop(window_table);
            self.undo_allocation(plan.rank, plan.restore);
            return Ok(false); // unreachable single-threaded: the plan saw the slots
        };
        let mut ok = rank
            .blocks
            .allocate_into(plan.new_blocks, &mut blocks)
            .is_ok();
        if let (true, Some(window), Some(table)) = (ok, rank.window.as_mut(), window_table.as_mut())
        {
            ok = window.grow(table, entries).is_ok();
        }
        if !ok {
            drop((blocks, window_table, single, live));
            self.undo_allocation(plan.rank, plan.restore);
            return Ok(false); // see `allocate_into`: only with partially released chains
        }
        rank.query_tokens += (plan.query_blocks * block_size) as u64;
        rank.hit_tokens += (kept * block_size) as u64;
        rank.linear_hits += u64::from(plan.restore.is_some());
        let epoch = rank.blocks.prefix_cache().map_or(0, |c| c.epoch());
        seq.blocks = blocks;
        seq.block_size = block_size;
        seq.single_block = Some(single);
        seq.window = window_table;
        seq.num_cached_tokens = kept * block_size;
        seq.num_computed_tokens = seq.num_cached_tokens;
        seq.num_published = kept;
        seq.published_epoch = epoch;
        seq.last_saved_boundary = seq.num_computed_tokens;
        seq.restore_slot = restore_slot;
        seq.dp_rank = Some(plan.rank);
        seq.owner = Some(self.id);
        if let (Some(live), Some(hash), Some(src)) = (&live, plan.restore, restore_slot) {
            let op = LinearOp::new(plan.rank, OpKind::Restore, hash, src, live.clone());
            self.new_op(seq, op);
        }
        seq.linear_slot = live;
        self.collect_events(plan.rank);
        Ok(true)
    }

    fn can_append(&self, seq: &Sequence, lookahead: usize) -> Result<bool> {
        ensure_arg!(
            self.check_owner(seq)?,
            "seq",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        // F5: a sum past usize::MAX tokens can never be had.
        Ok(appended_len(seq, lookahead).is_some_and(|tokens| self.can_grow(seq, tokens)))
    }

    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool> {
        ensure_arg!(
            self.check_owner(seq)?,
            "seq",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        Ok(appended_len(seq, lookahead).is_some_and(|tokens| self.grow(seq, tokens)))
    }

    fn cache(&mut self, seq: &mut Sequence) -> Result<()> {
        if self.check_owner(seq)? {
            self.publish(seq, Publish::Step);
        }
        Ok(())
    }

    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()> {
        self.release(seq, true)
    }
}

impl BlockManagerPool {
    /// Whether `seq` holds blocks of this pool (`ValueError`-style error if of another pool).
    pub fn owns_sequence(&self, seq: &Sequence) -> Result<bool> {
        self.check_owner(seq)
    }

    /// Checks what [`Self::advance`] requires of `seq` (allocated here, every token held)
    /// without changing anything.
    pub fn check_sequence_owned(&self, seq: &Sequence) -> Result<()> {
        ensure_arg!(
            self.check_owner_as(seq, "seqs")?,
            "seqs",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        ensure_arg!(
            seq.len() <= seq.capacity(),
            "seqs",
            "sequence {} has {} tokens but its table holds {}: call may_append first",
            seq.seq_id(),
            seq.len(),
            seq.capacity()
        );
        Ok(())
    }

    /// After a forward step over every token of `seq`, in one call: `num_computed_tokens =
    /// len(seq)` (R17), `cache(seq)` publishes the full blocks, and the sampled `token` is
    /// appended (its slot comes from the next `may_append`, R16).
    pub fn advance(&mut self, seq: &mut Sequence, token: u32) -> Result<()> {
        self.check_sequence_owned(seq)?;
        seq.num_computed_tokens = seq.len();
        self.publish(seq, Publish::Step);
        seq.append_token(token);
        Ok(())
    }

    /// [`Self::advance`] for a batch: `tokens[i]` goes to `seqs[i]`. Every sequence is checked
    /// before any changes (R29: an error changes nothing); the sequences must be distinct.
    pub fn advance_all(&mut self, seqs: &mut [&mut Sequence], tokens: &[u32]) -> Result<()> {
        ensure_arg!(
            tokens.len() == seqs.len(),
            "token_ids",
            "has {} tokens for {} sequences",
            tokens.len(),
            seqs.len()
        );
        for seq in seqs.iter() {
            self.check_sequence_owned(seq)?;
        }
        for (seq, &token) in seqs.iter_mut().zip(tokens) {
            seq.num_computed_tokens = seq.len();
            self.publish(seq, Publish::Step);
            seq.append_token(token);
        }
        Ok(())
    }

    /// [`Self::advance_all`], then room for each sequence's next `lookahead + 1` tokens
    /// ([`Self::may_append_all`]) in the same pass: one call per decode step instead of two.
    /// Returns the indices of the sequences that got no room (advanced, but unable to take
    /// their next token's slot: grow them later or preempt them). An error changes nothing.
    pub fn advance_and_reserve_all(
        &mut self,
        seqs: &mut [&mut Sequence],
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Vec<usize>> {
        self.advance_all(seqs, tokens)?; // checks every sequence
        Ok(self.grow_all(seqs, lookahead))
    }

    /// `may_append(seq, lookahead)` (R16) for a batch, after checking that every sequence is
    /// allocated here (an error changes nothing). Returns the indices of the sequences that
    /// could not get their blocks (those are unchanged): empty when every one did.
    pub fn may_append_all(
        &mut self,
        seqs: &mut [&mut Sequence],
        lookahead: usize,
    ) -> Result<Vec<usize>> {
        for seq in seqs.iter() {
            ensure_arg!(
                self.check_owner_as(seq, "seqs")?,
                "seqs",
                "sequence {} is not allocated in this pool",
                seq.seq_id()
            );
        }
        Ok(self.grow_all(seqs, lookahead))
    }

    /// The growth of [`Self::may_append_all`] for sequences already checked.
    fn grow_all(&mut self, seqs: &mut [&mut Sequence], lookahead: usize) -> Vec<usize> {
        let block_size = self.config.block_size;
        let mut failed = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let Some(tokens) = appended_len(seq, lookahead) else {
                failed.push(i); // F5: more tokens than usize can count
                continue;
            };
            if seq.window.is_none() && tokens <= seq.blocks.len() * block_size {
                continue; // the table holds them already (most decode steps)
            }
            if !self.grow(seq, tokens) {
                failed.push(i);
            }
        }
        failed
    }

    /// R18's deallocate. `all_released`: nothing else keeps the sequence's blocks after this
    /// (false when a host offload still holds them), so recomputed duplicates may be skipped
    /// and the rest of the chain published (see `PrefixCache::insert`).
    pub(crate) fn release(&mut self, seq: &mut Sequence, all_released: bool) -> Result<()> {
        if !self.check_owner(seq)? {
            return Ok(());
        }
        self.publish(seq, Publish::Release { all_released });
        self.cancel_ops(seq);
        if let (Some(rank), Some(table)) = (seq.dp_rank, seq.window.as_ref()) {
            if let Some(window) = self.ranks[rank].window.as_mut() {
                window.keep_tail(table); // R25: the next turn continues from this window
            }
        }
        let rank = seq.dp_rank;
        seq.reset();
        if let Some(cache) = rank.and_then(|r| self.ranks[r].blocks.prefix_cache_mut()) {
            cache.drain_released();
        }
        Ok(())
    }

    /// Publishes the full computed window blocks only (before a slide in `may_append`).
    fn publish_window(&mut self, seq: &mut Sequence) {
        let Some(rank_index) = seq.dp_rank else {
            return;
        };
        let block_size = self.config.block_size;
        let full = (seq.num_computed_tokens / block_size).min(seq.blocks.len());
        let rank = &mut self.ranks[rank_index];
        let Some(hasher) = rank.blocks.prefix_cache().map(|c| *c.hasher()) else {
            return;
        };
        if let (Some(window), Some(mut table)) = (rank.window.as_mut(), seq.window.take()) {
            if table.published < full {
                seq.ensure_hashes(&hasher, block_size, full * block_size);
                window.publish(&mut table, seq.hashes(full), seq.tokens(), full);
            }
            seq.window = Some(table);
        }
    }
}
