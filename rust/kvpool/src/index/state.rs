//! One copy of the index's state and the writer's operations on it.
//!
//! A write validates everything first (`Err` changes nothing), then changes this copy and the
//! writer's links (`tree/mod.rs`). The other copy, equal before the write, is brought level
//! afterwards by [`IndexState::level_with`]: it copies the node records the write changed (the
//! links list them) and replays the write's [`Journal`] of the small steps elsewhere
//! (sequence states, locations and groups, expiry records). No validation, sequence check,
//! hash probe or table store is done twice; the copies end equal (same node slots), as
//! [`crate::KVIndex::check`] verifies.
//!
//! Invariants (checked by [`IndexState::check`]): those of the tree (with the links), the
//! locations and the expiry heap; every entry's group bits are groups of its location; after
//! every operation the entries number at most `max_entries` (eviction, see `tree/lru.rs`); at
//! most `MAX_LOCATIONS` locations (a holder set's ids have 29 bits).

use std::collections::HashMap;

use crate::error::{ensure_arg, ensure_invariant, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::index::event::{EventKind, GroupKind, IndexEvent, Medium};
use crate::index::expiry::{Due, Expiry};
use crate::index::holders::MAX_LOCATIONS;
use crate::index::location::{FixedState, LocationKey, Locations};
use crate::index::sequence::{Cursor, Gap, SourceState, Sources, Verdict};
use crate::index::tree::{Changes, Links, Nodes, Parent, Tree, SPECULATIVE};

/// Settings of an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// The most entries (one block hash at one location) the index keeps; beyond it the
    /// least-recently stored chains are evicted from their tails.
    pub max_entries: usize,
    /// Seed of the chained hashes that token-id lookups compute (R6); must be the pools'.
    pub hash_seed: u64,
    /// Writers: the index is split by instance into this many shards, each with its own
    /// writer, so that batches of instances of different shards apply concurrently (1: one
    /// writer). `max_entries` is split evenly among them, each evicting from its own LRU.
    pub writers: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_entries: 1 << 24,
            hash_seed: crate::DEFAULT_HASH_SEED,
            writers: 1,
        }
    }
}

/// What one `apply` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Events applied.
    pub applied: usize,
    /// Events skipped as already applied (their number was below the source's last).
    pub duplicates: usize,
    /// Events dropped because their source is stalled at a gap.
    pub dropped: usize,
    /// Gaps this call opened (each source once until it resumes or is resynced).
    pub gaps: Vec<Gap>,
    /// Entries evicted to keep the memory bound.
    pub evicted: usize,
}

/// Counters over the index's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexCounters {
    /// Events applied.
    pub events_applied: u64,
    /// Events ignored because their sequence number was already applied.
    pub duplicates: u64,
    /// Events dropped (unknown parent, bad group, or over capacity).
    pub dropped: u64,
    /// Gaps found in a source's sequence numbers.
    pub gaps: u64,
    /// Entries evicted to stay under `max_entries`.
    pub evicted_entries: u64,
    /// Speculative entries expired without confirmation.
    pub expired_entries: u64,
    /// Speculative entries inserted.
    pub speculative_inserted: u64,
}

impl IndexCounters {
    /// Adds `other`'s counts to these.
    pub(crate) fn add(&mut self, other: &IndexCounters) {
        self.events_applied += other.events_applied;
        self.duplicates += other.duplicates;
        self.dropped += other.dropped;
        self.gaps += other.gaps;
        self.evicted_entries += other.evicted_entries;
        self.expired_entries += other.expired_entries;
        self.speculative_inserted += other.speculative_inserted;
    }
}

/// A step of a write outside the tree, as the journal keeps it for the other copy.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step {
    /// A source's sequence state after an event.
    Source(SourceState),
    /// The sequence state of (instance, dp rank), or of every rank, was dropped.
    Forget {
        instance: u64,
        dp_rank: Option<u32>,
    },
    Register(LocationKey),
    Group {
        location: u32,
        group: u32,
        kind: GroupKind,
    },
    ExpiryPush(Due),
    /// Every expiry record due at `now` was popped.
    ExpiryPop {
        now: f64,
    },
}

/// A write's steps outside the tree, and the writer's scratch space.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    pub steps: Vec<Step>,
    /// The expiry heap was rebuilt: the other copy copies it (and skips the expiry steps).
    pub expiry_rebuilt: bool,
    /// The node ids of the blocks of one event (reused).
    ids: Vec<u32>,
}

impl Journal {
    pub(crate) fn clear(&mut self) {
        self.steps.clear();
        self.expiry_rebuilt = false;
    }
}

/// One copy of the index.
#[derive(Clone)]
pub(crate) struct IndexState {
    pub config: IndexConfig,
    pub hasher: BlockHasher,
    pub tree: Nodes,
    pub locations: Locations,
    pub sources: Sources,
    pub expiry: Expiry,
    pub counters: IndexCounters,
}

/// The location and group bit of the last stored event, reused by the next one of the batch.
type Resolved = Option<(LocationKey, u32, GroupKind, u32, u32)>;

impl IndexState {
    pub(crate) fn new(config: IndexConfig) -> Result<Self> {
        ensure_arg!(
            config.max_entries >= 1,
            "max_entries",
            "must be >= 1, got 0"
        );
        Ok(Self {
            config,
            hasher: BlockHasher::new(config.hash_seed),
            tree: Nodes::new(),
            locations: Locations::default(),
            sources: Sources::default(),
            expiry: Expiry::default(),
            counters: IndexCounters::default(),
        })
    }

    /// Brings this copy level with `source`, which was equal to it before its last write,
    /// that write's `journal` and tree `changes`.
    pub(crate) fn level_with(
        &mut self,
        source: &IndexState,
        journal: &Journal,
        changes: &Changes,
    ) -> Result<()> {
        for step in &journal.steps {
            match *step {
                Step::Source(state) => self.sources.restore(state),
                Step::Forget { instance, dp_rank } => self.sources.forget(instance, dp_rank),
                Step::Register(key) => {
                    self.locations.register(key);
                }
                Step::Group {
                    location,
                    group,
                    kind,
                } => {
                    self.locations.add_group(location, group, kind)?;
                }
                Step::ExpiryPush(due) if !journal.expiry_rebuilt => self.expiry.push(due),
                Step::ExpiryPop { now } if !journal.expiry_rebuilt => {
                    while self.expiry.pop_due(now).is_some() {}
                }
                Step::ExpiryPush(_) | Step::ExpiryPop { .. } => {}
            }
        }
        if journal.expiry_rebuilt {
            self.expiry.clone_from(&source.expiry);
        }
        self.tree.level_with(&source.tree, changes);
        self.counters = source.counters;
        Ok(())
    }

    /// The id of location `key`, registered if new.
    fn location_id(&mut self, key: LocationKey, journal: &mut Journal) -> u32 {
        if let Some(id) = self.locations.find(&key) {
            return id;
        }
        journal.steps.push(Step::Register(key));
        let id = self.locations.register(key);
        self.tree.width = self.locations.width();
        id
    }

    /// The mask bit of group (`group`, `kind`) at `location`, registered if new.
    fn group_bit(
        &mut self,
        location: u32,
        group: u32,
        kind: GroupKind,
        journal: &mut Journal,
    ) -> Result<u32> {
        if let Some(bit) = self.locations.group_bit(location, group, kind) {
            return Ok(bit);
        }
        journal.steps.push(Step::Group {
            location,
            group,
            kind,
        });
        self.locations.add_group(location, group, kind)
    }

    fn validate_batch(&self, instance: u64, events: &[IndexEvent]) -> Result<()> {
        // New groups per location, so that a batch that would overflow one fails whole.
        let mut new_groups: HashMap<LocationKey, Vec<(u32, GroupKind)>, FixedState> =
            HashMap::default();
        let mut known: Option<(LocationKey, u32, GroupKind)> = None;
        for event in events {
            event.validate()?;
            if !matches!(event.kind, EventKind::Stored | EventKind::Group) {
                continue;
            }
            let key = location_key(instance, event);
            let group = (event.group, event.group_kind);
            if known == Some((key, group.0, group.1)) {
                continue;
            }
            let exists = self
                .locations
                .find(&key)
                .is_some_and(|id| self.locations.group_bit(id, group.0, group.1).is_some());
            if exists {
                known = Some((key, group.0, group.1));
                continue;
            }
            let pending = new_groups.entry(key).or_default();
            if pending.contains(&group) {
                continue;
            }
            ensure_arg!(
                self.locations
                    .can_add_group(&key, group.0, group.1, pending.len()),
                "group",
                "location {key:?} would hold more than {} groups",
                crate::index::event::MAX_GROUPS
            );
            pending.push(group);
        }
        let fresh = new_groups
            .keys()
            .filter(|k| self.locations.find(k).is_none())
            .count();
        ensure_arg!(
            self.locations.len() + fresh <= MAX_LOCATIONS,
            "instance",
            "the index holds at most {MAX_LOCATIONS} locations"
        );
        Ok(())
    }

    /// Applies `instance`'s events in order (see `sequence.rs` for gaps and duplicates).
    pub(crate) fn apply(
        &mut self,
        links: &mut Links,
        instance: u64,
        events: &[IndexEvent],
        journal: &mut Journal,
    ) -> Result<ApplyReport> {
        self.validate_batch(instance, events)?;
        // The table slots of every block first, then the nodes that exist (removals, a run's
        // parent): their cache misses overlap instead of coming one by one.
        for event in events {
            self.tree.prefetch(&event.block_hashes);
            if let Some(parent) = event.parent_hash {
                self.tree.prefetch_slot(parent.0);
            }
        }
        for event in events {
            match event.kind {
                EventKind::Removed => {
                    for hash in &event.block_hashes {
                        let _ = self.tree.prefetch_candidate(hash.0);
                    }
                }
                EventKind::Stored => {
                    if let Some(parent) = event.parent_hash {
                        let _ = self.tree.prefetch_candidate(parent.0);
                    }
                }
                EventKind::Cleared | EventKind::Group => {}
            }
        }
        let mut report = ApplyReport::default();
        let mut last: Resolved = None;
        // The source of the events in turn, its state read once per run of its events (a
        // batch is mostly one source's): only a run's final state goes to the journal.
        let mut cursor: Option<Cursor> = None;
        for event in events {
            if let Some(sequence) = event.sequence {
                if let Some(done) = cursor.filter(|c| c.dp_rank != event.dp_rank) {
                    journal
                        .steps
                        .extend(self.sources.close(done).map(Step::Source));
                    cursor = None;
                }
                let sources = &self.sources;
                let run =
                    cursor.get_or_insert_with(|| sources.open(instance, event.dp_rank, sequence));
                match run.admit(sequence) {
                    Verdict::Apply => {}
                    Verdict::Duplicate => {
                        report.duplicates += 1;
                        continue;
                    }
                    Verdict::Dropped(gap) => {
                        report.dropped += 1;
                        report.gaps.extend(gap);
                        continue;
                    }
                }
            }
            self.apply_one(links, instance, event, journal, &mut last)?;
            report.applied += 1;
        }
        if let Some(done) = cursor {
            journal
                .steps
                .extend(self.sources.close(done).map(Step::Source));
        }
        report.evicted = self.evict_to_bound(links);
        let c = &mut self.counters;
        c.events_applied += report.applied as u64;
        c.duplicates += report.duplicates as u64;
        c.dropped += report.dropped as u64;
        c.gaps += report.gaps.len() as u64;
        c.evicted_entries += report.evicted as u64;
        Ok(report)
    }

    fn apply_one(
        &mut self,
        links: &mut Links,
        instance: u64,
        event: &IndexEvent,
        journal: &mut Journal,
        last: &mut Resolved,
    ) -> Result<()> {
        let key = location_key(instance, event);
        match event.kind {
            EventKind::Stored => {
                let (location, bit) = match *last {
                    Some((k, g, kind, location, bit))
                        if k == key && g == event.group && kind == event.group_kind =>
                    {
                        (location, bit)
                    }
                    _ => {
                        let location = self.location_id(key, journal);
                        let bit =
                            self.group_bit(location, event.group, event.group_kind, journal)?;
                        *last = Some((key, event.group, event.group_kind, location, bit));
                        (location, bit)
                    }
                };
                Tree::new(&mut self.tree, links).store_run(
                    &event.block_hashes,
                    event.parent_hash.map(|h| h.0),
                    location,
                    bit,
                    &mut journal.ids,
                );
            }
            EventKind::Removed => {
                let (location, bit) = match *last {
                    Some((k, g, kind, location, bit))
                        if k == key && g == event.group && kind == event.group_kind =>
                    {
                        (location, bit)
                    }
                    _ => {
                        let Some(location) = self.locations.find(&key) else {
                            return Ok(());
                        };
                        let Some(bit) =
                            self.locations
                                .group_bit(location, event.group, event.group_kind)
                        else {
                            return Ok(());
                        };
                        *last = Some((key, event.group, event.group_kind, location, bit));
                        (location, bit)
                    }
                };
                let mut tree = Tree::new(&mut self.tree, links);
                for hash in &event.block_hashes {
                    if let Some(id) = tree.find(hash.0) {
                        tree.clear_bits(id, location, bit, None);
                    }
                }
            }
            EventKind::Cleared => {
                let ids =
                    self.locations
                        .matching(instance, Some(event.dp_rank), Some(event.medium));
                self.drop_locations(links, &ids);
            }
            EventKind::Group => {
                let location = self.location_id(key, journal);
                self.group_bit(location, event.group, event.group_kind, journal)?;
            }
        }
        Ok(())
    }

    fn drop_locations(&mut self, links: &mut Links, ids: &[u32]) -> usize {
        if ids.is_empty() {
            return 0;
        }
        let mut hit = vec![false; self.locations.len()];
        for &id in ids {
            hit[id as usize] = true;
        }
        Tree::new(&mut self.tree, links).drop_locations(|l| hit[l as usize])
    }

    fn evict_to_bound(&mut self, links: &mut Links) -> usize {
        let mut evicted = 0;
        let max = self.config.max_entries;
        let mut tree = Tree::new(&mut self.tree, links);
        while tree.nodes.entries > max {
            let gone = tree.evict_one();
            if gone == 0 {
                break;
            }
            evicted += gone;
        }
        evicted
    }

    /// Evicts until the entries fit `max_entries` (the only copy: a loaded index); returns
    /// how many went.
    pub(crate) fn enforce_bound(&mut self, links: &mut Links) -> usize {
        links.begin_write();
        let evicted = self.evict_to_bound(links);
        self.tree.drop_deleted(links.deleted());
        self.counters.evicted_entries += evicted as u64;
        evicted
    }

    /// Marks `chain` speculative (see `KVIndex::insert_speculative`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn speculate(
        &mut self,
        links: &mut Links,
        instance: u64,
        dp_rank: u32,
        block_size: u32,
        chain: &[BlockHash],
        now: f64,
        ttl: f64,
        journal: &mut Journal,
    ) -> Result<usize> {
        ensure_arg!(now.is_finite(), "now", "must be finite, got {now}");
        ensure_arg!(
            ttl.is_finite() && ttl > 0.0,
            "ttl",
            "must be finite and > 0, got {ttl}"
        );
        ensure_arg!(
            (now + ttl).is_finite(),
            "ttl",
            "now + ttl must be finite, got {now} + {ttl}"
        );
        ensure_arg!(block_size >= 1, "block_size", "must be >= 1, got 0");
        for pair in chain.windows(2) {
            ensure_arg!(
                pair[0] != pair[1],
                "block_hashes",
                "block {:?} is its own parent",
                pair[0]
            );
        }
        let key = LocationKey {
            instance,
            dp_rank,
            medium: Medium::Device,
            block_size,
        };
        ensure_arg!(
            self.locations.find(&key).is_some() || self.locations.len() < MAX_LOCATIONS,
            "instance",
            "the index holds at most {MAX_LOCATIONS} locations"
        );
        let expired = self.expire_due(links, now, journal);
        let location = self.location_id(key, journal);
        let expires = now + ttl;
        let mut ids = std::mem::take(&mut journal.ids);
        ids.clear();
        let mut up = Parent::Root;
        let mut marked = 0;
        let mut tree = Tree::new(&mut self.tree, links);
        for hash in chain {
            let id = tree.get_or_create(hash.0, up);
            if tree.add_speculative(id, location, expires) {
                let due = Due {
                    expires,
                    hash: hash.0,
                    location,
                };
                self.expiry.push(due);
                journal.steps.push(Step::ExpiryPush(due));
                marked += 1;
            }
            ids.push(id);
            up = Parent::Node(id);
        }
        for &id in ids.iter().rev() {
            tree.touch(id);
        }
        journal.ids = ids;
        let evicted = self.evict_to_bound(links);
        let c = &mut self.counters;
        c.expired_entries += expired as u64;
        c.speculative_inserted += marked as u64;
        c.evicted_entries += evicted as u64;
        Ok(marked)
    }

    /// Drops the speculative entries lapsing at or before `now`; returns how many.
    pub(crate) fn expire(
        &mut self,
        links: &mut Links,
        now: f64,
        journal: &mut Journal,
    ) -> Result<usize> {
        ensure_arg!(!now.is_nan(), "now", "must be a number, got NaN");
        let expired = self.expire_due(links, now, journal);
        self.counters.expired_entries += expired as u64;
        Ok(expired)
    }

    fn expire_due(&mut self, links: &mut Links, now: f64, journal: &mut Journal) -> usize {
        let mut expired = 0;
        let mut popped = false;
        let mut tree = Tree::new(&mut self.tree, links);
        while let Some(due) = self.expiry.pop_due(now) {
            popped = true;
            if let Some(id) = tree.find(due.hash) {
                let cleared = tree.clear_bits(id, due.location, SPECULATIVE, Some(due.expires));
                expired += usize::from(cleared & SPECULATIVE != 0);
            }
        }
        if popped {
            journal.steps.push(Step::ExpiryPop { now });
        }
        if self.expiry.needs_rebuild(self.tree.speculative) {
            let live = self.speculative_due();
            self.expiry.rebuild(live);
            journal.expiry_rebuilt = true;
        }
        expired
    }

    /// An expiry record per speculative entry.
    pub(crate) fn speculative_due(&self) -> Vec<Due> {
        let mut out = Vec::with_capacity(self.tree.speculative);
        for id in self.tree.ids() {
            let hash = self.tree.rec(id).hash();
            for entry in self.tree.extras(id) {
                if entry.mask & SPECULATIVE != 0 {
                    out.push(Due {
                        expires: entry.expires,
                        hash,
                        location: entry.location,
                    });
                }
            }
        }
        out
    }

    /// Drops the entries and sequence state of (`instance`, `dp_rank`), or of the whole
    /// instance; returns the entries dropped.
    pub(crate) fn forget(
        &mut self,
        links: &mut Links,
        instance: u64,
        dp_rank: Option<u32>,
        journal: &mut Journal,
    ) -> Result<usize> {
        self.sources.forget(instance, dp_rank);
        journal.steps.push(Step::Forget { instance, dp_rank });
        let ids = self.locations.matching(instance, dp_rank, None);
        Ok(self.drop_locations(links, &ids))
    }

    /// Every source's sequence state.
    pub(crate) fn sources(&self) -> Vec<SourceState> {
        self.sources.list()
    }

    /// Checks every invariant of the module doc, `links` being the tree's (level with this
    /// copy).
    pub(crate) fn check(&self, links: &Links) -> Result<()> {
        self.locations.check()?;
        ensure_invariant!(
            self.tree.width == self.locations.width(),
            "the tree's bitset width {} is not the locations' {}",
            self.tree.width,
            self.locations.width()
        );
        links.check(&self.tree, self.locations.len())?;
        ensure_invariant!(
            self.tree.entries <= self.config.max_entries,
            "{} entries over the bound {}",
            self.tree.entries,
            self.config.max_entries
        );
        let records = self.expiry.records();
        for id in self.tree.ids() {
            let hash = self.tree.rec(id).hash();
            for entry in self.tree.entries_of(id) {
                let location = self.locations.get(entry.location);
                let groups = (1u64 << location.groups.len()) - 1;
                ensure_invariant!(
                    u64::from(entry.mask & !SPECULATIVE) & !groups == 0,
                    "entry of location {} has bits {:b} beyond its {} groups",
                    entry.location,
                    entry.mask,
                    location.groups.len()
                );
                if entry.mask & SPECULATIVE != 0 {
                    ensure_invariant!(
                        location.key.medium == Medium::Device,
                        "speculative entry off the device"
                    );
                    let due = Due {
                        expires: entry.expires,
                        hash,
                        location: entry.location,
                    };
                    ensure_invariant!(
                        records.binary_search(&due).is_ok(),
                        "speculative entry {due:?} has no expiry record"
                    );
                }
            }
        }
        Ok(())
    }
}

fn location_key(instance: u64, event: &IndexEvent) -> LocationKey {
    LocationKey {
        instance,
        dp_rank: event.dp_rank,
        medium: event.medium,
        block_size: event.block_size,
    }
}
