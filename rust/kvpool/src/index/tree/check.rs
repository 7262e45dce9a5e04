//! A tree restored from a dump, and the check of the parent module's invariants.

use super::{Entry, Links, Nodes, Tree, NIL, OFF, PLAIN, SPECULATIVE, UNKNOWN};
use crate::error::{ensure_invariant, Result};
use crate::index::table::{Probe, Table};

/// A node of a dump: its hash, its parent (`None` unknown, `Some(None)` a chain's first
/// block, `Some(Some(i))` the `i`-th node) and its entries, sorted by location.
pub(crate) type Restored = (u128, Option<Option<u32>>, Vec<Entry>);

impl Nodes {
    /// Checks that this copy is record for record the same as `other` (the two copies of an
    /// index once levelled): the same ids for the same hashes (the shared table relies on it),
    /// the same holders, extras and counts.
    pub(crate) fn check_same_as(&self, other: &Nodes) -> Result<()> {
        ensure_invariant!(
            self.recs.len() == other.recs.len(),
            "copies have {} and {} node records",
            self.recs.len(),
            other.recs.len()
        );
        for (i, (a, b)) in self.recs.iter().zip(other.recs.iter()).enumerate() {
            ensure_invariant!(
                a.lo == b.lo && a.hi == b.hi && a.word >> 62 == b.word >> 62,
                "node {i}: hash or flags differ between copies"
            );
            ensure_invariant!(
                a.holders().slot() == b.holders().slot()
                    && a.holders()
                        .iter(&self.sets)
                        .eq(b.holders().iter(&other.sets)),
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
        ensure_invariant!(
            (self.live, self.entries, self.speculative, self.width)
                == (other.live, other.entries, other.speculative, other.width),
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

impl Tree<'_> {
    /// A tree of `nodes` in LRU order (oldest first; entry-less ones anywhere). Structural
    /// checks are left to [`Tree::check`] except those restoring needs.
    pub(crate) fn restore(nodes: Vec<Restored>, width: usize) -> Result<(Nodes, Links)> {
        let mut copy = Nodes::new();
        copy.width = width;
        copy.table = std::sync::Arc::new(Table::with_capacity(nodes.len()));
        let mut links = Links::default();
        let mut tree = Tree::new(&mut copy, &mut links);
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
                tree.nodes.entries += 1;
                tree.nodes.speculative += usize::from(entry.mask & SPECULATIVE != 0);
                if entry.mask == PLAIN {
                    tree.insert_holder(id, entry.location);
                } else {
                    tree.extras_mut(id).push(entry);
                }
            }
            if tree.nodes.recs[id as usize].has_entries() {
                tree.touch(id);
            }
            parents.push(parent);
        }
        for (id, parent) in parents.into_iter().enumerate() {
            match parent {
                None => {}
                Some(None) => tree.links.meta[id].parent = NIL,
                Some(Some(parent)) => {
                    tree.links.meta[id].parent = parent;
                    tree.links.meta[parent as usize].children += 1;
                }
            }
        }
        tree.links.begin_write();
        Ok((copy, links))
    }
}

impl Links {
    /// Checks the module's invariants of these links and copy `nodes` (level with them);
    /// `locations` is the number of registered locations.
    pub(crate) fn check(&self, nodes: &Nodes, locations: usize) -> Result<()> {
        let links = self;
        ensure_invariant!(
            nodes.recs.len() == links.meta.len(),
            "{} records, {} links",
            nodes.recs.len(),
            links.meta.len()
        );
        let mut children = vec![0u32; nodes.recs.len()];
        let (mut entries, mut speculative, mut live, mut with_entries) = (0, 0, 0, 0);
        for (i, rec) in nodes.recs.iter().enumerate() {
            let id = i as u32;
            let meta = &links.meta[i];
            if !rec.live() {
                ensure_invariant!(
                    *rec == super::Rec::default()
                        && *meta == super::BLANK
                        && !nodes.extras.contains_key(&id),
                    "free node {id} holds something"
                );
                continue;
            }
            live += 1;
            ensure_invariant!(
                nodes.find(rec.hash()) == Some(id),
                "the table does not find node {id}"
            );
            ensure_invariant!(
                rec.has_entries() || meta.children > 0,
                "node {id} has neither entries nor children"
            );
            ensure_invariant!(
                (meta.prev != OFF) == rec.has_entries(),
                "node {id}: on the LRU iff it has entries"
            );
            with_entries += usize::from(rec.has_entries());
            let holders = rec.holders();
            holders
                .check(&nodes.sets)
                .map_err(|e| crate::KvPoolError::Invariant(format!("node {id}: {e}")))?;
            ensure_invariant!(
                holders.iter(&nodes.sets).all(|l| (l as usize) < locations),
                "node {id}: a holder of no location"
            );
            ensure_invariant!(
                rec.has_extras() == nodes.extras.contains_key(&id),
                "node {id}: extras flag"
            );
            let extras = nodes.extras(id);
            ensure_invariant!(
                !rec.has_extras() || !extras.is_empty(),
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
                    !holders.contains(entry.location, &nodes.sets),
                    "node {id}: location {} both holder and extra",
                    entry.location
                );
                speculative += usize::from(entry.mask & SPECULATIVE != 0);
            }
            entries += holders.len() + extras.len();
            if meta.parent != NIL && meta.parent != UNKNOWN {
                let parent = meta.parent as usize;
                ensure_invariant!(
                    nodes.recs.get(parent).is_some_and(|p| p.live()),
                    "node {id}: dead parent"
                );
                children[parent] += 1;
            }
        }
        for (i, rec) in nodes.recs.iter().enumerate() {
            if !rec.live() {
                continue;
            }
            let meta = &links.meta[i];
            ensure_invariant!(
                meta.children == children[i],
                "node {i} counts {} children, has {}",
                meta.children,
                children[i]
            );
            // No cycle: walking up ends within `live` steps.
            let (mut up, mut steps) = (meta.parent, 0);
            while up != NIL && up != UNKNOWN {
                steps += 1;
                ensure_invariant!(steps <= live, "node {i}: parent links cycle");
                up = links.meta[up as usize].parent;
            }
        }
        ensure_invariant!(
            live == nodes.live,
            "{} live nodes counted, {live} held",
            nodes.live
        );
        ensure_invariant!(
            entries == nodes.entries,
            "{} entries counted, {entries} held",
            nodes.entries
        );
        ensure_invariant!(
            speculative == nodes.speculative,
            "{} speculative entries counted, {speculative} held",
            nodes.speculative
        );
        // The LRU list: linked both ways, every node on it once, with entries.
        let (mut on_lru, mut prev, mut at) = (0, NIL, links.head);
        while at != NIL {
            ensure_invariant!(
                on_lru < with_entries + 1,
                "the LRU list is longer than the nodes with entries (a cycle?)"
            );
            let meta = &links.meta[at as usize];
            ensure_invariant!(meta.prev == prev, "LRU node {at}: its back link");
            ensure_invariant!(
                nodes.recs[at as usize].has_entries(),
                "LRU node {at} has no entries"
            );
            on_lru += 1;
            prev = at;
            at = meta.next;
        }
        ensure_invariant!(links.tail == prev, "the LRU list's tail");
        ensure_invariant!(
            on_lru == with_entries && on_lru == links.on_lru,
            "{on_lru} nodes on the LRU, {with_entries} nodes with entries, {} counted",
            links.on_lru
        );
        // Every slot of the sets is named by one live node's holders, or free, once.
        let mut lists = vec![0u32; nodes.sets.lists.len()];
        let mut bits = vec![0u32; nodes.sets.bits.len()];
        for rec in nodes.recs.iter().filter(|r| r.live()) {
            match rec.holders().slot() {
                Some((false, at)) => lists[at as usize] += 1,
                Some((true, at)) => bits[at as usize] += 1,
                None => {}
            }
        }
        for &at in &nodes.sets.free_lists {
            lists[at as usize] += 1;
        }
        for &at in &nodes.sets.free_bits {
            bits[at as usize] += 1;
        }
        ensure_invariant!(
            lists.iter().chain(&bits).all(|&n| n == 1),
            "a holder set slot is named twice or lost"
        );
        let mut free = vec![false; nodes.recs.len()];
        for &id in &links.free {
            ensure_invariant!(
                (id as usize) < free.len() && !free[id as usize] && !nodes.recs[id as usize].live(),
                "free id {id} repeated, out of range or live"
            );
            free[id as usize] = true;
        }
        ensure_invariant!(
            links.free.len() + nodes.live == nodes.recs.len(),
            "node slots: {} free + {} live != {}",
            links.free.len(),
            nodes.live,
            nodes.recs.len()
        );
        Ok(())
    }
}
