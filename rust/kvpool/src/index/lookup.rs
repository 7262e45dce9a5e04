//! Lookups: a request's matched prefix on every location in one call.
//!
//! The request is a chain of block hashes (or token ids, hashed per block size in use with the
//! index's seed, R6). A location's match is the largest `n` such that each of its groups
//! holds what a hit of `n` blocks needs (see [`crate::index::event::GroupKind`]): full
//! attention `0..n`, a sliding window the blocks of its last `window - 1` tokens before
//! `n * block_size`, a linear state block `n - 1`. A speculative entry (not lapsed at `now`)
//! stands for every group of its location at that block.
//!
//! Locations with full-attention groups only (the common case) take the fast path: one walk
//! down the chain, keeping the sorted list of locations still matching and merging it with
//! each node's sorted entries; it stops at the first block no location still matching holds.
//! The walk costs O(sum over the blocks walked of the entries met), and at 1,000 instances
//! sharing a first block it is bound by the bytes it reads and writes per instance: a 16-byte
//! entry, a 12-byte location record and an 8-byte [`Row`] (the rich [`Match`] is made from the
//! rows afterwards, for the callers that want it). Locations with a sliding
//! window or a linear state take a second walk over the whole chain that records, per group,
//! which blocks are held, then pick the largest admissible `n`.

use std::collections::HashMap;

use crate::hash::BlockHash;
use crate::index::event::{GroupKind, Medium};
use crate::index::state::IndexState;
use crate::index::tree::{Entry, SPECULATIVE};

/// One location's matched prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Match {
    /// The serving instance.
    pub instance: u64,
    /// The data-parallel rank inside the instance.
    pub dp_rank: u32,
    /// Where the blocks live: device, host or remote.
    pub medium: Medium,
    /// Tokens per block at this location.
    pub block_size: u32,
    /// Leading blocks of the request held there.
    pub blocks: u32,
    /// `blocks * block_size`.
    pub tokens: u64,
}

/// One location's matched prefix, compact (8 bytes): the location's id within the index
/// (`Snapshot::location` resolves it) and its blocks. A lookup at 1,000 instances writes a
/// row per instance holding the first block, so the rows' size is most of its cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    /// Index into the match's locations.
    pub location: u32,
    /// Leading blocks of the query held at that location.
    pub blocks: u32,
}

impl IndexState {
    /// Appends to `out` one [`Row`] per location of `block_size` that holds at least the
    /// first block of `chain` (in no particular order).
    pub(crate) fn rows_chain(
        &self,
        chain: &[BlockHash],
        block_size: u32,
        now: f64,
        out: &mut Vec<Row>,
    ) {
        let counts = self.locations.size_counts(block_size);
        if chain.is_empty() || counts.locations == 0 {
            return;
        }
        if counts.gapped < counts.locations {
            self.walk_full(chain, block_size, now, out);
        }
        if counts.gapped > 0 {
            self.walk_gapped(chain, block_size, now, out);
        }
    }

    /// [`IndexState::rows_chain`] for the chain of `tokens` under `extra_key`, for each block
    /// size in use.
    pub(crate) fn rows_tokens(
        &self,
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        now: f64,
        out: &mut Vec<Row>,
    ) {
        for (block_size, counts) in self.locations.block_sizes() {
            if counts.locations == 0 || tokens.len() < block_size as usize {
                continue;
            }
            let chain = self.hasher.chain(tokens, block_size as usize, extra_key);
            self.rows_chain(&chain, block_size, now, out);
        }
    }

    /// The [`Match`] of a row.
    #[inline]
    pub(crate) fn to_match(&self, row: Row) -> Match {
        let key = self.locations.key(row.location);
        Match {
            instance: key.instance,
            dp_rank: key.dp_rank,
            medium: key.medium,
            block_size: key.block_size,
            blocks: row.blocks,
            tokens: u64::from(row.blocks) * u64::from(key.block_size),
        }
    }

    /// The location of a row.
    pub(crate) fn location(&self, id: u32) -> Option<crate::index::location::LocationKey> {
        ((id as usize) < self.locations.len()).then(|| self.locations.key(id))
    }

    #[inline]
    fn emit(location: u32, blocks: usize, out: &mut Vec<Row>) {
        out.push(Row {
            location,
            blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        });
    }

    /// Whether `entry` gives a full-attention-only location (with groups `full`) the block.
    #[inline]
    fn holds(entry: &Entry, full: u32, now: f64) -> bool {
        (full != 0 && entry.mask & full == full) || entry.speculative_at(now)
    }

    fn walk_full(&self, chain: &[BlockHash], block_size: u32, now: f64, out: &mut Vec<Row>) {
        let Some(first) = self.tree.get(chain[0].0) else {
            return;
        };
        out.reserve(first.entries.len());
        // Blocks 0 and 1 in one pass over the first block's entries (often every instance),
        // so that the locations matching only block 0 are emitted without being listed.
        let second = chain.get(1).and_then(|h| self.tree.get(h.0));
        let second: &[Entry] = second.map_or(&[], |n| &n.entries[..]);
        let mut active: Vec<u32> = Vec::with_capacity(second.len());
        let mut j = 0;
        for entry in &first.entries {
            let meta = self.locations.meta(entry.location);
            if meta.gapped
                || meta.block_size != block_size
                || !Self::holds(entry, meta.full_mask, now)
            {
                continue;
            }
            while j < second.len() && second[j].location < entry.location {
                j += 1;
            }
            if j < second.len()
                && second[j].location == entry.location
                && Self::holds(&second[j], meta.full_mask, now)
            {
                active.push(entry.location);
            } else {
                Self::emit(entry.location, 1, out);
            }
        }
        let mut next: Vec<u32> = Vec::with_capacity(active.len());
        let mut depth = 2;
        while depth < chain.len() && !active.is_empty() {
            let Some(node) = self.tree.get(chain[depth].0) else {
                break;
            };
            let entries = &node.entries[..];
            next.clear();
            // Both lists are sorted by location: merge, or binary-search the longer one when
            // few locations are left.
            let search = entries.len() > 8 * active.len();
            let mut j = 0;
            for &location in &active {
                if search {
                    j += entries[j..].partition_point(|e| e.location < location);
                } else {
                    while j < entries.len() && entries[j].location < location {
                        j += 1;
                    }
                }
                if j < entries.len()
                    && entries[j].location == location
                    && Self::holds(&entries[j], self.locations.meta(location).full_mask, now)
                {
                    next.push(location);
                } else {
                    Self::emit(location, depth, out);
                }
            }
            std::mem::swap(&mut active, &mut next);
            depth += 1;
        }
        for &location in &active {
            Self::emit(location, depth, out);
        }
    }

    fn walk_gapped(&self, chain: &[BlockHash], block_size: u32, now: f64, out: &mut Vec<Row>) {
        let words = chain.len().div_ceil(64);
        // Per location met: its bitsets (one per group, then one of speculative blocks).
        let mut seen: HashMap<u32, Vec<Vec<u64>>> = HashMap::new();
        for (i, hash) in chain.iter().enumerate() {
            let Some(node) = self.tree.get(hash.0) else {
                continue;
            };
            for entry in &node.entries {
                let meta = self.locations.meta(entry.location);
                if !meta.gapped || meta.block_size != block_size {
                    continue;
                }
                let groups = self.locations.get(entry.location).groups.len();
                let sets = seen
                    .entry(entry.location)
                    .or_insert_with(|| vec![vec![0u64; words]; groups + 1]);
                let (word, bit) = (i / 64, 1u64 << (i % 64));
                let mut mask = entry.mask & !SPECULATIVE;
                while mask != 0 {
                    sets[mask.trailing_zeros() as usize][word] |= bit;
                    mask &= mask - 1;
                }
                if entry.speculative_at(now) {
                    sets[groups][word] |= bit;
                }
            }
        }
        let mut locations: Vec<u32> = seen.keys().copied().collect();
        locations.sort_unstable();
        for location in locations {
            let blocks = self.admissible(location, &seen[&location], chain.len());
            if blocks > 0 {
                Self::emit(location, blocks, out);
            }
        }
    }

    /// The largest `n <= len` that every group of gapped `location` admits, given the blocks
    /// each holds (`sets[g]`, `sets[groups]` the speculative ones).
    fn admissible(&self, location: u32, sets: &[Vec<u64>], len: usize) -> usize {
        let location = self.locations.get(location);
        let block_size = location.key.block_size as usize;
        let speculative = &sets[location.groups.len()];
        let held =
            |g: usize, i: usize| (sets[g][i / 64] | speculative[i / 64]) >> (i % 64) & 1 != 0;
        // Full attention caps n at its contiguous run; the others need runs ending at n - 1.
        let mut cap = len;
        let mut streaks: Vec<(GroupKind, Vec<u32>)> = Vec::new();
        for (g, &(_, kind)) in location.groups.iter().enumerate() {
            if kind.is_gapped() {
                let mut streak = vec![0u32; len];
                for i in 0..len {
                    if held(g, i) {
                        streak[i] = if i == 0 { 1 } else { streak[i - 1] + 1 };
                    }
                }
                streaks.push((kind, streak));
            } else {
                let run = (0..len).take_while(|&i| held(g, i)).count();
                cap = cap.min(run);
            }
        }
        (1..=cap)
            .rev()
            .find(|&n| {
                streaks.iter().all(|(kind, streak)| {
                    let need = match *kind {
                        GroupKind::SlidingWindow { window } => {
                            let end = n * block_size;
                            let first = end.saturating_sub(window as usize - 1) / block_size;
                            n - first
                        }
                        _ => 1, // a linear state: the checkpoint at block n - 1
                    };
                    need == 0 || streak[n - 1] as usize >= need
                })
            })
            .unwrap_or(0)
    }
}
