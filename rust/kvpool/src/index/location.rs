//! Locations: where an index entry says a block's KV lives.
//!
//! A location is (instance, dp rank, medium, block size); its groups (index and kind, learned
//! from stored events) are numbered by bits `0..MAX_GROUPS` of the entries' masks, in the order
//! they were first seen. Invariants (checked by `check`):
//! - ids are dense (`0..len`) and never reused, so an entry's location id stays valid for the
//!   index's life (a location emptied by "cleared" keeps its id and its groups);
//! - `full_mask` has exactly the bits of the location's full-attention groups, and `gapped`
//!   says whether it has any other group;
//! - `per_block_size` counts the locations (and the gapped ones) of each block size.

use std::collections::{BTreeMap, HashMap};

use crate::error::{ensure_invariant, KvPoolError, Result};
use crate::index::event::{GroupKind, Medium, MAX_GROUPS};

/// A fast deterministic hasher (no random state), so that both copies of an index (and a
/// loaded one) behave alike.
pub(crate) type FixedState = rustc_hash::FxBuildHasher;

/// The identity of a location.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocationKey {
    /// The serving instance.
    pub instance: u64,
    /// The data-parallel rank inside the instance.
    pub dp_rank: u32,
    /// Where the blocks live: device, host or remote.
    pub medium: Medium,
    /// Tokens per block at this location.
    pub block_size: u32,
}

/// One location and its groups.
#[derive(Clone, Debug)]
pub(crate) struct Location {
    pub key: LocationKey,
    /// (group index, kind); bit `i` of an entry's mask is `groups[i]`.
    pub groups: Vec<(u32, GroupKind)>,
    /// Bits of the full-attention groups.
    pub full_mask: u32,
    /// Whether a group is a sliding window or a linear state.
    pub gapped: bool,
}

/// What a walk checks of a location for every entry it meets, kept dense and small (12
/// bytes): a lookup at 1,000 instances reads one per instance, and its cost is the bytes read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LocationMeta {
    pub full_mask: u32,
    pub block_size: u32,
    pub gapped: bool,
}

/// Counts of the locations of one block size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SizeCounts {
    pub locations: usize,
    pub gapped: usize,
}

/// Every location the index has seen.
#[derive(Clone, Debug, Default)]
pub(crate) struct Locations {
    list: Vec<Location>,
    /// `meta[i]` and `keys[i]` mirror `list[i]`.
    meta: Vec<LocationMeta>,
    keys: Vec<LocationKey>,
    ids: HashMap<LocationKey, u32, FixedState>,
    per_block_size: BTreeMap<u32, SizeCounts>,
}

impl Locations {
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    pub(crate) fn get(&self, id: u32) -> &Location {
        &self.list[id as usize]
    }

    #[inline]
    pub(crate) fn meta(&self, id: u32) -> LocationMeta {
        self.meta[id as usize]
    }

    #[inline]
    pub(crate) fn key(&self, id: u32) -> LocationKey {
        self.keys[id as usize]
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Location)> {
        self.list.iter().enumerate().map(|(i, l)| (i as u32, l))
    }

    pub(crate) fn find(&self, key: &LocationKey) -> Option<u32> {
        self.ids.get(key).copied()
    }

    /// Block sizes in use and their counts.
    pub(crate) fn block_sizes(&self) -> impl Iterator<Item = (u32, SizeCounts)> + '_ {
        self.per_block_size.iter().map(|(&k, &v)| (k, v))
    }

    /// The counts of block size `block_size`.
    pub(crate) fn size_counts(&self, block_size: u32) -> SizeCounts {
        self.per_block_size
            .get(&block_size)
            .copied()
            .unwrap_or_default()
    }

    /// The id of `key`, registering it (with no groups) if new.
    pub(crate) fn register(&mut self, key: LocationKey) -> u32 {
        if let Some(id) = self.ids.get(&key) {
            return *id;
        }
        let id = self.list.len() as u32;
        self.list.push(Location {
            key,
            groups: Vec::new(),
            full_mask: 0,
            gapped: false,
        });
        self.keys.push(key);
        self.meta.push(LocationMeta {
            full_mask: 0,
            block_size: key.block_size,
            gapped: false,
        });
        self.ids.insert(key, id);
        self.per_block_size
            .entry(key.block_size)
            .or_default()
            .locations += 1;
        id
    }

    /// The mask bit of group (`group`, `kind`) at location `id`, if it has that group.
    pub(crate) fn group_bit(&self, id: u32, group: u32, kind: GroupKind) -> Option<u32> {
        self.list[id as usize]
            .groups
            .iter()
            .position(|&g| g == (group, kind))
            .map(|i| 1 << i)
    }

    /// Whether registering (`group`, `kind`) at `key` would succeed (at most [`MAX_GROUPS`]
    /// groups per location), counting `pending` groups about to be added there.
    pub(crate) fn can_add_group(
        &self,
        key: &LocationKey,
        group: u32,
        kind: GroupKind,
        pending: usize,
    ) -> bool {
        let existing = match self.find(key) {
            Some(id) => {
                if self.group_bit(id, group, kind).is_some() {
                    return true;
                }
                self.list[id as usize].groups.len()
            }
            None => 0,
        };
        existing + pending < MAX_GROUPS as usize
    }

    /// The mask bit of (`group`, `kind`) at location `id`, registering the group if new.
    pub(crate) fn add_group(&mut self, id: u32, group: u32, kind: GroupKind) -> Result<u32> {
        if let Some(bit) = self.group_bit(id, group, kind) {
            return Ok(bit);
        }
        let location = &mut self.list[id as usize];
        if location.groups.len() >= MAX_GROUPS as usize {
            return Err(KvPoolError::invalid(
                "group",
                format!("a location holds at most {MAX_GROUPS} groups"),
            ));
        }
        let bit = 1u32 << location.groups.len();
        location.groups.push((group, kind));
        if kind.is_gapped() {
            if !location.gapped {
                location.gapped = true;
                let size = location.key.block_size;
                self.per_block_size.entry(size).or_default().gapped += 1;
            }
        } else {
            location.full_mask |= bit;
        }
        self.meta[id as usize].full_mask = location.full_mask;
        self.meta[id as usize].gapped = location.gapped;
        Ok(bit)
    }

    /// Ids of the locations of `instance` (and `dp_rank`, `medium` when given).
    pub(crate) fn matching(
        &self,
        instance: u64,
        dp_rank: Option<u32>,
        medium: Option<Medium>,
    ) -> Vec<u32> {
        self.iter()
            .filter(|(_, l)| {
                l.key.instance == instance
                    && dp_rank.is_none_or(|d| d == l.key.dp_rank)
                    && medium.is_none_or(|m| m == l.key.medium)
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Checks the module's invariants.
    pub(crate) fn check(&self) -> Result<()> {
        ensure_invariant!(
            self.ids.len() == self.list.len()
                && self.meta.len() == self.list.len()
                && self.keys.len() == self.list.len(),
            "{} location ids for {} locations",
            self.ids.len(),
            self.list.len()
        );
        let mut sizes: BTreeMap<u32, SizeCounts> = BTreeMap::new();
        for (id, location) in self.iter() {
            ensure_invariant!(
                self.ids.get(&location.key) == Some(&id),
                "location {id} not under its key"
            );
            ensure_invariant!(
                location.groups.len() <= MAX_GROUPS as usize,
                "location {id} has {} groups",
                location.groups.len()
            );
            let mut full = 0;
            for (i, (_, kind)) in location.groups.iter().enumerate() {
                if !kind.is_gapped() {
                    full |= 1 << i;
                }
            }
            ensure_invariant!(
                full == location.full_mask,
                "location {id}: full mask {:b}, groups say {full:b}",
                location.full_mask
            );
            let gapped = location.groups.iter().any(|(_, k)| k.is_gapped());
            ensure_invariant!(gapped == location.gapped, "location {id}: gapped flag");
            ensure_invariant!(
                self.meta[id as usize]
                    == LocationMeta {
                        full_mask: full,
                        block_size: location.key.block_size,
                        gapped,
                    }
                    && self.keys[id as usize] == location.key,
                "location {id}: dense copies differ"
            );
            let counts = sizes.entry(location.key.block_size).or_default();
            counts.locations += 1;
            counts.gapped += usize::from(gapped);
        }
        ensure_invariant!(
            sizes == self.per_block_size,
            "per-block-size counts {:?}, locations say {sizes:?}",
            self.per_block_size
        );
        Ok(())
    }
}
