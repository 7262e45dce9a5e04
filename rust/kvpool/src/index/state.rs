//! One copy of the index's state and the writer's operations on it.
//!
//! [`IndexState::run`] is deterministic: the same operation on equal states leaves equal
//! states (same node slots, same LRU order), which lets [`crate::KVIndex`] keep two copies and
//! replay each operation on the second one later. An operation validates everything first and
//! returns `Err` having changed nothing.
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
use crate::index::tree::{Tree, SPECULATIVE};

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

/// A write, kept to be replayed on the second copy.
#[derive(Clone, Debug)]
pub(crate) enum WriteOp {
    Apply {
        instance: u64,
        events: Vec<IndexEvent>,
    },
    Speculate {
        instance: u64,
        dp_rank: u32,
        block_size: u32,
        chain: Vec<BlockHash>,
        now: f64,
        ttl: f64,
    },
    Expire {
        now: f64,
    },
    /// Drop the entries and sequence state of (instance, dp rank), or of the whole instance.
    Forget {
        instance: u64,
        dp_rank: Option<u32>,
    },
}

/// What a write returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Applied(ApplyReport),
    Count(usize),
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
            tree: Tree::new(),
            locations: Locations::default(),
            sources: Sources::default(),
            expiry: Expiry::default(),
            counters: IndexCounters::default(),
        })
    }

    /// Runs `op`; `Err` (bad input) changes nothing.
    pub(crate) fn run(&mut self, op: &WriteOp) -> Result<Outcome> {
        match op {
            WriteOp::Apply { instance, events } => {
                self.apply(*instance, events).map(Outcome::Applied)
            }
            WriteOp::Speculate {
                instance,
                dp_rank,
                block_size,
                chain,
                now,
                ttl,
            } => self
                .speculate(*instance, *dp_rank, *block_size, chain, *now, *ttl)
                .map(Outcome::Count),
            WriteOp::Expire { now } => self.expire(*now).map(Outcome::Count),
            WriteOp::Forget { instance, dp_rank } => {
                Ok(Outcome::Count(self.forget(*instance, *dp_rank)))
            }
        }
    }

    fn validate_batch(&self, instance: u64, events: &[IndexEvent]) -> Result<()> {
        // New groups per location, so that a batch that would overflow one fails whole.
        let mut new_groups: HashMap<LocationKey, Vec<(u32, GroupKind)>, FixedState> =
            HashMap::default();
        for event in events {
            event.validate()?;
            if event.kind != EventKind::Stored {
                continue;
            }
            let key = location_key(instance, event);
            let group = (event.group, event.group_kind);
            let known = self
                .locations
                .find(&key)
                .is_some_and(|id| self.locations.group_bit(id, group.0, group.1).is_some());
            if known {
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

    fn apply(&mut self, instance: u64, events: &[IndexEvent]) -> Result<ApplyReport> {
        self.validate_batch(instance, events)?;
        let mut report = ApplyReport::default();
        for event in events {
            if let Some(sequence) = event.sequence {
                match self.sources.admit(instance, event.dp_rank, sequence) {
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
            self.apply_one(instance, event)?;
            report.applied += 1;
        }
        report.evicted = self.enforce_bound();
        self.counters.events_applied += report.applied as u64;
        self.counters.duplicates += report.duplicates as u64;
        self.counters.dropped += report.dropped as u64;
        self.counters.gaps += report.gaps.len() as u64;
        Ok(report)
    }

    fn apply_one(&mut self, instance: u64, event: &IndexEvent) -> Result<()> {
        let key = location_key(instance, event);
        match event.kind {
            EventKind::Stored => {
                let location = self.locations.register(key);
                let bit = self
                    .locations
                    .add_group(location, event.group, event.group_kind)?;
                let mut ids = smallvec::SmallVec::<[u32; 32]>::new();
                let mut parent = event.parent_hash.map(|h| h.0);
                for hash in &event.block_hashes {
                    let id = self.tree.get_or_create(hash.0, parent);
                    self.tree.add_groups(id, location, bit);
                    ids.push(id);
                    parent = Some(hash.0);
                }
                // Deepest first, so that parents end up newer than their children.
                for &id in ids.iter().rev() {
                    self.tree.touch(id);
                }
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
                for hash in &event.block_hashes {
                    if let Some(id) = self.tree.find(hash.0) {
                        self.tree.clear_bits(id, location, bit, None);
                    }
                }
            }
            EventKind::Cleared => {
                let ids =
                    self.locations
                        .matching(instance, Some(event.dp_rank), Some(event.medium));
                self.drop_locations(&ids);
            }
        }
        Ok(())
    }

    fn drop_locations(&mut self, ids: &[u32]) -> usize {
        if ids.is_empty() {
            return 0;
        }
        let mut hit = vec![false; self.locations.len()];
        for &id in ids {
            hit[id as usize] = true;
        }
        self.tree.drop_locations(|l| hit[l as usize])
    }

    /// Evicts until the entries fit `max_entries`; returns how many went.
    pub(crate) fn enforce_bound(&mut self) -> usize {
        let mut evicted = 0;
        while self.tree.entries > self.config.max_entries {
            let gone = self.tree.evict_one();
            if gone == 0 {
                break;
            }
            evicted += gone;
        }
        self.counters.evicted_entries += evicted as u64;
        evicted
    }

    fn speculate(
        &mut self,
        instance: u64,
        dp_rank: u32,
        block_size: u32,
        chain: &[BlockHash],
        now: f64,
        ttl: f64,
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
        self.expire(now)?;
        let location = self.locations.register(LocationKey {
            instance,
            dp_rank,
            medium: Medium::Device,
            block_size,
        });
        let expires = now + ttl;
        let mut ids = Vec::with_capacity(chain.len());
        let mut parent = None;
        let mut marked = 0;
        for hash in chain {
            let id = self.tree.get_or_create(hash.0, parent);
            if self.tree.add_speculative(id, location, expires) {
                self.expiry.push(Due {
                    expires,
                    hash: hash.0,
                    location,
                });
                marked += 1;
            }
            ids.push(id);
            parent = Some(hash.0);
        }
        for &id in ids.iter().rev() {
            self.tree.touch(id);
        }
        self.counters.speculative_inserted += marked as u64;
        self.enforce_bound();
        Ok(marked)
    }

    fn expire(&mut self, now: f64) -> Result<usize> {
        ensure_arg!(!now.is_nan(), "now", "must be a number, got NaN");
        let mut expired = 0;
        while let Some(due) = self.expiry.pop_due(now) {
            if let Some(id) = self.tree.find(due.hash) {
                let cleared =
                    self.tree
                        .clear_bits(id, due.location, SPECULATIVE, Some(due.expires));
                expired += usize::from(cleared & SPECULATIVE != 0);
            }
        }
        if self.expiry.needs_rebuild(self.tree.speculative) {
            let live = self.speculative_due();
            self.expiry.rebuild(live);
        }
        self.counters.expired_entries += expired as u64;
        Ok(expired)
    }

    /// An expiry record per speculative entry.
    pub(crate) fn speculative_due(&self) -> Vec<Due> {
        let mut out = Vec::with_capacity(self.tree.speculative);
        for id in self.tree.ids_in_order() {
            let node = self.tree.node(id);
            for entry in &node.entries {
                if entry.mask & SPECULATIVE != 0 {
                    out.push(Due {
                        expires: entry.expires,
                        hash: node.hash,
                        location: entry.location,
                    });
                }
            }
        }
        out
    }

    fn forget(&mut self, instance: u64, dp_rank: Option<u32>) -> usize {
        self.sources.forget(instance, dp_rank);
        let ids = self.locations.matching(instance, dp_rank, None);
        self.drop_locations(&ids)
    }

    /// Every source's sequence state.
    pub(crate) fn sources(&self) -> Vec<SourceState> {
        self.sources.list()
    }

    /// Checks every invariant of the module doc.
    pub(crate) fn check(&self) -> Result<()> {
        self.locations.check()?;
        self.tree.check(self.locations.len())?;
        ensure_invariant!(
            self.tree.entries <= self.config.max_entries,
            "{} entries over the bound {}",
            self.tree.entries,
            self.config.max_entries
        );
        let records = self.expiry.records();
        for id in self.tree.ids_in_order() {
            let node = self.tree.node(id);
            for entry in &node.entries {
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
                        hash: node.hash,
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
