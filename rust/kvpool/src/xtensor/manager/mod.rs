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
use crate::xtensor::backend::{backend_error, AccountingBackend, PageBackend, PageError};
use crate::xtensor::pages::PageTable;

mod check;

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
    /// The last settling failed (a backend error): the page rules are restored by the next.
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

    // --- the inbox and the page rules --------------------------------------------------------

    /// Moves the ids released since the last call onto their pages.
    #[inline]
    pub(crate) fn drain(&mut self) {
        while let Some(id) = self.store.free.pop() {
            self.pages.push(id);
            self.released += 1;
        }
    }

    /// Most empty pages kept mapped (the top of the spare band).
    #[inline]
    fn max_spares(&self) -> usize {
        2 * self.spare_pages
    }

    #[inline]
    fn needs_settle(&self) -> bool {
        let empty = self.pages.empty_len();
        let mapped = self.pages.mapped();
        empty > self.max_spares()
            || mapped > self.limit_pages
            || (empty < self.spare_pages
                && !self.map_refused
                && mapped < self.limit_pages
                && self.pages.unmapped_len() > 0)
            || self.unsettled
    }

    /// Restores the page rules (module doc) after a change: unmaps the empty pages beyond the
    /// spares, reclaims toward the limit, maps spares.
    #[inline]
    pub(crate) fn settle(&mut self) -> Result<()> {
        if self.needs_settle() {
            self.settle_slow()
        } else {
            Ok(())
        }
    }

    fn settle_slow(&mut self) -> Result<()> {
        self.unsettled = true;
        self.trim_empty()?;
        if self.pages.mapped() > self.limit_pages {
            self.reclaim_over_limit()?;
        }
        self.replenish()?;
        self.unsettled = false;
        Ok(())
    }

    /// Unmaps empty pages while more than `2 * spare_pages` are mapped (and the reservation
    /// keeps its ids), or while the limit is exceeded (cutting the reservation if it must).
    pub(crate) fn trim_empty(&mut self) -> Result<()> {
        loop {
            let over = self.pages.mapped() > self.limit_pages;
            if !over && self.pages.empty_len() <= self.max_spares() {
                return Ok(());
            }
            let Some(page) = self.pages.empty_to_unmap() else {
                return Ok(());
            };
            let left = self.pages.free_mapped() - self.pages.total(page) as usize;
            if left < self.reserved {
                if !over {
                    return Ok(());
                }
                self.reserved = left;
            }
            self.unmap_page(page)?;
        }
    }

    fn reclaim_over_limit(&mut self) -> Result<()> {
        let Some(cache) = self.cache.as_mut() else {
            return Ok(());
        };
        cache.drain_released();
        if self.reclaimed_at == Some(self.reclaim_clock()) {
            return Ok(());
        }
        self.reclaim_pages()?;
        self.reclaimed_at = Some(self.reclaim_clock());
        Ok(())
    }

    /// What moves when a page may have become reclaimable (see `reclaimed_at`).
    fn reclaim_clock(&self) -> (u64, u64) {
        let insertions = self.cache.as_ref().map_or(0, PrefixCache::lru_insertions);
        (self.released, insertions)
    }

    fn replenish(&mut self) -> Result<()> {
        while self.pages.empty_len() < self.spare_pages
            && self.pages.mapped() < self.limit_pages
            && !self.map_refused
        {
            let Some(page) = self.pages.next_to_map() else {
                break;
            };
            match self.map_page(page) {
                Ok(()) | Err(PageError::OutOfMemory { .. }) => {} // a refusal ends the loop
                Err(error) => return Err(backend_error(error)),
            }
        }
        Ok(())
    }

    fn map_page(&mut self, page: u32) -> std::result::Result<(), PageError> {
        if let Err(error) = self.backend.map_page(page as usize) {
            if matches!(error, PageError::OutOfMemory { .. }) {
                self.stats.map_failures += 1;
                self.map_refused = true;
            }
            return Err(error);
        }
        self.map_refused = false;
        self.pages.map(page);
        self.stats.maps += 1;
        self.stats.peak_mapped_pages = self.stats.peak_mapped_pages.max(self.pages.mapped());
        Ok(())
    }

    pub(crate) fn unmap_page(&mut self, page: u32) -> Result<()> {
        self.backend
            .unmap_page(page as usize)
            .map_err(backend_error)?;
        self.pages.unmap(page);
        self.stats.unmaps += 1;
        self.map_refused = false;
        Ok(())
    }

    /// Maps pages (the next in order) until `free ids on mapped pages >= want` or the limit or
    /// the range ends; returns the pages mapped. A refused map stops it (and sets
    /// `map_refused`); any other backend error unmaps what it mapped and is returned.
    fn map_until(&mut self, want: usize) -> Result<Vec<u32>> {
        let mut fresh = Vec::new();
        while self.pages.free_mapped() < want && self.pages.mapped() < self.limit_pages {
            let Some(page) = self.pages.next_to_map() else {
                break;
            };
            match self.map_page(page) {
                Ok(()) => fresh.push(page),
                Err(PageError::OutOfMemory { .. }) => break,
                Err(error) => {
                    self.unmap_all(&fresh)?;
                    return Err(backend_error(error));
                }
            }
        }
        Ok(fresh)
    }

    /// Gives back the pages a call mapped before it failed; a refusal that made it fail stands.
    fn unmap_all(&mut self, pages: &[u32]) -> Result<()> {
        let refused = self.map_refused;
        for &page in pages.iter().rev() {
            self.unmap_page(page)?;
        }
        self.map_refused = refused;
        Ok(())
    }

    /// Ids the unmapped pages within the limit would bring.
    fn unmapped_capacity(&self) -> usize {
        let headroom = self.limit_pages.saturating_sub(self.pages.mapped());
        self.pages.ids_of_next(headroom)
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
        self.drain();
        let start = out.len();
        if n > self.pages.free_mapped() {
            self.make_room(n)?;
        }
        if let Err(error) = self.take(n, out) {
            out.truncate(start);
            return Err(error);
        }
        if let Err(error) = self.settle() {
            out.truncate(start); // the handles go back through the inbox
            return Err(error);
        }
        Ok(())
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
        self.drain();
        if let Some((id, _)) = self.pages.pop() {
            self.reserved = self.reserved.saturating_sub(1);
            let block = self.store.take(id);
            self.settle()?;
            return Ok(block);
        }
        let mut out = Vec::with_capacity(1);
        self.allocate_into(1, &mut out)?;
        out.pop()
            .ok_or_else(|| KvPoolError::Invariant("allocate_into gave no block".into()))
    }

    // --- reservation and the memory limit ------------------------------------------------------

    /// Promises `n` more blocks to the coming allocations: maps pages (within the limit) until
    /// the free ids on mapped pages cover every promise, so those allocations map nothing.
    /// Never evicts. Returns false, changing nothing, if the limit or the device's memory does
    /// not allow it. Allocations consume the promise; [`Self::free_reserved`] drops the rest.
    pub fn try_reserve(&mut self, n: usize) -> Result<bool> {
        self.drain();
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
        self.settle()?;
        Ok(true)
    }

    /// Drops what is left of the reservation (pages it kept mapped may unmap); returns how many
    /// blocks were still promised.
    pub fn free_reserved(&mut self) -> Result<usize> {
        self.drain();
        let released = std::mem::take(&mut self.reserved);
        self.settle()?;
        Ok(released)
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
        self.drain();
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
        let settled = self.settle();
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
        settled.map(|()| report)
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
    /// returns how many pages were unmapped.
    pub fn trim(&mut self) -> Result<usize> {
        self.drain();
        if let Some(cache) = self.cache.as_mut() {
            cache.drain_released();
        }
        let before = self.stats.unmaps;
        self.settle()?;
        Ok((self.stats.unmaps - before) as usize)
    }

    /// [`BlockManager::evict`] that reports a backend error instead of deferring it.
    pub fn try_evict(&mut self, n: usize) -> Result<usize> {
        let evicted = self.reclaim_blocks(n);
        self.drain();
        self.settle()?;
        Ok(evicted)
    }

    /// [`BlockManager::reset_prefix_cache`] that reports a backend error instead of deferring it.
    pub fn try_reset_prefix_cache(&mut self) -> Result<()> {
        if let Some(cache) = self.cache.as_mut() {
            cache.reset();
        }
        self.drain();
        self.settle()
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
        if let Some(cache) = self.cache.as_mut() {
            cache.drain_released();
        }
        self.drain();
        self.settle()
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
    /// while unmapping is deferred to the next call (use [`XTensorBlockManager::try_evict`]).
    fn evict(&mut self, n: usize) -> usize {
        let evicted = self.reclaim_blocks(n);
        self.drain();
        let _deferred = self.settle(); // `unsettled` stays set: the next call retries
        evicted
    }

    /// Drops every cached entry (R12); see [`XTensorBlockManager::try_reset_prefix_cache`].
    fn reset_prefix_cache(&mut self) {
        let _deferred = self.try_reset_prefix_cache(); // retried by the next call
    }

    fn check(&self) -> Result<()> {
        self.check_all()
    }
}
