//! `XTensorBlockManager`: a block allocator whose KV memory is mapped page by page, so an
//! instance's footprint grows and shrinks with its load (xLLM's `XTensorBlockManagerImpl`),
//! with the prefix cache on top.
//!
//! Ids are grouped into pages of `blocks_per_page` ([`super::pages`]); a page is backed by
//! memory (mapped through a [`PageBackend`]) only while it is needed. Handles and the prefix
//! cache are those of the plain manager (`Block`, `BlockStore`, `PrefixCache`); the store's free
//! list is only the inbox of ids released since the manager's last call (a handle may be dropped
//! anywhere, lock-free, R4), which every call first drains onto the pages.
//!
//! Invariants, at the end of every `&mut self` call (checked by [`BlockManager::check`]):
//! - R1-R5 as in the plain manager: id 0 (on page 0) is never handed out; every id is free
//!   (on its page's free list or in the inbox), cached or used; the counts add up;
//! - no id on an unmapped page is handed out or cached: a page that holds a used or cached
//!   block is mapped; page 0 is always mapped;
//! - the mapped pages are exactly page 0, the pages holding a used or cached block, and the
//!   empty mapped pages (the spares), whose number stays between `spare_pages` and
//!   `2 * spare_pages`: below it a page is mapped ahead (the preallocation), above it empty
//!   pages unmap (the band keeps a block allocated and freed at a page boundary from mapping
//!   and unmapping a page each time). Fewer only where the memory limit, the end of the range
//!   or a refused map stops it, more only where the reservation needs them;
//! - `free ids on mapped pages >= reserved` (what `try_reserve` promised is mapped);
//! - at most `limit_pages = memory_limit / page_bytes` pages are mapped, unless sequences hold
//!   blocks on the excess (then no page is empty, and no page is reclaimable: one whose
//!   blocks are all cache-only and whose cached descendants are too); the manager keeps
//!   reclaiming toward the limit as those blocks are released.
//!
//! Every `&mut self` call drains the inbox at its start and restores the page rules before it
//! returns, on every exit path, a call that answers "no room" or fails too ([`settle`]); a page
//! backend error is raised only by a call that has done nothing of its own (docs/xtensor.md, "A
//! failing backend").
//!
//! Allocation packs into the fullest mapped page with room, opens an empty (spare) page only
//! when none has room, maps a page only when no mapped page has a free id and the limit allows,
//! and evicts cached blocks (LRU, R10) only when neither suffices: `num_available_blocks` (free
//! ids on mapped pages, cached blocks, and the ids of the unmapped pages the limit allows) is
//! exactly what `allocate` can hand out. Memory is returned in whole pages: a page unmaps when
//! its last block is freed (beyond the spares), and when memory must be given back (the limit
//! is lowered, or `evict`), eviction frees whole pages first ([`super::reclaim`]).

use crate::alloc;
use crate::block::{Block, BlockStore, StoreRef};
use crate::error::{KvPoolError, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::manager::{BlockCounts, BlockManager};
use crate::prefix_cache::PrefixCache;
use crate::xtensor::backend::{backend_error, AccountingBackend, PageBackend};
use crate::xtensor::pages::PageTable;

mod check;
mod settle;

use crate::xtensor::config::{MemoryLimitReport, PageStats, XTensorConfig};

/// The elastic allocator (module doc).
pub struct XTensorBlockManager {
    pub(crate) store: StoreRef,
    pub(crate) cache: Option<PrefixCache>,
    hasher: BlockHasher,
    pub(crate) pages: PageTable,
    backend: Box<dyn PageBackend>,
    page_bytes: u64,
    spare_pages: usize,
    memory_limit: Option<u64>,
    pub(crate) limit_pages: usize,
    reserved: usize,
    /// A map was refused for lack of memory: spares are not replenished until memory may have
    /// come back (a page was unmapped, the limit changed, an allocation mapped one).
    map_refused: bool,
    /// Ids drained from the inbox so far.
    released: u64,
    /// (`released`, the cache's `lru_insertions`) when reclaiming over the limit last ran: a
    /// page becomes reclaimable only when a block on it (or below its blocks) is released, so
    /// until one of the two moves, running it again cannot free more.
    reclaimed_at: Option<(u64, u64)>,
    /// A backend failure left the page rules unrestored: the next call retries first
    /// ([`Self::begin`]) and its settling completes them; `check` does not hold the page rules
    /// meanwhile.
    unsettled: bool,
    pub(crate) stats: PageStats,
}

impl XTensorBlockManager {
    /// A manager per `config` on the accounting-only backend.
    pub fn new(config: XTensorConfig) -> Result<Self> {
        config.validate()?;
        let backend = AccountingBackend::new(config.num_pages());
        Self::with_backend(config, Box::new(backend))
    }

    /// A manager per `config` whose pages `backend` maps (page 0 and the spares at once).
    pub fn with_backend(config: XTensorConfig, backend: Box<dyn PageBackend>) -> Result<Self> {
        config.validate()?;
        alloc::probe(config.footprint(), "num_blocks")?;
        let store = StoreRef::new(BlockStore::with_empty_free_list(
            config.num_blocks,
            config.block_size as u32,
            "num_blocks",
        )?);
        let cache = match config.enable_prefix_cache {
            true => Some(PrefixCache::new(store.clone(), config.hasher)?),
            false => None,
        };
        let pages = PageTable::new(config.num_blocks, config.blocks_per_page)?;
        let mut manager = Self {
            store,
            cache,
            hasher: config.hasher,
            pages,
            backend,
            page_bytes: config.page_bytes,
            spare_pages: config.spare_pages,
            memory_limit: config.memory_limit,
            limit_pages: 0,
            reserved: 0,
            map_refused: false,
            released: 0,
            reclaimed_at: None,
            unsettled: false,
            stats: PageStats::default(),
        };
        manager.limit_pages = manager.pages_allowed(config.memory_limit);
        // Page 0 holds the padding block: mapped for the manager's whole life.
        manager.backend.map_page(0).map_err(backend_error)?;
        manager.stats.maps = 1;
        manager.stats.peak_mapped_pages = 1;
        manager.settle()?;
        Ok(manager)
    }

    fn pages_allowed(&self, limit: Option<u64>) -> usize {
        let num_pages = self.pages.num_pages();
        limit.map_or(num_pages, |bytes| {
            usize::try_from(bytes / self.page_bytes).map_or(num_pages, |p| p.min(num_pages))
        })
    }

    // --- allocation ----------------------------------------------------------------------------

    /// Takes `n` ids off the mapped pages (fullest first) as handles appended to `out`.
    fn take(&mut self, n: usize, out: &mut Vec<Block>) -> Result<()> {
        out.reserve(n);
        for _ in 0..n {
            let Some((id, _)) = self.pages.pop() else {
                return Err(KvPoolError::Invariant(
                    "a mapped page with room was counted but not found".into(),
                ));
            };
            out.push(self.store.take(id));
        }
        self.reserved = self.reserved.saturating_sub(n);
        Ok(())
    }

    /// Appends `n` fresh blocks to `out` (all-or-nothing, R3): free ids on mapped pages first,
    /// then newly mapped pages (within the limit), then evicted cached blocks.
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<Block>) -> Result<()> {
        self.retry_pending()?;
        self.grow_into(n, out)
    }

    /// [`Self::allocate_into`] without the retry of a pending backend failure (the pool's
    /// growth, after its own [`Self::retry_pending`]).
    pub(crate) fn grow_into(&mut self, n: usize, out: &mut Vec<Block>) -> Result<()> {
        self.drain();
        let start = out.len();
        let mut taken = Ok(());
        if n > self.pages.free_mapped() {
            taken = self.make_room(n);
        }
        taken = taken.and_then(|()| self.take(n, out));
        if taken.is_err() {
            out.truncate(start); // the handles go back through the inbox
        }
        self.finish(taken)
    }

    /// Makes `free ids on mapped pages >= n`, or changes nothing and fails.
    fn make_room(&mut self, n: usize) -> Result<()> {
        let cached = self.store.num_cache_only();
        let available = self.pages.free_mapped() + cached + self.unmapped_capacity();
        if n > available {
            return Err(KvPoolError::OutOfBlocks {
                requested: n,
                available,
            });
        }
        let fresh = self.map_until(n)?;
        let free = self.pages.free_mapped();
        if n > free {
            if n - free > cached {
                // A map was refused: the memory is not there after all.
                self.unmap_all(&fresh)?;
                return Err(KvPoolError::OutOfBlocks {
                    requested: n,
                    available: self.pages.free_mapped() + cached,
                });
            }
            if let Some(cache) = self.cache.as_mut() {
                cache.evict(n - free);
            }
            self.drain();
            let free = self.pages.free_mapped();
            if n > free {
                // Only reachable when cached blocks could not be evicted because someone holds
                // descendants of them (released a chain's head, kept its tail).
                self.unmap_all(&fresh)?;
                return Err(KvPoolError::OutOfBlocks {
                    requested: n,
                    available: self.pages.free_mapped(),
                });
            }
        }
        Ok(())
    }

    /// One fresh block without a `Vec`: the hot path of a decode step crossing a block boundary.
    #[inline]
    pub fn allocate_one(&mut self) -> Result<Block> {
        self.retry_pending()?;
        self.grow_one()
    }

    /// [`Self::allocate_one`] without the retry (see [`Self::grow_into`]).
    #[inline]
    pub(crate) fn grow_one(&mut self) -> Result<Block> {
        self.drain();
        if let Some((id, _)) = self.pages.pop() {
            self.reserved = self.reserved.saturating_sub(1);
            let block = self.store.take(id);
            return self.finish(Ok(block));
        }
        let mut out = Vec::with_capacity(1);
        self.grow_into(1, &mut out)?;
        out.pop()
            .ok_or_else(|| KvPoolError::Invariant("allocate_into gave no block".into()))
    }

    // --- reservation and the memory limit ------------------------------------------------------

    /// Promises `n` more blocks to the coming allocations: maps pages (within the limit) until
    /// the free ids on mapped pages cover every promise, so those allocations map nothing.
    /// Never evicts. Returns false, changing nothing, if the limit or the device's memory does
    /// not allow it. Allocations consume the promise; [`Self::free_reserved`] drops the rest.
    pub fn try_reserve(&mut self, n: usize) -> Result<bool> {
        self.begin()?;
        let reserved = self.reserve(n);
        self.finish(reserved)
    }

    /// `try_reserve`'s own work.
    fn reserve(&mut self, n: usize) -> Result<bool> {
        let Some(want) = self.reserved.checked_add(n) else {
            return Ok(false);
        };
        if want > self.pages.free_mapped() + self.unmapped_capacity() {
            return Ok(false);
        }
        let fresh = self.map_until(want)?;
        if self.pages.free_mapped() < want {
            self.unmap_all(&fresh)?;
            return Ok(false);
        }
        self.reserved = want;
        Ok(true)
    }

    /// Drops what is left of the reservation (pages it kept mapped may unmap); returns how many
    /// blocks were still promised. A release: a backend failure in the unmaps is deferred.
    pub fn free_reserved(&mut self) -> Result<usize> {
        self.drain();
        let released = std::mem::take(&mut self.reserved);
        self.finish(Ok(released))
    }

    /// Blocks promised by [`Self::try_reserve`] and not yet allocated.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Sets the memory limit (`None`: the whole range). Lowering it unmaps spare pages, then
    /// evicts cached blocks page by page ([`super::reclaim`]) and unmaps the pages that empty;
    /// what sequences hold stays mapped and is reported (`excess_bytes`, `held_pages`), and the
    /// manager keeps reclaiming toward the limit as they release it. Raising it maps spares.
    pub fn set_memory_limit(&mut self, limit: Option<u64>) -> Result<MemoryLimitReport> {
        self.begin()?;
        if let Some(cache) = self.cache.as_mut() {
            cache.drain_released();
        }
        let before = self.stats;
        let evictions = self.evictions();
        let reserved = self.reserved;
        self.memory_limit = limit;
        self.limit_pages = self.pages_allowed(limit);
        self.map_refused = false;
        self.reclaimed_at = None;
        self.finish(Ok(()))?;
        let mapped = self.pages.mapped();
        let report = MemoryLimitReport {
            limit_bytes: limit,
            limit_pages: self.limit_pages,
            mapped_pages: mapped,
            mapped_bytes: self.mapped_bytes(),
            evicted_blocks: (self.evictions() - evictions) as usize,
            unmapped_pages: (self.stats.unmaps - before.unmaps) as usize,
            mapped_new_pages: (self.stats.maps - before.maps) as usize,
            released_reserved_blocks: reserved.saturating_sub(self.reserved),
            excess_bytes: mapped.saturating_sub(self.limit_pages) as u64 * self.page_bytes,
            held_pages: crate::xtensor::reclaim::held_pages(self),
        };
        Ok(report)
    }

    fn evictions(&self) -> u64 {
        self.cache.as_ref().map_or(0, |c| c.stats().evictions)
    }

    /// The memory limit in bytes (`None`: the whole range).
    pub fn memory_limit(&self) -> Option<u64> {
        self.memory_limit
    }

    /// Pages the memory limit allows.
    pub fn limit_pages(&self) -> usize {
        self.limit_pages
    }

    /// Takes in the ids released by handle drops outside the manager and restores the page
    /// rules (a page whose last block such a drop freed unmaps here, or at the next call);
    /// returns how many pages were unmapped. A backend failure left pending is retried first and
    /// raised if it fails again (nothing else done).
    pub fn trim(&mut self) -> Result<usize> {
        let before = self.stats.unmaps;
        self.begin()?;
        if let Some(cache) = self.cache.as_mut() {
            cache.drain_released();
        }
        self.finish(Ok(()))?;
        Ok((self.stats.unmaps - before) as usize)
    }

    /// [`BlockManager::evict`] that first retries a backend failure left pending and raises it,
    /// evicting nothing, if the backend fails again.
    pub fn try_evict(&mut self, n: usize) -> Result<usize> {
        self.begin()?;
        let evicted = self.reclaim_blocks(n);
        self.finish(Ok(evicted))
    }

    /// [`BlockManager::reset_prefix_cache`] that first retries a backend failure left pending
    /// and raises it, dropping nothing, if the backend fails again.
    pub fn try_reset_prefix_cache(&mut self) -> Result<()> {
        self.begin()?;
        if let Some(cache) = self.cache.as_mut() {
            cache.reset();
        }
        self.finish(Ok(()))
    }

    // --- queries -------------------------------------------------------------------------------

    /// Ids in the pool, padding included.
    pub fn num_blocks(&self) -> usize {
        self.store.num_blocks()
    }

    /// Blocks per page.
    pub fn blocks_per_page(&self) -> usize {
        self.pages.blocks_per_page()
    }

    /// Pages of the range.
    pub fn num_pages(&self) -> usize {
        self.pages.num_pages()
    }

    /// Bytes one mapped page costs.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Empty pages kept mapped.
    pub fn spare_pages(&self) -> usize {
        self.spare_pages
    }

    /// Pages mapped now, page 0 included.
    pub fn mapped_pages(&self) -> usize {
        self.pages.mapped()
    }

    /// Bytes mapped now (`mapped_pages * page_bytes`).
    pub fn mapped_bytes(&self) -> u64 {
        self.pages.mapped() as u64 * self.page_bytes
    }

    /// The page holding block `id`, or `None` if `id` is not an id of this manager.
    pub fn page_of(&self, id: u32) -> Option<usize> {
        ((id as usize) < self.num_blocks()).then(|| self.pages.page_of(id) as usize)
    }

    /// Whether `page` is mapped (false for a page past the range).
    pub fn is_page_mapped(&self, page: usize) -> bool {
        page < self.num_pages() && self.pages.is_mapped(page as u32)
    }

    /// The mapped pages, ascending.
    pub fn mapped_page_ids(&self) -> Vec<usize> {
        (0..self.num_pages())
            .filter(|&p| self.pages.is_mapped(p as u32))
            .collect()
    }

    /// Page counters.
    pub fn page_stats(&self) -> PageStats {
        self.stats
    }

    /// Physical bytes the backend holds, where it can measure them.
    pub fn resident_bytes(&self) -> Option<u64> {
        self.backend.resident_bytes()
    }

    /// The prefix cache, if enabled.
    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref()
    }

    /// The hasher used for chains (also when the cache is off).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Chain hashes for `tokens` with this manager's hasher.
    pub fn hash_chain(&self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<BlockHash> {
        self.hasher.chain(tokens, self.block_size(), extra_key)
    }

    fn check_owned(&self, blocks: &[Block], name: &'static str) -> Result<()> {
        crate::block::check_owned(&self.store, blocks, name)
    }
}

impl BlockManager for XTensorBlockManager {
    fn block_size(&self) -> usize {
        self.store.block_size as usize
    }

    fn owns(&self, block: &Block) -> bool {
        block.belongs_to(&self.store)
    }

    fn counts(&self) -> BlockCounts {
        let total = self.store.num_blocks() - 1;
        let free = self.pages.free_mapped() + self.pages.free_unmapped() + self.store.free.len();
        let cached = self.store.num_cache_only();
        BlockCounts {
            total,
            free,
            cached,
            used: total.saturating_sub(free + cached),
        }
    }

    fn num_available_blocks(&self) -> usize {
        self.pages.free_mapped()
            + self.store.free.len()
            + self.store.num_cache_only()
            + self.unmapped_capacity()
    }

    fn allocate(&mut self, n: usize) -> Result<Vec<Block>> {
        let mut out = Vec::new();
        self.allocate_into(n, &mut out)?;
        Ok(out)
    }

    fn deallocate(&mut self, blocks: Vec<Block>) -> Result<()> {
        self.check_owned(&blocks, "blocks")?;
        // Deepest first: the tail of a chain becomes evictable before its head.
        for block in blocks.into_iter().rev() {
            drop(block);
        }
        self.take_in(); // a release never raises a backend failure
        Ok(())
    }

    fn allocate_shared(&mut self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block> {
        let block_size = self.block_size();
        let Some(cache) = self.cache.as_mut() else {
            return Vec::new();
        };
        cache.share_prefix(tokens, block_size, extra_key)
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

    /// Evicts up to `n` cached blocks, whole pages first ([`super::reclaim`]); a backend error
    /// while unmapping is deferred to the next call (use [`XTensorBlockManager::try_evict`] to
    /// have one left pending raised first).
    fn evict(&mut self, n: usize) -> usize {
        let evicted = self.reclaim_blocks(n);
        self.finish(Ok(evicted)).unwrap_or(evicted)
    }

    /// Drops every cached entry (R12); a backend error while unmapping is deferred (see
    /// [`XTensorBlockManager::try_reset_prefix_cache`]).
    fn reset_prefix_cache(&mut self) {
        if let Some(cache) = self.cache.as_mut() {
            cache.reset();
        }
        let _settled = self.finish(Ok(())); // only an invariant error could come back
    }

    fn check(&self) -> Result<()> {
        self.check_all()
    }
}
