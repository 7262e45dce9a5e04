//! Bringing a copy of the nodes level with the other one (see the module doc of `mod.rs`):
//! copying the records a write changed and what they name, dropping the table entries of the
//! nodes it deleted once no copy holds them, and rebuilding a copy's table.
//!
//! Invariant kept: after [`Nodes::level_with`] this copy equals `source` record for record
//! (`Nodes::check_same_as` checks it); a copy's table finds every live node of that copy.

use std::sync::Arc;

use super::{Changes, Nodes};
use crate::index::table::Table;

impl Nodes {
    /// Brings this copy level with `source`, which was equal to it before its last write,
    /// `changes` being that write's: copies the records it changed and what they name (their
    /// set's slot, their extras). The caller then drops the table entries of the nodes
    /// deleted ([`Nodes::drop_deleted`]).
    pub(crate) fn level_with(&mut self, source: &Nodes, changes: &Changes) {
        // This copy's records are cold (the other copy was written last): ask for them all
        // before copying into any, so that their misses overlap.
        for &id in &changes.nodes {
            if let Some(rec) = self.recs.get(id as usize) {
                crate::index::table::prefetch(rec);
            }
        }
        let old = changes.nodes_start.min(self.recs.len());
        self.recs.truncate(old);
        self.recs.extend_from(&source.recs);
        for &id in &changes.nodes {
            let i = id as usize;
            if i >= old {
                continue;
            }
            let had_extras = self.recs[i].has_extras();
            let rec = source.recs[i];
            self.recs[i] = rec;
            if had_extras || rec.has_extras() || rec.holders().slot().is_some() {
                self.level_side(source, i, had_extras);
            }
        }
        for i in old..self.recs.len() {
            let rec = &source.recs[i];
            if rec.holders().slot().is_some() || rec.has_extras() {
                self.level_side(source, i, false);
            }
        }
        // Slots made and freed within the write exist (empty) here too.
        self.sets
            .lists
            .resize_with(source.sets.lists.len(), Vec::new);
        self.sets.bits.resize_with(source.sets.bits.len(), Vec::new);
        self.sets.free_lists.clone_from(&source.sets.free_lists);
        self.sets.free_bits.clone_from(&source.sets.free_bits);
        self.live = source.live;
        self.entries = source.entries;
        self.speculative = source.speculative;
        self.width = source.width;
        if !Arc::ptr_eq(&self.table, &source.table) {
            self.table = Arc::clone(&source.table);
        }
    }

    /// Copies what record `i` names outside itself (its set's slot, its extras) from `source`.
    #[inline]
    fn level_side(&mut self, source: &Nodes, i: usize, had_extras: bool) {
        let rec = &source.recs[i];
        match rec.holders().slot() {
            Some((false, at)) => self.sets.copy_list(&source.sets, at),
            Some((true, at)) => self.sets.copy_bits(&source.sets, at),
            None => {}
        }
        let id = i as u32;
        if rec.has_extras() {
            self.extras
                .entry(id)
                .or_default()
                .clone_from(&source.extras[&id]);
        } else if had_extras {
            self.extras.remove(&id);
        }
    }

    /// Tombstones the table entries of `deleted` nodes (a write's) that this copy does not
    /// hold (again): once no copy a reader can reach holds them (this copy is the only one,
    /// or the other copy is level with it).
    pub(crate) fn drop_deleted(&self, deleted: &[(u128, u32)]) {
        for &(hash, id) in deleted {
            self.table.remove(hash, id, |id| self.valid(id, hash));
        }
    }

    /// Gives this copy a new table holding its live nodes, with room for `capacity` (the
    /// other copy keeps the old one until it is brought level; see `table.rs`).
    pub(crate) fn rebuild_table(&mut self, capacity: usize) {
        let live = self
            .recs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.live())
            .map(|(i, r)| (r.hash(), i as u32));
        self.table = Arc::new(Table::rebuilt(live, capacity.max(self.live)));
    }
}
