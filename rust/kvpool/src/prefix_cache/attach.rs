//! Attachments: the blocks other groups of a shared block store hang on the prefix tree, and
//! the marks that decide how long they are kept (docs/hybrid.md, "One block store").
//!
//! In a pool whose groups draw from one store (R25), a sliding-window group's block of chain
//! position `i` is published by **attaching** it to the full-attention node of position `i`
//! (the node of that chain hash, verified by hash, parent and tokens: R7): it is found through
//! the node, never by a hash lookup of its own, so a hash collision cannot hand out another
//! prefix's window block, and it lives no longer than its node (R10: evicting a node drops its
//! attachments). A hit at boundary `k` needs the window group's run before `k`, the
//! attachments of positions `first_needed(k)..k` (R25; a chunked local attention group's run
//! starts at its chunk's start, none at a chunk's end).
//!
//! Which hit points are kept (the retention rule). Every window block that slides out of a
//! sequence stays attached (cached, evictable) instead of being freed; eviction then ranks
//! what is cached:
//! - **low** (evicted first): attachments no mark protects, and leaf nodes that are no hit
//!   point (some group's run before their boundary is incomplete), so a chain whose last hit
//!   point went is dropped back to the previous one as a whole;
//! - **main**: the nodes, least recently used leaves first (R10, R11);
//! - **keep** (evicted last): attachments a mark protects, and those of a chain's **head**. Two
//!   marks: a node where the prefix tree branched (a **junction**: it has had two or more
//!   children) protects its boundary's run; the node of a released sequence's last computed
//!   full block (its **end**) protects the runs of the boundaries in the last
//!   `retention_tokens` tokens before it, where the next turn of a conversation, which resends
//!   it, diverges. A mark lives as long as its node (a junction too, after the branches that
//!   made it were evicted: a prefix that was shared once, such as a system prompt, is likely
//!   shared again); its protection ends with it. The head, the blocks in the first
//!   `retention_tokens` tokens of every chain (where system prompts end and unrelated requests
//!   part: a junction before the tree knows it), is protected for as long as it is attached.
//!   Among the protected, eviction takes first what only the head protects (a running
//!   sequence's own slid-out blocks), then what no sequence's node holds, then the oldest.
//!
//! Marks and protections are counted (an attachment's protect count is the number of marks
//! whose runs hold it); an attachment that comes after a mark is not counted by it, which only
//! makes it go earlier. Nothing here affects what a hit may share (R7, R10): only the order.
//!
//! Invariants (checked by `PrefixCache::check`): an attachment's entry is live, of kind
//! `1 + g`, names a live node whose slot for group `g` names it, has the cache's reference
//! (`CACHED`) and the node's hash; a cache-only attachment is on the keep list iff its protect
//! count is positive (or queued for a list); a node's slot names only such attachments.

use crate::alloc;
use crate::block::{Block, CACHED, COUNT_MASK};
use crate::error::{ensure_invariant, Result};

use super::lists::{List, NONE};
use super::{CacheEvent, Entry, PrefixCache, CACHE_ONLY_BIT, NIL};

/// `Entry::kind` of a node (an attachment of group `g` has `1 + g`).
pub(super) const NODE: u8 = 0;
/// A node's mark: the last computed full block of a released sequence.
const END: u8 = 1;
/// A node's mark: two or more children.
const JUNCTION: u8 = 2;

/// Protected attachments [`PrefixCache::keep_victim`] looks at (bounds an eviction's cost).
const KEEP_SCAN: usize = 64;

/// Attachment groups a cache can have.
pub(crate) const MAX_ATTACH_GROUPS: usize = 8;

/// The groups that attach blocks to a cache's nodes, and the retention rule's tail.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct AttachConfig {
    /// The sliding window, in tokens, of each attaching group (`g` = its position).
    pub(crate) windows: Vec<usize>,
    /// The windows are chunks of chunked local attention: the run before boundary `k` starts at
    /// its chunk's start (multiples of the block size).
    pub(crate) chunked: bool,
    /// The groups are state groups (`groups/shared_window.rs`): every attachment is a cached
    /// state, a hit point of its own, so one no mark protects ranks with the protected ones (it
    /// goes with its node, by the nodes' order) instead of first.
    pub(crate) states: bool,
    /// The tokens before a released sequence's end whose boundaries' runs its end mark keeps.
    pub(crate) retention_tokens: usize,
}

/// What happened to an attachment, for the KV events of its group (R21).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AttachEvent {
    /// The attaching group (`AttachConfig::windows` position).
    pub(crate) group: usize,
    /// A `CacheEvent::Stored` of one block, a `Removed`, or `Cleared`.
    pub(crate) event: CacheEvent,
}

/// The attachment state of a cache (module doc); empty (and free) for a cache without.
#[derive(Default)]
pub(super) struct Attachments {
    config: AttachConfig,
    /// Blocks of the runs: `ceil((window - 1) / block_size)` per group; the longest run of a
    /// chunked group.
    runs: Vec<usize>,
    /// Blocks of a chunk per group (chunked local attention), or 0 (a sliding window).
    chunk_blocks: Vec<usize>,
    /// Boundaries of an end mark's tail, and positions of a chain's protected head.
    tail_blocks: usize,
    /// Node id * groups + g -> the attachment's id, or NIL.
    slots: Vec<u32>,
    /// Nodes that became junctions since the last drain (their protection follows the
    /// publication that made them, so that the window blocks it attached count).
    pending: Vec<u32>,
    /// Events of the attachments, when recording.
    events: Option<Vec<AttachEvent>>,
}

impl Attachments {
    fn groups(&self) -> usize {
        self.runs.len()
    }
}

impl PrefixCache {
    /// Lets the groups of `config` attach blocks to this cache's nodes (module doc); an error
    /// naming `num_blocks` if the slots cannot be allocated.
    pub(crate) fn enable_attachments(&mut self, config: AttachConfig) -> Result<()> {
        let groups = config.windows.len();
        debug_assert!((1..=MAX_ATTACH_GROUPS).contains(&groups));
        let bs = self.block_size;
        self.attach.runs = config
            .windows
            .iter()
            .map(|&w| w.saturating_sub(1).div_ceil(bs))
            .collect();
        self.attach.chunk_blocks = config
            .windows
            .iter()
            .map(|&w| if config.chunked { w / bs } else { 0 })
            .collect();
        self.attach.tail_blocks = config.retention_tokens.div_ceil(bs);
        self.attach.slots = alloc::filled(self.entries.len() * groups, "num_blocks", || NIL)?;
        self.attach.config = config;
        Ok(())
    }

    /// Bytes the attachment slots of `groups` groups cost per block.
    pub(crate) fn attach_bytes_per_block(groups: usize) -> u128 {
        4 * groups as u128
    }

    /// Whether groups attach blocks to this cache.
    #[inline]
    pub(crate) fn has_attachments(&self) -> bool {
        self.attach.groups() > 0
    }

    /// Starts (or stops) recording the attachments' events.
    pub(crate) fn set_record_attach_events(&mut self, on: bool) {
        self.attach.events = on.then(Vec::new);
    }

    /// Takes the attachments' recorded events, a run of consecutive blocks of one chain
    /// stored together as one "stored" event.
    pub(crate) fn take_attach_events(&mut self) -> Vec<AttachEvent> {
        let events = self
            .attach
            .events
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        let mut merged: Vec<AttachEvent> = Vec::with_capacity(events.len());
        for next in events {
            if let (
                Some(AttachEvent {
                    group,
                    event:
                        CacheEvent::Stored {
                            block_hashes,
                            token_ids,
                            extra_key,
                            ..
                        },
                }),
                CacheEvent::Stored {
                    block_hashes: more,
                    parent_hash: Some(parent),
                    token_ids: more_tokens,
                    extra_key: key,
                },
            ) = (merged.last_mut(), &next.event)
            {
                if *group == next.group && block_hashes.last() == Some(parent) && extra_key == key {
                    block_hashes.extend_from_slice(more);
                    token_ids.extend_from_slice(more_tokens);
                    continue;
                }
            }
            merged.push(next);
        }
        merged
    }

    fn attach_event(&mut self, group: usize, event: CacheEvent) {
        if let Some(events) = self.attach.events.as_mut() {
            events.push(AttachEvent { group, event });
        }
    }

    #[inline]
    fn slot(&self, node: u32, g: usize) -> u32 {
        self.attach.slots[node as usize * self.attach.groups() + g]
    }

    #[inline]
    fn set_slot(&mut self, node: u32, g: usize, value: u32) {
        let groups = self.attach.groups();
        self.attach.slots[node as usize * groups + g] = value;
    }

    /// Whether `id` is a live node of this cache (the block a chain position is cached in).
    #[inline]
    pub(crate) fn is_node(&self, id: u32) -> bool {
        self.entries
            .get(id as usize)
            .is_some_and(|e| e.live && e.kind == NODE)
    }

    /// Attaches `block` (a block of this store that group `g`'s table holds, not cached) to
    /// `node`, unless the node has one already (first writer wins, R9). Returns whether it
    /// did. The cache takes its reference; with events, a "stored" event of group `g`.
    pub(crate) fn attach(&mut self, node: u32, g: usize, block: &Block) -> bool {
        let id = block.id();
        if !self.is_node(node) || self.slot(node, g) != NIL || block.is_cached() || id == 0 {
            return false;
        }
        let (hash, parent, depth, extra_key) = {
            let n = &self.entries[node as usize];
            (n.hash, n.parent, n.depth, n.extra_key.clone())
        };
        self.entries[id as usize] = Entry {
            hash,
            parent: node,
            depth,
            // The head of a chain is protected while it is attached (module doc).
            children: u32::from((depth as usize) < self.attach.tail_blocks),
            live: true,
            kind: 1 + g as u8,
            ..Entry::default()
        };
        self.set_slot(node, g, id);
        self.store.mark_cached(id, hash);
        if self.attach.events.is_some() {
            let parent_hash = (parent != NIL).then(|| self.entries[parent as usize].hash);
            let token_ids = self.block_tokens(node).to_vec();
            self.attach_event(
                g,
                CacheEvent::Stored {
                    block_hashes: vec![hash],
                    parent_hash,
                    token_ids,
                    extra_key,
                },
            );
        }
        true
    }

    /// Blocks of group `g`'s run before boundary `k`: `runs[g]`, or for a chunked group the
    /// blocks since its chunk's start.
    #[inline]
    fn run_len(&self, g: usize, k: usize) -> usize {
        match self.attach.chunk_blocks[g] {
            0 => self.attach.runs[g],
            chunk => k % chunk,
        }
    }

    /// First position of group `g`'s run before boundary `k` (`first_needed(k)..k`).
    #[inline]
    fn run_start(&self, g: usize, k: usize) -> usize {
        k.saturating_sub(self.run_len(g, k))
    }

    /// The deepest boundary `k <= limit` whose run of group `g` is attached to the walked nodes
    /// `ids` (flags of [`Self::walk`] ignored); 0 always qualifies. O(limit + run).
    pub(crate) fn window_limit(&self, ids: &[u32], g: usize, limit: usize) -> usize {
        let mut k = limit.min(ids.len());
        // Invariant: every position in `checked..k` is attached.
        let mut checked = k;
        while k > 0 {
            let start = self.run_start(g, k);
            let mut missing = None;
            while checked > start {
                let node = ids[checked - 1] & !CACHE_ONLY_BIT;
                if self.slot(node, g) == NIL {
                    missing = Some(checked - 1);
                    break;
                }
                checked -= 1;
            }
            match missing {
                None => return k,
                Some(i) => {
                    // No boundary past `i` can be served; position `i` itself is missing.
                    k = i;
                    checked = i;
                }
            }
        }
        0
    }

    /// How many of the run of group `g` before boundary `k` (accepted by
    /// [`Self::window_limit`]) only the cache holds: a hit makes them used.
    pub(crate) fn window_hit_cost(&self, ids: &[u32], g: usize, k: usize) -> usize {
        (self.run_start(g, k)..k)
            .filter(|&i| {
                let att = self.slot(ids[i] & !CACHE_ONLY_BIT, g);
                att != NIL && self.store.state(att) & (CACHED | COUNT_MASK) == CACHED | 1
            })
            .count()
    }

    /// New handles of group `g`'s run before boundary `k`, appended to `out`: they become
    /// used (off their lists). False, with `out` as it was, if a position has no attachment.
    pub(crate) fn retain_window(
        &mut self,
        ids: &[u32],
        g: usize,
        k: usize,
        out: &mut Vec<Block>,
    ) -> bool {
        self.drain_released();
        let start = self.run_start(g, k);
        let before = out.len();
        for &flagged in &ids[start..k] {
            let att = self.slot(flagged & !CACHE_ONLY_BIT, g);
            if att == NIL {
                out.truncate(before);
                return false;
            }
            self.list_unlink(att);
            out.push(self.store.retain_cached(att));
        }
        true
    }

    /// Whether node `node`'s boundary is a hit point: every group's run before it is attached.
    fn is_hit_point(&self, node: u32) -> bool {
        let boundary = self.entries[node as usize].depth as usize + 1;
        (0..self.attach.groups()).all(|g| {
            let mut id = node;
            for _ in 0..self.run_len(g, boundary) {
                if id == NIL {
                    return true; // the run starts at the chain's first block
                }
                if self.slot(id, g) == NIL {
                    return false;
                }
                id = self.entries[id as usize].parent;
            }
            true
        })
    }

    /// The list a cache-only entry goes on (module doc).
    pub(super) fn class_of(&self, id: u32) -> List {
        let entry = &self.entries[id as usize];
        if entry.kind != NODE {
            return if entry.children > 0 || self.attach.config.states {
                List::Keep
            } else {
                List::Low
            };
        }
        if self.has_attachments() && entry.children == 0 && !self.is_hit_point(id) {
            List::Low
        } else {
            List::Main
        }
    }

    /// Adds `delta` (+1 or -1, saturating) to the protect count of every attachment of group
    /// `g` on `count` nodes from `node` up; moves the cache-only ones between the low and keep
    /// lists.
    fn protect_up(&mut self, node: u32, g: usize, count: usize, delta: i32) {
        let mut id = node;
        for _ in 0..count {
            if id == NIL {
                break;
            }
            let att = self.slot(id, g);
            if att != NIL {
                let entry = &mut self.entries[att as usize];
                let before = entry.children;
                entry.children = if delta > 0 {
                    before + 1
                } else {
                    before.saturating_sub(1)
                };
                match (before, entry.children) {
                    (0, 1) => self.list_move(att, List::Keep),
                    (1, 0) if !self.attach.config.states => self.list_move(att, List::Low),
                    _ => {}
                }
            }
            id = self.entries[id as usize].parent;
        }
    }

    /// A mark's protection: the run before the node's boundary, and for an end mark also the
    /// runs of the `tail_blocks` boundaries before it.
    fn protect_mark(&mut self, node: u32, mark: u8, delta: i32) {
        let tail = if mark == END {
            self.attach.tail_blocks
        } else {
            0
        };
        let boundary = self.entries[node as usize].depth as usize + 1;
        for g in 0..self.attach.groups() {
            // With a tail, the runs of its boundaries: from the run's start before the first
            // (a sliding window's runs are equal; a chunked group's earliest start is the first
            // boundary's chunk start).
            let first = boundary.saturating_sub(tail);
            let count = tail + self.run_len(g, first);
            self.protect_up(node, g, count, delta);
        }
    }

    /// Marks node `node` as the end of a released sequence (module doc); nothing if it is
    /// marked so already or is no node.
    pub(crate) fn mark_end(&mut self, node: u32) {
        if !self.has_attachments() || !self.is_node(node) {
            return;
        }
        if self.entries[node as usize].flags & END == 0 {
            self.entries[node as usize].flags |= END;
            self.protect_mark(node, END, 1);
        }
    }

    /// Records that `node` got a child (insertion): a second child makes it a junction, whose
    /// protection the next drain applies (after the publication attached its blocks).
    #[inline]
    pub(super) fn child_added(&mut self, node: u32) {
        self.walk_parent(node);
        let entry = &mut self.entries[node as usize];
        entry.children += 1;
        if entry.list == List::Low as u8 {
            // A cache-only leaf that was no hit point got a child (a release publishing under
            // a cached original, R9): no longer a leaf, it takes its place among the nodes.
            self.lift_node(node);
            return;
        }
        if entry.children == 2 && self.attach.groups() > 0 && entry.flags & JUNCTION == 0 {
            entry.flags |= JUNCTION;
            self.attach.pending.push(node);
        }
    }

    /// Applies the protections of the junctions made since the last drain.
    pub(super) fn apply_pending_marks(&mut self) {
        if self.attach.pending.is_empty() {
            return;
        }
        for node in std::mem::take(&mut self.attach.pending) {
            // A node removed meanwhile took its mark with it (`unmark`).
            if self.is_node(node) && self.entries[node as usize].flags & JUNCTION != 0 {
                self.protect_mark(node, JUNCTION, 1);
            }
        }
    }

    /// A child of `node` was removed: a cache-only node that became a leaf and is no hit point
    /// moves to the low list; one that stays on its segment may be a late leaf of its walk
    /// (segment_walk.rs). A junction keeps its mark (module doc) until the node goes.
    pub(super) fn child_removed(&mut self, node: u32) {
        let entry = &mut self.entries[node as usize];
        entry.children -= 1;
        if entry.children > 0 || entry.kind != NODE {
            return;
        }
        if super::policy::segment_index(entry.list).is_some()
            && self.has_attachments()
            && !self.is_hit_point(node)
        {
            self.list_move(node, List::Low);
        }
        self.walk_leaf(node);
    }

    /// Drops node `node`'s marks and their protection (the node is being removed).
    pub(super) fn unmark(&mut self, node: u32) {
        let marks = self.entries[node as usize].flags & (END | JUNCTION);
        if marks == 0 {
            return;
        }
        if marks & END != 0 {
            self.protect_mark(node, END, -1);
        }
        if marks & JUNCTION != 0 {
            if self.attach.pending.contains(&node) {
                self.attach.pending.retain(|&n| n != node);
            } else {
                self.protect_mark(node, JUNCTION, -1);
            }
        }
        self.entries[node as usize].flags &= !(END | JUNCTION);
    }

    /// Detaches attachment `att` from its node: the cache drops its reference (the block is
    /// freed if only the cache held it; a table holding it keeps it, unpublished). Returns
    /// whether it was freed.
    fn detach(&mut self, att: u32) -> bool {
        self.list_unlink(att);
        let entry = std::mem::take(&mut self.entries[att as usize]);
        let g = (entry.kind - 1) as usize;
        self.set_slot(entry.parent, g, NIL);
        self.attach_event(
            g,
            CacheEvent::Removed {
                block_hashes: vec![entry.hash],
                extra_key: self.entries[entry.parent as usize].extra_key.clone(),
            },
        );
        self.store.unmark_cached(att)
    }

    /// The protected attachment to evict when nothing else is left, looking at the oldest
    /// [`KEEP_SCAN`]: the oldest that only the head rule protects (no mark: no junction and no
    /// end names its run, so no known hit point needs it); else the oldest whose node no
    /// sequence holds (a held node's hit point stays servable on the full-attention side, so
    /// its run is worth more); else the oldest.
    pub(super) fn keep_victim(&self) -> Option<u32> {
        let oldest = self.lists.get(List::Keep).oldest;
        let mut id = oldest;
        let mut unheld = NIL;
        for _ in 0..KEEP_SCAN {
            if id == NIL {
                break;
            }
            let entry = &self.entries[id as usize];
            let head = u32::from((entry.depth as usize) < self.attach.tail_blocks);
            if entry.children == head {
                return Some(id); // no mark protects it, only the head rule
            }
            let node = entry.parent;
            if unheld == NIL && self.store.state(node) & (CACHED | COUNT_MASK) == CACHED | 1 {
                unheld = id;
            }
            id = entry.next;
        }
        if unheld != NIL {
            return Some(unheld);
        }
        (oldest != NIL).then_some(oldest)
    }

    /// Evicts a listed (cache-only) attachment.
    pub(super) fn drop_attachment(&mut self, att: u32) {
        let freed = self.detach(att);
        debug_assert!(freed, "evicted attachment {att} was held");
    }

    /// Detaches every attachment of node `node`; returns how many blocks went free.
    pub(super) fn detach_all(&mut self, node: u32) -> usize {
        let mut freed = 0;
        for g in 0..self.attach.groups() {
            let att = self.slot(node, g);
            if att != NIL {
                freed += usize::from(self.detach(att));
            }
        }
        freed
    }

    /// Detaches every attachment (a reset, R12); with events, one "cleared" per group.
    pub(super) fn reset_attachments(&mut self) {
        if !self.has_attachments() {
            return;
        }
        let recording = self.attach.events.take();
        let ids: Vec<u32> = self.index.values().copied().collect();
        for node in ids {
            self.detach_all(node);
        }
        self.attach.pending.clear();
        self.attach.events = recording;
        for g in 0..self.attach.groups() {
            self.attach_event(g, CacheEvent::Cleared);
        }
    }

    /// Walks the attachments (module doc's invariants); `cache_only` counts the cache-only
    /// ones (part of the store's cache-only count, R2).
    pub(super) fn check_attachments(&self, cache_only: &mut usize) -> Result<()> {
        let groups = self.attach.groups();
        for (slot, &att) in self.attach.slots.iter().enumerate() {
            if att == NIL {
                continue;
            }
            let (node, g) = ((slot / groups) as u32, slot % groups);
            ensure_invariant!(
                self.is_node(node),
                "attachment {att} hangs on node {node}, which is not cached"
            );
            let entry = &self.entries[att as usize];
            ensure_invariant!(
                entry.live && entry.kind as usize == 1 + g && entry.parent == node,
                "attachment {att} of group {g} does not name node {node}"
            );
            ensure_invariant!(
                entry.hash == self.entries[node as usize].hash,
                "attachment {att} carries another hash than its node"
            );
            let state = self.store.state(att);
            ensure_invariant!(
                state & CACHED != 0,
                "attachment {att} lacks the cache's reference"
            );
            if state & COUNT_MASK == 1 {
                *cache_only += 1;
                let list = entry.list;
                ensure_invariant!(
                    list == NONE && state & crate::block::QUEUED != 0
                        || list == List::Keep as u8
                            && (entry.children > 0 || self.attach.config.states)
                        || list == List::Low as u8
                            && entry.children == 0
                            && !self.attach.config.states,
                    "cache-only attachment {att} is on the wrong list"
                );
            } else {
                ensure_invariant!(
                    entry.list == NONE,
                    "held attachment {att} is on an eviction list"
                );
            }
        }
        Ok(())
    }
}
