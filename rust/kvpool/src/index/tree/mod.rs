//! The index's nodes: one per block hash, holding which locations have that block.
//!
//! A location's entry at a node is a mask of the location's groups that hold the block, plus
//! a speculative bit with its expiry. Most entries are exactly group bit 0 (a location with
//! one full-attention group): those are kept as the node's [`Holders`], a set of location ids
//! (inline, an array or a bitset); every other entry (more groups, a speculative bit) is an
//! "extra", kept sorted by location in a side map for the few nodes that have any.
//!
//! The state is split by who reads it:
//! - [`Nodes`], one per copy of the index (readers walk the published one): per node a
//!   24-byte record ([`Rec`]: the hash, the packed holder set and two flags), the holder sets
//!   too large to be inline, the extras, and the hash -> id table, which is shared with the
//!   other copy (`table.rs`);
//! - [`Links`], the writer's alone (readers never look at them, so there is one): per node its
//!   parent, a count of its children and its place in the LRU list (16 bytes), the free ids
//!   and what the current write changed.
//!
//! A write changes the unpublished copy's records through a [`Tree`] (the copy and the links
//! together) and lists the records it changes, so that the other copy is brought level by
//! copying just those from this one ([`Nodes::level_with`]) rather than doing the write again.
//! Nodes deleted by a write keep their table entries until the other copy is level too.
//!
//! Invariants (checked by [`Tree::check`]):
//! - a node is live iff it has an entry or a child (an emptied leaf is deleted at once, and its
//!   parent reconsidered); the table finds every live node under its hash; a free record is
//!   all zero;
//! - a location is a holder or an extra of a node, never both; extras have masks other than 0
//!   and group bit 0 alone, sorted by location; `entries` and `speculative` count all entries
//!   and those with the speculative bit;
//! - `children` counts the live nodes whose parent it is; parent links have no cycle;
//! - LRU: the list (oldest first) holds exactly the nodes with entries. Writers touch a chain
//!   deepest block first, so a parent is newer than the children stored with it and eviction,
//!   which takes the oldest node with no children, works from the chains' tails: a location
//!   that held a prefix-closed set still does after an eviction.

mod check;
mod entries;
mod level;
mod lru;

use std::sync::Arc;

use crate::index::chunked::Chunked;
use crate::index::holders::{Holders, Sets, View};
use crate::index::location::FixedState;
use crate::index::table::{Probe, Table, Vacant};

pub(crate) const NIL: u32 = u32::MAX;
/// A parent not known yet (a node made for a parent hash before its own event came).
pub(crate) const UNKNOWN: u32 = u32::MAX - 1;
/// `Meta::prev` of a node that is not on the LRU list.
const OFF: u32 = u32::MAX - 1;
/// Node ids stay below this (the two values above are markers).
const MAX_NODES: usize = (u32::MAX - 1) as usize;

/// The bit of an entry's mask that marks a speculative entry (bits below it are groups).
pub(crate) const SPECULATIVE: u32 = 1 << crate::index::event::MAX_GROUPS;

/// The mask of a holder: group bit 0 alone.
pub(crate) const PLAIN: u32 = 1;

/// Record flag bits (above the 62 bits of the holder set).
const LIVE: u64 = 1 << 62;
const HAS_EXTRAS: u64 = 1 << 63;

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

/// A node's record in one copy (24 bytes, plain data): what a reader needs of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Rec {
    lo: u64,
    hi: u64,
    /// The holder set (low 62 bits), [`LIVE`] and [`HAS_EXTRAS`].
    word: u64,
}

impl Rec {
    #[inline]
    pub(crate) fn hash(&self) -> u128 {
        u128::from(self.hi) << 64 | u128::from(self.lo)
    }

    #[inline]
    fn is(&self, hash: u128) -> bool {
        self.lo == hash as u64 && self.hi == (hash >> 64) as u64
    }

    #[inline]
    pub(crate) fn holders(&self) -> Holders {
        Holders::from_word(self.word)
    }

    #[inline]
    fn set_holders(&mut self, holders: Holders) {
        self.word = self.word & !Holders::MASK | holders.word();
    }

    #[inline]
    pub(crate) fn has_extras(&self) -> bool {
        self.word & HAS_EXTRAS != 0
    }

    #[inline]
    fn live(&self) -> bool {
        self.word & LIVE != 0
    }

    #[inline]
    fn has_entries(&self) -> bool {
        self.word & (Holders::MASK | HAS_EXTRAS) != 0
    }
}

/// A node's links, the writer's own (16 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Meta {
    /// The parent node, [`NIL`] for a chain's first block, [`UNKNOWN`] until known.
    parent: u32,
    children: u32,
    /// The LRU neighbours (older, newer); `prev == OFF` when not on the list.
    prev: u32,
    next: u32,
}

const BLANK: Meta = Meta {
    parent: UNKNOWN,
    children: 0,
    prev: OFF,
    next: NIL,
};

impl Default for Meta {
    fn default() -> Self {
        BLANK
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

/// What the last write changed, for [`Nodes::level_with`].
#[derive(Clone, Debug, Default)]
pub(crate) struct Changes {
    /// Records changed below `nodes_start` (some maybe more than once); the records from there
    /// on are new and copied whole.
    nodes: Vec<u32>,
    nodes_start: usize,
    /// Nodes deleted, with their hashes: their table entries go once no copy holds them.
    deleted: Vec<(u128, u32)>,
}

/// One copy's nodes (see the module doc): what readers walk.
#[derive(Clone)]
pub(crate) struct Nodes {
    recs: Chunked<Rec>,
    sets: Sets,
    table: Arc<Table>,
    extras: std::collections::HashMap<u32, Vec<Entry>, FixedState>,
    /// Live nodes.
    live: usize,
    pub entries: usize,
    pub speculative: usize,
    /// Words of a bitset over every known location (kept by the state as locations come).
    pub width: usize,
}

/// The writer's own state of the tree (see the module doc).
#[derive(Clone, Debug)]
pub(crate) struct Links {
    meta: Chunked<Meta>,
    free: Vec<u32>,
    /// The LRU list's oldest and newest nodes.
    head: u32,
    tail: u32,
    on_lru: usize,
    changes: Changes,
}

/// A write's view: one copy's nodes and the links.
pub(crate) struct Tree<'a> {
    pub(crate) nodes: &'a mut Nodes,
    links: &'a mut Links,
}

impl Nodes {
    /// An empty copy.
    pub(crate) fn new() -> Self {
        Self {
            recs: Chunked::default(),
            sets: Sets::default(),
            table: Arc::new(Table::with_capacity(0)),
            extras: Default::default(),
            live: 0,
            entries: 0,
            speculative: 0,
            width: 0,
        }
    }

    /// Live nodes.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Bytes this copy holds (capacity, not length), by part; the shared table once.
    pub(crate) fn bytes(&self) -> [(&'static str, usize); 4] {
        let lists: usize = self.sets.lists.iter().map(|l| l.capacity() * 4 + 24).sum();
        let bits: usize = self.sets.bits.iter().map(|l| l.capacity() * 8 + 24).sum();
        let extras: usize = self.extras.values().map(|e| e.capacity() * 24 + 40).sum();
        [
            ("records", self.recs.bytes()),
            ("sets", lists + bits),
            ("extras", extras),
            ("table", self.table.bytes()),
        ]
    }

    /// The hash table (shared with the other copy while both are level).
    pub(crate) fn table(&self) -> &Arc<Table> {
        &self.table
    }

    /// The ids of the live nodes.
    pub(crate) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.recs.len() as u32).filter(|&id| self.recs[id as usize].live())
    }

    /// The live node of `hash`.
    #[inline]
    pub(crate) fn find(&self, hash: u128) -> Option<u32> {
        self.table.find(hash, |id| self.valid(id, hash))
    }

    #[inline]
    fn valid(&self, id: u32, hash: u128) -> bool {
        self.recs
            .get(id as usize)
            .is_some_and(|r| r.live() && r.is(hash))
    }

    #[inline]
    pub(crate) fn rec(&self, id: u32) -> &Rec {
        &self.recs[id as usize]
    }

    /// The live node of `hash`, with its id.
    #[inline]
    pub(crate) fn get(&self, hash: u128) -> Option<(u32, &Rec)> {
        self.find(hash).map(|id| (id, &self.recs[id as usize]))
    }

    /// A node's holders, to read.
    #[inline]
    pub(crate) fn holders(&self, rec: &Rec) -> View<'_> {
        rec.holders().view(&self.sets)
    }

    /// Node `id`'s entries other than its holders, sorted by location.
    #[inline]
    pub(crate) fn extras(&self, id: u32) -> &[Entry] {
        if self.recs[id as usize].has_extras() {
            self.extras.get(&id).map_or(&[], |e| &e[..])
        } else {
            &[]
        }
    }

    /// Every entry of node `id`, sorted by location.
    pub(crate) fn entries_of(&self, id: u32) -> Vec<Entry> {
        let rec = &self.recs[id as usize];
        let mut out: Vec<Entry> = rec
            .holders()
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
    /// [`Table::candidate`]); returns its id, a hint for [`Nodes::get_hinted`].
    #[inline]
    pub(crate) fn prefetch_candidate(&self, hash: u128) -> Option<u32> {
        let id = self.table.candidate(hash)?;
        crate::index::table::prefetch(self.recs.get(id as usize)?);
        Some(id)
    }

    /// [`Nodes::get`], trying `hint` (a [`Nodes::prefetch_candidate`] of `hash`, taken any time
    /// before on this copy) first: a live node of this copy with that hash is the one node of
    /// `hash` here, whatever the table holds now; otherwise the table is probed.
    #[inline]
    pub(crate) fn get_hinted(&self, hash: u128, hint: Option<u32>) -> Option<(u32, &Rec)> {
        match hint {
            Some(id) if self.valid(id, hash) => Some((id, &self.recs[id as usize])),
            _ => self.get(hash),
        }
    }
}

impl Default for Links {
    fn default() -> Self {
        Self {
            meta: Chunked::default(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            on_lru: 0,
            changes: Changes::default(),
        }
    }
}

impl Links {
    /// Starts tracking a write's changes; `nodes` is the number of node records.
    pub(crate) fn begin_write(&mut self) {
        let c = &mut self.changes;
        c.nodes.clear();
        c.deleted.clear();
        c.nodes_start = self.meta.len();
    }

    /// Bytes the links hold (capacity).
    pub(crate) fn bytes(&self) -> usize {
        self.meta.bytes() + self.free.capacity() * 4
    }

    pub(crate) fn changes(&self) -> &Changes {
        &self.changes
    }

    /// Records the current write changed.
    pub(crate) fn changed(&self) -> usize {
        self.changes.nodes.len() + self.meta.len() - self.changes.nodes_start
    }

    /// The nodes the last write deleted, with their hashes.
    pub(crate) fn deleted(&self) -> &[(u128, u32)] {
        &self.changes.deleted
    }

    /// Live node ids in LRU order (oldest first), then the nodes without entries by id.
    pub(crate) fn ids_in_order(&self, nodes: &Nodes) -> Vec<u32> {
        let mut out = Vec::with_capacity(nodes.live);
        let mut at = self.head;
        while at != NIL && out.len() <= self.meta.len() {
            out.push(at);
            at = self.meta[at as usize].next;
        }
        for (i, rec) in nodes.recs.iter().enumerate() {
            if rec.live() && !rec.has_entries() {
                out.push(i as u32);
            }
        }
        out
    }

    /// Node `id`'s parent: `None` unknown, `Some(None)` a chain's first block.
    pub(crate) fn parent(&self, id: u32) -> Option<Option<u32>> {
        match self.meta[id as usize].parent {
            UNKNOWN => None,
            NIL => Some(None),
            p => Some(Some(p)),
        }
    }
}

impl<'a> Tree<'a> {
    pub(crate) fn new(nodes: &'a mut Nodes, links: &'a mut Links) -> Self {
        Self { nodes, links }
    }

    /// Lists record `id` as changed by this write (ids from `nodes_start` on are new and
    /// copied whole).
    #[inline]
    fn mark(&mut self, id: u32) {
        if (id as usize) < self.links.changes.nodes_start {
            self.links.changes.nodes.push(id);
        }
    }

    /// Record `id`, to change: lists it.
    #[inline]
    fn rec_mut(&mut self, id: u32) -> &mut Rec {
        self.mark(id);
        &mut self.nodes.recs[id as usize]
    }

    #[inline]
    fn meta(&mut self, id: u32) -> &mut Meta {
        &mut self.links.meta[id as usize]
    }

    /// The live node of `hash`.
    #[inline]
    pub(crate) fn find(&self, hash: u128) -> Option<u32> {
        self.nodes.find(hash)
    }

    /// Whether `location` is a holder of node `id`.
    #[inline]
    fn holds(&self, id: u32, location: u32) -> bool {
        self.nodes.recs[id as usize]
            .holders()
            .contains(location, &self.nodes.sets)
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
        self.make_room(hashes.len() + 1);
        ids.reserve(hashes.len());
        let mut up = parent.map_or(Parent::Root, Parent::Hash);
        for hash in hashes {
            let hash = hash.0;
            let id = match self
                .nodes
                .table
                .probe(hash, |id| self.nodes.valid(id, hash))
            {
                Probe::Found(id) => {
                    if self.links.meta[id as usize].parent == UNKNOWN {
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
                        let id = self.alloc_node(vacant, hash, Holders::one(location), parent);
                        self.nodes.entries += 1;
                        if parent != NIL {
                            self.meta(parent).children += 1;
                        }
                        id
                    }
                    _ => {
                        let id = self.alloc_at(vacant, hash);
                        if bits == PLAIN {
                            // A new node's first holder.
                            self.nodes.recs[id as usize].set_holders(Holders::one(location));
                            self.nodes.entries += 1;
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
            self.touch(id);
        }
    }

    /// The node of `hash`, created (without entries) if new. A new node, or a live one whose
    /// parent is unknown, is linked under `parent` (a parent hash's node is created if
    /// absent); a link that would close a cycle is not made.
    pub(crate) fn get_or_create(&mut self, hash: u128, parent: Parent) -> u32 {
        match self.probe(hash) {
            Probe::Found(id) => {
                if self.links.meta[id as usize].parent == UNKNOWN {
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
                self.meta(id).parent = NIL;
                return;
            }
            Parent::Node(p) => p,
            Parent::Hash(p) => match self.probe(p) {
                Probe::Found(p) => p,
                Probe::Vacant(vacant) => self.alloc_at(vacant, p),
            },
        };
        self.meta(id).parent = parent_id;
        self.meta(parent_id).children += 1;
    }

    /// Where `hash` is in the table, making room first.
    #[inline]
    fn probe(&mut self, hash: u128) -> Probe {
        self.make_room(1);
        self.nodes
            .table
            .probe(hash, |id| self.nodes.valid(id, hash))
    }

    /// Rebuilds the table first if `inserts` more would fill more than three quarters of its
    /// slots (tombstones included): into one where the live nodes and the inserts take a
    /// quarter to a half of the slots (then it grows to three quarters before the next).
    #[inline]
    fn make_room(&mut self, inserts: usize) {
        if self.nodes.table.needs_room_for(inserts) {
            self.nodes.rebuild_table(self.nodes.live + inserts);
        }
    }

    fn link_late(&mut self, id: u32, parent: Parent) {
        let found = match parent {
            Parent::Root => {
                self.meta(id).parent = NIL;
                return;
            }
            Parent::Node(p) => Probe::Found(p),
            Parent::Hash(p) => self.probe(p),
        };
        if let Probe::Found(parent_id) = found {
            // Refuse a link under one of `id`'s own descendants (corrupt input only).
            let mut up = parent_id;
            while up != NIL && up != UNKNOWN {
                if up == id {
                    return;
                }
                up = self.links.meta[up as usize].parent;
            }
        }
        let parent_id = match (found, parent) {
            (Probe::Found(p), _) => p,
            (Probe::Vacant(vacant), Parent::Hash(p)) => self.alloc_at(vacant, p),
            (Probe::Vacant(_), _) => return,
        };
        self.meta(id).parent = parent_id;
        self.meta(parent_id).children += 1;
    }

    /// A new node for `hash` (no entries, parent unknown), entered in the table where a probe
    /// just made said.
    #[inline(always)]
    fn alloc_at(&mut self, vacant: Vacant, hash: u128) -> u32 {
        self.alloc_node(vacant, hash, Holders::EMPTY, UNKNOWN)
    }

    /// A new live node of `hash` with `holders` under `parent`, entered in the table where a
    /// probe of its hash just made said. The caller counts the entries and the parent's child.
    #[inline(always)]
    fn alloc_node(&mut self, vacant: Vacant, hash: u128, holders: Holders, parent: u32) -> u32 {
        let rec = Rec {
            lo: hash as u64,
            hi: (hash >> 64) as u64,
            word: LIVE | holders.word(),
        };
        let meta = Meta { parent, ..BLANK };
        let id = match self.links.free.pop() {
            Some(id) => {
                self.nodes.recs[id as usize] = rec;
                self.links.meta[id as usize] = meta;
                self.mark(id);
                id
            }
            None => {
                assert!(
                    self.links.meta.len() < MAX_NODES,
                    "index: node ids exhausted"
                );
                self.nodes.recs.push(rec);
                self.links.meta.push(meta);
                (self.links.meta.len() - 1) as u32
            }
        };
        self.nodes.live += 1;
        self.nodes.table.insert_at(vacant, id);
        id
    }
}
