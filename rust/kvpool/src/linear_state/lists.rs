//! The two LRU lists of committed checkpoints (R23, "checkpoint retention"): the plain list
//! (a pool's intermediate saves) is evicted before the kept list (junction saves, restored
//! checkpoints, the API's own), each oldest first. Intrusive, O(1) per operation: `prev` and
//! `next` per slot, ends per list; each listed checkpoint carries the stamp of its listing (the
//! clock a pool sets to its prefix cache's, so the one store compares a checkpoint's recency
//! with the KV's).
//!
//! Invariants (checked by `check.rs`): a checkpoint is listed iff it is committed and unpinned,
//! on the list its `kept` flag names; stamps never decrease from a list's oldest end; each
//! list's count is its length.

use super::{LinearStatePrefixCache, KEPT, NIL, PLAIN};
use crate::hash::BlockHash;

impl LinearStatePrefixCache {
    pub(super) fn list_of(&self, slot: u32) -> usize {
        match self.kept[slot as usize] {
            true => KEPT,
            false => PLAIN,
        }
    }

    pub(super) fn unlink(&mut self, slot: u32) {
        let list = self.list_of(slot);
        let (prev, next) = (self.prev[slot as usize], self.next[slot as usize]);
        match prev {
            NIL => self.head[list] = next,
            p => self.next[p as usize] = next,
        }
        match next {
            NIL => self.tail[list] = prev,
            n => self.prev[n as usize] = prev,
        }
        self.prev[slot as usize] = NIL;
        self.next[slot as usize] = NIL;
        self.listed[list] -= 1;
    }

    pub(super) fn push_tail(&mut self, slot: u32) {
        let list = self.list_of(slot);
        self.prev[slot as usize] = self.tail[list];
        self.next[slot as usize] = NIL;
        match self.tail[list] {
            NIL => self.head[list] = slot,
            t => self.next[t as usize] = slot,
        }
        self.tail[list] = slot;
        self.stamps[slot as usize] = self.clock.max(
            self.prev_stamp(slot), // stamps never decrease along a list
        );
        self.listed[list] += 1;
    }

    pub(super) fn prev_stamp(&self, slot: u32) -> u64 {
        match self.prev[slot as usize] {
            NIL => 0,
            p => self.stamps[p as usize],
        }
    }

    /// Sets the stamp the next listed checkpoint gets (a pool passes its prefix cache's clock).
    pub(crate) fn set_clock(&mut self, clock: u64) {
        self.clock = clock;
    }

    /// Unpinned committed checkpoints on the plain list (evicted first).
    pub fn num_plain_checkpoints(&self) -> usize {
        self.listed[PLAIN]
    }

    /// Unpinned committed checkpoints on the kept list.
    pub fn num_kept_checkpoints(&self) -> usize {
        self.listed[KEPT]
    }

    /// The stamp of the checkpoint eviction takes next (the plain list first), if any.
    pub(crate) fn next_victim_stamp(&self) -> Option<u64> {
        let slot = match self.head[PLAIN] {
            NIL => self.head[KEPT],
            slot => slot,
        };
        (slot != NIL).then(|| self.stamps[slot as usize])
    }

    /// Whether the committed checkpoint of `prefix_hash` is on the plain list.
    pub(crate) fn is_plain(&self, prefix_hash: BlockHash) -> bool {
        self.peek(prefix_hash)
            .is_some_and(|slot| !self.kept[slot as usize] && self.pins[slot as usize] == 0)
    }

    /// Moves the committed checkpoint in `slot` to the kept list (a hit came back to it).
    pub(super) fn keep_slot(&mut self, slot: u32) {
        if self.kept[slot as usize] {
            return;
        }
        let listed = self.pins[slot as usize] == 0;
        if listed {
            self.unlink(slot);
        }
        self.kept[slot as usize] = true;
        if listed {
            self.push_tail(slot);
        }
    }

    /// Committed checkpoints in eviction order (unpinned ones only): the plain list, then the
    /// kept list, each from least to most recently used.
    pub fn lru_order(&self) -> Vec<u32> {
        let mut order = Vec::with_capacity(self.num_committed);
        for list in [PLAIN, KEPT] {
            order.extend(self.list_order(list));
        }
        order
    }

    /// One list from its oldest to its newest checkpoint.
    pub(super) fn list_order(&self, list: usize) -> Vec<u32> {
        let mut order = Vec::with_capacity(self.listed[list]);
        let mut slot = self.head[list];
        while slot != NIL {
            order.push(slot);
            slot = self.next[slot as usize];
        }
        order
    }
}
