//! The index's nodes: one per block hash, holding which locations have that block.
//!
//! A location's entry at a node is a mask of the location's groups that hold the block, plus
//! a speculative bit with its expiry. Most entries are exactly group bit 0 (a location with
//! one full-attention group): those are kept as the node's [`Holders`], a set of location ids
//! (an array or a bitset); every other entry (more groups, a speculative bit) is an "extra",
//! kept sorted by location in a side map for the few nodes that have any. Nodes are plain
//! data; a large holder set lives in the tree's [`Sets`]. A node also has its
//! parent (from the chain the hash came in), a count of its children and its LRU stamp.
//!
//! The hash -> id table is shared with the index's other copy (`table.rs`). A write keeps
//! track of what it changes (the nodes, marked once each, the free list's and the LRU
//! queue's ends, the nodes it deleted), so that the other copy is brought level by copying
//! just that from this one ([`Tree::level_with`]) rather than doing the write again.
//!
//! Invariants (checked by [`Tree::check`]):
//! - a node is live iff it has an entry or a child (an emptied leaf is deleted at once, and its
//!   parent reconsidered); the table finds every live node under its hash;
//! - a location is a holder or an extra of a node, never both; extras have masks other than 0
//!   and group bit 0 alone, sorted by location; `entries` and `speculative` count all entries
//!   and those with the speculative bit;
//! - `children` counts the live nodes whose parent it is; parent links have no cycle;
//! - LRU: a node has a non-zero stamp iff it has entries; the queue (from `lru_head` on) holds
//!   one record `(id, stamp)` per such node with its current stamp, in stamp order (oldest
//!   first), plus stale records (a node touched again, or gone), dropped when they outnumber
//!   the live ones (amortized O(1) per touch). Writers touch a chain deepest block first, so a parent is
//!   newer than the children stored with it and eviction, which takes the oldest node with no
//!   children, works from the chains' tails: a location that held a prefix-closed set still
//!   does after an eviction.

mod check;
mod entries;
mod lru;

use std::sync::Arc;

use crate::index::holders::{Holders, Sets, View};
use crate::index::location::FixedState;
use crate::index::table::{Probe, Table, Vacant};

pub(crate) const NIL: u32 = u32::MAX;

/// The bit of an entry's mask that marks a speculative entry (bits below it are groups).
pub(crate) const SPECULATIVE: u32 = 1 << crate::index::event::MAX_GROUPS;

/// The mask of a holder: group bit 0 alone.
pub(crate) const PLAIN: u32 = 1;

const LIVE: u8 = 1;
const PARENT_KNOWN: u8 = 2;
const HAS_EXTRAS: u8 = 4;

/// A table rebuilt for growth or tombstones has room for this many times the live nodes (the
/// rebuild, O(table), then comes after about that many inserts again).
const REBUILD_ROOM: usize = 2;

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
    pub(crate) fn speculative_at(&self, now: f64) -> bool {
        self.mask & SPECULATIVE != 0 && self.expires > now
    }
}

/// A node (64 bytes, plain data: copies are `memcpy`s).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Node {
    pub hash: u128,
    /// LRU stamp; 0 when the node has no entries.
    stamp: u64,
    pub parent: u32,
    pub children: u32,
    pub holders: Holders,
    /// The write that last changed it (see [`Tree::node_mut`]).
    written: u32,
    flags: u8,
}

const BLANK: Node = Node {
    hash: 0,
    stamp: 0,
    parent: NIL,
    children: 0,
    holders: Holders::EMPTY,
    written: 0,
    flags: 0,
};

impl Node {
    /// Whether `parent` is known (a chain's first block has none); a node made for a parent
    /// hash before its own event came has an unknown parent until that event links it.
    pub(crate) fn parent_known(&self) -> bool {
        self.flags & PARENT_KNOWN != 0
    }

    #[inline]
    pub(crate) fn has_extras(&self) -> bool {
        self.flags & HAS_EXTRAS != 0
    }

    #[inline]
    fn live(&self) -> bool {
        self.flags & LIVE != 0
    }

    #[inline]
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

/// What the last write changed, for [`Tree::level_with`].
#[derive(Clone, Debug, Default)]
struct Changes {
    /// Nodes changed below `nodes_start` (each once: see [`Tree::node_mut`]); the nodes from
    /// there on are new and copied whole.
    nodes: Vec<u32>,
    nodes_start: usize,
    /// The free list's length at the write's start, and the least it had since.
    free_low: usize,
    /// The LRU queue's length at the write's start, and whether it was compacted since (then
    /// it is copied whole).
    lru_start: usize,
    lru_compacted: bool,
    /// The write counter wrapped: every node's `written` was reset.
    wrapped: bool,
    /// Nodes deleted, with their hashes: their table entries go once no copy holds them.
    deleted: Vec<(u128, u32)>,
}

/// Nodes, the shared table, the extras and the LRU queue.
#[derive(Clone)]
pub(crate) struct Tree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    sets: Sets,
    table: Arc<Table>,
    extras: std::collections::HashMap<u32, Vec<Entry>, FixedState>,
    /// LRU records; those before `lru_head` are popped.
    lru: Vec<(u32, u64)>,
    lru_head: usize,
    tick: u64,
    /// Nodes with entries (a current LRU record each).
    on_lru: usize,
    live: usize,
    pub entries: usize,
    pub speculative: usize,
    /// Words of a bitset over every known location (kept by the state as locations come).
    pub width: usize,
    /// The current write's number (a node changed by it has `written == write`).
    write: u32,
    changes: Changes,
}

impl Tree {
    /// An empty tree with room for `capacity` nodes (reserved and touched up front).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let mut tree = Self {
            nodes: Vec::new(),
            free: Vec::new(),
            sets: Sets::default(),
            table: Arc::new(Table::with_capacity(capacity)),
            extras: Default::default(),
            lru: Vec::new(),
            lru_head: 0,
            tick: 0,
            on_lru: 0,
            live: 0,
            entries: 0,
            speculative: 0,
            width: 0,
            write: 1,
            changes: Changes::default(),
        };
        tree.reserve(capacity);
        tree
    }

    /// Reserves room for `capacity` nodes in this copy's own vectors, touching the pages (so
    /// that a fresh index does not take its page faults during its first writes).
    pub(crate) fn reserve(&mut self, capacity: usize) {
        let more = capacity.saturating_sub(self.nodes.len());
        if more == 0 {
            return;
        }
        let at = self.nodes.len();
        self.nodes.resize(at + more, BLANK);
        self.nodes.truncate(at);
        // The queue holds up to about two records per node before it is compacted.
        let at = self.lru.len();
        self.lru.resize(at + capacity.saturating_mul(2), (NIL, 0));
        self.lru.truncate(at);
        self.changes.nodes.reserve(1024);
    }

    /// Starts tracking a write's changes (on the copy it writes).
    pub(crate) fn begin_write(&mut self) {
        self.write = self.write.wrapping_add(1);
        self.changes.wrapped = self.write == 0;
        if self.changes.wrapped {
            // Once in 2^32 writes: no node may look changed by a write that has not run.
            for node in &mut self.nodes {
                node.written = 0;
            }
            self.write = 1;
        }
        let c = &mut self.changes;
        c.nodes.clear();
        c.deleted.clear();
        c.nodes_start = self.nodes.len();
        c.free_low = self.free.len();
        c.lru_start = self.lru.len();
        c.lru_compacted = false;
    }

    /// Brings this copy level with `source`, which was equal to it before its last write:
    /// copies what that write changed (see `Changes`). The caller then drops the table
    /// entries of the nodes deleted.
    pub(crate) fn level_with(&mut self, source: &Tree) {
        let c = &source.changes;
        if c.wrapped {
            for node in &mut self.nodes {
                node.written = 0;
            }
        }
        // This copy's nodes are cold (the other copy was written last): ask for them all
        // before copying into any, so that their misses overlap.
        for &id in &c.nodes {
            if let Some(node) = self.nodes.get(id as usize) {
                crate::index::table::prefetch(node);
            }
        }
        let old = c.nodes_start;
        self.nodes.extend_from_slice(&source.nodes[old..]);
        for &id in &c.nodes {
            let i = id as usize;
            let had_extras = self.nodes[i].has_extras();
            let node = source.nodes[i];
            self.nodes[i] = node;
            if had_extras || node.has_extras() || node.holders.slot().is_some() {
                self.level_node(source, i, had_extras);
            }
        }
        for i in old..self.nodes.len() {
            if source.nodes[i].holders.slot().is_some() || source.nodes[i].has_extras() {
                self.level_node(source, i, false);
            }
        }
        // Slots made and freed within the write exist (empty) here too.
        self.sets
            .lists
            .resize_with(source.sets.lists.len(), Vec::new);
        self.sets.bits.resize_with(source.sets.bits.len(), Vec::new);
        self.sets.free_lists.clone_from(&source.sets.free_lists);
        self.sets.free_bits.clone_from(&source.sets.free_bits);
        self.free.truncate(c.free_low);
        self.free.extend_from_slice(&source.free[c.free_low..]);
        if c.lru_compacted {
            self.lru.clone_from(&source.lru);
        } else {
            self.lru.extend_from_slice(&source.lru[c.lru_start..]);
        }
        self.lru_head = source.lru_head;
        self.tick = source.tick;
        self.on_lru = source.on_lru;
        self.live = source.live;
        self.entries = source.entries;
        self.speculative = source.speculative;
        self.width = source.width;
        self.write = source.write;
        if !Arc::ptr_eq(&self.table, &source.table) {
            self.table = Arc::clone(&source.table);
        }
    }

    /// Copies what node `i` names outside the node (its set's slot, its extras) from `source`.
    #[inline]
    fn level_node(&mut self, source: &Tree, i: usize, had_extras: bool) {
        let node = &source.nodes[i];
        match node.holders.slot() {
            Some((false, at)) => self.sets.copy_list(&source.sets, at),
            Some((true, at)) => self.sets.copy_bits(&source.sets, at),
            None => {}
        }
        let id = i as u32;
        if node.has_extras() {
            self.extras
                .entry(id)
                .or_default()
                .clone_from(&source.extras[&id]);
        } else if had_extras {
            self.extras.remove(&id);
        }
    }

    /// Nodes the current (or last) write changed.
    pub(crate) fn changed(&self) -> usize {
        self.changes.nodes.len() + self.nodes.len() - self.changes.nodes_start
    }

    /// The nodes the last write deleted, with their hashes.
    pub(crate) fn deleted(&self) -> &[(u128, u32)] {
        &self.changes.deleted
    }

    /// Tombstones the table entries of `deleted` nodes (a write's, see [`Tree::deleted`]) that
    /// this copy does not hold (again): once no copy a reader can reach holds them (this copy
    /// is the only one, or the other copy is level with it).
    pub(crate) fn drop_deleted(&self, deleted: &[(u128, u32)]) {
        for &(hash, id) in deleted {
            self.table.remove(hash, id, |id| self.valid(id, hash));
        }
    }

    /// Marks node `id` changed by this write (once).
    #[inline]
    fn mark(&mut self, id: u32) {
        let node = &mut self.nodes[id as usize];
        if node.written != self.write {
            node.written = self.write;
            if (id as usize) < self.changes.nodes_start {
                self.changes.nodes.push(id);
            }
        }
    }

    /// Node `id`, to change: marks it changed by this write (once).
    #[inline]
    fn node_mut(&mut self, id: u32) -> &mut Node {
        self.mark(id);
        &mut self.nodes[id as usize]
    }

    /// Live nodes.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// The live node of `hash`.
    #[inline]
    pub(crate) fn find(&self, hash: u128) -> Option<u32> {
        self.table.find(hash, |id| self.valid(id, hash))
    }

    #[inline]
    fn valid(&self, id: u32, hash: u128) -> bool {
        self.nodes
            .get(id as usize)
            .is_some_and(|n| n.live() && n.hash == hash)
    }

    #[inline]
    pub(crate) fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    /// The live node of `hash`, with its id.
    #[inline]
    pub(crate) fn get(&self, hash: u128) -> Option<(u32, &Node)> {
        self.find(hash).map(|id| (id, &self.nodes[id as usize]))
    }

    /// A node's holders, to read.
    #[inline]
    pub(crate) fn holders<'a>(&'a self, node: &'a Node) -> View<'a> {
        node.holders.view(&self.sets)
    }

    /// Whether `location` is a holder of node `id`.
    #[inline]
    fn holds(&self, id: u32, location: u32) -> bool {
        self.nodes[id as usize]
            .holders
            .contains(location, &self.sets)
    }

    /// Node `id`'s entries other than its holders, sorted by location.
    #[inline]
    pub(crate) fn extras(&self, id: u32) -> &[Entry] {
        if self.nodes[id as usize].has_extras() {
            self.extras.get(&id).map_or(&[], |e| &e[..])
        } else {
            &[]
        }
    }

    /// Every entry of node `id`, sorted by location.
    pub(crate) fn entries_of(&self, id: u32) -> Vec<Entry> {
        let node = &self.nodes[id as usize];
        let mut out: Vec<Entry> = node
            .holders
            .iter(&self.sets)
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
    pub(crate) fn ids_in_order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.live);
        for &(id, stamp) in &self.lru[self.lru_head..] {
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

    /// Asks for the table slots of `hashes` (see [`Table::prefetch`]).
    #[inline]
    pub(crate) fn prefetch(&self, hashes: &[crate::hash::BlockHash]) {
        for hash in hashes {
            self.table.prefetch(hash.0);
        }
    }

    /// Asks for the table slot of `hash`.
    #[inline]
    pub(crate) fn prefetch_slot(&self, hash: u128) {
        self.table.prefetch(hash);
    }

    /// Asks for the node the table names for `hash` without confirming it (see
    /// [`Table::candidate`]); returns its id, a hint for [`Tree::get_hinted`].
    #[inline]
    pub(crate) fn prefetch_candidate(&self, hash: u128) -> Option<u32> {
        let id = self.table.candidate(hash)?;
        crate::index::table::prefetch(self.nodes.get(id as usize)?);
        Some(id)
    }

    /// [`Tree::get`], trying `hint` (a [`Tree::prefetch_candidate`] of `hash`, taken any time
    /// before on this copy) first: a live node of this copy with that hash is the one node of
    /// `hash` here, whatever the table holds now; otherwise the table is probed.
    #[inline]
    pub(crate) fn get_hinted(&self, hash: u128, hint: Option<u32>) -> Option<(u32, &Node)> {
        match hint {
            Some(id) if self.valid(id, hash) => Some((id, &self.nodes[id as usize])),
            _ => self.get(hash),
        }
    }

    /// Stores a run of consecutive blocks `hashes` at `location` under group bit `bits`, the
    /// first one's parent `parent` (`None`: a chain's first block): each block's node is
    /// created if new and linked (see [`Tree::get_or_create`]) and gets the bit (see
    /// [`Tree::add_groups`]); then the run is touched deepest block first, so that parents end
    /// up newer than their children. `ids` (scratch) ends holding the run's nodes.
    pub(crate) fn store_run(
        &mut self,
        hashes: &[crate::hash::BlockHash],
        parent: Option<u128>,
        location: u32,
        bits: u32,
        ids: &mut Vec<u32>,
    ) {
        ids.clear();
        // Room for the whole run (and a parent) first: no table rebuild inside the loop.
        if self.table.needs_room_for(hashes.len() + 1) {
            self.rebuild_table(REBUILD_ROOM * (self.live + hashes.len() + 1));
        }
        ids.reserve(hashes.len());
        self.lru.reserve(hashes.len());
        let mut up = parent.map_or(Parent::Root, Parent::Hash);
        for hash in hashes {
            let hash = hash.0;
            let id = match self.table.probe(hash, |id| self.valid(id, hash)) {
                Probe::Found(id) => {
                    if !self.nodes[id as usize].parent_known() {
                        self.link_late(id, up);
                    }
                    self.add_groups(id, location, bits);
                    id
                }
                Probe::Vacant(vacant) => match up {
                    // The common case: a new block of a plain location under the run's
                    // previous block (or at a chain's root), its node written whole at once.
                    Parent::Node(_) | Parent::Root if bits == PLAIN => {
                        let parent = match up {
                            Parent::Node(p) => p,
                            _ => NIL,
                        };
                        let id = self.alloc_node(
                            vacant,
                            Node {
                                hash,
                                written: self.write,
                                flags: LIVE | PARENT_KNOWN,
                                parent,
                                holders: Holders::one(location),
                                ..BLANK
                            },
                        );
                        self.entries += 1;
                        if parent != NIL {
                            self.node_mut(parent).children += 1;
                        }
                        id
                    }
                    _ => {
                        let id = self.alloc_at(vacant, hash);
                        if bits == PLAIN {
                            // A new node's first holder.
                            self.nodes[id as usize].holders = Holders::one(location);
                            self.entries += 1;
                        } else {
                            self.add_groups(id, location, bits);
                        }
                        self.link_new(id, up);
                        id
                    }
                },
            };
            ids.push(id);
            up = Parent::Node(id);
        }
        for &id in ids.iter().rev() {
            self.stamp(id);
        }
        self.compact_lru();
    }

    /// The node of `hash`, created (without entries) if new. A new node, or a live one whose
    /// parent is unknown, is linked under `parent` (a parent hash's node is created if
    /// absent); a link that would close a cycle is not made.
    pub(crate) fn get_or_create(&mut self, hash: u128, parent: Parent) -> u32 {
        match self.probe(hash) {
            Probe::Found(id) => {
                if !self.nodes[id as usize].parent_known() {
                    self.link_late(id, parent);
                }
                id
            }
            Probe::Vacant(vacant) => {
                let id = self.alloc_at(vacant, hash);
                self.link_new(id, parent);
                id
            }
        }
    }

    /// Links new node `id` under `parent` (a parent hash's node is created if absent).
    #[inline]
    fn link_new(&mut self, id: u32, parent: Parent) {
        // `id` is new, so no node descends from it: the link closes no cycle.
        let parent_id = match parent {
            Parent::Root => {
                self.nodes[id as usize].flags |= PARENT_KNOWN;
                return;
            }
            Parent::Node(p) => p,
            Parent::Hash(p) => match self.probe(p) {
                Probe::Found(p) => p,
                Probe::Vacant(vacant) => self.alloc_at(vacant, p),
            },
        };
        let node = &mut self.nodes[id as usize];
        node.flags |= PARENT_KNOWN;
        node.parent = parent_id;
        self.node_mut(parent_id).children += 1;
    }

    /// Where `hash` is in the table, making room first.
    #[inline]
    fn probe(&mut self, hash: u128) -> Probe {
        if self.table.needs_room_for(1) {
            self.rebuild_table(REBUILD_ROOM * (self.live + 1));
        }
        self.table.probe(hash, |id| self.valid(id, hash))
    }

    fn link_late(&mut self, id: u32, parent: Parent) {
        let found = match parent {
            Parent::Root => {
                self.node_mut(id).flags |= PARENT_KNOWN;
                return;
            }
            Parent::Node(p) => Probe::Found(p),
            Parent::Hash(p) => self.probe(p),
        };
        if let Probe::Found(parent_id) = found {
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
            (Probe::Found(p), _) => p,
            (Probe::Vacant(vacant), Parent::Hash(p)) => self.alloc_at(vacant, p),
            (Probe::Vacant(_), _) => return,
        };
        let node = self.node_mut(id);
        node.flags |= PARENT_KNOWN;
        node.parent = parent_id;
        self.node_mut(parent_id).children += 1;
    }

    /// A new node for `hash`, entered in the table where a probe just made said.
    #[inline(always)]
    fn alloc_at(&mut self, vacant: Vacant, hash: u128) -> u32 {
        let node = Node {
            hash,
            written: self.write,
            flags: LIVE,
            ..BLANK
        };
        self.alloc_node(vacant, node)
    }

    /// A new node `node` (live, `written` by this write), entered in the table where a probe
    /// of its hash just made said.
    #[inline(always)]
    fn alloc_node(&mut self, vacant: Vacant, node: Node) -> u32 {
        let id = match self.free.pop() {
            Some(id) => {
                self.changes.free_low = self.changes.free_low.min(self.free.len());
                self.nodes[id as usize] = node;
                if (id as usize) < self.changes.nodes_start {
                    self.changes.nodes.push(id);
                }
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.live += 1;
        self.table.insert_at(vacant, id);
        id
    }

    /// Gives this copy a new table holding its live nodes, with room for `capacity` (the
    /// other copy keeps the old one until it is brought level; see `table.rs`).
    pub(crate) fn rebuild_table(&mut self, capacity: usize) {
        let live = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.live())
            .map(|(i, n)| (n.hash, i as u32));
        self.table = Arc::new(Table::rebuilt(live, capacity.max(self.live)));
    }
}
