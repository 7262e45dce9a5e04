//! `trait BlockManager` and `BlockManagerImpl`: the physical allocator with its prefix cache.
//!
//! Invariants (R1-R5, checked by [`BlockManager::check`]):
//! - id 0 is the padding block: never in the free list, never handed out (R1);
//! - every id in `1..num_blocks` is free, cached or used (R2), and the counts are read off that
//!   state: `free` is the free list's length, `cached` the store's cache-only count, `used` the
//!   rest, so they always add up to `num_total_blocks`;
//! - `allocate(n)` is all-or-nothing and evicts only what it needs (R3);
//! - `deallocate` is the logical release of handles; the id returns to the free list when the
//!   last handle (maybe the cache's) goes (R4, R5).

use crate::alloc;
use crate::block::{Block, BlockStore, StoreRef, CACHED, COUNT_MASK};
use crate::error::{ensure_arg, ensure_invariant, KvPoolError, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::prefix_cache::PrefixCache;

/// Most blocks one manager may own (ids are u32 with two bits of the state word reserved).
pub const MAX_BLOCKS: usize = 1 << 30;

/// Block counts of a manager (R2): `free + cached + used == total`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockCounts {
    /// Allocatable ids (`num_blocks - 1`).
    pub total: usize,
    /// In the free list.
    pub free: usize,
    /// Held only by the prefix cache (evictable).
    pub cached: usize,
    /// Held by at least one handle outside the cache.
    pub used: usize,
}

impl BlockCounts {
    /// R2 against a walk of the ids that found `cache_only` blocks held by the cache alone.
    pub(crate) fn check(&self, cache_only: usize) -> Result<()> {
        ensure_invariant!(
            self.cached == cache_only,
            "num_cached_blocks is {} but {cache_only} blocks are cache-only (R2)",
            self.cached
        );
        ensure_invariant!(
            self.free + self.cached + self.used == self.total,
            "free {} + cached {} + used {} != total {} (R2)",
            self.free,
            self.cached,
            self.used,
            self.total
        );
        Ok(())
    }

    /// Adds `other`'s counts (totals over ranks).
    pub(crate) fn add(&mut self, other: &BlockCounts) {
        self.total += other.total;
        self.free += other.free;
        self.cached += other.cached;
        self.used += other.used;
    }

    /// `free + cached`: what `allocate` can hand out.
    pub fn available(&self) -> usize {
        self.free + self.cached
    }

    /// `used / total`.
    pub fn usage(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.used as f64 / self.total as f64
        }
    }
}

/// The physical allocator interface (xLLM's `BlockManager`).
pub trait BlockManager {
    /// Tokens per block.
    fn block_size(&self) -> usize;
    /// Whether `block` was handed out by this manager.
    fn owns(&self, block: &Block) -> bool;
    /// Block counts (R2).
    fn counts(&self) -> BlockCounts;
    /// How many blocks `allocate` can hand out now: `free + cached` for a manager whose free ids
    /// are all usable; less for one whose memory is bounded otherwise (an
    /// `XTensorBlockManager` under a memory limit).
    fn num_available_blocks(&self) -> usize {
        self.counts().available()
    }
    /// `n` fresh blocks, evicting cached ones if needed; all-or-nothing (R3).
    fn allocate(&mut self, n: usize) -> Result<Vec<Block>>;
    /// Logical release of handles (R5).
    fn deallocate(&mut self, blocks: Vec<Block>) -> Result<()>;
    /// Handles of the longest cached prefix of `tokens` (R7).
    fn allocate_shared(&mut self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block>;
    /// Publishes the full blocks of `tokens` held in `blocks` (R9); returns how many are new.
    fn cache(
        &mut self,
        tokens: &[u32],
        blocks: &[Block],
        extra_key: Option<&[u8]>,
    ) -> Result<usize>;
    /// Evicts up to `n` cached blocks (R10); returns how many.
    fn evict(&mut self, n: usize) -> usize;
    /// Drops every cached entry (R12).
    fn reset_prefix_cache(&mut self);
    /// Walks every structure (R2, R10).
    fn check(&self) -> Result<()>;
}

/// Options of a [`BlockManagerImpl`].
#[derive(Clone, Copy, Debug)]
pub struct ManagerConfig {
    /// Ids in the pool, padding block 0 included (>= 2).
    pub num_blocks: usize,
    /// Tokens per block (>= 1).
    pub block_size: usize,
    /// Keep a prefix cache.
    pub enable_prefix_cache: bool,
    /// Hasher of the prefix cache (seed, debug truncation).
    pub hasher: BlockHasher,
}

impl ManagerConfig {
    /// Defaults: prefix cache on, default seed.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            enable_prefix_cache: true,
            hasher: BlockHasher::default(),
        }
    }

    /// Bytes a manager of this config allocates (for [`crate::alloc::probe`]).
    pub(crate) fn footprint(&self) -> u128 {
        let cache = match self.enable_prefix_cache {
            true => PrefixCache::bytes_per_block(self.block_size),
            false => 0,
        };
        self.num_blocks as u128 * (BlockStore::BYTES_PER_ID + cache)
    }

    /// Validates the numbers (R1).
    pub fn validate(&self) -> Result<()> {
        ensure_arg!(
            self.num_blocks >= 2,
            "num_blocks",
            "must be at least 2 (block 0 is the padding block), got {}",
            self.num_blocks
        );
        ensure_arg!(
            self.num_blocks <= MAX_BLOCKS,
            "num_blocks",
            "must be at most {MAX_BLOCKS}, got {}",
            self.num_blocks
        );
        ensure_arg!(
            self.block_size >= 1,
            "block_size",
            "must be at least 1, got {}",
            self.block_size
        );
        ensure_arg!(
            self.block_size <= 1 << 16,
            "block_size",
            "must be at most 65536, got {}",
            self.block_size
        );
        ensure_arg!(
            self.num_blocks
                .checked_mul(self.block_size)
                .is_some_and(|t| t < 1 << 40),
            "num_blocks",
            "num_blocks * block_size is too large"
        );
        Ok(())
    }
}

/// Plain allocator with an optional prefix cache and the padding block (xLLM's
/// `BlockManagerImpl`).
pub struct BlockManagerImpl {
    pub(crate) store: StoreRef,
    cache: Option<PrefixCache>,
    hasher: BlockHasher,
}

impl BlockManagerImpl {
    /// A manager per `config` (R1: id 0 reserved).
    pub fn new(config: ManagerConfig) -> Result<Self> {
        config.validate()?;
        alloc::probe(config.footprint(), "num_blocks")?;
        let store = StoreRef::new(BlockStore::new(
            config.num_blocks,
            config.block_size as u32,
            "num_blocks",
        )?);
        let cache = match config.enable_prefix_cache {
            true => Some(PrefixCache::new(store.clone(), config.hasher)?),
            false => None,
        };
        Ok(Self {
            store,
            cache,
            hasher: config.hasher,
        })
    }

    /// Ids in the pool, padding included.
    pub fn num_blocks(&self) -> usize {
        self.store.num_blocks()
    }

    /// The prefix cache, if enabled.
    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref()
    }

    /// The prefix cache, if enabled.
    pub fn prefix_cache_mut(&mut self) -> Option<&mut PrefixCache> {
        self.cache.as_mut()
    }

    /// The slab behind this manager's handles (shared with `ConcurrentBlockManager`'s lock-free
    /// paths).
    pub(crate) fn store(&self) -> &StoreRef {
        &self.store
    }

    /// The hasher used for chains (also when the cache is off).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Number of free plus cached blocks.
    #[inline]
    pub fn num_available(&self) -> usize {
        self.store.free.len() + self.store.num_cache_only()
    }

    /// Appends `n` fresh blocks to `out` (all-or-nothing, R3).
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<Block>) -> Result<()> {
        let free = self.store.free.len();
        if n > free {
            let available = free + self.store.num_cache_only();
            if n > available {
                return Err(KvPoolError::OutOfBlocks {
                    requested: n,
                    available,
                });
            }
            if let Some(cache) = self.cache.as_mut() {
                cache.evict(n - free);
            }
        }
        out.reserve(n);
        // the handles' store references in one count update (bulk_arc.rs)
        let mut refs = self.store.reserve(n);
        for taken in 0..n {
            match self.store.free.pop() {
                Some(id) => out.push(refs.take_block(id)),
                None => {
                    // Only reachable when cached blocks could not be evicted because the caller
                    // holds descendants of them (released a chain's head, kept its tail).
                    let available = taken + self.store.free.len();
                    out.truncate(out.len() - taken);
                    return Err(KvPoolError::OutOfBlocks {
                        requested: n,
                        available,
                    });
                }
            }
        }
        Ok(())
    }

    /// One fresh block without a `Vec` (evicting a cached one if none is free): the hot path
    /// of a decode step that crosses a block boundary.
    #[inline]
    pub fn allocate_one(&mut self) -> Result<Block> {
        if let Some(id) = self.store.free.pop() {
            return Ok(self.store.take(id));
        }
        let mut out = Vec::with_capacity(1);
        self.allocate_into(1, &mut out)?;
        out.pop().ok_or(KvPoolError::OutOfBlocks {
            requested: 1,
            available: 0,
        })
    }

    /// Chain hashes for `tokens` with this manager's hasher.
    pub fn hash_chain(&self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<BlockHash> {
        self.hasher.chain(tokens, self.block_size(), extra_key)
    }

    fn check_owned(&self, blocks: &[Block], name: &'static str) -> Result<()> {
        crate::block::check_owned(&self.store, blocks, name)
    }
}

impl BlockManager for BlockManagerImpl {
    fn block_size(&self) -> usize {
        self.store.block_size as usize
    }

    fn owns(&self, block: &Block) -> bool {
        block.belongs_to(&self.store)
    }

    fn counts(&self) -> BlockCounts {
        let total = self.store.num_blocks() - 1;
        let free = self.store.free.len();
        let cached = self.store.num_cache_only();
        BlockCounts {
            total,
            free,
            cached,
            used: total.saturating_sub(free + cached),
        }
    }

    fn allocate(&mut self, n: usize) -> Result<Vec<Block>> {
        let available = self.num_available();
        if n > available {
            return Err(KvPoolError::OutOfBlocks {
                requested: n,
                available,
            });
        }
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out)?;
        Ok(out)
    }

    fn deallocate(&mut self, blocks: Vec<Block>) -> Result<()> {
        self.check_owned(&blocks, "blocks")?;
        // Deepest first: the tail of a chain becomes evictable before its head.
        for block in blocks.into_iter().rev() {
            drop(block);
        }
        if let Some(cache) = self.cache.as_mut() {
            cache.drain_released();
        }
        Ok(())
    }

    fn allocate_shared(&mut self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block> {
        let Some(cache) = self.cache.as_mut() else {
            return Vec::new();
        };
        cache.share_prefix(tokens, self.store.block_size as usize, extra_key)
    }

    fn cache(
        &mut self,
        tokens: &[u32],
        blocks: &[Block],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        self.check_owned(blocks, "blocks")?;
        let block_size = self.block_size();
        let Some(cache) = self.cache.as_mut() else {
            return Ok(0);
        };
        Ok(cache.publish_tokens(tokens, blocks, block_size, extra_key))
    }

    fn evict(&mut self, n: usize) -> usize {
        self.cache.as_mut().map_or(0, |cache| cache.evict(n))
    }

    fn reset_prefix_cache(&mut self) {
        if let Some(cache) = self.cache.as_mut() {
            cache.reset();
        }
    }

    fn check(&self) -> Result<()> {
        self.check_store(self.cache.is_some())?;
        if let Some(cache) = &self.cache {
            cache.check()?;
        }
        Ok(())
    }
}

impl BlockManagerImpl {
    /// R1, R2 over the store; `cache_allowed`: some structure may hold `CACHED` references
    /// (the prefix cache, or the sliding-window group's kept tails).
    pub(crate) fn check_store(&self, cache_allowed: bool) -> Result<()> {
        let n = self.store.num_blocks();
        let free_ids = self.store.free.snapshot();
        ensure_invariant!(
            free_ids.len() == self.store.free.len(),
            "free list holds {} ids but counts {}",
            free_ids.len(),
            self.store.free.len()
        );
        let mut in_free = vec![false; n];
        for &id in &free_ids {
            ensure_invariant!(id != 0, "padding block 0 is in the free list (R1)");
            ensure_invariant!((id as usize) < n, "free id {id} out of range");
            ensure_invariant!(!in_free[id as usize], "id {id} is twice in the free list");
            in_free[id as usize] = true;
        }
        ensure_invariant!(
            self.store.state(0) & COUNT_MASK == 0,
            "padding block 0 was handed out (R1)"
        );
        let mut cached = 0;
        for id in 1..n as u32 {
            let state = self.store.state(id);
            let count = state & COUNT_MASK;
            ensure_invariant!(
                (count == 0) == in_free[id as usize],
                "block {id}: count {count} but {} the free list (R2, R4)",
                if in_free[id as usize] { "in" } else { "not in" }
            );
            if state & CACHED != 0 {
                ensure_invariant!(cache_allowed, "block {id} is cached with the cache off");
                if count == 1 {
                    cached += 1;
                }
            }
        }
        self.counts().check(cached)?;
        Ok(())
    }
}

/// One id per sequence (block size 1, id 0 reserved, no prefix cache): xLLM's
/// `SingleBlockManager`, also the slot allocator of the linear-state cache.
pub struct SingleBlockManager {
    inner: BlockManagerImpl,
}

impl SingleBlockManager {
    /// A manager of `num_slots` ids, id 0 reserved (R1).
    pub fn new(num_slots: usize) -> Result<Self> {
        let mut config = ManagerConfig::new(num_slots, 1);
        config.enable_prefix_cache = false;
        let rename = |e: KvPoolError| e.renamed_all("num_slots");
        config.validate().map_err(rename)?;
        Ok(Self {
            inner: BlockManagerImpl::new(config).map_err(rename)?,
        })
    }

    /// One slot, or `None` if exhausted.
    pub fn allocate_one(&mut self) -> Option<Block> {
        self.inner
            .store
            .free
            .pop()
            .map(|id| self.inner.store.take(id))
    }
}

impl BlockManager for SingleBlockManager {
    fn block_size(&self) -> usize {
        1
    }
    fn owns(&self, block: &Block) -> bool {
        self.inner.owns(block)
    }
    fn counts(&self) -> BlockCounts {
        self.inner.counts()
    }
    fn allocate(&mut self, n: usize) -> Result<Vec<Block>> {
        self.inner.allocate(n)
    }
    fn deallocate(&mut self, blocks: Vec<Block>) -> Result<()> {
        self.inner.deallocate(blocks)
    }
    fn allocate_shared(&mut self, _tokens: &[u32], _extra_key: Option<&[u8]>) -> Vec<Block> {
        Vec::new()
    }
    fn cache(
        &mut self,
        _tokens: &[u32],
        blocks: &[Block],
        _extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        self.inner.check_owned(blocks, "blocks")?;
        Ok(0)
    }
    fn evict(&mut self, _n: usize) -> usize {
        0
    }
    fn reset_prefix_cache(&mut self) {}
    fn check(&self) -> Result<()> {
        self.inner.check()
    }
}

#[cfg(test)]
mod tests {
    //! The cost of the prefix cache's eviction walk (prefix_cache/segment_walk.rs) under ghost
    //! admission, through the manager, with the ghost filter told of evictions directly.
    use super::{BlockManager, BlockManagerImpl, ManagerConfig};
    use crate::block::Block;
    use crate::prefix_cache::{Eviction, PrefixCache};

    /// Chains of the test, each two blocks under its own parent: as many as the protected
    /// segment holds.
    const CHAINS: u32 = 400;

    /// A ghost SLRU cache of `4 * CHAINS` blocks of 2 tokens: the protected segment holds a
    /// quarter, `CHAINS` nodes.
    fn manager() -> BlockManagerImpl {
        let mut m = BlockManagerImpl::new(ManagerConfig::new(4 * CHAINS as usize, 2)).unwrap();
        let cache = m.prefix_cache_mut().unwrap();
        cache.set_eviction(Eviction::GhostSlru, 25).unwrap();
        m
    }

    /// Computes chain `tokens` in fresh blocks after the ghost filter was told that its last
    /// block was evicted (and not its first: its slot went to a later eviction), publishes it
    /// and releases it (tail first). Returns the ids.
    fn publish_recomputed_tail(m: &mut BlockManagerImpl, tokens: &[u32]) -> Vec<u32> {
        let cache = m.prefix_cache_mut().unwrap();
        let hashes = cache.hasher().chain(tokens, 2, None);
        cache.ghost_remember(hashes[hashes.len() - 1]);
        let blocks = m.allocate(tokens.len() / 2).unwrap();
        m.cache(tokens, &blocks, None).unwrap();
        let ids = blocks.iter().map(Block::id).collect();
        m.deallocate(blocks).unwrap();
        ids
    }

    /// The pathological shape of the Mooncake conversation trace: parents in probation whose
    /// only child the ghost filter admitted to the protected segment. Each child goes back to
    /// probation only when the protected segment overflows, behind every such parent; evicting
    /// it makes its parent the oldest leaf. A walk that starts again from the oldest end on each
    /// call, and goes on from that parent, passes the other parents again each time (quadratic:
    /// 81 000 entries looked at here before 2026-12-03); the walk that keeps its place passes
    /// each once (1 200: one per parent passed, one per evicted block).
    #[test]
    fn the_eviction_walk_passes_each_parent_once_under_ghost_admission() {
        let mut m = manager();
        let chains: Vec<Vec<u32>> = (0..CHAINS)
            .map(|i| publish_recomputed_tail(&mut m, &[1, i, 2, i]))
            .collect();
        let cache = m.prefix_cache().unwrap();
        assert_eq!(cache.protected_order().len(), CHAINS as usize);
        // One-block prompts recomputed after their eviction: each pushes the oldest child out of
        // the protected segment, to the newest end of probation.
        for i in 0..CHAINS {
            publish_recomputed_tail(&mut m, &[3, i]);
        }
        m.check().unwrap();
        let before = m.prefix_cache().unwrap().eviction_walk_steps();
        // Half the chains one call each (child, then its parent: the oldest leaf), then the rest
        // in one call.
        for chain in &chains[..CHAINS as usize / 2] {
            assert_eq!(m.evict(2), 2);
            let cache = m.prefix_cache().unwrap();
            assert!(chain.iter().all(|&id| !is_cached(cache, id)));
        }
        assert_eq!(m.evict(CHAINS as usize), CHAINS as usize);
        m.check().unwrap();
        let cache = m.prefix_cache().unwrap();
        assert!(chains.iter().flatten().all(|&id| !is_cached(cache, id)));
        assert_eq!(
            cache.protected_order().len(),
            CHAINS as usize,
            "the prompts stay"
        );
        let steps = cache.eviction_walk_steps() - before;
        let evicted = 2 * u64::from(CHAINS);
        assert!(
            steps <= 2 * evicted,
            "the walk looked at {steps} entries to evict {evicted}"
        );
    }

    /// Whether block `id` is cached (an entry of the cache).
    fn is_cached(cache: &PrefixCache, id: u32) -> bool {
        cache.entries().any(|(entry, _)| entry == id)
    }
}
