//! Where the eviction walk of each node segment (policy.rs: probation, then the protected
//! segment) stands between calls of [`PrefixCache::evict`], and the leaves that appear behind it.
//!
//! The walk takes a segment's oldest leaf (R10: only leaves; R11: least recently released). A
//! segment is in release order, so the walk keeps a frontier: the entries older than it were
//! passed because they had children. A passed parent that loses its last child becomes a late
//! leaf: it joins an ordered set of its segment, which goes before the frontier (all its stamps
//! are older). So each entry is passed at most once while it stays on its segment: O(1) per
//! evicted block amortized, O(log n) for a late leaf. A walk that started again from the oldest
//! end on every call, or went on from a late leaf, would pass the same parents again and again:
//! under ghost admission many parents in probation keep their only child in the protected
//! segment until it is demoted, long after (quadratic: 600 entries looked at per evicted block
//! on the Mooncake conversation trace at 2M tokens).
//!
//! Invariants (checked by [`PrefixCache::check_walks`]), for each segment `s`:
//! - `frontier[s]` is an entry on segment `s`, or `NIL` when the walk passed the whole segment;
//! - every entry on `s` older than `frontier[s]` (every entry when it is `NIL`) has children, or
//!   is a late leaf: it has none, carries the [`LATE`] flag and is in `late[s]` under its stamp;
//! - `late[s]` holds exactly the entries on `s` with the [`LATE`] flag; no entry elsewhere
//!   carries it.
//!
//! So the oldest leaf of a segment is its oldest late leaf if it has one, else the first entry
//! without children from its frontier on.

use std::collections::BTreeSet;

use crate::error::{ensure_invariant, Result};

use super::lists::List;
use super::policy::{segment_index, SEGMENTS};
use super::{PrefixCache, NIL};

/// [`super::Entry`] flag: the node lost its last child after its segment's walk had passed it
/// (it is in `SegmentWalks::late` of its segment, module doc).
pub(super) const LATE: u8 = 1 << 5;

/// The walks of the two node segments (module doc), indexed like [`SEGMENTS`].
#[derive(Debug)]
pub(super) struct SegmentWalks {
    /// The first entry of each segment the walk has not passed, or `NIL`.
    frontier: [u32; 2],
    /// The late leaves of each segment: (stamp, id), oldest first.
    late: [BTreeSet<(u64, u32)>; 2],
}

impl Default for SegmentWalks {
    fn default() -> Self {
        Self {
            frontier: [NIL; 2],
            late: [BTreeSet::new(), BTreeSet::new()],
        }
    }
}

impl PrefixCache {
    /// The oldest leaf of segment `segment` (module doc), or `None` when it has none. Moves the
    /// frontier past the entries with children it meets; counts every entry it looks at.
    pub(super) fn segment_victim(&mut self, segment: usize) -> Option<u32> {
        if let Some(&(_, id)) = self.segment_walks.late[segment].first() {
            self.segment_walk_steps += 1;
            return Some(id);
        }
        loop {
            let id = self.segment_walks.frontier[segment];
            if id == NIL {
                return None;
            }
            self.segment_walk_steps += 1;
            let entry = &self.entries[id as usize];
            if entry.children == 0 {
                return Some(id);
            }
            // Passed with children: it stays behind until it leaves or becomes a late leaf.
            self.segment_walks.frontier[segment] = entry.next;
        }
    }

    /// Entries the walks of the node segments looked at so far: a debug counter for tests of
    /// the eviction's cost (about one per evicted node and one per parent passed), never part of
    /// `stats`.
    pub fn eviction_walk_steps(&self) -> u64 {
        self.segment_walk_steps
    }

    /// `list_push` put `id` at the newest end of `list`: a walk that passed its whole segment
    /// stands before it.
    #[inline]
    pub(super) fn walk_pushed(&mut self, list: List, id: u32) {
        if let Some(segment) = segment_index(list as u8) {
            if self.segment_walks.frontier[segment] == NIL {
                self.segment_walks.frontier[segment] = id;
            }
        }
    }

    /// `id` is leaving its list (its `next` still set): a frontier on it moves to the next entry,
    /// and a late leaf leaves its set.
    #[inline]
    pub(super) fn walk_unlinked(&mut self, id: u32) {
        let entry = &self.entries[id as usize];
        let Some(segment) = segment_index(entry.list) else {
            return;
        };
        if self.segment_walks.frontier[segment] == id {
            self.segment_walks.frontier[segment] = entry.next;
        }
        if entry.flags & LATE != 0 {
            self.forget_late(segment, id);
        }
    }

    /// Node `id` lost its last child (`child_removed`): on a segment and behind its frontier, it
    /// becomes a late leaf.
    #[inline]
    pub(super) fn walk_leaf(&mut self, id: u32) {
        let entry = &self.entries[id as usize];
        let Some(segment) = segment_index(entry.list) else {
            return;
        };
        let frontier = self.segment_walks.frontier[segment];
        if frontier == NIL || entry.stamp < self.entries[frontier as usize].stamp {
            self.segment_walks.late[segment].insert((entry.stamp, id));
            self.entries[id as usize].flags |= LATE;
        }
    }

    /// Node `id` got a child (`child_added`): a late leaf is a passed parent again.
    #[inline]
    pub(super) fn walk_parent(&mut self, id: u32) {
        let entry = &self.entries[id as usize];
        if let (Some(segment), true) = (segment_index(entry.list), entry.flags & LATE != 0) {
            self.forget_late(segment, id);
        }
    }

    /// Takes late leaf `id` of `segment` out of its set.
    fn forget_late(&mut self, segment: usize, id: u32) {
        let entry = &mut self.entries[id as usize];
        entry.flags &= !LATE;
        let removed = self.segment_walks.late[segment].remove(&(entry.stamp, id));
        debug_assert!(removed, "late leaf {id} was not in its set");
    }

    /// Starts both walks again from their segment's oldest end, with no late leaf (after the
    /// segments were rebuilt, `set_eviction`; or emptied, `lists_clear`).
    pub(super) fn restart_walks(&mut self) {
        for (segment, list) in SEGMENTS.into_iter().enumerate() {
            for (_, id) in std::mem::take(&mut self.segment_walks.late[segment]) {
                self.entries[id as usize].flags &= !LATE;
            }
            self.segment_walks.frontier[segment] = self.lists.get(list).oldest;
        }
    }

    /// Verifies the module doc's invariants of the walks.
    pub(super) fn check_walks(&self) -> Result<()> {
        for (segment, list) in SEGMENTS.into_iter().enumerate() {
            let frontier = self.segment_walks.frontier[segment];
            let mut behind = true;
            let mut late = 0;
            for id in self.list_ids(list) {
                behind &= id != frontier;
                let entry = &self.entries[id as usize];
                let flagged = entry.flags & LATE != 0;
                late += usize::from(flagged);
                ensure_invariant!(
                    !flagged || (behind && entry.children == 0),
                    "{list:?} entry {id} is a late leaf but is not behind the walk or has children"
                );
                ensure_invariant!(
                    !behind || entry.children > 0 || flagged,
                    "{list:?} entry {id} is a leaf behind the walk but no late leaf"
                );
                ensure_invariant!(
                    !flagged || self.segment_walks.late[segment].contains(&(entry.stamp, id)),
                    "{list:?} late leaf {id} is missing from its set"
                );
            }
            ensure_invariant!(
                frontier == NIL || !behind,
                "the {list:?} walk's frontier {frontier} is not on its segment"
            );
            ensure_invariant!(
                late == self.segment_walks.late[segment].len(),
                "the {list:?} walk holds {} late leaves, {late} entries are flagged",
                self.segment_walks.late[segment].len()
            );
        }
        let flagged = self.entries.iter().filter(|e| e.flags & LATE != 0).count();
        let late: usize = self.segment_walks.late.iter().map(BTreeSet::len).sum();
        ensure_invariant!(
            flagged == late,
            "{flagged} entries carry the late flag, the walks hold {late}"
        );
        Ok(())
    }
}
