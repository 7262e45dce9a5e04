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
//! Invariants: at most `capacity` graves (the cache's block count), the oldest buried first
//! dropped; a grave's anchor is carried by no live entry of this cache (it moves back to the
//! entry that takes it, and a hash maps to one entry). Only caches whose entries something
//! links to (a pool with a window or linear-state group, a host tier behind one) bury.

use std::collections::VecDeque;

use crate::hash::{BlockHash, ByHash};

use super::anchors::{Anchor, ROOT_LINK};
use super::keys::same_tokens;
use super::{ExtraKey, PrefixCache, NIL};

/// One removed anchored entry (module doc).
struct Grave {
    anchor: Anchor,
    /// The parent's anchor, or [`ROOT_LINK`] for a chain's first block.
    parent: Anchor,
    /// The chain's extra key, for a first block.
    extra_key: Option<ExtraKey>,
    tokens: Box<[u32]>,
    /// Burial number, to match the queue's record.
    serial: u64,
}

/// The graves of one cache, by hash, with their burial order.
#[derive(Default)]
pub(super) struct Graveyard {
    by_hash: ByHash<Grave>,
    /// (hash, serial) in burial order; records of graves taken or replaced since are skipped.
    order: VecDeque<(u128, u64)>,
    buried: u64,
}

impl Graveyard {
    pub(super) fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub(super) fn clear(&mut self) {
        self.by_hash.clear();
        self.order.clear();
    }

    /// The anchors of the graves (for `check`).
    pub(super) fn anchors(&self) -> impl Iterator<Item = Anchor> + '_ {
        self.by_hash.values().map(|g| g.anchor)
    }
}

impl PrefixCache {
    /// Buries entry `id` (being removed, still intact; anchored) with anchor `anchor`.
    pub(super) fn bury(&mut self, id: u32, anchor: Anchor) {
        let entry = &self.entries[id as usize];
        let (hash, parent_id) = (entry.hash, entry.parent);
        let (parent, extra_key) = match parent_id {
            NIL => (ROOT_LINK, entry.extra_key.clone()),
            p => (self.anchor(p), None),
        };
        let capacity = self.entries.len();
        let tokens: Box<[u32]> = self.block_tokens(id).into();
        let graves = &mut self.graves;
        while graves.by_hash.len() >= capacity {
            let Some((old, serial)) = graves.order.pop_front() else {
                break;
            };
            if graves.by_hash.get(&old).is_some_and(|g| g.serial == serial) {
                graves.by_hash.remove(&old);
            }
        }
        graves.buried += 1;
        let serial = graves.buried;
        graves.order.push_back((hash.0, serial));
        graves.by_hash.insert(
            hash.0,
            Grave {
                anchor,
                parent,
                extra_key,
                tokens,
                serial,
            },
        );
        // The queue keeps records of graves taken since; it never outgrows twice the graves.
        if graves.order.len() > 2 * capacity.max(graves.by_hash.len()) {
            let by_hash = &graves.by_hash;
            graves
                .order
                .retain(|(h, s)| by_hash.get(h).is_some_and(|g| g.serial == *s));
        }
    }

    /// Gives the entry just recorded for block `id` (hash `hash`) the anchor of the grave under
    /// its hash, if it is that grave's chain position (module doc).
    pub(super) fn raise(&mut self, id: u32, hash: BlockHash) {
        let Some(grave) = self.graves.by_hash.get(&hash.0) else {
            return;
        };
        let entry = &self.entries[id as usize];
        let same_parent = match entry.parent {
            NIL => grave.parent == ROOT_LINK && entry.extra_key == grave.extra_key,
            p => grave.parent != ROOT_LINK && self.anchor_of(p) == grave.parent,
        };
        if !same_parent || !same_tokens(self.block_tokens(id), &grave.tokens) {
            return;
        }
        let anchor = grave.anchor;
        self.graves.by_hash.remove(&hash.0);
        self.set_anchor(id, anchor);
    }
}
