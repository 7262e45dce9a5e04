//! `BlockManagerPool`: the sequence-level KV-cache manager (the seed's `KVCacheManager`), one
//! block manager and one single-block manager per data-parallel rank.
//!
//! Invariants: a sequence holds blocks of at most one pool (`owner`) and one rank (R13); every
//! entry point is all-or-nothing (R14, R16, R29): it either succeeds or leaves the pool and the
//! sequence as they were (blocks, LRU, single blocks, statistics, dp rank); counts of every rank
//! obey R2; blocks are published only once their KV exists (R17).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{ensure_arg, ensure_invariant, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::manager::{
    BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig, SingleBlockManager,
};
use crate::prefix_cache::{CacheEvent, ExtraKey, Probe};
use crate::sequence::Sequence;

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
    query_tokens: u64,
    hit_tokens: u64,
}

/// A planned first allocation (computed without side effects).
struct Plan {
    rank: usize,
    probe: Probe,
    query_blocks: usize,
    new_blocks: usize,
}

/// Per-rank block managers behind the sequence-level API.
pub struct BlockManagerPool {
    id: u64,
    config: PoolConfig,
    ranks: Vec<Rank>,
    events: Option<Vec<KvEvent>>,
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
        let num_single = config.num_single_blocks.unwrap_or(config.num_blocks);
        let mut ranks = Vec::with_capacity(config.dp_size);
        for _ in 0..config.dp_size {
            let mut blocks = BlockManagerImpl::new(manager)?;
            if let Some(cache) = blocks.prefix_cache_mut() {
                cache.set_record_events(config.enable_events);
            }
            let single = SingleBlockManager::new(num_single).map_err(|e| match e {
                crate::KvPoolError::InvalidArgument { message, .. } => {
                    crate::KvPoolError::invalid("num_single_blocks", message)
                }
                other => other,
            })?;
            ranks.push(Rank {
                blocks,
                single,
                query_tokens: 0,
                hit_tokens: 0,
            });
        }
        Ok(Self {
            // Relaxed: only uniqueness matters.
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            config,
            ranks,
            events: config.enable_events.then(Vec::new),
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

    /// The block manager of `rank`.
    pub fn block_manager(&self, rank: usize) -> Option<&BlockManagerImpl> {
        self.ranks.get(rank).map(|r| &r.blocks)
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
        match seq.owner {
            None => Ok(false),
            Some(owner) if owner == self.id => Ok(true),
            Some(_) => Err(crate::KvPoolError::invalid(
                "seq",
                format!("sequence {} holds blocks of another pool", seq.seq_id()),
            )),
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    /// R13: the rank a sequence without one goes to, or `None` if none has a single block.
    fn choose_rank(&self, seq: &Sequence) -> Option<usize> {
        if let Some(rank) = seq.dp_rank.filter(|&r| r < self.ranks.len()) {
            return Some(rank);
        }
        let mut best: Option<(usize, usize)> = None;
        for (index, rank) in self.ranks.iter().enumerate() {
            if rank.single.counts().free == 0 {
                continue;
            }
            let available = rank.blocks.num_available();
            if best.is_none_or(|(_, b)| available > b) {
                best = Some((index, available));
            }
        }
        best.map(|(index, _)| index)
    }

    /// Plans a first allocation of `num_tokens` tokens; `None` if it cannot succeed (R14, R15).
    fn plan(&self, seq: &mut Sequence, num_tokens: usize) -> Option<Plan> {
        let rank_index = self.choose_rank(seq)?;
        let rank = &self.ranks[rank_index];
        if rank.single.counts().free == 0 {
            return None;
        }
        let block_size = self.config.block_size;
        let (probe, query_blocks) = match rank.blocks.prefix_cache() {
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
        let new_blocks = self.blocks_for(num_tokens).saturating_sub(probe.matched);
        let available = rank.blocks.num_available() - probe.cache_only;
        (new_blocks <= available).then_some(Plan {
            rank: rank_index,
            probe,
            query_blocks,
            new_blocks,
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

    /// Drops every cached entry of every rank (R12).
    pub fn reset_prefix_cache(&mut self) {
        for index in 0..self.ranks.len() {
            self.ranks[index].blocks.reset_prefix_cache();
            self.collect_events(index);
        }
    }

    /// R19: the block tables of `seqs`, row-major `[len(seqs), max_blocks]`, padded with 0.
    pub fn block_tables(&self, seqs: &[&Sequence]) -> Result<(Vec<i32>, usize)> {
        for seq in seqs {
            self.check_owner(seq)?;
        }
        let width = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
        let mut table = vec![0i32; seqs.len() * width];
        for (row, seq) in table.chunks_exact_mut(width.max(1)).zip(seqs) {
            for (slot, id) in row.iter_mut().zip(seq.block_ids()) {
                *slot = id as i32;
            }
        }
        Ok((table, width))
    }

    /// R19: the cache slots of tokens `[num_computed_tokens, len)` of every sequence.
    pub fn slot_mapping(&self, seqs: &[&Sequence]) -> Result<Vec<i64>> {
        let block_size = self.config.block_size;
        let mut total = 0;
        for seq in seqs {
            self.check_owner(seq)?;
            ensure_arg!(
                seq.len() <= seq.capacity(),
                "seqs",
                "sequence {} has {} tokens but its table holds {}: call may_append first",
                seq.seq_id(),
                seq.len(),
                seq.capacity()
            );
            total += seq.len() - seq.num_computed_tokens;
        }
        let mut slots = Vec::with_capacity(total);
        for seq in seqs {
            for position in seq.num_computed_tokens..seq.len() {
                let id = seq.blocks[position / block_size].id() as i64;
                slots.push(id * block_size as i64 + (position % block_size) as i64);
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
            let r = RankStats {
                counts: rank.blocks.counts(),
                prefix_query_tokens: rank.query_tokens,
                prefix_hit_tokens: rank.hit_tokens,
                num_evictions: cache.evictions,
                num_free_single_blocks: rank.single.counts().free,
                ..RankStats::default()
            };
            stats.total.add(&r);
            stats.ranks.push(r);
        }
        stats
    }

    /// Walks every structure of every rank (R20).
    pub fn check(&self) -> Result<()> {
        for (index, rank) in self.ranks.iter().enumerate() {
            rank.blocks.check().map_err(|e| prefix_rank(e, index))?;
            rank.single.check().map_err(|e| prefix_rank(e, index))?;
        }
        Ok(())
    }

    /// Checks a sequence against this pool: its table, counts and ownership.
    pub fn check_sequence(&self, seq: &Sequence) -> Result<()> {
        if !self.check_owner(seq)? {
            ensure_invariant!(seq.blocks.is_empty(), "unallocated sequence holds blocks");
            return Ok(());
        }
        let rank = seq.dp_rank.unwrap_or(usize::MAX);
        ensure_invariant!(
            rank < self.ranks.len(),
            "allocated sequence has no valid dp rank"
        );
        let manager = &self.ranks[rank].blocks;
        ensure_invariant!(
            seq.blocks.iter().all(|b| manager.owns(b)),
            "sequence holds foreign blocks"
        );
        ensure_invariant!(
            seq.num_cached_tokens <= seq.num_computed_tokens
                && seq.num_computed_tokens <= seq.len()
                && seq.num_computed_tokens <= seq.capacity(),
            "sequence {} token counts out of order (R17)",
            seq.seq_id()
        );
        Ok(())
    }

    fn grow(&mut self, seq: &mut Sequence, tokens: usize) -> bool {
        let rank = seq.dp_rank.expect("allocated sequence has a rank");
        let need = self.blocks_for(tokens).saturating_sub(seq.blocks.len());
        if need == 0 {
            return true;
        }
        let ok = self.ranks[rank]
            .blocks
            .allocate_into(need, &mut seq.blocks)
            .is_ok();
        self.collect_events(rank);
        ok
    }

    fn publish(&mut self, seq: &mut Sequence) {
        let Some(rank) = seq.dp_rank else { return };
        let block_size = self.config.block_size;
        let full = (seq.num_computed_tokens / block_size).min(seq.blocks.len());
        let Some(cache) = self.ranks[rank].blocks.prefix_cache_mut() else {
            return;
        };
        if seq.published_epoch != cache.epoch() {
            seq.num_published = 0;
            seq.published_epoch = cache.epoch();
        }
        if seq.num_published >= full {
            return;
        }
        let hasher = *cache.hasher();
        let key: Option<ExtraKey> = seq.extra_key_arc().cloned();
        seq.ensure_hashes(&hasher, block_size, full * block_size);
        let hashes: &[BlockHash] = seq.hashes(full);
        let (_, stop) = cache.insert(
            hashes,
            seq.tokens(),
            &seq.blocks[..full],
            seq.num_published,
            key.as_ref(),
        );
        seq.num_published = stop;
        self.collect_events(rank);
    }
}

fn prefix_rank(error: crate::KvPoolError, rank: usize) -> crate::KvPoolError {
    match error {
        crate::KvPoolError::Invariant(message) => {
            crate::KvPoolError::Invariant(format!("dp rank {rank}: {message}"))
        }
        other => other,
    }
}

impl KvCacheManager for BlockManagerPool {
    fn can_allocate(&mut self, seq: &mut Sequence, num_tokens: Option<usize>) -> Result<bool> {
        let n = Self::validate_num_tokens(seq, num_tokens)?;
        if self.check_owner(seq)? {
            let rank = &self.ranks[seq.dp_rank.unwrap_or(0)];
            let need = self.blocks_for(n).saturating_sub(seq.blocks.len());
            return Ok(need <= rank.blocks.num_available());
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
        let rank = &mut self.ranks[plan.rank];
        // Match first (pinning what it found), then take the single block and new blocks (R14).
        let mut blocks = Vec::with_capacity(plan.probe.matched + plan.new_blocks);
        if let Some(cache) = rank.blocks.prefix_cache_mut() {
            let hasher = *cache.hasher();
            seq.ensure_hashes(&hasher, block_size, plan.query_blocks * block_size);
            let hashes = seq.hashes(plan.query_blocks);
            let matched = cache.match_prefix(
                hashes,
                seq.tokens(),
                seq.extra_key(),
                plan.query_blocks,
                &mut blocks,
            );
            debug_assert_eq!(matched, plan.probe.matched);
        }
        let Some(single) = rank.single.allocate_one() else {
            return Ok(false); // unreachable single-threaded: the plan saw a free single block
        };
        if rank
            .blocks
            .allocate_into(plan.new_blocks, &mut blocks)
            .is_err()
        {
            drop(single);
            return Ok(false); // see `allocate_into`: only with partially released chains
        }
        rank.query_tokens += (plan.query_blocks * block_size) as u64;
        rank.hit_tokens += (plan.probe.matched * block_size) as u64;
        let epoch = rank.blocks.prefix_cache().map_or(0, |c| c.epoch());
        seq.blocks = blocks;
        seq.block_size = block_size;
        seq.single_block = Some(single);
        seq.num_cached_tokens = plan.probe.matched * block_size;
        seq.num_computed_tokens = seq.num_cached_tokens;
        seq.num_published = plan.probe.matched;
        seq.published_epoch = epoch;
        seq.dp_rank = Some(plan.rank);
        seq.owner = Some(self.id);
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
        let need = self
            .blocks_for(seq.len() + lookahead)
            .saturating_sub(seq.blocks.len());
        let rank = seq.dp_rank.unwrap_or(0);
        Ok(need == 0 || need <= self.ranks[rank].blocks.num_available())
    }

    fn may_append(&mut self, seq: &mut Sequence, lookahead: usize) -> Result<bool> {
        ensure_arg!(
            self.check_owner(seq)?,
            "seq",
            "sequence {} is not allocated in this pool",
            seq.seq_id()
        );
        Ok(self.grow(seq, seq.len() + lookahead))
    }

    fn cache(&mut self, seq: &mut Sequence) -> Result<()> {
        if self.check_owner(seq)? {
            self.publish(seq);
        }
        Ok(())
    }

    fn deallocate(&mut self, seq: &mut Sequence) -> Result<()> {
        if !self.check_owner(seq)? {
            return Ok(());
        }
        self.publish(seq);
        let rank = seq.dp_rank;
        seq.reset();
        if let Some(cache) = rank.and_then(|r| self.ranks[r].blocks.prefix_cache_mut()) {
            cache.drain_released();
        }
        Ok(())
    }
}
