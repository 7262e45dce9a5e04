//! The full-attention group of a rank: the rank's block allocator with its prefix cache.
//!
//! It is the group that owns the prefix chain: an admission's hit starts as its walk of the
//! chain ([`FullGroup::walk`]), the other groups narrow it, and [`FullGroup::take_hit`] then
//! retains exactly the walked blocks (no second walk). Blocks stay in a sequence's table for its
//! life (no slide). The allocator is an [`Allocator`], so a new allocator kind plugs in as a
//! variant without touching the pool.
//!
//! Invariants: those of the allocator (R1-R12, `BlockManagerImpl::check`).

use crate::block::Block;
use crate::error::Result;
use crate::hash::{BlockHash, BlockHasher};
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl};
use crate::prefix_cache::{ExtraKey, PrefixCache, Switch, CACHE_ONLY_BIT};

/// The physical allocator of a rank's full-attention group.
pub(crate) enum Allocator {
    /// Fixed pages with a prefix cache (`BlockManagerImpl`).
    Paged(BlockManagerImpl),
}

/// The full-attention group of one rank.
pub(crate) struct FullGroup {
    allocator: Allocator,
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
        }
    }

    /// The allocator as a `BlockManagerImpl` (every kind today).
    #[inline]
    pub(crate) fn manager(&self) -> &BlockManagerImpl {
        match &self.allocator {
            Allocator::Paged(m) => m,
        }
    }

    #[inline]
    pub(crate) fn manager_mut(&mut self) -> &mut BlockManagerImpl {
        match &mut self.allocator {
            Allocator::Paged(m) => m,
        }
    }

    /// The prefix cache, if enabled.
    #[inline]
    pub(crate) fn cache(&self) -> Option<&PrefixCache> {
        self.manager().prefix_cache()
    }

    #[inline]
    pub(crate) fn cache_mut(&mut self) -> Option<&mut PrefixCache> {
        self.manager_mut().prefix_cache_mut()
    }

    /// The hasher of the chains (also when the cache is off).
    pub(crate) fn hasher(&self) -> BlockHasher {
        *self.manager().hasher()
    }

    /// Free plus evictable blocks.
    #[inline]
    pub(crate) fn num_available(&self) -> usize {
        self.manager().num_available()
    }

    pub(crate) fn counts(&self) -> BlockCounts {
        self.manager().counts()
    }

    pub(crate) fn owns(&self, block: &Block) -> bool {
        self.manager().owns(block)
    }

    pub(crate) fn check(&self) -> Result<()> {
        self.manager().check()
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

    /// Whether a hit of `k` blocks, then `entries` table entries, fit: the new blocks come from
    /// the available ones minus those the hit makes used.
    pub(crate) fn fits(&self, walk: &Walk, k: usize, entries: usize) -> bool {
        entries.saturating_sub(k) <= self.num_available().saturating_sub(walk.cache_only(k))
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
        match need {
            0 => true,
            1 => match self.manager_mut().allocate_one() {
                Ok(block) => {
                    table.push(block);
                    true
                }
                Err(_) => false,
            },
            _ => self.manager_mut().allocate_into(need, table).is_ok(),
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

    /// Puts the blocks whose last outside handle went onto the LRU list.
    pub(crate) fn drain(&mut self) {
        if let Some(cache) = self.cache_mut() {
            cache.drain_released();
        }
    }

    /// Drops every cached entry (R12).
    pub(crate) fn reset(&mut self) {
        self.manager_mut().reset_prefix_cache();
    }
}
