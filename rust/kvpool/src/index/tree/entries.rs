//! A node's entries: holders (group bit 0 alone) and extras (every other mask), added,
//! confirmed, cleared and dropped; the counts `entries` and `speculative` follow each change
//! (invariants in the parent module's doc).

use super::{Entry, Holders, Tree, HAS_EXTRAS, PLAIN, SPECULATIVE};

impl Tree<'_> {
    pub(super) fn extras_mut(&mut self, id: u32) -> &mut Vec<Entry> {
        self.rec_mut(id).word |= HAS_EXTRAS;
        self.nodes.extras.entry(id).or_default()
    }

    /// Drops node `id`'s extras if none are left.
    pub(super) fn tidy_extras(&mut self, id: u32) {
        if self.nodes.extras.get(&id).is_some_and(|e| e.is_empty()) {
            self.nodes.extras.remove(&id);
            self.rec_mut(id).word &= !HAS_EXTRAS;
        }
    }

    pub(super) fn insert_extra(&mut self, id: u32, location: u32, mask: u32, expires: f64) {
        let extras = self.extras_mut(id);
        let at = extras.partition_point(|e| e.location < location);
        extras.insert(
            at,
            Entry {
                location,
                mask,
                expires,
            },
        );
    }

    /// Changes node `id`'s holder set by `change` (which says whether it changed it).
    #[inline]
    fn change_holders(
        &mut self,
        id: u32,
        change: impl FnOnce(&mut Holders, usize, &mut super::Sets) -> bool,
    ) -> bool {
        let width = self.nodes.width;
        let rec = &mut self.nodes.recs[id as usize];
        let mut holders = rec.holders();
        let changed = change(&mut holders, width, &mut self.nodes.sets);
        if changed {
            rec.set_holders(holders);
            self.mark(id);
        }
        changed
    }

    pub(super) fn insert_holder(&mut self, id: u32, location: u32) -> bool {
        self.change_holders(id, |h, width, sets| h.insert(location, width, sets))
    }

    #[inline]
    pub(super) fn remove_holder(&mut self, id: u32, location: u32) -> bool {
        self.change_holders(id, |h, width, sets| h.remove(location, width, sets))
    }

    /// Adds group bits `bits` of `location` to node `id`; a speculative bit there is
    /// confirmed (cleared). Returns whether the entry is new.
    #[inline]
    pub(crate) fn add_groups(&mut self, id: u32, location: u32, bits: u32) -> bool {
        if bits == PLAIN && !self.nodes.recs[id as usize].has_extras() {
            // The common case: a holder more (or again).
            let new = self.insert_holder(id, location);
            self.nodes.entries += usize::from(new);
            return new;
        }
        self.add_groups_slow(id, location, bits)
    }

    pub(super) fn add_groups_slow(&mut self, id: u32, location: u32, bits: u32) -> bool {
        if self.holds(id, location) {
            if bits != PLAIN {
                // A holder gains another group: it becomes an extra.
                self.remove_holder(id, location);
                self.insert_extra(id, location, PLAIN | bits, 0.0);
            }
            return false;
        }
        if let Ok(i) = self
            .nodes
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        {
            let entry = &mut self.extras_mut(id)[i];
            let confirmed = entry.mask & SPECULATIVE != 0;
            entry.mask = (entry.mask | bits) & !SPECULATIVE;
            let plain = entry.mask == PLAIN;
            self.nodes.speculative -= usize::from(confirmed);
            if plain {
                self.extras_mut(id).remove(i);
                self.tidy_extras(id);
                self.insert_holder(id, location);
            }
            return false;
        }
        if bits == PLAIN {
            self.insert_holder(id, location);
        } else {
            self.insert_extra(id, location, bits, 0.0);
        }
        self.nodes.entries += 1;
        true
    }

    /// Marks `location`'s entry at node `id` speculative until `expires`, unless a group
    /// already holds it there. Returns whether the speculative bit was set or extended.
    pub(crate) fn add_speculative(&mut self, id: u32, location: u32, expires: f64) -> bool {
        if self.holds(id, location) {
            return false; // held for real: nothing to predict
        }
        if let Ok(i) = self
            .nodes
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        {
            let held = self.nodes.extras(id)[i];
            if held.mask & !SPECULATIVE != 0 || expires <= held.expires {
                return false;
            }
            self.extras_mut(id)[i].expires = expires;
            return true;
        }
        self.insert_extra(id, location, SPECULATIVE, expires);
        self.nodes.entries += 1;
        self.nodes.speculative += 1;
        true
    }

    /// Clears bits `bits` (groups, or [`SPECULATIVE`]) of `location`'s entry at node `id`;
    /// an entry left with no bit is dropped, and the node collected if emptied. With
    /// `only_expiring == Some(t)` the speculative bit is cleared only if it lapses at `t`.
    /// Returns the bits cleared.
    #[inline]
    pub(crate) fn clear_bits(
        &mut self,
        id: u32,
        location: u32,
        bits: u32,
        only_expiring: Option<f64>,
    ) -> u32 {
        if bits & PLAIN != 0 && self.remove_holder(id, location) {
            // The common case: a holder goes (a removed event of a plain location).
            self.nodes.entries -= 1;
            if !self.nodes.recs[id as usize].has_entries() {
                self.collect(id);
            }
            return PLAIN;
        }
        self.clear_extra_bits(id, location, bits, only_expiring)
    }

    /// [`Tree::clear_bits`] of an entry that is not a holder (an extra).
    fn clear_extra_bits(
        &mut self,
        id: u32,
        location: u32,
        bits: u32,
        only_expiring: Option<f64>,
    ) -> u32 {
        let Ok(i) = self
            .nodes
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        else {
            return 0;
        };
        let held = self.nodes.extras(id)[i];
        let mut clear = bits & held.mask;
        if clear & SPECULATIVE != 0 && only_expiring.is_some_and(|t| t != held.expires) {
            clear &= !SPECULATIVE;
        }
        if clear == 0 {
            return 0;
        }
        let left = held.mask & !clear;
        self.extras_mut(id)[i].mask = left;
        if clear & SPECULATIVE != 0 {
            self.nodes.speculative -= 1;
        }
        if left == 0 || left == PLAIN {
            self.extras_mut(id).remove(i);
            if left == PLAIN {
                self.insert_holder(id, location);
            } else {
                self.nodes.entries -= 1;
            }
            self.tidy_extras(id);
            if !self.nodes.recs[id as usize].has_entries() {
                self.collect(id);
            }
        }
        clear
    }

    /// Drops every entry of the locations `drop` says, in every node. Returns how many.
    pub(crate) fn drop_locations(&mut self, drop: impl Fn(u32) -> bool) -> usize {
        let mut emptied = Vec::new();
        let mut dropped = 0;
        let mut speculative = 0;
        for i in 0..self.nodes.recs.len() {
            let id = i as u32;
            let rec = self.nodes.recs[i];
            if !rec.live() || !rec.has_entries() {
                continue;
            }
            let hit = rec.holders().iter(&self.nodes.sets).any(&drop)
                || self.nodes.extras(id).iter().any(|e| drop(e.location));
            if !hit {
                continue;
            }
            let before = rec.holders().len();
            self.change_holders(id, |h, width, sets| h.retain(|l| !drop(l), width, sets) > 0);
            dropped += before - self.nodes.recs[i].holders().len();
            if self.nodes.recs[i].has_extras() {
                let extras = self.extras_mut(id);
                let before = extras.len();
                extras.retain(|e| {
                    let gone = drop(e.location);
                    speculative += usize::from(gone && e.mask & SPECULATIVE != 0);
                    !gone
                });
                dropped += before - extras.len();
                self.tidy_extras(id);
            }
            if !self.nodes.recs[i].has_entries() {
                emptied.push(id);
            }
        }
        self.nodes.entries -= dropped;
        self.nodes.speculative -= speculative;
        for id in emptied {
            self.collect(id);
        }
        dropped
    }
}
