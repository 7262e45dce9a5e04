//! The linear-state group in the one store (docs/hybrid.md "Linear state in the one store",
//! R22): the group holds `blocks_per_state` blocks of the full-attention group's store per slot
//! in use, so memory flows between the KV and the states.
//!
//! Order in which the store gives memory: free blocks, the group's surplus (blocks of slots that
//! went free), then checkpoints and the KV's cached blocks by recency (the plain checkpoints
//! first), and the checkpoints whatever their age once the KV cannot cover a request. A new
//! sequence's live slot follows [`SlotSource`], one rule for the admission's question and its
//! action (R15).
//!
//! Invariant (checked by `LinearGroup::check`): the group holds at least `blocks_per_state`
//! blocks per slot in use, each a block of the store that nothing else holds.

use crate::groups::{FullGroup, QueryChain};

use super::LinearGroup;

/// KV blocks the one store evicts per call while a checkpoint is newer than the KV (the recency
/// of the two kinds is compared once per batch).
const KV_BATCH: usize = 32;

/// Where a new slot's memory comes from in the one store (one rule for the question and the
/// action of an admission, R15).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotSource {
    /// The group holds its slots in a store of their own.
    Own,
    /// Blocks the group already holds beyond its slots in use.
    Surplus,
    /// An unpinned checkpoint is evicted, its slot and blocks reused (plain ones first).
    Evict,
    /// Blocks taken from the store (counted in the admission's demand).
    Store,
}

impl LinearGroup {
    /// The group takes its states' memory from the full-attention group's store:
    /// `blocks_per_state` blocks per slot in use, census owner `owner`.
    pub(crate) fn in_one_store(mut self, blocks_per_state: usize, owner: u8) -> Self {
        self.blocks_per_state = blocks_per_state;
        self.owner = owner;
        self.cache.refuse_api_slots();
        self
    }

    /// Blocks of the store a state takes (0: the slots are a store of their own).
    pub(crate) fn blocks_per_state(&self) -> usize {
        self.blocks_per_state
    }

    /// Blocks of the store the group holds.
    pub(crate) fn budget_blocks(&self) -> usize {
        self.budget.len()
    }

    /// Slots live, pending or committed.
    pub(super) fn in_use(&self) -> usize {
        self.cache.num_slots() - 1 - self.cache.num_free_slots()
    }

    /// Blocks held beyond the slots in use.
    fn surplus(&self) -> usize {
        self.budget
            .len()
            .saturating_sub(self.blocks_per_state * self.in_use())
    }

    /// Where a new slot comes from, and the blocks the group could then give back to the
    /// store (surplus and evictable checkpoints), with `pinned` (a hit's checkpoint about to be
    /// pinned: whether it is on the plain list) off the evictable ones.
    fn slot_source(&self, pinned: Option<bool>) -> (SlotSource, usize) {
        let k = self.blocks_per_state;
        if k == 0 {
            return (SlotSource::Own, 0);
        }
        let mut plain = self.cache.num_plain_checkpoints();
        let mut kept = self.cache.num_kept_checkpoints();
        match pinned {
            Some(true) => plain -= 1,
            Some(false) => kept -= 1,
            None => {}
        }
        let mut surplus = self.surplus();
        let source = if self.cache.num_free_slots() == 0 {
            SlotSource::Evict // no slot id: acquire_slot evicts one (plain first)
        } else if surplus >= k {
            surplus -= k;
            SlotSource::Surplus
        } else if plain + kept > 0 {
            SlotSource::Evict
        } else {
            SlotSource::Store
        };
        if source == SlotSource::Evict {
            match plain > 0 {
                true => plain -= 1,
                false => kept = kept.saturating_sub(1),
            }
        }
        (source, surplus + k * (plain + kept))
    }

    /// The checkpoint a hit at `k` pins: whether it is on the plain list (`None`: no hit, or
    /// already pinned).
    fn pinned_by(&self, chain: &QueryChain<'_>, k: usize) -> Option<bool> {
        let hash = chain.hashes[k.checked_sub(1)?];
        (!self.cache.is_pinned(hash)).then(|| self.cache.is_plain(hash))
    }

    /// Blocks of the store a hit at `k` and the sequence's live slot take (0 or one state).
    pub(crate) fn demand(&self, chain: &QueryChain<'_>, k: usize) -> usize {
        match self.slot_source(self.pinned_by(chain, k)) {
            (SlotSource::Store, _) => self.blocks_per_state,
            _ => 0,
        }
    }

    /// Blocks the group gives back to the store's other groups after a hit at `k` and its
    /// live slot (surplus and evictable checkpoints).
    pub(crate) fn spare_after(&self, chain: &QueryChain<'_>, k: usize) -> usize {
        self.slot_source(self.pinned_by(chain, k)).1
    }

    /// Blocks the group gives back to the store's other groups now.
    pub(crate) fn spare(&self) -> usize {
        match self.blocks_per_state {
            0 => 0,
            k => {
                let evictable =
                    self.cache.num_plain_checkpoints() + self.cache.num_kept_checkpoints();
                self.surplus() + k * evictable
            }
        }
    }

    /// Frees blocks of the store until `need` are free or the group has none to give, in the
    /// one store's order (docs/hybrid.md): its surplus first, then its checkpoints and the
    /// store's KV by recency (whichever was used longest ago goes; among the checkpoints the
    /// plain list first), the checkpoints whatever their age once the KV cannot cover `need`.
    pub(crate) fn make_room(&mut self, full: &mut FullGroup, need: usize) {
        if self.blocks_per_state == 0 {
            return;
        }
        if let Some(cache) = full.cache_mut() {
            cache.drain_released(); // the recency of what was released since
        }
        loop {
            let free = full.counts().free;
            if free >= need {
                return;
            }
            if self.surplus() > 0 {
                self.release_surplus();
                continue;
            }
            let Some(stamp) = self.cache.next_victim_stamp() else {
                return; // the allocator evicts KV for the rest
            };
            let kv = full.num_available() - free;
            let kv_next = full.cache().and_then(|c| c.next_victim_stamp());
            if kv < need - free || kv_next.is_none_or(|kv| stamp < kv) {
                self.cache.evict(1);
                continue;
            }
            // The KV goes first: evict it up to the checkpoint's age (or what is missing), a
            // batch at a time (the order within a batch is the cache's own, R10).
            let Some(cache) = full.cache_mut() else {
                return;
            };
            let mut evicted = 0;
            while evicted < need - free && cache.next_victim_stamp().is_some_and(|kv| kv <= stamp) {
                match cache.evict((need - free - evicted).min(KV_BATCH)) {
                    0 => break,
                    n => evicted += n,
                }
            }
            if evicted == 0 {
                self.cache.evict(1);
            }
        }
    }

    /// Gives the blocks beyond the slots in use back to the store.
    pub(super) fn release_surplus(&mut self) {
        let keep = self.blocks_per_state * self.in_use();
        if self.budget.len() > keep {
            self.budget.truncate(keep);
        }
    }

    /// Secures the memory of one more slot in the one store before a slot is taken;
    /// `at_admission`: by the admission's rule (what its plan counted, [`Self::slot_source`]),
    /// otherwise (a save at a step) free blocks of the store come before the checkpoints, and
    /// the KV the store evicts competes with the kept checkpoints by recency. False if no
    /// memory can be had (the slot is then not taken).
    pub(super) fn secure_slot(&mut self, full: &mut FullGroup, at_admission: bool) -> bool {
        let k = self.blocks_per_state;
        if k == 0 {
            return true;
        }
        let (source, _) = self.slot_source(None);
        match source {
            SlotSource::Own | SlotSource::Surplus => return true,
            SlotSource::Evict if self.cache.num_free_slots() == 0 => return true,
            _ => {}
        }
        if !at_admission && full.counts().free >= k {
            return full.grow_for(&mut self.budget, k, self.owner);
        }
        if at_admission && source == SlotSource::Evict {
            return self.cache.evict(1) == 1;
        }
        if !at_admission {
            // A checkpoint older than the KV the store would evict gives its slot and blocks.
            let kv_next = full.cache().and_then(|c| c.next_victim_stamp());
            let older = match (self.cache.next_victim_stamp(), kv_next) {
                (Some(stamp), Some(kv)) => stamp < kv,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if older && self.cache.evict(1) == 1 {
                return true;
            }
        }
        if full.num_available() >= k && full.grow_for(&mut self.budget, k, self.owner) {
            return true;
        }
        self.cache.evict(1) == 1
    }
}
