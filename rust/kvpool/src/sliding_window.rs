//! `SlidingWindowBlockManager`: the block group of sliding-window attention layers (R25).
//!
//! A layer with window `w` lets the query at position `p` attend to positions `[p - w + 1, p]`.
//! Once a sequence has computed `c` tokens, its next query is at `c`, so every block whose tokens
//! all lie before `c - w + 1` can never be read again: [`SlidingWindowBlockManager::slide`]
//! releases those blocks and their table entries become the padding id 0. A fresh prefill holds
//! all its blocks (the step that computes them needs them).
//!
//! Prefix sharing (the rule kvpool chooses, R25 in docs/contract.md): a window block is shareable only
//! while it is still held. The manager keeps an index `chain hash -> block id` of the published
//! window blocks, whose entries hold *no* reference, and it holds two kinds of blocks:
//! - blocks of running sequences; those a slide releases are free at once (released window
//!   blocks never linger, which is what keeps a window group small);
//! - the **window tail of finished sequences**: at deallocate the manager keeps the published
//!   blocks still in the sequence's window (the `CACHED` bit of the store: evictable, counted
//!   as cached, reclaimed oldest-first when the group runs short). They are exactly what the
//!   next turn of a conversation needs: its hit ends where the previous turn stopped.
//!
//! A prefix hit at block boundary `k` is valid only if every block the next query can attend
//! to, `[first_needed(k * bs), k)`, is held (by a sequence or as a kept tail) and indexed under
//! the chain's hash with the same tokens, and its recorded *link* (the anchor of the
//! full-attention entry of the position before it, `chain.rs`) is where the query's own
//! verified walk goes: a window cannot compare the prefix before its first block, so the
//! full-attention cache stands in for its parent (R7). The hit then takes new handles on exactly
//! those blocks (entries before them are 0). A block is published once the full-attention
//! publication of its chain went past its position. It never hands out a released block: an index entry is used only
//! after the store proves the block is still held (an atomic "retain if alive"), and the id's
//! publication is cleared whenever the manager hands the id out again. This is vLLM's
//! sliding-window manager restricted to blocks inside some window, or SGLang's SWA radix cache
//! without tombstones.
//!
//! Invariants (checked by [`SlidingWindowBlockManager::check`]): those of the block manager
//! (R1-R5, with `cached` = kept tail blocks nothing else holds); a block has the `CACHED` bit
//! iff it is in the kept list; a published block has a link; index entries name real ids (stale ones are skipped on lookup and
//! pruned in bulk when the index outgrows twice the number of ids); with events on, every
//! findable published block is announced (`events.rs`).
//!
//! Events (R21, `events.rs`): with [`SlidingWindowBlockManager::set_record_events`], a
//! publication queues a "stored" event and a block that stopped being findable a "removed" one,
//! found by [`SlidingWindowBlockManager::sweep_events`] (its last handle may drop on any
//! thread, lock-free, where the manager does not see it).
//!
//! [`BlockStore::try_retain`]: crate::block::BlockStore

mod events;

use std::collections::VecDeque;

use crate::alloc;
use crate::block::{Block, CACHED, COUNT_MASK};
use crate::chain::{OwnChain, QueryChain};
use crate::error::{ensure_arg, ensure_invariant, Result};
use crate::hash::{BlockHash, ByHash};
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig};
use crate::prefix_cache::{Anchor, CacheEvent, ExtraKey};

use events::WindowEvents;

/// A sequence's table in a sliding-window group: `released` leading entries are padding (0),
/// then the blocks it still holds.
#[derive(Debug, Default)]
pub struct WindowTable {
    pub(crate) released: usize,
    pub(crate) blocks: Vec<Block>,
    /// Leading blocks published in the window index.
    pub(crate) published: usize,
    /// A state group's previous state block (`groups/shared_window.rs`): one entry among the
    /// released ones still held, the source of the step's state copy, until the step is done.
    pub(crate) carry: Option<(usize, Block)>,
    /// A state group's boundary states whose full-attention node is not cached yet (its chain's
    /// publication stopped at a duplicate, R9): attached once it is, at the latest at release.
    pub(crate) pending: Vec<(usize, Block)>,
}

impl WindowTable {
    /// Entries of the table (released ones included).
    pub fn len(&self) -> usize {
        self.released + self.blocks.len()
    }

    /// Whether the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Released (padding) leading entries.
    pub fn num_released(&self) -> usize {
        self.released
    }

    /// Handles still held, from entry `num_released()` on.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Block id of every entry, 0 for released ones (but a carried one).
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        // zeros, the carried id at its entry (always a released one), zeros, the held ids
        let (at, carried) = match &self.carry {
            Some((at, block)) => (*at, Some(block.id())),
            None => (self.released, None),
        };
        std::iter::repeat_n(0, at)
            .chain(carried)
            .chain(std::iter::repeat_n(0, self.released.saturating_sub(at + 1)))
            .chain(self.blocks.iter().map(Block::id))
    }

    /// The block of entry `index`, if held.
    pub fn get(&self, index: usize) -> Option<&Block> {
        match &self.carry {
            Some((at, block)) if *at == index => Some(block),
            _ => index
                .checked_sub(self.released)
                .and_then(|i| self.blocks.get(i)),
        }
    }

    /// Drops every handle and empties the table.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.carry = None;
        self.pending.clear();
        self.released = 0;
        self.published = 0;
    }
}

/// Block allocator of a sliding-window group (window `window` tokens).
pub struct SlidingWindowBlockManager {
    inner: BlockManagerImpl,
    window: usize,
    sharing: Option<WindowIndex>,
    /// Kept window tails of finished sequences, oldest first (each with the `CACHED` bit).
    kept: VecDeque<u32>,
    /// KV events (R21), when recorded (only with sharing: nothing is findable otherwise);
    /// boxed, so a manager without them stays small.
    events: Option<Box<WindowEvents>>,
}

/// Chain hash -> block id of published window blocks (entries hold no reference).
struct WindowIndex {
    index: ByHash<u32>,
    /// The hash each id is published under, if any (cleared when the id is handed out).
    published: Vec<Option<BlockHash>>,
    tokens: Vec<u32>,
    /// The link (`chain.rs`) each published id was published with.
    links: Vec<Anchor>,
    /// The chain's extra key beside a root link (a chain's first block).
    roots: Vec<Option<ExtraKey>>,
}

impl SlidingWindowBlockManager {
    /// `num_blocks` ids (padding 0 included) of `block_size` tokens for a window of `window`
    /// tokens; `enable_sharing` keeps the index that lets prefix hits share held blocks.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        window: usize,
        enable_sharing: bool,
    ) -> Result<Self> {
        ensure_arg!(window >= 1, "window", "must be at least 1, got {window}");
        let mut config = ManagerConfig::new(num_blocks, block_size);
        config.enable_prefix_cache = false;
        let inner = BlockManagerImpl::new(config)?;
        let sharing = match enable_sharing {
            true => Some(WindowIndex {
                index: ByHash::default(),
                published: alloc::filled(num_blocks, "num_blocks", || None)?,
                tokens: alloc::filled(num_blocks * block_size, "num_blocks", || 0)?,
                links: alloc::filled(num_blocks, "num_blocks", || 0)?,
                roots: alloc::filled(num_blocks, "num_blocks", || None)?,
            }),
            false => None,
        };
        Ok(Self {
            inner,
            window,
            sharing,
            kept: VecDeque::new(),
            events: None,
        })
    }

    /// Records KV events (R21) from now on (`on`), or stops and forgets them. Only with
    /// sharing: without it no block is ever findable, so there is nothing to announce.
    pub fn set_record_events(&mut self, on: bool) {
        self.events = (on && self.sharing.is_some()).then(Box::default);
    }

    /// Queues a "removed" event for every announced block that is no longer findable (its
    /// last handle dropped, a kept tail evicted); returns how many hashes left. The pool calls
    /// it when it takes its events.
    pub fn sweep_events(&mut self) -> usize {
        let Some(events) = self.events.as_mut() else {
            return 0;
        };
        let Some(sharing) = self.sharing.as_ref() else {
            return 0;
        };
        let store = &self.inner.store;
        events.sweep(|hash, id| Self::findable(sharing, store, hash, id))
    }

    /// Takes the queued events, oldest first (empty without events).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(|e| e.take()).unwrap_or_default()
    }

    /// Blocks announced by a "stored" event and not yet by a "removed" one.
    pub fn num_announced(&self) -> usize {
        self.events.as_ref().map_or(0, |e| e.num_announced())
    }

    /// Whether a prefix hit can find block `id` under `hash`: the index names it, it is held
    /// and published under that hash (the rule of [`Self::find`], tokens aside).
    fn findable(
        sharing: &WindowIndex,
        store: &crate::block::BlockStore,
        hash: BlockHash,
        id: u32,
    ) -> bool {
        sharing.index.get(&hash.0) == Some(&id)
            && store.state(id) & COUNT_MASK != 0
            && sharing.published[id as usize] == Some(hash)
    }

    /// Bytes a manager of these numbers allocates (for [`crate::alloc::probe`]).
    pub(crate) fn footprint(num_blocks: usize, block_size: usize, sharing: bool) -> u128 {
        let index = match sharing {
            true => {
                std::mem::size_of::<Option<BlockHash>>()
                    + 4 * block_size
                    + std::mem::size_of::<Anchor>()
                    + std::mem::size_of::<Option<ExtraKey>>()
            }
            false => 0,
        };
        num_blocks as u128 * (crate::block::BlockStore::BYTES_PER_ID + index as u128)
    }

    /// Free blocks plus kept tail blocks nothing else holds: what `grow` can hand out.
    pub fn num_available(&self) -> usize {
        self.inner.num_available()
    }

    /// Clears the `QUEUED` marks the store sets when a kept block's other handles go (the kept
    /// list is ordered by keep time, so the queue itself carries no information here).
    fn drain_released(&self) {
        let store = &self.inner.store;
        while let Some(id) = store.released.pop() {
            store.clear_queued(id);
        }
    }

    /// Keeps the published blocks still in `table`'s window (a sequence being released) so a
    /// later request continuing the same prefix can share them. Only with sharing on.
    pub fn keep_tail(&mut self, table: &WindowTable) {
        let Some(sharing) = self.sharing.as_ref() else {
            return;
        };
        let end = table.published.min(table.len());
        for i in table.released..end {
            let Some(block) = table.get(i) else { continue };
            let id = block.id();
            let Some(hash) = sharing.published[id as usize] else {
                continue;
            };
            if self.inner.store.state(id) & CACHED == 0 {
                self.inner.store.mark_cached(id, hash);
                self.kept.push_back(id);
            }
        }
    }

    /// Frees up to `n` kept blocks that nothing else holds, oldest first; returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        self.drain_released();
        let store = &self.inner.store;
        let mut evicted = 0;
        let mut scanned = 0;
        let total = self.kept.len();
        while evicted < n && scanned < total {
            let Some(id) = self.kept.pop_front() else {
                break;
            };
            scanned += 1;
            if store.state(id) & (CACHED | COUNT_MASK) == CACHED | 1 {
                store.unmark_cached(id);
                evicted += 1;
            } else {
                self.kept.push_back(id); // still in a running sequence's window
            }
        }
        evicted
    }

    /// Drops every kept block (those still in running windows stay with their sequences).
    fn drop_kept(&mut self) {
        self.drain_released();
        while let Some(id) = self.kept.pop_front() {
            self.inner.store.unmark_cached(id);
        }
    }

    /// A prefix hit at block boundary `k` of `chain` for this group (module doc): `None` unless
    /// every block the next query can attend to is held and published under the chain (and
    /// linked to it); else how many of those are kept blocks nothing else holds (the hit makes
    /// them used, so they no longer count as available).
    pub(crate) fn hit_cost(&self, chain: &QueryChain<'_>, k: usize) -> Option<usize> {
        let first = self.first_needed_block(k * self.block_size());
        let mut cost = 0;
        for i in (first..k).rev() {
            let id = self.find(chain, i)?;
            cost += usize::from(self.inner.store.state(id) & (CACHED | COUNT_MASK) == CACHED | 1);
        }
        Some(cost)
    }

    /// The window, in tokens.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Whether prefix hits may share held window blocks.
    pub fn sharing(&self) -> bool {
        self.sharing.is_some()
    }

    /// Free blocks.
    pub fn num_free(&self) -> usize {
        self.inner.store.free.len()
    }

    /// Index of the first block the query at position `num_computed_tokens` can attend to: the
    /// blocks before it hold only tokens before `num_computed_tokens - window + 1`. Exact for
    /// every `usize` (no `+ 1` that could wrap, F5; `window >= 1`).
    #[inline]
    pub fn first_needed_block(&self, num_computed_tokens: usize) -> usize {
        num_computed_tokens.saturating_sub(self.window - 1) / self.block_size()
    }

    /// The first block a slide at `num_computed_tokens` keeps: the first one a query at the last
    /// full block boundary can attend to. A later request sharing the prefix can only hit at a
    /// block boundary, so the tail is kept for that query, not for the one at
    /// `num_computed_tokens` (a block more when the window ends inside the last block).
    #[inline]
    fn first_kept_block(&self, num_computed_tokens: usize) -> usize {
        let bs = self.block_size();
        self.first_needed_block(num_computed_tokens / bs * bs)
    }

    /// Releases the blocks of `table` that neither a future query of the sequence nor a hit at
    /// one of its block boundaries can attend to (R25); returns how many.
    #[inline]
    pub fn slide(&self, table: &mut WindowTable, num_computed_tokens: usize) -> usize {
        let first = self.first_kept_block(num_computed_tokens).min(table.len());
        if first <= table.released {
            return 0; // most steps: the window did not pass a block boundary
        }
        Self::release_before(table, first)
    }

    /// Releases the entries of `table` before `first` (the slide's rare part).
    fn release_before(table: &mut WindowTable, first: usize) -> usize {
        let count = first - table.released;
        // Oldest first: drop the handles; ids nobody else holds are free at once.
        table.blocks.drain(..count);
        table.released = first;
        count
    }

    /// How many blocks `slide(table, num_computed_tokens)` would make available right now: those
    /// whose last handle outside this manager is the table's (free at once), and kept tails
    /// whose only other holder is the table (evictable once it lets go, F4).
    pub fn releasable(&self, table: &WindowTable, num_computed_tokens: usize) -> usize {
        let first = self.first_kept_block(num_computed_tokens).min(table.len());
        let store = &self.inner.store;
        (table.released..first)
            .filter(|&i| {
                table.get(i).is_some_and(|b| {
                    let state = store.state(b.id());
                    let count = state & COUNT_MASK;
                    count == 1 || (state & CACHED != 0 && count == 2)
                })
            })
            .count()
    }

    /// What [`Self::grow`] can hand out once `table` has slid to `num_computed_tokens`: the
    /// available blocks plus [`Self::releasable`] (the pool's one growth computation, R16).
    pub fn available_after_slide(&self, table: &WindowTable, num_computed_tokens: usize) -> usize {
        self.num_available() + self.releasable(table, num_computed_tokens)
    }

    /// Grows `table` to `num_entries` entries with fresh blocks (all-or-nothing, R3).
    pub fn grow(&mut self, table: &mut WindowTable, num_entries: usize) -> Result<()> {
        let need = num_entries.saturating_sub(table.len());
        if need == 0 {
            return Ok(());
        }
        let free = self.num_free();
        if need > free && !self.kept.is_empty() {
            self.evict(need - free);
        }
        let before = table.blocks.len();
        self.inner.allocate_into(need, &mut table.blocks)?;
        if let Some(sharing) = self.sharing.as_mut() {
            for block in &table.blocks[before..] {
                sharing.published[block.id() as usize] = None;
            }
        }
        Ok(())
    }

    /// Publishes the held blocks of `table` among its first `num_full` entries (full blocks
    /// whose KV exists) under the hashes of `chain`, each with its link (`chain.rs`), so prefix
    /// hits can share them; with events, queues their "stored" events (under the chain's extra
    /// key). Positions past the chain's full-attention reach wait for a later call; a block
    /// whose link cannot be found stays private.
    pub(crate) fn publish(
        &mut self,
        table: &mut WindowTable,
        chain: &mut OwnChain<'_>,
        num_full: usize,
    ) {
        let block_size = self.block_size();
        let Some(sharing) = self.sharing.as_mut() else {
            return;
        };
        let (hashes, tokens) = (chain.hashes, chain.tokens);
        let end = num_full
            .min(table.len())
            .min(hashes.len())
            .min(chain.reach());
        let start = table.published.max(table.released);
        for i in start..end {
            let Some(block) = table.get(i) else { continue };
            let id = block.id() as usize;
            let hash = hashes[i];
            if sharing.published[id].is_some() {
                continue; // matched from another sequence: already published
            }
            let link = chain.link(i);
            if link == 0 {
                continue; // the parent is not cached as this chain's: a hit could not verify it
            }
            if let Some(&other) = sharing.index.get(&hash.0) {
                let held = self.inner.store.state(other) & crate::block::COUNT_MASK != 0;
                if held && sharing.published[other as usize] == Some(hash) {
                    if sharing.links[other as usize] == link {
                        continue; // first writer wins (R9): another held block has this chain
                    }
                    // Linked elsewhere: another prefix whose hash collides, or this prefix
                    // before its parent's entry was evicted and computed again. Its link no
                    // longer serves this chain: the newer publication takes the hash.
                    sharing.published[other as usize] = None;
                }
            }
            sharing.published[id] = Some(hash);
            sharing.links[id] = link;
            if i == 0 {
                sharing.roots[id] = chain.extra_key.cloned();
            }
            let block_tokens = &tokens[i * block_size..(i + 1) * block_size];
            sharing.tokens[id * block_size..(id + 1) * block_size].copy_from_slice(block_tokens);
            sharing.index.insert(hash.0, id as u32);
            if let Some(events) = self.events.as_mut() {
                // Any older block of this hash is unfindable now (failed the first-writer test
                // above, or lost the hash to this one): its removal is queued first.
                let parent = i.checked_sub(1).map(|p| hashes[p]);
                events.stored(hash, parent, block_tokens, id as u32, chain.extra_key);
            }
        }
        table.published = table.published.max(end);
        if sharing.index.len() > 2 * sharing.published.len() + 64 {
            let store = &self.inner.store;
            let published = &sharing.published;
            sharing.index.retain(|&hash, &mut id| {
                store.state(id) & crate::block::COUNT_MASK != 0
                    && published[id as usize].map(|h| h.0) == Some(hash)
            });
        }
    }

    /// The held block published for position `i` of `chain`, if any: under its hash, with its
    /// tokens, linked to where the chain's walk verified the position before (R7).
    fn find(&self, chain: &QueryChain<'_>, i: usize) -> Option<u32> {
        let sharing = self.sharing.as_ref()?;
        let hash = chain.hashes[i];
        let &id = sharing.index.get(&hash.0)?;
        let bs = self.block_size();
        let held = self.inner.store.state(id) & crate::block::COUNT_MASK != 0;
        let at = id as usize;
        (held
            && sharing.published[at] == Some(hash)
            && sharing.tokens[at * bs..(at + 1) * bs] == chain.tokens[i * bs..(i + 1) * bs]
            && chain.links(i, sharing.links[at], sharing.roots[at].as_deref()))
        .then_some(id)
    }

    /// Fills an empty `table` for a hit at boundary `k` (after [`Self::hit_cost`]): entries
    /// before the window are padding, the window's blocks are shared. False (table untouched)
    /// if a block was released meanwhile.
    pub(crate) fn take_hit(
        &self,
        table: &mut WindowTable,
        chain: &QueryChain<'_>,
        k: usize,
    ) -> bool {
        debug_assert!(table.is_empty());
        let first = self.first_needed_block(k * self.block_size());
        let mut blocks = Vec::with_capacity(k - first);
        for i in first..k {
            let Some(id) = self.find(chain, i) else {
                return false;
            };
            let store = &self.inner.store;
            let block = if store.state(id) & CACHED != 0 {
                // Kept: the manager's own reference proves the block is alive.
                Some(store.retain_cached(id))
            } else {
                store.try_retain(id)
            };
            match block {
                Some(block) => blocks.push(block),
                None => return false,
            }
        }
        table.released = first;
        table.blocks = blocks;
        table.published = k;
        true
    }

    /// Forgets the announced blocks without removal events: the caller records a "cleared"
    /// event that covers them (the pool's reset, whose device "cleared" covers every group).
    pub(crate) fn forget_events(&mut self) {
        if let Some(events) = self.events.as_mut() {
            events.forget();
        }
    }

    /// Forgets every published block and drops the kept tails (blocks of running sequences
    /// stay with them). With events, the announced blocks are removed at the next sweep
    /// unless the caller forgets them ([`Self::forget_events`]).
    pub fn reset_sharing(&mut self) {
        self.drop_kept();
        if let Some(sharing) = self.sharing.as_mut() {
            sharing.index.clear();
            sharing.published.iter_mut().for_each(|p| *p = None);
        }
    }

    /// Index entries that still point at a held, published block.
    pub fn num_shared_entries(&self) -> usize {
        let Some(sharing) = self.sharing.as_ref() else {
            return 0;
        };
        sharing
            .index
            .iter()
            .filter(|(&hash, &id)| {
                self.inner.store.state(id) & crate::block::COUNT_MASK != 0
                    && sharing.published[id as usize].map(|h| h.0) == Some(hash)
            })
            .count()
    }
}

impl BlockManager for SlidingWindowBlockManager {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn owns(&self, block: &Block) -> bool {
        self.inner.owns(block)
    }
    fn counts(&self) -> BlockCounts {
        self.inner.counts()
    }
    fn allocate(&mut self, n: usize) -> Result<Vec<Block>> {
        let blocks = self.inner.allocate(n)?;
        if let Some(sharing) = self.sharing.as_mut() {
            for block in &blocks {
                sharing.published[block.id() as usize] = None;
            }
        }
        Ok(blocks)
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
        for block in blocks {
            ensure_arg!(
                self.owns(block),
                "blocks",
                "block {} belongs to another manager",
                block.id()
            );
        }
        Ok(0)
    }
    fn evict(&mut self, n: usize) -> usize {
        SlidingWindowBlockManager::evict(self, n)
    }
    fn reset_prefix_cache(&mut self) {
        self.reset_sharing();
    }
    fn check(&self) -> Result<()> {
        self.inner.check_store(true)?;
        let mut kept = vec![false; self.inner.num_blocks()];
        for &id in &self.kept {
            ensure_invariant!(!kept[id as usize], "window block {id} is kept twice");
            kept[id as usize] = true;
        }
        for (id, &is_kept) in kept.iter().enumerate() {
            let cached = self.inner.store.state(id as u32) & CACHED != 0;
            ensure_invariant!(
                cached == is_kept,
                "window block {id}: CACHED bit {cached} but kept {is_kept}"
            );
        }
        if let Some(sharing) = &self.sharing {
            for &id in sharing.index.values() {
                ensure_invariant!(
                    (id as usize) < sharing.published.len() && id != 0,
                    "window index entry points at id {id}"
                );
            }
            for (id, published) in sharing.published.iter().enumerate() {
                ensure_invariant!(
                    published.is_none() || sharing.links[id] != 0,
                    "window block {id} is published without a link (R7)"
                );
            }
            if let Some(events) = &self.events {
                let store = &self.inner.store;
                events.check(sharing.index.iter(), |hash, id| {
                    Self::findable(sharing, store, hash, id)
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_window_example() {
        // R25: block size 4, window 8, 20-token prefill then one appended token.
        let mut manager = SlidingWindowBlockManager::new(16, 4, 8, false).unwrap();
        let mut table = WindowTable::default();
        manager.grow(&mut table, 5).unwrap();
        assert_eq!(manager.slide(&mut table, 0), 0);
        assert_eq!(table.len(), 5);
        manager.grow(&mut table, 6).unwrap(); // 21 tokens
        assert_eq!(manager.releasable(&table, 20), 3);
        assert_eq!(manager.slide(&mut table, 20), 3);
        assert_eq!(table.ids().take(3).collect::<Vec<_>>(), vec![0, 0, 0]);
        assert_eq!(manager.num_free(), 15 - 3);
        manager.check().unwrap();
    }
}
