//! The index's nodes: one per block hash, holding which locations have that block.
//!
//! A location's entry at a node is a mask of the location's groups that hold the block, plus
//! a speculative bit with its expiry. Most entries are exactly group bit 0 (a location with
//! one full-attention group): those are kept as the node's [`Holders`], a set of location ids
//! (an array or a bitset); every other entry (more groups, a speculative bit) is an "extra",
//! kept sorted by location in a side map for the few nodes that have any. A node also has its
//! parent (from the chain the hash came in), a count of its children and its LRU stamp.
//!
//! The hash -> id table is shared with the index's other copy (`table.rs`); a write goes
//! through a [`Resolve`], which finds nodes by probing the table (and records what it found)
//! in the copy written first, or replays those answers in the other copy, so that the replay
//! neither probes nor stores (see `mod.rs`).
//!
//! Invariants (checked by [`Tree::check`]):
//! - a node is live iff it has an entry or a child (an emptied leaf is deleted at once, and its
//!   parent reconsidered); the table finds every live node under its hash;
//! - a location is a holder or an extra of a node, never both; extras have masks other than 0
//!   and group bit 0 alone, sorted by location; `entries` and `speculative` count all entries
//!   and those with the speculative bit;
//! - `children` counts the live nodes whose parent it is; parent links have no cycle;
//! - LRU: a node has a non-zero stamp iff it has entries; the queue holds one record
//!   `(id, stamp)` per such node with its current stamp, in stamp order (oldest first), plus
//!   stale records (a node touched again, or gone), dropped when they outnumber the live ones
//!   (amortized O(1) per touch). Writers touch a chain deepest block first, so a parent is
//!   newer than the children stored with it and eviction, which takes the oldest node with no
//!   children, works from the chains' tails: a location that held a prefix-closed set still
//!   does after an eviction.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::error::{ensure_invariant, Result};
use crate::index::holders::Holders;
use crate::index::location::FixedState;
use crate::index::table::Table;

pub(crate) const NIL: u32 = u32::MAX;

/// The bit of an entry's mask that marks a speculative entry (bits below it are groups).
pub(crate) const SPECULATIVE: u32 = 1 << crate::index::event::MAX_GROUPS;

/// The mask of a holder: group bit 0 alone.
pub(crate) const PLAIN: u32 = 1;

const LIVE: u8 = 1;
const PARENT_KNOWN: u8 = 2;
const HAS_EXTRAS: u8 = 4;

/// Stale LRU records tolerated beyond the live ones before the queue is compacted.
const LRU_SLACK: usize = 1024;

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
    pub fn speculative_at(&self, now: f64) -> bool {
        self.mask & SPECULATIVE != 0 && self.expires > now
    }
}

/// A node (64 bytes).
#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub hash: u128,
    /// LRU stamp; 0 when the node has no entries.
    stamp: u64,
    pub parent: u32,
    pub children: u32,
    pub holders: Holders,
    flags: u8,
}

impl Node {
    /// Whether `parent` is known (a chain's first block has none); a node made for a parent
    /// hash before its own event came has an unknown parent until that event links it.
    pub fn parent_known(&self) -> bool {
        self.flags & PARENT_KNOWN != 0
    }

    #[inline]
    pub fn has_extras(&self) -> bool {
        self.flags & HAS_EXTRAS != 0
    }

    #[inline]
    fn live(&self) -> bool {
        self.flags & LIVE != 0
    }

    fn has_entries(&self) -> bool {
        !self.holders.is_empty() || self.has_extras()
    }
}

/// The parent a stored block names.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Parent {
    /// A chain's first block.
    Root,
    /// The block of this hash (created, without entries, if absent).
    Hash(u128),
    /// A live node (the previous block of the same run).
    Node(u32),
}

/// How a write finds nodes and keeps the shared table (see the module doc).
pub(crate) trait Resolve {
    /// Whether this write stores into the table (not a replay).
    const STORES: bool;
    /// The live node of `hash`.
    fn find(&mut self, tree: &Tree, hash: u128) -> Option<u32>;
    /// Node `id` was created for `hash`.
    fn created(&mut self, tree: &Tree, hash: u128, id: u32);
    /// Node `id` of `hash` was deleted.
    fn deleted(&mut self, tree: &Tree, hash: u128, id: u32);
}

/// The only copy (a load, a restore): probes, stores, and deletes from the table at once.
pub(crate) struct Direct;

impl Resolve for Direct {
    const STORES: bool = true;
    fn find(&mut self, tree: &Tree, hash: u128) -> Option<u32> {
        tree.find(hash)
    }
    fn created(&mut self, tree: &Tree, hash: u128, id: u32) {
        tree.table.insert(hash, id);
    }
    fn deleted(&mut self, tree: &Tree, hash: u128, id: u32) {
        tree.table.remove(hash, id);
    }
}

/// The copy written first: probes and records the answers, stores new nodes, and defers
/// deletions until the other copy has replayed them.
pub(crate) struct Record<'a> {
    pub found: &'a mut Vec<u32>,
    pub deleted: &'a mut Vec<(u128, u32)>,
}

impl Resolve for Record<'_> {
    const STORES: bool = true;
    #[inline]
    fn find(&mut self, tree: &Tree, hash: u128) -> Option<u32> {
        let id = tree.find(hash);
        self.found.push(id.unwrap_or(NIL));
        id
    }
    #[inline]
    fn created(&mut self, tree: &Tree, hash: u128, id: u32) {
        tree.table.insert(hash, id);
    }
    #[inline]
    fn deleted(&mut self, _: &Tree, hash: u128, id: u32) {
        self.deleted.push((hash, id));
    }
}

/// The other copy: the answers the first one recorded, in order; nothing stored.
pub(crate) struct Replay<'a> {
    pub found: &'a [u32],
    pub at: usize,
}

impl Resolve for Replay<'_> {
    const STORES: bool = false;
    #[inline]
    fn find(&mut self, _: &Tree, _: u128) -> Option<u32> {
        // The same operations on an equal copy ask the same questions: `at` stays in range
        // (an out-of-range read would be a bug; it answers "absent", and `check` would see
        // the copies differ).
        let id = self.found.get(self.at).copied().unwrap_or(NIL);
        self.at += 1;
        (id != NIL).then_some(id)
    }
    #[inline]
    fn created(&mut self, _: &Tree, _: u128, _: u32) {}
    #[inline]
    fn deleted(&mut self, _: &Tree, _: u128, _: u32) {}
}

/// Nodes, the shared table, the extras and the LRU queue.
#[derive(Clone)]
pub(crate) struct Tree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    table: Arc<Table>,
    extras: std::collections::HashMap<u32, Vec<Entry>, FixedState>,
    lru: VecDeque<(u32, u64)>,
    tick: u64,
    /// Nodes with entries (a current LRU record each).
    on_lru: usize,
    live: usize,
    pub entries: usize,
    pub speculative: usize,
    /// Words of a bitset over every known location (kept by the state as locations come).
    pub width: usize,
}

impl Tree {
    /// An empty tree with room for `capacity` nodes (reserved and touched up front).
    pub fn with_capacity(capacity: usize) -> Self {
        let mut tree = Self {
            nodes: Vec::new(),
            free: Vec::new(),
            table: Arc::new(Table::with_capacity(capacity)),
            extras: Default::default(),
            lru: VecDeque::new(),
            tick: 0,
            on_lru: 0,
            live: 0,
            entries: 0,
            speculative: 0,
            width: 0,
        };
        tree.reserve(capacity);
        tree
    }

    /// Reserves room for `capacity` nodes in this copy's own vectors, touching the pages (so
    /// that a fresh index does not take its page faults during its first writes).
    pub fn reserve(&mut self, capacity: usize) {
        let more = capacity.saturating_sub(self.nodes.len());
        if more == 0 {
            return;
        }
        self.nodes.reserve(more);
        let at = self.nodes.len();
        let blank = Node {
            hash: 0,
            stamp: 0,
            parent: NIL,
            children: 0,
            holders: Holders::default(),
            flags: 0,
        };
        self.nodes.resize(at + more, blank);
        self.nodes.truncate(at);
        // The queue holds up to about two records per node before it is compacted.
        let records = capacity.saturating_mul(2);
        let at = self.lru.len();
        self.lru.extend(std::iter::repeat_n((NIL, 0), records));
        self.lru.truncate(at);
    }

    /// Live nodes.
    pub fn len(&self) -> usize {
        self.live
    }

    /// The live node of `hash`.
    #[inline]
    pub fn find(&self, hash: u128) -> Option<u32> {
        self.table.find(hash, |id| {
            self.nodes
                .get(id as usize)
                .is_some_and(|n| n.live() && n.hash == hash)
        })
    }

    #[inline]
    pub fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    /// The live node of `hash`, with its id.
    #[inline]
    pub fn get(&self, hash: u128) -> Option<(u32, &Node)> {
        self.find(hash).map(|id| (id, &self.nodes[id as usize]))
    }

    /// Node `id`'s entries other than its holders, sorted by location.
    #[inline]
    pub fn extras(&self, id: u32) -> &[Entry] {
        if self.nodes[id as usize].has_extras() {
            self.extras.get(&id).map_or(&[], |e| &e[..])
        } else {
            &[]
        }
    }

    /// Every entry of node `id`, sorted by location.
    pub fn entries_of(&self, id: u32) -> Vec<Entry> {
        let node = &self.nodes[id as usize];
        let mut out: Vec<Entry> = node
            .holders
            .iter()
            .map(|location| Entry {
                location,
                mask: PLAIN,
                expires: 0.0,
            })
            .collect();
        let extras = self.extras(id);
        if !extras.is_empty() {
            out.extend_from_slice(extras);
            out.sort_by_key(|e| e.location);
        }
        out
    }

    /// Live node ids in LRU order (oldest first), then the nodes without entries.
    pub fn ids_in_order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.live);
        for &(id, stamp) in &self.lru {
            if self.nodes[id as usize].stamp == stamp && stamp != 0 {
                out.push(id);
            }
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if node.live() && node.stamp == 0 {
                out.push(i as u32);
            }
        }
        out
    }

    /// The node of `hash`, created (without entries) if new. A new node, or a live one whose
    /// parent is unknown, is linked under `parent` (a parent hash's node is created if
    /// absent); a link that would close a cycle is not made.
    pub fn get_or_create<R: Resolve>(&mut self, hash: u128, parent: Parent, r: &mut R) -> u32 {
        if let Some(id) = r.find(self, hash) {
            if !self.nodes[id as usize].parent_known() {
                self.link_late(id, parent, r);
            }
            return id;
        }
        let id = self.alloc(hash, r);
        self.nodes[id as usize].flags |= PARENT_KNOWN;
        // `id` is new, so no node descends from it: the link closes no cycle.
        let parent_id = match parent {
            Parent::Root => return id,
            Parent::Node(p) => p,
            Parent::Hash(p) => match r.find(self, p) {
                Some(p) => p,
                None => self.alloc(p, r),
            },
        };
        self.nodes[id as usize].parent = parent_id;
        self.nodes[parent_id as usize].children += 1;
        id
    }

    fn link_late<R: Resolve>(&mut self, id: u32, parent: Parent, r: &mut R) {
        let found = match parent {
            Parent::Root => {
                self.nodes[id as usize].flags |= PARENT_KNOWN;
                return;
            }
            Parent::Node(p) => Some(p),
            Parent::Hash(p) => r.find(self, p),
        };
        if let Some(parent_id) = found {
            // Refuse a link under one of `id`'s own descendants (corrupt input only).
            let mut up = parent_id;
            while up != NIL {
                if up == id {
                    return;
                }
                up = self.nodes[up as usize].parent;
            }
        }
        let parent_id = match (found, parent) {
            (Some(p), _) => p,
            (None, Parent::Hash(p)) => self.alloc(p, r),
            (None, _) => return,
        };
        let node = &mut self.nodes[id as usize];
        node.flags |= PARENT_KNOWN;
        node.parent = parent_id;
        self.nodes[parent_id as usize].children += 1;
    }

    fn alloc<R: Resolve>(&mut self, hash: u128, r: &mut R) -> u32 {
        if R::STORES && self.table.needs_room() {
            self.rebuild_table(2 * (self.live + 1));
        }
        let node = Node {
            hash,
            stamp: 0,
            parent: NIL,
            children: 0,
            holders: Holders::default(),
            flags: LIVE,
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
        self.live += 1;
        r.created(self, hash, id);
        id
    }

    /// Gives this copy a new table holding its live nodes, with room for `capacity` (the
    /// other copy keeps the old one until it is brought level; see `table.rs`).
    pub fn rebuild_table(&mut self, capacity: usize) {
        let live = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.live())
            .map(|(i, n)| (n.hash, i as u32));
        self.table = Arc::new(Table::rebuilt(live, capacity.max(self.live)));
    }

    /// This copy's table (shared with the other copy).
    pub fn table(&self) -> &Arc<Table> {
        &self.table
    }

    /// Takes `table` (the other copy's, once this one is level with it).
    pub fn adopt_table(&mut self, table: Arc<Table>) {
        self.table = table;
    }

    fn extras_mut(&mut self, id: u32) -> &mut Vec<Entry> {
        self.nodes[id as usize].flags |= HAS_EXTRAS;
        self.extras.entry(id).or_default()
    }

    /// Drops node `id`'s extras if none are left.
    fn tidy_extras(&mut self, id: u32) {
        if self.extras.get(&id).is_some_and(|e| e.is_empty()) {
            self.extras.remove(&id);
            self.nodes[id as usize].flags &= !HAS_EXTRAS;
        }
    }

    /// Adds group bits `bits` of `location` to node `id`; a speculative bit there is
    /// confirmed (cleared). Returns whether the entry is new.
    pub fn add_groups(&mut self, id: u32, location: u32, bits: u32) -> bool {
        let width = self.width;
        let node = &mut self.nodes[id as usize];
        if bits == PLAIN && !node.has_extras() {
            // The common case: a holder more (or again).
            let new = node.holders.insert(location, width);
            self.entries += usize::from(new);
            return new;
        }
        if node.holders.contains(location) {
            if bits != PLAIN {
                // A holder gains another group: it becomes an extra.
                node.holders.remove(location, width);
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
                self.nodes[id as usize].holders.insert(location, width);
            }
            return false;
        }
        if bits == PLAIN {
            self.nodes[id as usize].holders.insert(location, width);
        } else {
            self.insert_extra(id, location, bits, 0.0);
        }
        self.entries += 1;
        true
    }

    fn insert_extra(&mut self, id: u32, location: u32, mask: u32, expires: f64) {
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

    /// Marks `location`'s entry at node `id` speculative until `expires`, unless a group
    /// already holds it there. Returns whether the speculative bit was set or extended.
    pub fn add_speculative(&mut self, id: u32, location: u32, expires: f64) -> bool {
        if self.nodes[id as usize].holders.contains(location) {
            return false; // held for real: nothing to predict
        }
        if let Ok(i) = self
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        {
            let entry = &mut self.extras_mut(id)[i];
            if entry.mask & !SPECULATIVE != 0 || expires <= entry.expires {
                return false;
            }
            entry.expires = expires;
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
    pub fn clear_bits<R: Resolve>(
        &mut self,
        id: u32,
        location: u32,
        bits: u32,
        only_expiring: Option<f64>,
        r: &mut R,
    ) -> u32 {
        let width = self.width;
        let node = &mut self.nodes[id as usize];
        if bits & PLAIN != 0 && node.holders.remove(location, width) {
            self.entries -= 1;
            if !node.has_entries() {
                self.collect(id, r);
            }
            return PLAIN;
        }
        let Ok(i) = self
            .extras(id)
            .binary_search_by_key(&location, |e| e.location)
        else {
            return 0;
        };
        let entry = &mut self.extras_mut(id)[i];
        let mut clear = bits & entry.mask;
        if clear & SPECULATIVE != 0 && only_expiring.is_some_and(|t| t != entry.expires) {
            clear &= !SPECULATIVE;
        }
        if clear == 0 {
            return 0;
        }
        entry.mask &= !clear;
        let left = entry.mask;
        if clear & SPECULATIVE != 0 {
            self.speculative -= 1;
        }
        if left == 0 || left == PLAIN {
            self.extras_mut(id).remove(i);
            if left == PLAIN {
                self.nodes[id as usize].holders.insert(location, width);
            } else {
                self.entries -= 1;
            }
            self.tidy_extras(id);
            if !self.nodes[id as usize].has_entries() {
                self.collect(id, r);
            }
        }
        clear
    }

    /// Drops every entry of the locations `drop` says, in every node. Returns how many.
    pub fn drop_locations<R: Resolve>(&mut self, drop: impl Fn(u32) -> bool, r: &mut R) -> usize {
        let width = self.width;
        let mut emptied = Vec::new();
        let mut dropped = 0;
        let mut speculative = 0;
        for i in 0..self.nodes.len() {
            let id = i as u32;
            let node = &mut self.nodes[i];
            if !node.live() || !node.has_entries() {
                continue;
            }
            dropped += node.holders.retain(|l| !drop(l), width);
            if node.has_extras() {
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
            self.collect(id, r);
        }
        dropped
    }

    /// Moves node `id` (which has entries) to the newest end of the LRU.
    #[inline]
    pub fn touch(&mut self, id: u32) {
        self.tick += 1;
        let node = &mut self.nodes[id as usize];
        if node.stamp == 0 {
            self.on_lru += 1;
        }
        node.stamp = self.tick;
        self.lru.push_back((id, self.tick));
        if self.lru.len() > 2 * self.on_lru + LRU_SLACK {
            let nodes = &self.nodes;
            self.lru
                .retain(|&(id, stamp)| nodes[id as usize].stamp == stamp);
        }
    }

    fn leave_lru(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        if node.stamp != 0 {
            node.stamp = 0;
            self.on_lru -= 1;
        }
    }

    /// Evicts the oldest node with no children (a node with children met on the way is moved
    /// to the newest end, so each pass is amortized O(1)). Returns how many entries went.
    pub fn evict_one<R: Resolve>(&mut self, r: &mut R) -> usize {
        let mut budget = self.live;
        while budget > 0 {
            let Some(&(id, stamp)) = self.lru.front() else {
                break;
            };
            if self.nodes[id as usize].stamp != stamp {
                self.lru.pop_front(); // stale
                continue;
            }
            budget -= 1;
            if self.nodes[id as usize].children > 0 {
                self.touch(id);
                continue;
            }
            self.lru.pop_front();
            let node = &mut self.nodes[id as usize];
            let mut gone = node.holders.len();
            node.holders = Holders::default();
            if node.has_extras() {
                let extras = self.extras.remove(&id).unwrap_or_default();
                self.nodes[id as usize].flags &= !HAS_EXTRAS;
                gone += extras.len();
                self.speculative -= extras
                    .iter()
                    .filter(|e| e.mask & SPECULATIVE != 0)
                    .count();
            }
            self.entries -= gone;
            self.collect(id, r);
            return gone;
        }
        0
    }

    /// Node `id` has no entries: leave the LRU; delete it if it has no children either, then
    /// reconsider its parent.
    fn collect<R: Resolve>(&mut self, mut id: u32, r: &mut R) {
        loop {
            let node = &self.nodes[id as usize];
            if !node.live() || node.has_entries() {
                return; // it has entries, or went already (collected through a child)
            }
            self.leave_lru(id);
            let node = &mut self.nodes[id as usize];
            if node.children > 0 {
                return;
            }
            let (hash, parent) = (node.hash, node.parent);
            node.flags = 0;
            node.holders = Holders::default();
            node.parent = NIL;
            self.free.push(id);
            self.live -= 1;
            r.deleted(self, hash, id);
            if parent == NIL {
                return;
            }
            self.nodes[parent as usize].children -= 1;
            id = parent;
        }
    }

    /// A tree of `nodes` in LRU order (oldest first; entry-less ones anywhere): each a hash,
    /// its parent (`None` unknown, `Some(None)` a chain's first block, `Some(Some(i))` the
    /// `i`-th of `nodes`) and its entries, sorted by location. Structural checks are left to
    /// [`Tree::check`] except those restoring needs.
    #[allow(clippy::type_complexity)]
    pub fn restore(
        nodes: Vec<(u128, Option<Option<u32>>, Vec<Entry>)>,
        width: usize,
    ) -> Result<Self> {
        let mut tree = Self::with_capacity(nodes.len());
        tree.width = width;
        let mut parents = Vec::with_capacity(nodes.len());
        for (hash, parent, entries) in nodes {
            ensure_invariant!(tree.find(hash).is_none(), "hash {hash:032x} twice");
            let id = tree.alloc(hash, &mut Direct);
            ensure_invariant!(
                entries.windows(2).all(|p| p[0].location < p[1].location),
                "node {id}: entries not sorted by location"
            );
            for entry in entries {
                ensure_invariant!(entry.mask != 0, "node {id}: an empty entry");
                tree.entries += 1;
                tree.speculative += usize::from(entry.mask & SPECULATIVE != 0);
                if entry.mask == PLAIN {
                    tree.nodes[id as usize].holders.insert(entry.location, width);
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
        Ok(tree)
    }

    /// Checks the module's invariants; `locations` is the number of registered locations.
    pub fn check(&self, locations: usize) -> Result<()> {
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
                .check()
                .map_err(|e| crate::KvPoolError::Invariant(format!("node {id}: {e}")))?;
            ensure_invariant!(
                node.holders.iter().all(|l| (l as usize) < locations),
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
                    !node.holders.contains(entry.location),
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
        ensure_invariant!(live == self.live, "{} live nodes counted, {live} held", self.live);
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
        for &(id, stamp) in &self.lru {
            ensure_invariant!(stamp > last, "LRU records out of stamp order");
            last = stamp;
            on_lru += usize::from(self.nodes.get(id as usize).is_some_and(|n| n.stamp == stamp));
        }
        ensure_invariant!(
            on_lru == with_entries && on_lru == self.on_lru,
            "{on_lru} current LRU records, {with_entries} nodes with entries, {} counted",
            self.on_lru
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
