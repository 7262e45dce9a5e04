//! When speculative entries lapse: a min-heap of (expiry, hash, location) on the caller's
//! clock.
//!
//! Invariant: every speculative entry of the tree has a record with its exact expiry (records
//! whose entry was confirmed, extended or dropped since are stale: `pop_due` hands them out
//! and the tree ignores them, as its entry no longer lapses at that time). Stale records are
//! bounded: when they outnumber live ones by more than [`SLACK`], the heap is rebuilt.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Stale records tolerated beyond twice the live ones before a rebuild.
const SLACK: usize = 1024;

/// One record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Due {
    pub expires: f64,
    pub hash: u128,
    pub location: u32,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        self.expires
            .total_cmp(&other.expires)
            .then(self.hash.cmp(&other.hash))
            .then(self.location.cmp(&other.location))
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Expiry {
    heap: BinaryHeap<Reverse<Due>>,
}

impl Expiry {
    pub(crate) fn push(&mut self, due: Due) {
        self.heap.push(Reverse(due));
    }

    /// The oldest record lapsing at or before `now`.
    pub(crate) fn pop_due(&mut self, now: f64) -> Option<Due> {
        match self.heap.peek() {
            Some(Reverse(due)) if due.expires <= now => self.heap.pop().map(|r| r.0),
            _ => None,
        }
    }

    /// Whether stale records should be dropped, with `live` speculative entries.
    pub(crate) fn needs_rebuild(&self, live: usize) -> bool {
        self.heap.len() > 2 * live + SLACK
    }

    /// Replaces the records with `live` ones.
    pub(crate) fn rebuild(&mut self, live: impl IntoIterator<Item = Due>) {
        self.heap = live.into_iter().map(Reverse).collect();
    }

    /// Every record, sorted (for `check`).
    pub(crate) fn records(&self) -> Vec<Due> {
        let mut out: Vec<Due> = self.heap.iter().map(|r| r.0).collect();
        out.sort();
        out
    }
}
