//! The prefix cache's eviction lists: intrusive doubly linked lists threaded through the
//! entries (`prev`, `next`), one per eviction class, each oldest first.
//!
//! - [`List::Main`]: the LRU list of cache-only nodes (R10, R11). A cache without attachments
//!   has only this one, and everything here is the single LRU list of the module doc.
//! - [`List::Low`]: what no hit point can use, evicted first: attachments no mark protects and
//!   leaves that are no hit point (attach.rs).
//! - [`List::Keep`]: attachments a mark protects (the window runs of the hit points a shared
//!   store keeps), evicted last.
//! - [`List::Protected`]: under SLRU (policy.rs), the protected segment of the nodes (those
//!   hit while cached), evicted after [`List::Main`] (then SLRU's probationary segment) and
//!   before [`List::Keep`]; empty under LRU.
//!
//! Invariants (checked by `PrefixCache::check`): an entry is on at most one list, its `list`
//! field names it; the links of every list are consistent and its stamps increase from the
//! oldest end to the newest; each list's `len` is its length.

use super::{PrefixCache, NIL};
use crate::block::{CACHED, COUNT_MASK};

/// `Entry::list` of an entry on no list.
pub(super) const NONE: u8 = u8::MAX;

/// One eviction list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum List {
    Main = 0,
    Low = 1,
    Keep = 2,
    Protected = 3,
}

impl List {
    pub(super) const ALL: [List; 4] = [List::Main, List::Low, List::Keep, List::Protected];
}

/// Ends and length of one list.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ends {
    pub(super) oldest: u32,
    pub(super) newest: u32,
    pub(super) len: usize,
}

impl Default for Ends {
    fn default() -> Self {
        Self {
            oldest: NIL,
            newest: NIL,
            len: 0,
        }
    }
}

/// The four lists' ends.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Lists([Ends; 4]);

impl Lists {
    pub(super) fn get(&self, list: List) -> &Ends {
        &self.0[list as usize]
    }

    fn get_mut(&mut self, list: List) -> &mut Ends {
        &mut self.0[list as usize]
    }
}

impl PrefixCache {
    /// Block ids on the LRU list of nodes, oldest first (cache-only blocks the cache knows
    /// about; with attachments, the useless leaves and the attachments are on the other lists).
    /// Under SLRU (policy.rs): the probationary segment, then the protected one.
    pub fn lru_order(&self) -> Vec<u32> {
        let mut ids = self.list_ids(List::Main);
        if self.lists.get(List::Protected).len > 0 {
            ids.extend(self.list_ids(List::Protected));
        }
        ids
    }

    /// The eviction order, oldest first, without draining: the low list and the LRU list (the
    /// LRU list alone without attachments; under SLRU probation, then the protected segment,
    /// each walked for leaves), then the blocks released since the last drain in
    /// release order (where the next drain puts them, F9). Exact only without concurrent handle
    /// drops and attachments, and under SLRU only while the protected segment has room; for
    /// tests and debugging.
    pub fn eviction_order(&self) -> Vec<u32> {
        let mut ids = self.list_ids(List::Low);
        ids.extend(self.list_ids(List::Main));
        let queued = self.store.released.snapshot(); // newest release first
        let queued: Vec<u32> = queued
            .into_iter()
            .rev()
            .filter(|&id| {
                let entry = &self.entries[id as usize];
                self.store.state(id) & (CACHED | COUNT_MASK) == CACHED | 1
                    && entry.live
                    && entry.list == NONE
            })
            .collect();
        // Under SLRU a queued node that was hit goes to the protected segment (policy.rs).
        let (protected, probation): (Vec<u32>, Vec<u32>) = queued
            .into_iter()
            .partition(|&id| self.segment_of(id) == List::Protected);
        ids.extend(probation);
        ids.extend(self.list_ids(List::Protected));
        ids.extend(protected);
        ids
    }

    /// The stamp of what eviction takes next among the listed entries: 0 while the low list
    /// holds something (what no hit point can use goes before anything else), then the oldest
    /// node's (under SLRU probation's, then the protected segment's, policy.rs), then the oldest
    /// protected attachment's; `None` when nothing is listed. A
    /// linear-state group of the one store compares its kept checkpoints' stamps with it.
    pub(crate) fn next_victim_stamp(&self) -> Option<u64> {
        if self.lists.get(List::Low).len > 0 {
            return Some(0);
        }
        [List::Main, List::Protected, List::Keep]
            .into_iter()
            .map(|list| self.lists.get(list).oldest)
            .find(|&id| id != NIL)
            .map(|id| self.entries[id as usize].stamp)
    }

    /// The stamp the next listed entry gets.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// Puts entry `id` (on no list) at the newest end of `list`, with a fresh stamp (a walk that
    /// passed its whole segment stands before it, segment_walk.rs).
    pub(super) fn list_push(&mut self, list: List, id: u32) {
        let newest = self.lists.get(list).newest;
        {
            let entry = &mut self.entries[id as usize];
            debug_assert_eq!(entry.list, NONE, "entry {id} is already listed");
            entry.prev = newest;
            entry.next = NIL;
            entry.list = list as u8;
            entry.stamp = self.clock;
        }
        self.clock += 1;
        if newest == NIL {
            self.lists.get_mut(list).oldest = id;
        } else {
            self.entries[newest as usize].next = id;
        }
        let ends = self.lists.get_mut(list);
        ends.newest = id;
        ends.len += 1;
        self.walk_pushed(list, id);
    }

    /// Takes entry `id` off its list (nothing if it is on none); its segment's walk lets go of
    /// it (segment_walk.rs).
    pub(super) fn list_unlink(&mut self, id: u32) {
        self.walk_unlinked(id);
        let (list, prev, next) = {
            let entry = &mut self.entries[id as usize];
            if entry.list == NONE {
                return;
            }
            let list = List::ALL[entry.list as usize];
            entry.list = NONE;
            (
                list,
                std::mem::replace(&mut entry.prev, NIL),
                std::mem::replace(&mut entry.next, NIL),
            )
        };
        if prev == NIL {
            self.lists.get_mut(list).oldest = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.lists.get_mut(list).newest = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
        self.lists.get_mut(list).len -= 1;
    }

    /// Moves entry `id` to `list` (newest end) if it is on another list; keeps its place when
    /// it is on `list` already, does nothing when it is on none.
    pub(super) fn list_move(&mut self, id: u32, list: List) {
        let current = self.entries[id as usize].list;
        if current != NONE && current != list as u8 {
            self.list_unlink(id);
            self.list_push(list, id);
        }
    }

    /// The ids on `list`, oldest first.
    pub(super) fn list_ids(&self, list: List) -> Vec<u32> {
        let ends = self.lists.get(list);
        let mut ids = Vec::with_capacity(ends.len);
        let mut id = ends.oldest;
        while id != NIL && ids.len() <= self.entries.len() {
            ids.push(id);
            id = self.entries[id as usize].next;
        }
        ids
    }

    /// Empties every list (the entries' fields are the caller's) and starts the segments'
    /// walks again (segment_walk.rs).
    pub(super) fn lists_clear(&mut self) {
        self.lists = Lists::default();
        self.restart_walks();
    }
}
