//! `LinearStatePrefixCache::check`: the walk of every structure that tests run after each step
//! (the invariants of the module doc: each held slot in exactly one state with one handle, the
//! index covering pending and committed slots, the two LRU lists holding exactly the unpinned
//! committed ones, and the counters and the slot manager's counts agreeing).

use super::{Held, LinearStatePrefixCache, NIL};
use crate::error::{ensure_invariant, Result};
use crate::manager::BlockManager;

impl LinearStatePrefixCache {
    /// Walks every structure (R22 invariants; see module doc).
    pub fn check(&self) -> Result<()> {
        self.slots.check()?;
        let (mut live, mut pending, mut committed, mut pinned) = (0, 0, 0, 0);
        for slot in 0..self.num_slots() {
            let kind = self.kind[slot];
            ensure_invariant!(
                (kind == Held::No) == self.held[slot].is_none(),
                "linear-state slot {slot}: state {kind:?} disagrees with the held handle"
            );
            if let Some(handle) = &self.held[slot] {
                // A pool's planned copy may hold one more handle of a promoted slot until the
                // copy is confirmed, and then the checkpoint is pinned: evicting it would free
                // nothing (F2). Nothing else may hold one.
                let count = handle.ref_count();
                ensure_invariant!(
                    count == 1 || (count == 2 && kind == Held::Committed && self.pins[slot] > 0),
                    "linear-state slot {slot} ({kind:?}, {} pins) has {count} handles: \
                     evicting it would free nothing (R14, R15)",
                    self.pins[slot]
                );
            }
            ensure_invariant!(
                self.anchors[slot] == 0 || matches!(kind, Held::Pending | Held::Committed),
                "linear-state slot {slot} ({kind:?}) keeps an anchor"
            );
            ensure_invariant!(
                (self.tails[slot].tokens.is_empty() && self.tails[slot].root_key.is_none())
                    || matches!(kind, Held::Pending | Held::Committed),
                "linear-state slot {slot} ({kind:?}) keeps a checkpoint's tokens"
            );
            ensure_invariant!(
                !self.kept[slot] || matches!(kind, Held::Pending | Held::Committed),
                "linear-state slot {slot} ({kind:?}) is marked kept"
            );
            ensure_invariant!(
                !self.planned[slot] || kind == Held::Pending,
                "linear-state slot {slot} ({kind:?}) is marked as a planned save"
            );
            match kind {
                Held::No => {}
                Held::Live => live += 1,
                Held::Pending | Held::Committed => {
                    let hash = self.hash_of[slot];
                    ensure_invariant!(
                        self.index.get(&hash.0) == Some(&(slot as u32)),
                        "checkpoint slot {slot} is not indexed under its hash"
                    );
                    if kind == Held::Pending {
                        pending += 1;
                        ensure_invariant!(self.pins[slot] == 0, "pending slot {slot} is pinned");
                    } else {
                        committed += 1;
                        pinned += usize::from(self.pins[slot] > 0);
                    }
                }
            }
            if kind != Held::Committed {
                ensure_invariant!(self.pins[slot] == 0, "slot {slot} pinned but not committed");
            }
        }
        ensure_invariant!(
            live == self.num_live_held
                && pending == self.num_pending
                && committed == self.num_committed
                && pinned == self.num_pinned,
            "linear-state counters drifted (live {live}/{}, pending {pending}/{}, committed \
             {committed}/{}, pinned {pinned}/{})",
            self.num_live_held,
            self.num_pending,
            self.num_committed,
            self.num_pinned
        );
        ensure_invariant!(
            self.index.len() == pending + committed,
            "checkpoint index holds {} hashes for {} checkpoints",
            self.index.len(),
            pending + committed
        );
        let mut listed = 0;
        for list in [super::PLAIN, super::KEPT] {
            let order = self.list_order(list);
            listed += order.len();
            ensure_invariant!(
                order.len() == self.listed[list],
                "LRU list {list} holds {} checkpoints, counted {}",
                order.len(),
                self.listed[list]
            );
            for (i, &slot) in order.iter().enumerate() {
                ensure_invariant!(
                    self.kind[slot as usize] == Held::Committed && self.pins[slot as usize] == 0,
                    "LRU entry {slot} is not an unpinned committed checkpoint"
                );
                ensure_invariant!(
                    self.list_of(slot) == list,
                    "checkpoint {slot} is on the other LRU list"
                );
                let expected_prev = if i == 0 { NIL } else { order[i - 1] };
                ensure_invariant!(
                    self.prev[slot as usize] == expected_prev,
                    "LRU links broken at slot {slot}"
                );
                ensure_invariant!(
                    i == 0 || self.stamps[order[i - 1] as usize] <= self.stamps[slot as usize],
                    "LRU stamps decrease at slot {slot}"
                );
            }
            ensure_invariant!(
                self.tail[list] == order.last().copied().unwrap_or(NIL),
                "LRU tail of list {list} is wrong"
            );
        }
        ensure_invariant!(
            listed == committed - pinned,
            "LRU holds {listed} checkpoints, expected {} unpinned committed",
            committed - pinned
        );
        let counts = self.slots.counts();
        ensure_invariant!(
            counts.free + self.num_live_slots() + pending + committed == counts.total,
            "free + live + pending + committed != usable slots"
        );
        Ok(())
    }
}
