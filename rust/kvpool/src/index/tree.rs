//! The index's table: one node per block hash, holding which locations have that block.
//!
//! A node has a sorted list of entries (one per location: a mask of the location's groups that
//! hold the block, plus a speculative bit with its expiry), its parent node (from the chain the
//! hash came in) and a count of its children. Invariants (checked by [`Tree::check`]):
//! - `by_hash` maps exactly the live nodes; a node exists iff it has an entry or a child (an
//!   emptied leaf is deleted at once, and its parent is reconsidered);
//! - entries are sorted by location, one per location, each with a non-zero mask; `entries`
//!   and `speculative` count all entries and those with the speculative bit;
//! - `children` counts the live nodes whose parent it is; parent links have no cycle;
//! - the LRU list holds exactly the nodes that have entries, oldest first. Writers touch a
//!   chain deepest block first, so a parent is newer than the children stored with it and
//!   eviction, which takes the oldest node with no children, works from the chains' tails:
//!   a location that held a prefix-closed set still does after an eviction.

use smallvec::SmallVec;

use crate::error::{ensure_invariant, Result};
use crate::hash::ByHash;

const NIL: u32 = u32::MAX;

/// The bit of an entry's mask that marks a speculative entry (bits below it are groups).
pub(crate) const SPECULATIVE: u32 = 1 << crate::index::event::MAX_GROUPS;

/// One location's entry in a node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Entry {
    pub location: u32,
    /// Group bits, plus [`SPECULATIVE`].
    pub mask: u32,
    /// When the speculative bit lapses (meaningless without it).
    pub expires: f64,
}

impl Entry {
    /// Whether the speculative bit is set and not lapsed at `now`.
    #[inline]
    pub(crate) fn speculative_at(&self, now: f64) -> bool {
        self.mask & SPECULATIVE != 0 && self.expires > now
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub hash: u128,
    pub parent: u32,
    /// Whether `parent` is known (a chain's first block has none); a node made for a parent
    /// hash before its own event came has an unknown parent until that event links it.
    pub parent_known: bool,
    pub children: u32,
    prev: u32,
    next: u32,
    in_lru: bool,
    pub entries: SmallVec<[Entry; 2]>,
}

/// Nodes, their hash map and the LRU list.
#[derive(Clone, Default)]
pub(crate) struct Tree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    by_hash: ByHash<u32>,
    /// Oldest and newest node of the LRU list.
    head: u32,
    tail: u32,
    pub entries: usize,
    pub speculative: usize,
}

impl Tree {
    pub(crate) fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            ..Self::default()
        }
    }

    /// Live nodes.
    pub(crate) fn len(&self) -> usize {
        self.by_hash.len()
    }

    #[inline]
    pub(crate) fn find(&self, hash: u128) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    #[inline]
    pub(crate) fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    /// The node of `hash`, if live.
    #[inline]
    pub(crate) fn get(&self, hash: u128) -> Option<&Node> {
        self.find(hash).map(|id| &self.nodes[id as usize])
    }

    /// Live node ids in LRU order (oldest first), then the nodes without entries.
    pub(crate) fn ids_in_order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len());
        let mut id = self.head;
        while id != NIL {
            out.push(id);
            id = self.nodes[id as usize].next;
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if !node.in_lru && self.by_hash.get(&node.hash) == Some(&(i as u32)) {
                out.push(i as u32);
            }
        }
        out
    }

    /// The node of `hash`, created (without entries) if new. A new node, or a live one whose
    /// parent is unknown, is linked under `parent` (`None`: a chain's first block; the parent
    /// node is created if absent); a link that would close a cycle is not made.
    pub(crate) fn get_or_create(&mut self, hash: u128, parent: Option<u128>) -> u32 {
        if let Some(id) = self.find(hash) {
            if !self.nodes[id as usize].parent_known {
                self.link_late(id, parent);
            }
            return id;
        }
        let id = self.alloc(hash);
        self.nodes[id as usize].parent_known = true;
        if let Some(parent) = parent {
            // `id` is new, so no node descends from it: the link closes no cycle.
            let parent_id = self.find(parent).unwrap_or_else(|| self.alloc(parent));
            self.nodes[id as usize].parent = parent_id;
            self.nodes[parent_id as usize].children += 1;
        }
        id
    }

    fn link_late(&mut self, id: u32, parent: Option<u128>) {
        let Some(parent) = parent else {
            self.nodes[id as usize].parent_known = true;
            return;
        };
        if let Some(parent_id) = self.find(parent) {
            // Refuse a link under one of `id`'s own descendants (corrupt input only).
            let mut up = parent_id;
            while up != NIL {
                if up == id {
                    return;
                }
                up = self.nodes[up as usize].parent;
            }
        }
        let parent_id = self.find(parent).unwrap_or_else(|| self.alloc(parent));
        let node = &mut self.nodes[id as usize];
        node.parent_known = true;
        node.parent = parent_id;
        self.nodes[parent_id as usize].children += 1;
    }

    fn alloc(&mut self, hash: u128) -> u32 {
        let node = Node {
            hash,
            parent: NIL,
            parent_known: false,
            children: 0,
            prev: NIL,
            next: NIL,
            in_lru: false,
            entries: SmallVec::new(),
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.by_hash.insert(hash, id);
        id
    }

    /// Adds group bits `bits` of `location` to node `id`; a speculative bit there is
    /// confirmed (cleared). Returns whether the entry is new.
    pub(crate) fn add_groups(&mut self, id: u32, location: u32, bits: u32) -> bool {
        let node = &mut self.nodes[id as usize];
        let new = match node.entries.binary_search_by_key(&location, |e| e.location) {
            Ok(i) => {
                let entry = &mut node.entries[i];
                if entry.mask & SPECULATIVE != 0 {
                    self.speculative -= 1;
                }
                entry.mask = (entry.mask | bits) & !SPECULATIVE;
                false
            }
            Err(i) => {
                node.entries.insert(
                    i,
                    Entry {
                        location,
                        mask: bits,
                        expires: 0.0,
                    },
                );
                self.entries += 1;
                true
            }
        };
        self.lru_enter(id);
        new
    }

    /// Marks `location`'s entry at node `id` speculative until `expires`, unless a group
    /// already holds it there. Returns whether the speculative bit was set or extended.
    pub(crate) fn add_speculative(&mut self, id: u32, location: u32, expires: f64) -> bool {
        let node = &mut self.nodes[id as usize];
        let changed = match node.entries.binary_search_by_key(&location, |e| e.location) {
            Ok(i) => {
                let entry = &mut node.entries[i];
                if entry.mask & !SPECULATIVE != 0 {
                    false // held for real: nothing to predict
                } else if expires > entry.expires {
                    entry.expires = expires;
                    true
                } else {
                    false
                }
            }
            Err(i) => {
                node.entries.insert(
                    i,
                    Entry {
                        location,
                        mask: SPECULATIVE,
                        expires,
                    },
                );
                self.entries += 1;
                self.speculative += 1;
                true
            }
        };
        self.lru_enter(id);
        changed
    }

    /// Clears bits `bits` (groups, or [`SPECULATIVE`]) of `location`'s entry at node `id`;
    /// an entry left with no bit is dropped, and the node collected if emptied. With
    /// `only_expiring == Some(t)` the speculative bit is cleared only if it lapses at `t`.
    /// Returns the bits cleared.
    pub(crate) fn clear_bits(
        &mut self,
        id: u32,
        location: u32,
        bits: u32,
        only_expiring: Option<f64>,
    ) -> u32 {
        let node = &mut self.nodes[id as usize];
        let Ok(i) = node.entries.binary_search_by_key(&location, |e| e.location) else {
            return 0;
        };
        let entry = &mut node.entries[i];
        let mut clear = bits & entry.mask;
        if clear & SPECULATIVE != 0 && only_expiring.is_some_and(|t| t != entry.expires) {
            clear &= !SPECULATIVE;
        }
        if clear == 0 {
            return 0;
        }
        if clear & SPECULATIVE != 0 {
            self.speculative -= 1;
        }
        entry.mask &= !clear;
        if entry.mask == 0 {
            node.entries.remove(i);
            self.entries -= 1;
            if node.entries.is_empty() {
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
        for (i, node) in self.nodes.iter_mut().enumerate() {
            if node.entries.is_empty() {
                continue; // free slot or entry-less node
            }
            let before = node.entries.len();
            node.entries.retain(|e| {
                let gone = drop(e.location);
                speculative += usize::from(gone && e.mask & SPECULATIVE != 0);
                !gone
            });
            dropped += before - node.entries.len();
            if node.entries.is_empty() {
                emptied.push(i as u32);
            }
        }
        self.entries -= dropped;
        self.speculative -= speculative;
        for id in emptied {
            self.collect(id);
        }
        dropped
    }

    /// Moves node `id` (which has entries) to the newest end of the LRU list.
    pub(crate) fn touch(&mut self, id: u32) {
        if self.nodes[id as usize].in_lru {
            self.lru_unlink(id);
            self.lru_push(id);
        }
    }

    /// Evicts the oldest node with no children (a node with children met on the way is moved
    /// to the newest end, so each pass is amortized O(1)). Returns how many entries went.
    pub(crate) fn evict_one(&mut self) -> usize {
        let mut budget = self.len();
        while self.head != NIL && budget > 0 {
            budget -= 1;
            let id = self.head;
            if self.nodes[id as usize].children > 0 {
                self.touch(id);
                continue;
            }
            let node = &mut self.nodes[id as usize];
            let gone = node.entries.len();
            let speculative = node
                .entries
                .iter()
                .filter(|e| e.mask & SPECULATIVE != 0)
                .count();
            node.entries.clear();
            self.entries -= gone;
            self.speculative -= speculative;
            self.collect(id);
            return gone;
        }
        0
    }

    /// Node `id` has no entries: leave the LRU; delete it if it has no children either, then
    /// reconsider its parent.
    fn collect(&mut self, mut id: u32) {
        loop {
            let node = &self.nodes[id as usize];
            if !node.entries.is_empty() || self.by_hash.get(&node.hash) != Some(&id) {
                return; // it has entries, or went already (collected through a child)
            }
            if self.nodes[id as usize].in_lru {
                self.lru_unlink(id);
            }
            let node = &self.nodes[id as usize];
            if node.children > 0 {
                return;
            }
            let (hash, parent) = (node.hash, node.parent);
            self.by_hash.remove(&hash);
            self.nodes[id as usize].entries = SmallVec::new();
            self.free.push(id);
            if parent == NIL {
                return;
            }
            self.nodes[parent as usize].children -= 1;
            id = parent;
        }
    }

    fn lru_enter(&mut self, id: u32) {
        if !self.nodes[id as usize].in_lru {
            self.lru_push(id);
        }
    }

    fn lru_push(&mut self, id: u32) {
        let tail = self.tail;
        let node = &mut self.nodes[id as usize];
        node.prev = tail;
        node.next = NIL;
        node.in_lru = true;
        if tail == NIL {
            self.head = id;
        } else {
            self.nodes[tail as usize].next = id;
        }
        self.tail = id;
    }

    fn lru_unlink(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        let (prev, next) = (node.prev, node.next);
        node.in_lru = false;
        node.prev = NIL;
        node.next = NIL;
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// A tree of `nodes` in LRU order (oldest first; entry-less ones anywhere): each a hash,
    /// its parent (`None` unknown, `Some(None)` a chain's first block, `Some(Some(i))` the
    /// `i`-th of `nodes`) and its entries. Structural checks are left to [`Tree::check`]
    /// except those restoring needs (distinct hashes).
    #[allow(clippy::type_complexity)]
    pub(crate) fn restore(nodes: Vec<(u128, Option<Option<u32>>, Vec<Entry>)>) -> Result<Self> {
        let mut tree = Self::new();
        let mut parents = Vec::with_capacity(nodes.len());
        for (hash, parent, entries) in nodes {
            ensure_invariant!(tree.find(hash).is_none(), "hash {hash:032x} twice");
            let id = tree.alloc(hash);
            tree.entries += entries.len();
            tree.speculative += entries.iter().filter(|e| e.mask & SPECULATIVE != 0).count();
            let node = &mut tree.nodes[id as usize];
            node.entries = entries.into_iter().collect();
            node.parent_known = parent.is_some();
            parents.push(parent.flatten());
            if !tree.nodes[id as usize].entries.is_empty() {
                tree.lru_push(id);
            }
        }
        for (id, parent) in parents.into_iter().enumerate() {
            if let Some(parent) = parent {
                tree.nodes[id].parent = parent;
                tree.nodes[parent as usize].children += 1;
            }
        }
        Ok(tree)
    }

    /// Checks the module's invariants; `locations` is the number of registered locations.
    pub(crate) fn check(&self, locations: usize) -> Result<()> {
        let mut children = vec![0u32; self.nodes.len()];
        let mut entries = 0;
        let mut speculative = 0;
        for (&hash, &id) in &self.by_hash {
            let node = &self.nodes[id as usize];
            ensure_invariant!(node.hash == hash, "node {id} under another hash");
            ensure_invariant!(
                !node.entries.is_empty() || node.children > 0,
                "node {id} has neither entries nor children"
            );
            ensure_invariant!(
                node.in_lru != node.entries.is_empty(),
                "node {id}: on the LRU iff it has entries"
            );
            for pair in node.entries.windows(2) {
                ensure_invariant!(
                    pair[0].location < pair[1].location,
                    "node {id}: entries not sorted by location"
                );
            }
            for entry in &node.entries {
                ensure_invariant!(entry.mask != 0, "node {id}: an empty entry");
                ensure_invariant!(
                    (entry.location as usize) < locations,
                    "node {id}: unknown location {}",
                    entry.location
                );
                speculative += usize::from(entry.mask & SPECULATIVE != 0);
            }
            entries += node.entries.len();
            if node.parent != NIL {
                ensure_invariant!(node.parent_known, "node {id}: a parent while unknown");
                let parent = node.parent as usize;
                ensure_invariant!(
                    self.by_hash.get(&self.nodes[parent].hash) == Some(&node.parent),
                    "node {id}: dead parent"
                );
                children[parent] += 1;
            }
        }
        for &id in self.by_hash.values() {
            let node = &self.nodes[id as usize];
            ensure_invariant!(
                node.children == children[id as usize],
                "node {id} counts {} children, has {}",
                node.children,
                children[id as usize]
            );
            // No cycle: walking up ends within `len` steps.
            let (mut up, mut steps) = (node.parent, 0);
            while up != NIL {
                steps += 1;
                ensure_invariant!(steps <= self.len(), "node {id}: parent links cycle");
                up = self.nodes[up as usize].parent;
            }
        }
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
        let (mut id, mut prev, mut on_list) = (self.head, NIL, 0);
        while id != NIL {
            let node = &self.nodes[id as usize];
            ensure_invariant!(node.in_lru && node.prev == prev, "LRU links broken at {id}");
            on_list += 1;
            ensure_invariant!(on_list <= self.len(), "LRU list cycles");
            prev = id;
            id = node.next;
        }
        ensure_invariant!(prev == self.tail, "LRU tail");
        let with_entries = self
            .by_hash
            .values()
            .filter(|&&id| !self.nodes[id as usize].entries.is_empty())
            .count();
        ensure_invariant!(
            on_list == with_entries,
            "{on_list} nodes on the LRU, {with_entries} have entries"
        );
        ensure_invariant!(
            self.free.len() + self.by_hash.len() == self.nodes.len(),
            "node slots: {} free + {} live != {}",
            self.free.len(),
            self.by_hash.len(),
            self.nodes.len()
        );
        Ok(())
    }
}
