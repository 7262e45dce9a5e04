//! A tree restored from a dump, and the check of the parent module's invariants.

use super::{Entry, Tree, NIL, PARENT_KNOWN, PLAIN, SPECULATIVE};
use crate::error::{ensure_invariant, Result};
use crate::index::table::Probe;

impl Tree {
    /// A tree of `nodes` in LRU order (oldest first; entry-less ones anywhere): each a hash,
    /// its parent (`None` unknown, `Some(None)` a chain's first block, `Some(Some(i))` the
    /// `i`-th of `nodes`) and its entries, sorted by location. Structural checks are left to
    /// [`Tree::check`] except those restoring needs.
    #[allow(clippy::type_complexity)]
    pub(crate) fn restore(
        nodes: Vec<(u128, Option<Option<u32>>, Vec<Entry>)>,
        width: usize,
    ) -> Result<Self> {
        let mut tree = Self::with_capacity(nodes.len());
        tree.width = width;
        let mut parents = Vec::with_capacity(nodes.len());
        for (hash, parent, entries) in nodes {
            let Probe::Vacant(vacant) = tree.probe(hash) else {
                return Err(crate::KvPoolError::Invariant(format!(
                    "hash {hash:032x} twice"
                )));
            };
            let id = tree.alloc_at(vacant, hash);
            ensure_invariant!(
                entries.windows(2).all(|p| p[0].location < p[1].location),
                "node {id}: entries not sorted by location"
            );
            for entry in entries {
                ensure_invariant!(entry.mask != 0, "node {id}: an empty entry");
                tree.entries += 1;
                tree.speculative += usize::from(entry.mask & SPECULATIVE != 0);
                if entry.mask == PLAIN {
                    tree.insert_holder(id, entry.location);
                } else {
                    tree.extras_mut(id).push(entry);
                }
            }
            if parent.is_some() {
                tree.nodes[id as usize].flags |= PARENT_KNOWN;
            }
            parents.push(parent.flatten());
            if tree.nodes[id as usize].has_entries() {
                tree.touch(id);
            }
        }
        for (id, parent) in parents.into_iter().enumerate() {
            if let Some(parent) = parent {
                tree.nodes[id].parent = parent;
                tree.nodes[parent as usize].children += 1;
            }
        }
        tree.begin_write();
        Ok(tree)
    }

    /// Checks the module's invariants; `locations` is the number of registered locations.
    pub(crate) fn check(&self, locations: usize) -> Result<()> {
        let mut children = vec![0u32; self.nodes.len()];
        let (mut entries, mut speculative, mut live, mut with_entries) = (0, 0, 0, 0);
        for (i, node) in self.nodes.iter().enumerate() {
            let id = i as u32;
            if !node.live() {
                ensure_invariant!(
                    node.flags == 0 && node.holders.is_empty() && !self.extras.contains_key(&id),
                    "free node {id} holds something"
                );
                continue;
            }
            live += 1;
            ensure_invariant!(
                self.find(node.hash) == Some(id),
                "the table does not find node {id}"
            );
            ensure_invariant!(
                node.has_entries() || node.children > 0,
                "node {id} has neither entries nor children"
            );
            ensure_invariant!(
                (node.stamp != 0) == node.has_entries(),
                "node {id}: a stamp iff it has entries"
            );
            with_entries += usize::from(node.has_entries());
            node.holders
                .check(&self.sets)
                .map_err(|e| crate::KvPoolError::Invariant(format!("node {id}: {e}")))?;
            ensure_invariant!(
                node.holders
                    .iter(&self.sets)
                    .all(|l| (l as usize) < locations),
                "node {id}: a holder of no location"
            );
            ensure_invariant!(
                node.has_extras() == self.extras.contains_key(&id),
                "node {id}: extras flag"
            );
            let extras = self.extras(id);
            ensure_invariant!(
                !node.has_extras() || !extras.is_empty(),
                "node {id}: empty extras kept"
            );
            for pair in extras.windows(2) {
                ensure_invariant!(
                    pair[0].location < pair[1].location,
                    "node {id}: extras not sorted by location"
                );
            }
            for entry in extras {
                ensure_invariant!(
                    entry.mask != 0 && entry.mask != PLAIN,
                    "node {id}: an extra with mask {:b}",
                    entry.mask
                );
                ensure_invariant!(
                    (entry.location as usize) < locations,
                    "node {id}: unknown location {}",
                    entry.location
                );
                ensure_invariant!(
                    !node.holders.contains(entry.location, &self.sets),
                    "node {id}: location {} both holder and extra",
                    entry.location
                );
                speculative += usize::from(entry.mask & SPECULATIVE != 0);
            }
            entries += node.holders.len() + extras.len();
            if node.parent != NIL {
                ensure_invariant!(node.parent_known(), "node {id}: a parent while unknown");
                let parent = node.parent as usize;
                ensure_invariant!(
                    self.nodes.get(parent).is_some_and(|p| p.live()),
                    "node {id}: dead parent"
                );
                children[parent] += 1;
            }
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if !node.live() {
                continue;
            }
            ensure_invariant!(
                node.children == children[i],
                "node {i} counts {} children, has {}",
                node.children,
                children[i]
            );
            // No cycle: walking up ends within `live` steps.
            let (mut up, mut steps) = (node.parent, 0);
            while up != NIL {
                steps += 1;
                ensure_invariant!(steps <= live, "node {i}: parent links cycle");
                up = self.nodes[up as usize].parent;
            }
        }
        ensure_invariant!(
            live == self.live,
            "{} live nodes counted, {live} held",
            self.live
        );
        ensure_invariant!(
            entries == self.entries,
            "{} entries counted, {entries} held",
            self.entries
        );
        ensure_invariant!(
            speculative == self.speculative,
            "{} speculative entries counted, {speculative} held",
            self.speculative
        );
        let (mut on_lru, mut last) = (0, 0u64);
        for &(id, stamp) in &self.lru[self.lru_head..] {
            ensure_invariant!(stamp > last, "LRU records out of stamp order");
            last = stamp;
            on_lru += usize::from(
                self.nodes
                    .get(id as usize)
                    .is_some_and(|n| n.stamp == stamp),
            );
        }
        ensure_invariant!(
            on_lru == with_entries && on_lru == self.on_lru,
            "{on_lru} current LRU records, {with_entries} nodes with entries, {} counted",
            self.on_lru
        );
        // Every slot of the sets is named by one live node's holders, or free, once.
        let mut lists = vec![0u32; self.sets.lists.len()];
        let mut bits = vec![0u32; self.sets.bits.len()];
        for node in self.nodes.iter().filter(|n| n.live()) {
            match node.holders.slot() {
                Some((false, at)) => lists[at as usize] += 1,
                Some((true, at)) => bits[at as usize] += 1,
                None => {}
            }
        }
        for &at in &self.sets.free_lists {
            lists[at as usize] += 1;
        }
        for &at in &self.sets.free_bits {
            bits[at as usize] += 1;
        }
        ensure_invariant!(
            lists.iter().chain(&bits).all(|&n| n == 1),
            "a holder set slot is named twice or lost"
        );
        ensure_invariant!(
            self.free.len() + self.live == self.nodes.len(),
            "node slots: {} free + {} live != {}",
            self.free.len(),
            self.live,
            self.nodes.len()
        );
        Ok(())
    }
}

impl Tree {
    /// Checks that this copy is node for node the same as `other` (the two copies of an index
    /// once levelled): the same ids for the same hashes (the shared table relies on it), the
    /// same links, holders, extras, stamps, free list, current LRU records and counts.
    pub(crate) fn check_same_as(&self, other: &Tree) -> Result<()> {
        ensure_invariant!(
            self.nodes.len() == other.nodes.len(),
            "copies have {} and {} node slots",
            self.nodes.len(),
            other.nodes.len()
        );
        for (i, (a, b)) in self.nodes.iter().zip(&other.nodes).enumerate() {
            ensure_invariant!(a.flags == b.flags, "node {i}: flags differ between copies");
            if !a.live() {
                continue;
            }
            ensure_invariant!(
                a.hash == b.hash
                    && a.stamp == b.stamp
                    && a.parent == b.parent
                    && a.children == b.children,
                "node {i}: hash, stamp or links differ between copies"
            );
            ensure_invariant!(
                a.holders.slot() == b.holders.slot()
                    && a.holders.iter(&self.sets).eq(b.holders.iter(&other.sets)),
                "node {i}: holders differ between copies"
            );
            ensure_invariant!(
                self.extras(i as u32) == other.extras(i as u32),
                "node {i}: extras differ between copies"
            );
        }
        ensure_invariant!(
            self.extras.len() == other.extras.len(),
            "copies keep {} and {} extras lists",
            self.extras.len(),
            other.extras.len()
        );
        ensure_invariant!(self.free == other.free, "free lists differ between copies");
        let current = |tree: &Tree| -> Vec<(u32, u64)> {
            tree.lru[tree.lru_head..]
                .iter()
                .copied()
                .filter(|&(id, stamp)| tree.nodes[id as usize].stamp == stamp)
                .collect()
        };
        ensure_invariant!(
            current(self) == current(other),
            "current LRU records differ between copies"
        );
        ensure_invariant!(
            (
                self.live,
                self.entries,
                self.speculative,
                self.on_lru,
                self.tick,
                self.width
            ) == (
                other.live,
                other.entries,
                other.speculative,
                other.on_lru,
                other.tick,
                other.width
            ),
            "counts differ between copies"
        );
        ensure_invariant!(
            self.sets.free_lists == other.sets.free_lists
                && self.sets.free_bits == other.sets.free_bits,
            "holder set free slots differ between copies"
        );
        Ok(())
    }
}
