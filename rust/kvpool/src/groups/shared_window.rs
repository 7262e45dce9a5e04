//! A sliding-window group in the rank's shared block store (R25, docs/hybrid.md "One block
//! store"): its blocks come from the full-attention group's allocator (one free list, one id
//! space) and are published by attaching them to the full-attention prefix tree
//! (`prefix_cache/attach.rs`).
//!
//! A chunked local attention group (`attention_chunk_size`) is one whose query reads from its
//! chunk's start: its `first_needed` is that start, and so is its run's.
//!
//! A state group (`state_groups`, vLLM's Mamba "align" mode) keeps a recurrent state per block:
//! the state after a step lives in the block of the step's last token, copied there by the
//! engine from the block of the previous step's (or of a hit's last token). Its table grows by
//! that one block per step (null entries before it), holds the previous block as the step's
//! copy source (the table's carry) until the step is done, and publishes a block only when a
//! step ended on its end boundary: it then holds that boundary's state, and a hit at a boundary
//! needs the one block before it (a window of two tokens).
//!
//! Hit limit: the deepest boundary whose run (`first_needed(k)..k`) is attached to the nodes
//! the full-attention walk verified (R7 through the node); taking the hit shares exactly that
//! run. The table grows with the full-attention table (one entry per block). A slide drops
//! the handles of the blocks no future query of the sequence attends to: attached ones stay
//! cached (evictable, ranked by the retention rule of attach.rs), the others are free at once.
//! At release the node of the last computed full block gets the end mark that keeps the runs a
//! next turn needs.
//!
//! Invariants: a sequence's window table has as many entries as its full-attention table and
//! holds only blocks of the rank's store; its published watermark never passes what the full
//! table published.

use crate::block::Block;
use crate::block::{CACHED, COUNT_MASK};
use crate::error::{ensure_invariant, Result};
use crate::sliding_window::WindowTable;

use super::{FullGroup, OwnChain};
use crate::prefix_cache::PrefixCache;

/// What a group of the shared store holds before a query, and how its table grows (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WindowKind {
    /// A sliding window of `window` tokens (R25).
    Sliding,
    /// Chunked local attention: `window` is the chunk, and a query reads from its chunk's start.
    Chunked,
    /// A recurrent state per block (`window` is 2: the state before position p is in the block
    /// of token p - 1).
    State,
}

/// A sliding-window group whose blocks live in the full-attention group's store.
pub(crate) struct SharedWindowGroup {
    window: usize,
    kind: WindowKind,
    block_size: usize,
    /// Its attachment group in the full-attention cache.
    group: usize,
    /// Its position after full attention (1, 2, ...): its blocks' owner in the memory census.
    owner: u8,
    /// Window blocks released behind the window (stats).
    releases: u64,
}

impl SharedWindowGroup {
    pub(crate) fn new(
        window: usize,
        kind: WindowKind,
        block_size: usize,
        group: usize,
        owner: u8,
    ) -> Self {
        Self {
            window,
            kind,
            block_size,
            group,
            owner,
            releases: 0,
        }
    }

    /// The window, in tokens.
    pub(crate) fn window(&self) -> usize {
        self.window
    }

    /// The attachment group in the full-attention cache.
    pub(crate) fn attach_group(&self) -> usize {
        self.group
    }

    /// The first block the query at position `computed` attends to (R25; exact for every
    /// `usize`, F5): a chunked group's chunk start.
    #[inline]
    pub(crate) fn first_needed_block(&self, computed: usize) -> usize {
        match self.kind {
            WindowKind::Chunked => computed / self.window * self.window / self.block_size,
            WindowKind::Sliding | WindowKind::State => {
                computed.saturating_sub(self.window - 1) / self.block_size
            }
        }
    }

    /// The deepest boundary `k <= limit` whose run is attached to the walked nodes (`device`:
    /// the full-attention cache and its walk's ids).
    pub(crate) fn hit_limit(&self, device: Option<(&PrefixCache, &[u32])>, limit: usize) -> usize {
        match device {
            Some((cache, ids)) if cache.has_attachments() => {
                cache.window_limit(ids, self.group, limit)
            }
            _ => 0,
        }
    }

    /// Blocks of the shared store a hit at `k` (accepted by `hit_limit`) and then a table of
    /// `entries` entries take: the new entries, and the run's blocks only the cache holds.
    pub(crate) fn demand(
        &self,
        device: Option<(&PrefixCache, &[u32])>,
        k: usize,
        entries: usize,
    ) -> usize {
        let cost = match (k, device) {
            (0, _) | (_, None) => 0,
            (_, Some((cache, ids))) => cache.window_hit_cost(ids, self.group, k),
        };
        self.growth_from(k, entries) + cost
    }

    /// Blocks a table of `len` entries takes to grow to `entries`: every new entry, or a state
    /// group's one block of the last.
    fn growth_from(&self, len: usize, entries: usize) -> usize {
        let new = entries.saturating_sub(len);
        match self.kind {
            WindowKind::State => new.min(1),
            WindowKind::Sliding | WindowKind::Chunked => new,
        }
    }

    /// Blocks growing `table` to `entries` entries takes ([`Self::grow`]).
    pub(crate) fn growth(&self, table: &WindowTable, entries: usize) -> usize {
        self.growth_from(table.len(), entries)
    }

    /// The table of a hit at `k`: padding before the run, the run's blocks shared. `None` if
    /// a run block is gone (it cannot be: the pool changed nothing since the walk).
    pub(crate) fn take_hit(
        &self,
        full: &mut FullGroup,
        walked: &[u32],
        k: usize,
    ) -> Option<WindowTable> {
        let mut table = WindowTable::default();
        if k == 0 {
            return Some(table);
        }
        let cache = full.cache_mut()?;
        if !cache.retain_window(walked, self.group, k, &mut table.blocks) {
            return None;
        }
        table.released = k - table.blocks.len();
        table.published = k;
        Some(table)
    }

    /// Grows the table to `entries` entries from the shared store (all-or-nothing).
    pub(crate) fn grow(
        &self,
        full: &mut FullGroup,
        table: &mut WindowTable,
        entries: usize,
    ) -> bool {
        if self.kind != WindowKind::State {
            let need = entries.saturating_sub(table.len());
            return full.grow_for(&mut table.blocks, need, self.owner);
        }
        if entries <= table.len() {
            return true; // the step stays in the state's block
        }
        let mut fresh = Vec::with_capacity(1);
        if !full.grow_for(&mut fresh, 1, self.owner) {
            return false;
        }
        // The state moves to the last entry's new block. The last held entry (the previous
        // step's block, or a hit's) is the step's copy source, carried until the step is done;
        // the others (an older carry, superseded blocks) are published or of no more use.
        let source = match table.len().checked_sub(1) {
            Some(last) if last >= table.released => table.blocks.pop().map(|b| (last, b)),
            _ => None,
        };
        table.blocks.clear();
        if source.is_some() {
            table.carry = source;
        }
        table.released = entries - 1;
        table.blocks = fresh;
        true
    }

    /// Blocks a slide to `computed` would make available (free or cache-only): those the table
    /// alone holds, and attached ones the cache and the table alone hold (F4).
    pub(crate) fn releasable(
        &self,
        full: &FullGroup,
        table: &WindowTable,
        computed: usize,
    ) -> usize {
        let first = self.first_needed_block(computed).min(table.len());
        let store = full.store();
        let alone = |b: &Block| {
            let state = store.state(b.id());
            let count = state & COUNT_MASK;
            count == 1 || (state & CACHED != 0 && count == 2)
        };
        let carried = table
            .carry
            .as_ref()
            .is_some_and(|(at, b)| *at < first && alone(b));
        usize::from(carried)
            + (table.released..first)
                .filter(|&i| table.get(i).is_some_and(alone))
                .count()
    }

    /// Whether [`Self::publish`] has blocks to attach below `full_count` (`computed` tokens
    /// computed): a state group only its block of a step that ended on its end boundary.
    pub(crate) fn wants_publish(
        &self,
        table: &WindowTable,
        full_count: usize,
        computed: usize,
    ) -> bool {
        match self.kind {
            WindowKind::State => {
                !table.pending.is_empty()
                    || self.state_boundary(table, full_count, computed).is_some()
            }
            WindowKind::Sliding | WindowKind::Chunked => table.published < full_count,
        }
    }

    /// A state group's entry to publish at `computed`: the held block of the boundary the step
    /// ended on, if not published yet and its full-attention block is computed.
    fn state_boundary(
        &self,
        table: &WindowTable,
        full_count: usize,
        computed: usize,
    ) -> Option<usize> {
        let boundary = computed / self.block_size;
        let at_end = computed % self.block_size == 0 && boundary > 0 && boundary <= full_count;
        (at_end && table.published < boundary && table.get(boundary - 1).is_some())
            .then(|| boundary - 1)
    }

    /// Attaches the table's held blocks among its first `full_count` entries to the nodes of
    /// the same positions: the full-attention table's block where it is the node cached under
    /// the position's hash (published or switched to by dedup, R9), else, for a duplicate the
    /// full-attention cache did not take (R9, first writer wins), the cached original that the
    /// chain's verified walk reaches (R7: hash, parent and tokens), unless that node has a
    /// block of this group already. A window block holds the KV of its position's tokens after
    /// that prefix, whichever full-attention block holds theirs: without this, a sequence whose
    /// hit a window cut short would recompute and then drop the very runs the next turn needs.
    ///
    /// A position whose full-attention entry is not cached yet (the full-attention publication
    /// stopped at a duplicate before it, R9, and publishes the rest at release) is tried again
    /// by the next call: the table's published mark stops there.
    pub(crate) fn publish(
        &self,
        table: &mut WindowTable,
        chain: &mut OwnChain<'_>,
        full: usize,
        computed: usize,
    ) {
        if self.kind == WindowKind::State {
            self.publish_states(table, chain, full, computed);
            return;
        }
        let end = full
            .min(table.len())
            .min(chain.hashes.len())
            .min(chain.blocks().len());
        let mut stuck = None;
        for i in table.published.max(table.released)..end {
            match self.attach_at(table, chain, i) {
                None => break,
                Some(false) => {
                    stuck.get_or_insert(i);
                }
                Some(true) => {}
            }
        }
        table.published = table.published.max(stuck.unwrap_or(end));
    }

    /// A state group's publication: the state of the boundary the step ended on (module doc),
    /// and the pending ones whose node is cached now; a state whose node is not cached yet waits
    /// in the table's pending list (the state itself moves on).
    fn publish_states(
        &self,
        table: &mut WindowTable,
        chain: &mut OwnChain<'_>,
        full: usize,
        computed: usize,
    ) {
        let limit = chain.hashes.len().min(chain.blocks().len());
        let mut waiting = std::mem::take(&mut table.pending);
        if let Some(i) = self.state_boundary(table, full, computed) {
            if let Some(block) = table.get(i) {
                waiting.push((i, block.clone()));
            }
            table.published = i + 1;
        }
        for (i, block) in waiting {
            if i >= limit || self.attach_block(chain, i, &block) != Some(true) {
                table.pending.push((i, block));
            }
        }
    }

    /// Attaches the table's block of entry `i` (if held) to its node, as [`Self::publish`]
    /// says; `None` without a cache, `Some(false)` if the node is not cached yet.
    fn attach_at(&self, table: &WindowTable, chain: &mut OwnChain<'_>, i: usize) -> Option<bool> {
        match table.get(i) {
            Some(block) => self.attach_block(chain, i, block),
            None => Some(true),
        }
    }

    /// Attaches `block` to the node of chain position `i` (the table's own full-attention
    /// block's, or for a duplicate left private the cached original's, R7/R9).
    fn attach_block(&self, chain: &mut OwnChain<'_>, i: usize, block: &Block) -> Option<bool> {
        let (own, hash) = (chain.blocks()[i].id(), chain.hashes[i]);
        let node = match chain.cache_mut() {
            None => return None,
            Some(cache) if cache.block_id(hash) == Some(own) => Some(own),
            Some(_) => chain.entry(i), // a duplicate left private (R9): the original
        };
        match (node, chain.cache_mut()) {
            (Some(node), Some(cache)) => {
                cache.attach(node, self.group, block);
                Some(true)
            }
            _ => Some(false),
        }
    }

    /// Drops the handles no future query attends to (R25); returns how many.
    #[inline]
    pub(crate) fn slide(&mut self, table: &mut WindowTable, computed: usize) -> usize {
        let first = self.first_needed_block(computed).min(table.len());
        if table.carry.as_ref().is_some_and(|(at, _)| *at < first) {
            table.carry = None; // the step that copied from it is done
            self.releases += 1;
        }
        if first <= table.released {
            return 0;
        }
        let count = first - table.released;
        table.blocks.drain(..count);
        table.released = first;
        self.releases += count as u64;
        count
    }

    /// The sequence is released: the node of its last computed full block (`end`, a block of
    /// its full-attention table) gets the end mark.
    pub(crate) fn release(&self, full: &mut FullGroup, end: Option<u32>) {
        if let (Some(node), Some(cache)) = (end, full.cache_mut()) {
            cache.mark_end(node);
        }
    }

    pub(crate) fn releases(&self) -> u64 {
        self.releases
    }

    /// A sequence's window table against its full-attention table of `entries` entries.
    pub(crate) fn check_table(
        &self,
        full: &FullGroup,
        table: &WindowTable,
        entries: usize,
        seq_id: u64,
    ) -> Result<()> {
        ensure_invariant!(
            table.len() == entries
                && table.blocks().iter().all(|b| full.owns(b))
                && table
                    .carry
                    .as_ref()
                    .is_none_or(|(at, b)| *at < table.released && full.owns(b))
                && table.pending.iter().all(|(_, b)| full.owns(b)),
            "sequence {seq_id}: the window table does not match the full table (R25)"
        );
        Ok(())
    }
}
