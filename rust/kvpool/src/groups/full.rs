//! The full-attention group of a rank: the rank's block allocator with its prefix cache.
//!
//! It is the group that owns the prefix chain: an admission's hit starts as its walk of the
//! chain ([`FullGroup::walk`]), the other groups narrow it, and [`FullGroup::take_hit`] then
//! retains exactly the walked blocks (no second walk). Blocks stay in a sequence's table for its
//! life (no slide). The allocator is an [`Allocator`]: fixed memory (`BlockManagerImpl`) or
//! elastic pages (`XTensorBlockManager`, xLLM's `enable_xtensor`); the pool never asks which.
//!
//! Invariants: those of the allocator (R1-R12, `BlockManagerImpl::check`, and for elastic pages
//! the page rules of `XTensorBlockManager::check`). An elastic allocator is settled (released ids
//! taken onto their pages, emptied pages unmapped) whenever the pool drains the group.

use crate::block::{Block, CACHED, COUNT_MASK};
use crate::error::Result;
use crate::hash::{BlockHash, BlockHasher};
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl};
use crate::prefix_cache::{ExtraKey, PrefixCache, Switch, CACHE_ONLY_BIT};
use crate::xtensor::XTensorBlockManager;

/// The physical allocator of a rank's full-attention group.
// The plain manager stays inline (the hot path, no indirection); the elastic one is boxed.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Allocator {
    /// Fixed memory with a prefix cache (`BlockManagerImpl`).
    Paged(BlockManagerImpl),
    /// Elastic memory on virtual-memory pages, with a prefix cache (`XTensorBlockManager`).
    Elastic(Box<XTensorBlockManager>),
}

/// Calls `$body` with `$m` bound to the allocator, whichever kind it is.
macro_rules! with_allocator {
    ($allocator:expr, $m:ident => $body:expr) => {
        match $allocator {
            Allocator::Paged($m) => $body,
            Allocator::Elastic($m) => $body,
        }
    };
}

/// The full-attention group of one rank.
pub(crate) struct FullGroup {
    allocator: Allocator,
    /// With groups sharing the store: the group each id was last handed out to (0 full
    /// attention, then the rank's other groups in table order), for the memory per group
    /// (`BlockManagerPool::memory`); empty otherwise. Exact for every id that is not free.
    owners: Vec<u8>,
}

/// What one walk of the chain found in the device cache: the ids of the leading cached blocks,
/// each flagged when only the cache holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Walk {
    pub(crate) ids: Vec<u32>,
}

impl Walk {
    /// Blocks that hit.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// How many of the first `k` only the cache holds (a hit makes them used).
    pub(crate) fn cache_only(&self, k: usize) -> usize {
        self.ids[..k]
            .iter()
            .filter(|&&id| id & CACHE_ONLY_BIT != 0)
            .count()
    }
}

impl FullGroup {
    pub(crate) fn new(manager: BlockManagerImpl) -> Self {
        Self {
            allocator: Allocator::Paged(manager),
            owners: Vec::new(),
        }
    }

    /// Records the group of every block handed out from now on (a store shared by groups).
    pub(crate) fn track_owners(&mut self) -> Result<()> {
        let n = self.store().num_blocks();
        self.owners = crate::alloc::filled(n, "num_blocks", || 0)?;
        Ok(())
    }

    /// Blocks of the store per (state, group): `(free, [cached, used] per group)`, `groups`
    /// groups; a block of an untracked store counts as the full-attention group's.
    pub(crate) fn census(&self, groups: usize) -> (usize, Vec<[usize; 2]>) {
        let store = self.store();
        let mut per_group = vec![[0usize; 2]; groups.max(1)];
        let mut free = 0;
        for id in 1..store.num_blocks() as u32 {
            let state = store.state(id);
            if state & COUNT_MASK == 0 {
                free += 1;
                continue;
            }
            let owner = self.owners.get(id as usize).map_or(0, |&o| o as usize);
            let last = per_group.len() - 1;
            let slot = &mut per_group[owner.min(last)];
            match state & (CACHED | COUNT_MASK) == CACHED | 1 {
                true => slot[0] += 1,
                false => slot[1] += 1,
            }
        }
        (free, per_group)
    }

    /// A group on elastic pages.
    pub(crate) fn elastic(manager: XTensorBlockManager) -> Self {
        Self {
            allocator: Allocator::Elastic(Box::new(manager)),
            owners: Vec::new(),
        }
    }

    /// The allocator as the common trait.
    pub(crate) fn as_dyn(&self) -> &dyn BlockManager {
        match &self.allocator {
            Allocator::Paged(m) => m,
            Allocator::Elastic(m) => &**m,
        }
    }

    /// The allocator as the common trait.
    pub(crate) fn as_dyn_mut(&mut self) -> &mut dyn BlockManager {
        match &mut self.allocator {
            Allocator::Paged(m) => m,
            Allocator::Elastic(m) => &mut **m,
        }
    }

    /// The allocator if it is a `BlockManagerImpl` (fixed memory).
    #[inline]
    pub(crate) fn paged(&self) -> Option<&BlockManagerImpl> {
        match &self.allocator {
            Allocator::Paged(m) => Some(m),
            Allocator::Elastic(_) => None,
        }
    }

    /// The allocator if it is an `XTensorBlockManager` (elastic pages).
    #[inline]
    pub(crate) fn elastic_manager(&self) -> Option<&XTensorBlockManager> {
        match &self.allocator {
            Allocator::Paged(_) => None,
            Allocator::Elastic(m) => Some(m),
        }
    }

    #[inline]
    pub(crate) fn elastic_manager_mut(&mut self) -> Option<&mut XTensorBlockManager> {
        match &mut self.allocator {
            Allocator::Paged(_) => None,
            Allocator::Elastic(m) => Some(m),
        }
    }

    /// The prefix cache, if enabled.
    #[inline]
    pub(crate) fn cache(&self) -> Option<&PrefixCache> {
        with_allocator!(&self.allocator, m => m.prefix_cache())
    }

    #[inline]
    pub(crate) fn cache_mut(&mut self) -> Option<&mut PrefixCache> {
        match &mut self.allocator {
            Allocator::Paged(m) => m.prefix_cache_mut(),
            Allocator::Elastic(m) => m.cache.as_mut(),
        }
    }

    /// The hasher of the chains (also when the cache is off).
    pub(crate) fn hasher(&self) -> BlockHasher {
        with_allocator!(&self.allocator, m => *m.hasher())
    }

    /// Free plus evictable blocks (for elastic pages: plus what the memory limit lets map).
    #[inline]
    pub(crate) fn num_available(&self) -> usize {
        match &self.allocator {
            Allocator::Paged(m) => m.num_available(),
            Allocator::Elastic(m) => m.num_available_blocks(),
        }
    }

    pub(crate) fn counts(&self) -> BlockCounts {
        with_allocator!(&self.allocator, m => m.counts())
    }

    pub(crate) fn owns(&self, block: &Block) -> bool {
        with_allocator!(&self.allocator, m => m.owns(block))
    }

    pub(crate) fn check(&self) -> Result<()> {
        with_allocator!(&self.allocator, m => m.check())
    }

    /// One walk of the chain in the cache (empty without a cache).
    pub(crate) fn walk(
        &self,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        max_blocks: usize,
    ) -> Walk {
        let mut walk = Walk::default();
        if let Some(cache) = self.cache() {
            cache.walk(hashes, tokens, extra_key, max_blocks, &mut walk.ids);
        }
        walk
    }

    /// Whether a hit of `k` blocks, then `entries` table entries, fit, with `shared` more
    /// blocks the groups of the shared store take and `spare` blocks they give back: the new
    /// blocks come from the available ones minus those the hit makes used.
    pub(crate) fn fits(
        &self,
        walk: &Walk,
        k: usize,
        entries: usize,
        shared: usize,
        spare: usize,
    ) -> bool {
        entries.saturating_sub(k).saturating_add(shared)
            <= (self.num_available() + spare).saturating_sub(walk.cache_only(k))
    }

    /// The store of a fixed-memory allocator (the shared store of a rank's groups).
    pub(crate) fn store(&self) -> &crate::block::BlockStore {
        match &self.allocator {
            Allocator::Paged(m) => &m.store,
            Allocator::Elastic(m) => &m.store,
        }
    }

    /// Takes the first `k` walked blocks into `table` (the walk's blocks, retained).
    pub(crate) fn take_hit(&mut self, walk: &Walk, k: usize, table: &mut Vec<Block>) {
        if let Some(cache) = self.cache_mut() {
            cache.retain(&walk.ids[..k], table);
        }
    }

    /// Grows `table` by `need` fresh blocks (all-or-nothing, R3).
    #[inline]
    pub(crate) fn grow(&mut self, table: &mut Vec<Block>, need: usize) -> bool {
        let grown = match need {
            0 => return true,
            // Elastic pages: the pool retried pending backend failures before its call
            // (`BlockManagerPool::retry_pending`); an error here is "no room" for the growth,
            // which changes nothing (a backend's own exception is raised by the binding).
            1 => {
                let block = match &mut self.allocator {
                    Allocator::Paged(m) => m.allocate_one(),
                    Allocator::Elastic(m) => m.grow_one(),
                };
                match block {
                    Ok(block) => {
                        table.push(block);
                        true
                    }
                    Err(_) => false,
                }
            }
            _ => match &mut self.allocator {
                Allocator::Paged(m) => m.allocate_into(need, table).is_ok(),
                Allocator::Elastic(m) => m.grow_into(need, table).is_ok(),
            },
        };
        if grown && !self.owners.is_empty() {
            self.own(&table[table.len() - need..], 0);
        }
        grown
    }

    /// [`Self::grow`] for group `owner` of a shared store.
    pub(crate) fn grow_for(&mut self, table: &mut Vec<Block>, need: usize, owner: u8) -> bool {
        let grown = self.grow(table, need);
        if grown && need > 0 && !self.owners.is_empty() {
            self.own(&table[table.len() - need..], owner);
        }
        grown
    }

    fn own(&mut self, blocks: &[Block], owner: u8) {
        for block in blocks {
            self.owners[block.id() as usize] = owner;
        }
    }

    /// Publishes the full blocks `published..full` of a chain (R9, R17); returns where it
    /// stopped. `releasing`: the sequence drops every handle right after (see
    /// `PrefixCache::insert`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn publish(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        blocks: &[Block],
        published: usize,
        extra_key: Option<&ExtraKey>,
        releasing: bool,
    ) -> usize {
        match self.cache_mut() {
            Some(cache) => {
                cache
                    .insert(hashes, tokens, blocks, published, extra_key, releasing)
                    .1
            }
            None => published,
        }
    }

    /// [`Self::publish`] with dedup on publish (R9 revised): duplicates switch to their cached
    /// copy (appended to `switches`) and the chain continues.
    pub(crate) fn publish_dedup(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        blocks: &mut [Block],
        published: usize,
        extra_key: Option<&ExtraKey>,
        switches: &mut Vec<Switch>,
    ) -> usize {
        match self.cache_mut() {
            Some(cache) => {
                cache
                    .insert_dedup(hashes, tokens, blocks, published, extra_key, switches)
                    .1
            }
            None => published,
        }
    }

    /// Puts the blocks whose last outside handle went onto the LRU list; elastic pages also
    /// take the released ids onto their pages and unmap the pages that emptied.
    pub(crate) fn drain(&mut self) {
        match &mut self.allocator {
            Allocator::Paged(m) => {
                if let Some(cache) = m.prefix_cache_mut() {
                    cache.drain_released();
                }
            }
            // A release never raises a backend failure: the manager defers it (its next call
            // that maps, evicts or allocates retries it first, and raises if it fails again).
            Allocator::Elastic(m) => m.take_in(),
        }
    }

    /// Drops every cached entry (R12).
    pub(crate) fn reset(&mut self) {
        with_allocator!(&mut self.allocator, m => m.reset_prefix_cache());
    }
}
