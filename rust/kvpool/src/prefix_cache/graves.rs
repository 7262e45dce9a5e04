//! Graves: what the cache remembers of the anchored entries it removed, so that the same prefix
//! computed again gets its anchor back (`anchors.rs`).
//!
//! A window block or a checkpoint links to the anchor of a full-attention entry (R7). When the
//! cache evicts that entry and a later request computes the same prefix again, the new entry
//! would get a new anchor and every link to the old one would go stale, although the KV is the
//! same prefix's. So an anchored entry leaves a *grave*: its hash, its anchor, its tokens and
//! its parent's anchor (the parent is anchored for the purpose; [`ROOT_LINK`] and the extra key
//! for a chain's first block). A new entry takes the anchor of the grave under its hash when
//! it is the same chain position by the rule of a hit (R7): same tokens, and a parent that
//! carries the grave's parent anchor (or the same extra key at the root). The parent was
//! recorded, and so got its anchor back, first (a chain is recorded parent first), so an
//! anchor still names one prefix for ever.
//!
//! Only the caches of a pool with linear state, or with a window and a host tier, bury
//! ([`PrefixCache::keep_graves`]): there links outlive their chains (a checkpoint outlives the
//! blocks of its chain; a kept window tail outlives device blocks that went to the host and are
//! computed again), while in a plain window pool a window block is shared only while it is held
//! and a chain computed again publishes its own. Measured with `kvpool simulate` under memory
//! pressure: without graves a chat workload restored half as many checkpoints and a mixed
//! workload with a window and a host tier lost a sixth of its hits; a plain window pool hit as
//! often, and its decode steps stay free of the burials' cost.
//!
//! The graves sit in a direct-mapped table (one slot per two blocks of the cache, allocated at
//! the first burial, tokens beside): a burial overwrites the slot of its hash, a new entry
//! under an anchored parent reads the slot of its hash. A grave overwritten before it is raised
//! costs only hits; nothing is raised without the checks above, so a slot shared by two hashes
//! (a collision, `debug_hash_bits`) can never give an anchor to another prefix.
//!
//! Invariants (checked by `check.rs`): `live` counts the occupied slots; a grave's anchor is
//! carried by no live entry of another hash (it names one chain position; a load may give the
//! same position's entry the anchor back while the grave remains, and that entry's removal
//! overwrites the grave).

use crate::alloc;
use crate::hash::BlockHash;

use super::anchors::{Anchor, ROOT_LINK};
use super::keys::same_tokens;
use super::{ExtraKey, PrefixCache, NIL};

/// One removed anchored entry (module doc); `anchor` 0: an empty slot.
#[derive(Default)]
struct Grave {
    hash: u128,
    anchor: Anchor,
    /// The parent's anchor, or [`ROOT_LINK`] for a chain's first block.
    parent: Anchor,
    /// The chain's extra key, for a first block.
    extra_key: Option<ExtraKey>,
}

/// The graves of one cache: a direct-mapped table by hash, tokens beside (`block_size` per
/// slot).
#[derive(Default)]
pub(super) struct Graveyard {
    slots: Vec<Grave>,
    tokens: Vec<u32>,
    /// Occupied slots.
    live: usize,
}

impl Graveyard {
    pub(super) fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Forgets every grave (a reset); the table's memory goes too.
    pub(super) fn clear(&mut self) {
        *self = Self::default();
    }

    /// The anchors of the graves with their hashes (for `check`).
    pub(super) fn anchors(&self) -> impl Iterator<Item = (Anchor, u128)> + '_ {
        self.slots
            .iter()
            .filter(|g| g.anchor != 0)
            .map(|g| (g.anchor, g.hash))
    }

    /// Whether `live` counts the occupied slots (for `check`).
    pub(super) fn consistent(&self) -> bool {
        self.anchors().count() == self.live
    }

    /// The slot of `hash` (the table exists).
    fn slot(&self, hash: u128) -> usize {
        ((hash as u64 ^ (hash >> 64) as u64) % self.slots.len() as u64) as usize
    }
}

impl PrefixCache {
    /// Whether removed anchored entries leave graves from now on (module doc); off forgets the
    /// graves.
    pub(crate) fn keep_graves(&mut self, on: bool) {
        self.burying = on;
        if !on {
            self.graves.clear();
        }
    }

    /// Buries entry `id` (being removed, still intact; anchored) with anchor `anchor`.
    pub(super) fn bury(&mut self, id: u32, anchor: Anchor) {
        let bs = self.block_size;
        if self.graves.slots.is_empty() {
            // One slot per two blocks; if the memory cannot be had, nothing is buried (only hits
            // are lost).
            let n = (self.entries.len() / 2).max(1);
            match (
                alloc::filled(n, "graves", Grave::default),
                alloc::filled(n * bs, "graves", || 0),
            ) {
                (Ok(slots), Ok(tokens)) => {
                    self.graves.slots = slots;
                    self.graves.tokens = tokens;
                }
                _ => return,
            }
        }
        let entry = &self.entries[id as usize];
        let (hash, parent_id) = (entry.hash, entry.parent);
        let (parent, extra_key) = match parent_id {
            NIL => (ROOT_LINK, entry.extra_key.clone()),
            p => (self.anchor(p), None),
        };
        let start = self.token_start(id);
        let graves = &mut self.graves;
        let slot = graves.slot(hash.0);
        graves.live += usize::from(graves.slots[slot].anchor == 0);
        graves.tokens[slot * bs..(slot + 1) * bs].copy_from_slice(&self.tokens[start..start + bs]);
        graves.slots[slot] = Grave {
            hash: hash.0,
            anchor,
            parent,
            extra_key,
        };
    }

    /// Gives the entry just recorded for block `id` (hash `hash`) the anchor of the grave under
    /// its hash, if it is that grave's chain position (module doc). No look-up under a parent
    /// without an anchor: no grave can name it.
    pub(super) fn raise(&mut self, id: u32, hash: BlockHash) {
        let entry = &self.entries[id as usize];
        if entry.parent != NIL && !self.entries[entry.parent as usize].anchored() {
            return;
        }
        let slot = self.graves.slot(hash.0);
        let grave = &self.graves.slots[slot];
        if grave.anchor == 0 || grave.hash != hash.0 {
            return;
        }
        let same_parent = match entry.parent {
            NIL => grave.parent == ROOT_LINK && entry.extra_key == grave.extra_key,
            p => grave.parent != ROOT_LINK && self.anchor_of(p) == grave.parent,
        };
        let bs = self.block_size;
        let tokens = &self.graves.tokens[slot * bs..(slot + 1) * bs];
        if !same_parent || !same_tokens(self.block_tokens(id), tokens) {
            return;
        }
        let anchor = grave.anchor;
        self.graves.slots[slot] = Grave::default();
        self.graves.live -= 1;
        self.set_anchor(id, anchor);
    }
}
