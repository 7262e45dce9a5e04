//! A node's entries: holders (group bit 0 alone) and extras (every other mask), added,
//! confirmed, cleared and dropped; the counts `entries` and `speculative` follow each change
//! (invariants in the parent module's doc).

use super::{Entry, Tree, HAS_EXTRAS, PLAIN, SPECULATIVE};

impl Tree {
    pub(super) fn extras_mut(&mut self, id: u32) -> &mut Vec<Entry> {
        self.node_mut(id).flags |= HAS_EXTRAS;
        self.extras.entry(id).or_default()
    }

    /// Drops node `id`'s extras if none are left.
    pub(super) fn tidy_extras(&mut self, id: u32) {
        if self.extras.get(&id).is_some_and(|e| e.is_empty()) {
            self.extras.remove(&id);
            self.node_mut(id).flags &= !HAS_EXTRAS;
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

    pub(super) fn insert_holder(&mut self, id: u32, location: u32) -> bool {
        self.mark(id);
        let node = &mut self.nodes[id as usize];
        node.holders.insert(location, self.width, &mut self.sets)
    }

    #[inline]
    pub(super) fn remove_holder(&mut self, id: u32, location: u32) -> bool {
        self.mark(id);
        let node = &mut self.nodes[id as usize];
        node.holders.remove(location, self.width, &mut self.sets)
    }

    /// Adds group bits `bits` of `location` to node `id`; a speculative bit there is
    /// confirmed (cleared). Returns whether the entry is new.
    #[inline]
    pub(crate) fn add_groups(&mut self, id: u32, location: u32, bits: u32) -> bool {
        if bits == PLAIN && !self.nodes[id as usize].has_extras() {
            // The common case: a holder more (or again).
            let new = self.insert_holder(id, location);
            self.entries += usize::from(new);
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
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        {
            let entry = &mut self.extras_mut(id)[i];
            let confirmed = entry.mask & SPECULATIVE != 0;
            entry.mask = (entry.mask | bits) & !SPECULATIVE;
            let plain = entry.mask == PLAIN;
            self.speculative -= usize::from(confirmed);
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
        self.entries += 1;
        true
    }

    /// Marks `location`'s entry at node `id` speculative until `expires`, unless a group
    /// already holds it there. Returns whether the speculative bit was set or extended.
    pub(crate) fn add_speculative(&mut self, id: u32, location: u32, expires: f64) -> bool {
        if self.holds(id, location) {
            return false; // held for real: nothing to predict
        }
        if let Ok(i) = self
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        {
            let held = self.extras(id)[i];
            if held.mask & !SPECULATIVE != 0 || expires <= held.expires {
                return false;
            }
            self.extras_mut(id)[i].expires = expires;
            return true;
        }
        self.insert_extra(id, location, SPECULATIVE, expires);
        self.entries += 1;
        self.speculative += 1;
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
            self.entries -= 1;
            if !self.nodes[id as usize].has_entries() {
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
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        else {
            return 0;
        };
        let held = self.extras(id)[i];
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
            self.speculative -= 1;
        }
        if left == 0 || left == PLAIN {
            self.extras_mut(id).remove(i);
            if left == PLAIN {
                self.insert_holder(id, location);
            } else {
                self.entries -= 1;
            }
            self.tidy_extras(id);
            if !self.nodes[id as usize].has_entries() {
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
        for i in 0..self.nodes.len() {
            let id = i as u32;
            let node = &self.nodes[i];
            if !node.live() || !node.has_entries() {
                continue;
            }
            let hit = node.holders.iter(&self.sets).any(&drop)
                || self.extras(id).iter().any(|e| drop(e.location));
            if !hit {
                continue;
            }
            self.mark(id);
            let node = &mut self.nodes[i];
            dropped += node
                .holders
                .retain(|l| !drop(l), self.width, &mut self.sets);
            if self.nodes[i].has_extras() {
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
            if !self.nodes[i].has_entries() {
                emptied.push(id);
            }
        }
        self.entries -= dropped;
        self.speculative -= speculative;
        for id in emptied {
            self.collect(id);
        }
        dropped
    }
}
