//! One copy of the index's state and the writer's operations on it.
//!
//! A write first decides, from its input and this copy, what to do (validating everything
//! first: `Err` changes nothing), then does it as a sequence of [`Step`]s, each executed at
//! once and kept in a [`Journal`] together with the answers of the node look-ups it made. The
//! other copy replays the journal: the same steps on an equal copy with the recorded answers
//! (no validation, no sequence checks, no look-ups, no table stores) leave an equal copy (same
//! node slots, same LRU order), as [`crate::KVIndex::check`] verifies.
//!
//! Invariants (checked by [`IndexState::check`]): those of the tree, the locations and the
//! expiry heap; every entry's group bits are groups of its location; after every operation
//! the entries number at most `max_entries` (eviction, see `tree.rs`).

use std::collections::HashMap;

use crate::error::{ensure_arg, ensure_invariant, Result};
use crate::hash::{BlockHash, BlockHasher};
use crate::index::event::{EventKind, GroupKind, IndexEvent, Medium};
use crate::index::expiry::{Due, Expiry};
use crate::index::location::{FixedState, LocationKey, Locations};
use crate::index::sequence::{Gap, SourceState, Sources, Verdict};
use crate::index::tree::{Direct, Parent, Record, Replay, Resolve, Tree, SPECULATIVE};

/// Settings of an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// The most entries (one block hash at one location) the index keeps; beyond it the
    /// least-recently stored chains are evicted from their tails.
    pub max_entries: usize,
    /// Seed of the chained hashes that token-id lookups compute (R6); must be the pools'.
    pub hash_seed: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_entries: 1 << 24,
            hash_seed: crate::DEFAULT_HASH_SEED,
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
    pub events_applied: u64,
    pub duplicates: u64,
    pub dropped: u64,
    pub gaps: u64,
    pub evicted_entries: u64,
    pub expired_entries: u64,
    pub speculative_inserted: u64,
}

/// One step of a write, as the journal keeps it. Steps that carry blocks take their hashes,
/// in order, from the journal's `hashes`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step {
    /// A source's sequence state after an event.
    Source(SourceState),
    Register(LocationKey),
    Group {
        location: u32,
        group: u32,
        kind: GroupKind,
    },
    /// `len` blocks stored at `location` under group bit `bit`, the first one's parent
    /// `parent` (`None`: a chain's first block).
    Store {
        location: u32,
        bit: u32,
        parent: Option<u128>,
        len: u32,
    },
    Remove {
        location: u32,
        bit: u32,
        len: u32,
    },
    /// Drop the entries of `instance`'s locations (of `dp_rank` and `medium` when given), and
    /// with `forget` the sources' numbers too.
    Drop {
        instance: u64,
        dp_rank: Option<u32>,
        medium: Option<Medium>,
        forget: bool,
    },
    /// `len` blocks marked speculative at `location` until `expires`.
    Speculate {
        location: u32,
        expires: f64,
        len: u32,
    },
    Expire {
        now: f64,
    },
    /// Evict down to the bound.
    Bound,
    Counters(IndexCounters),
}

impl Step {
    fn blocks(&self) -> usize {
        match *self {
            Self::Store { len, .. } | Self::Remove { len, .. } | Self::Speculate { len, .. } => {
                len as usize
            }
            _ => 0,
        }
    }
}

/// A write's steps, the hashes they carry, and what the first copy found and deleted.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    pub steps: Vec<Step>,
    pub hashes: Vec<u128>,
    /// The answer of every node look-up, in order ([`crate::index::tree::NIL`]: absent).
    pub found: Vec<u32>,
    /// Nodes deleted: their table entries go once the other copy has replayed the write.
    pub deleted: Vec<(u128, u32)>,
}

impl Journal {
    pub fn clear(&mut self) {
        self.steps.clear();
        self.hashes.clear();
        self.found.clear();
        self.deleted.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// One copy of the index.
#[derive(Clone)]
pub(crate) struct IndexState {
    pub config: IndexConfig,
    pub hasher: BlockHasher,
    pub tree: Tree,
    pub locations: Locations,
    pub sources: Sources,
    pub expiry: Expiry,
    pub counters: IndexCounters,
}

/// The location and group bit of the last stored event, reused by the next one of the batch.
type Resolved = Option<(LocationKey, u32, GroupKind, u32, u32)>;

impl IndexState {
    pub fn new(config: IndexConfig, capacity: usize) -> Result<Self> {
        ensure_arg!(
            config.max_entries >= 1,
            "max_entries",
            "must be >= 1, got 0"
        );
        Ok(Self {
            config,
            hasher: BlockHasher::new(config.hash_seed),
            tree: Tree::with_capacity(capacity),
            locations: Locations::default(),
            sources: Sources::default(),
            expiry: Expiry::default(),
            counters: IndexCounters::default(),
        })
    }

    /// Executes `step` (its blocks are `hashes`) with `r` finding the nodes; returns what it
    /// counts (entries dropped, evicted, expired or marked).
    fn execute<R: Resolve>(&mut self, step: &Step, hashes: &[u128], r: &mut R) -> Result<usize> {
        match *step {
            Step::Source(state) => {
                self.sources.restore(state);
                Ok(0)
            }
            Step::Register(key) => {
                self.locations.register(key);
                self.tree.width = self.locations.width();
                Ok(0)
            }
            Step::Group {
                location,
                group,
                kind,
            } => {
                self.locations.add_group(location, group, kind)?;
                Ok(0)
            }
            Step::Store {
                location,
                bit,
                parent,
                ..
            } => {
                let mut ids = smallvec::SmallVec::<[u32; 32]>::new();
                let mut up = parent.map_or(Parent::Root, Parent::Hash);
                for &hash in hashes {
                    let id = self.tree.get_or_create(hash, up, r);
                    self.tree.add_groups(id, location, bit);
                    ids.push(id);
                    up = Parent::Node(id);
                }
                // Deepest first, so that parents end up newer than their children.
                for &id in ids.iter().rev() {
                    self.tree.touch(id);
                }
                Ok(0)
            }
            Step::Remove { location, bit, .. } => {
                for &hash in hashes {
                    if let Some(id) = r.find(&self.tree, hash) {
                        self.tree.clear_bits(id, location, bit, None, r);
                    }
                }
                Ok(0)
            }
            Step::Drop {
                instance,
                dp_rank,
                medium,
                forget,
            } => {
                if forget {
                    self.sources.forget(instance, dp_rank);
                }
                let ids = self.locations.matching(instance, dp_rank, medium);
                Ok(self.drop_locations(&ids, r))
            }
            Step::Speculate {
                location, expires, ..
            } => {
                let mut ids = Vec::with_capacity(hashes.len());
                let mut up = Parent::Root;
                let mut marked = 0;
                for &hash in hashes {
                    let id = self.tree.get_or_create(hash, up, r);
                    if self.tree.add_speculative(id, location, expires) {
                        self.expiry.push(Due {
                            expires,
                            hash,
                            location,
                        });
                        marked += 1;
                    }
                    ids.push(id);
                    up = Parent::Node(id);
                }
                for &id in ids.iter().rev() {
                    self.tree.touch(id);
                }
                Ok(marked)
            }
            Step::Expire { now } => Ok(self.expire_due(now, r)),
            Step::Bound => Ok(self.evict_to_bound(r)),
            Step::Counters(counters) => {
                self.counters = counters;
                Ok(0)
            }
        }
    }

    /// Executes `step` and keeps it in `journal` (the first copy of a write).
    fn run(&mut self, journal: &mut Journal, step: Step, hashes: &[BlockHash]) -> Result<usize> {
        let start = journal.hashes.len();
        journal.hashes.extend(hashes.iter().map(|h| h.0));
        journal.steps.push(step);
        let mut r = Record {
            found: &mut journal.found,
            deleted: &mut journal.deleted,
        };
        self.execute(&step, &journal.hashes[start..], &mut r)
    }

    /// Replays `journal` (written on an equal copy).
    pub fn replay(&mut self, journal: &Journal) -> Result<()> {
        let mut r = Replay {
            found: &journal.found,
            at: 0,
        };
        let mut at = 0;
        for step in &journal.steps {
            let n = step.blocks();
            self.execute(step, &journal.hashes[at..at + n], &mut r)?;
            at += n;
        }
        ensure_invariant!(
            r.at == journal.found.len(),
            "the replay asked {} look-ups, the write {}",
            r.at,
            journal.found.len()
        );
        Ok(())
    }

    fn validate_batch(&self, instance: u64, events: &[IndexEvent]) -> Result<()> {
        // New groups per location, so that a batch that would overflow one fails whole.
        let mut new_groups: HashMap<LocationKey, Vec<(u32, GroupKind)>, FixedState> =
            HashMap::default();
        let mut known: Option<(LocationKey, u32, GroupKind)> = None;
        for event in events {
            event.validate()?;
            if event.kind != EventKind::Stored {
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
        Ok(())
    }

    /// Applies `instance`'s events in order (see `sequence.rs` for gaps and duplicates).
    pub fn apply(
        &mut self,
        instance: u64,
        events: &[IndexEvent],
        journal: &mut Journal,
    ) -> Result<ApplyReport> {
        self.validate_batch(instance, events)?;
        let mut report = ApplyReport::default();
        let mut last: Resolved = None;
        for event in events {
            if let Some(sequence) = event.sequence {
                let before = self.sources.get(instance, event.dp_rank);
                let verdict = self.sources.admit(instance, event.dp_rank, sequence);
                let after = self.sources.get(instance, event.dp_rank);
                if after != before {
                    if let Some(state) = after {
                        journal.steps.push(Step::Source(state));
                    }
                }
                match verdict {
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
            self.apply_one(instance, event, journal, &mut last)?;
            report.applied += 1;
        }
        report.evicted = self.run(journal, Step::Bound, &[])?;
        let c = &mut self.counters;
        c.events_applied += report.applied as u64;
        c.duplicates += report.duplicates as u64;
        c.dropped += report.dropped as u64;
        c.gaps += report.gaps.len() as u64;
        c.evicted_entries += report.evicted as u64;
        journal.steps.push(Step::Counters(self.counters));
        Ok(report)
    }

    fn apply_one(
        &mut self,
        instance: u64,
        event: &IndexEvent,
        journal: &mut Journal,
        last: &mut Resolved,
    ) -> Result<()> {
        let key = location_key(instance, event);
        let len = event.block_hashes.len() as u32;
        match event.kind {
            EventKind::Stored => {
                let (location, bit) = match *last {
                    Some((k, g, kind, location, bit))
                        if k == key && g == event.group && kind == event.group_kind =>
                    {
                        (location, bit)
                    }
                    _ => {
                        let location = match self.locations.find(&key) {
                            Some(id) => id,
                            None => {
                                self.run(journal, Step::Register(key), &[])?;
                                self.locations.find(&key).ok_or_else(|| {
                                    crate::KvPoolError::Invariant("a location went".into())
                                })?
                            }
                        };
                        let bit = match self.locations.group_bit(
                            location,
                            event.group,
                            event.group_kind,
                        ) {
                            Some(bit) => bit,
                            None => {
                                let step = Step::Group {
                                    location,
                                    group: event.group,
                                    kind: event.group_kind,
                                };
                                self.run(journal, step, &[])?;
                                self.locations
                                    .group_bit(location, event.group, event.group_kind)
                                    .ok_or_else(|| {
                                        crate::KvPoolError::Invariant("a group went".into())
                                    })?
                            }
                        };
                        *last = Some((key, event.group, event.group_kind, location, bit));
                        (location, bit)
                    }
                };
                let step = Step::Store {
                    location,
                    bit,
                    parent: event.parent_hash.map(|h| h.0),
                    len,
                };
                self.run(journal, step, &event.block_hashes)?;
            }
            EventKind::Removed => {
                let Some(location) = self.locations.find(&key) else {
                    return Ok(());
                };
                let Some(bit) = self
                    .locations
                    .group_bit(location, event.group, event.group_kind)
                else {
                    return Ok(());
                };
                let step = Step::Remove { location, bit, len };
                self.run(journal, step, &event.block_hashes)?;
            }
            EventKind::Cleared => {
                let step = Step::Drop {
                    instance,
                    dp_rank: Some(event.dp_rank),
                    medium: Some(event.medium),
                    forget: false,
                };
                self.run(journal, step, &[])?;
            }
        }
        Ok(())
    }

    fn drop_locations<R: Resolve>(&mut self, ids: &[u32], r: &mut R) -> usize {
        if ids.is_empty() {
            return 0;
        }
        let mut hit = vec![false; self.locations.len()];
        for &id in ids {
            hit[id as usize] = true;
        }
        self.tree.drop_locations(|l| hit[l as usize], r)
    }

    fn evict_to_bound<R: Resolve>(&mut self, r: &mut R) -> usize {
        let mut evicted = 0;
        while self.tree.entries > self.config.max_entries {
            let gone = self.tree.evict_one(r);
            if gone == 0 {
                break;
            }
            evicted += gone;
        }
        evicted
    }

    /// Evicts until the entries fit `max_entries` (the only copy: a loaded index); returns
    /// how many went.
    pub fn enforce_bound(&mut self) -> usize {
        let evicted = self.evict_to_bound(&mut Direct);
        self.counters.evicted_entries += evicted as u64;
        evicted
    }

    /// Marks `chain` speculative (see `KVIndex::insert_speculative`).
    #[allow(clippy::too_many_arguments)]
    pub fn speculate(
        &mut self,
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
        let expired = self.run(journal, Step::Expire { now }, &[])?;
        let key = LocationKey {
            instance,
            dp_rank,
            medium: Medium::Device,
            block_size,
        };
        let location = match self.locations.find(&key) {
            Some(id) => id,
            None => {
                self.run(journal, Step::Register(key), &[])?;
                self.locations
                    .find(&key)
                    .ok_or_else(|| crate::KvPoolError::Invariant("a location went".into()))?
            }
        };
        let step = Step::Speculate {
            location,
            expires: now + ttl,
            len: chain.len() as u32,
        };
        let marked = self.run(journal, step, chain)?;
        let evicted = self.run(journal, Step::Bound, &[])?;
        let c = &mut self.counters;
        c.expired_entries += expired as u64;
        c.speculative_inserted += marked as u64;
        c.evicted_entries += evicted as u64;
        journal.steps.push(Step::Counters(self.counters));
        Ok(marked)
    }

    /// Drops the speculative entries lapsing at or before `now`; returns how many.
    pub fn expire(&mut self, now: f64, journal: &mut Journal) -> Result<usize> {
        ensure_arg!(!now.is_nan(), "now", "must be a number, got NaN");
        let expired = self.run(journal, Step::Expire { now }, &[])?;
        self.counters.expired_entries += expired as u64;
        journal.steps.push(Step::Counters(self.counters));
        Ok(expired)
    }

    fn expire_due<R: Resolve>(&mut self, now: f64, r: &mut R) -> usize {
        let mut expired = 0;
        while let Some(due) = self.expiry.pop_due(now) {
            if let Some(id) = r.find(&self.tree, due.hash) {
                let cleared =
                    self.tree
                        .clear_bits(id, due.location, SPECULATIVE, Some(due.expires), r);
                expired += usize::from(cleared & SPECULATIVE != 0);
            }
        }
        if self.expiry.needs_rebuild(self.tree.speculative) {
            let live = self.speculative_due();
            self.expiry.rebuild(live);
        }
        expired
    }

    /// An expiry record per speculative entry.
    pub fn speculative_due(&self) -> Vec<Due> {
        let mut out = Vec::with_capacity(self.tree.speculative);
        for id in self.tree.ids_in_order() {
            let hash = self.tree.node(id).hash;
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
    pub fn forget(
        &mut self,
        instance: u64,
        dp_rank: Option<u32>,
        journal: &mut Journal,
    ) -> Result<usize> {
        let step = Step::Drop {
            instance,
            dp_rank,
            medium: None,
            forget: true,
        };
        self.run(journal, step, &[])
    }

    /// Every source's sequence state.
    pub fn sources(&self) -> Vec<SourceState> {
        self.sources.list()
    }

    /// Checks every invariant of the module doc.
    pub fn check(&self) -> Result<()> {
        self.locations.check()?;
        ensure_invariant!(
            self.tree.width == self.locations.width(),
            "the tree's bitset width {} is not the locations' {}",
            self.tree.width,
            self.locations.width()
        );
        self.tree.check(self.locations.len())?;
        ensure_invariant!(
            self.tree.entries <= self.config.max_entries,
            "{} entries over the bound {}",
            self.tree.entries,
            self.config.max_entries
        );
        let records = self.expiry.records();
        for id in self.tree.ids_in_order() {
            let hash = self.tree.node(id).hash;
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
