//! Lookups: a request's matched prefix on every location in one call.
//!
//! The request is a chain of block hashes (or token ids, hashed per block size in use with the
//! index's seed, R6). A location's match is the largest `n` such that each of its groups
//! holds what a hit of `n` blocks needs (see [`crate::index::event::GroupKind`]): full
//! attention `0..n`, a sliding window the blocks of its last `window - 1` tokens before
//! `n * block_size`, a linear state block `n - 1`. A speculative entry (not lapsed at `now`)
//! stands for every group of its location at that block.
//!
//! Plain locations (one full-attention group, the common case; see `location.rs`) take the
//! fast path: one walk down the chain keeping the set of locations still matching, as a bitset
//! while it is large (intersected with each node's holder bitset a word at a time) and as a
//! sorted list once it is small, and recording where locations drop out: the locations that
//! leave at one depth while the set is a bitset are written as one bitset ("layer") of
//! [`Matches`], the others as [`Row`]s. The walk stops at the first block no location still
//! matching holds. So a lookup at 1,000 instances that all hold the first block costs a few
//! dozen words per block walked, not a row per instance. Complex locations (two or more
//! full-attention groups) walk their entries' masks; locations with a sliding window or a
//! linear state take a walk over the whole chain that records, per group, which blocks are
//! held, then pick the largest admissible `n`.

use std::collections::HashMap;

use crate::hash::BlockHash;
use crate::index::event::{GroupKind, Medium};
use crate::index::holders::Form;
use crate::index::location::Kind;
use crate::index::state::IndexState;
use crate::index::tree::{Entry, Rec, PLAIN, SPECULATIVE};

/// How many blocks ahead of itself a walk asks for table slots (the first ones before it
/// starts, then one more per block walked): enough for the misses to overlap, few enough
/// that a walk that stops early (most stop within a dozen blocks) asks for little it never
/// reads.
const PREFETCH: usize = 8;

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
    /// Leading blocks of the request a hit there restores: every group holds what a hit of
    /// this many blocks needs, a linear-state group a checkpoint at its end (see the module
    /// doc).
    pub blocks: u32,
    /// `blocks * block_size`.
    pub tokens: u64,
    /// Leading blocks whose KV is held there (every group but the linear-state ones holds
    /// what a hit of this many needs): `>= blocks`; past `blocks` a hit must recompute from
    /// the deepest checkpoint. Equal to `blocks` at a location without a linear-state group.
    pub kv_blocks: u32,
}

/// One location's matched prefix, compact (12 bytes): the location's id within the index
/// (`Snapshot::location` resolves it) and its depths (see [`Match`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    /// The location's id within the index.
    pub location: u32,
    /// Leading blocks of the query a hit there restores (see [`Match::blocks`]).
    pub blocks: u32,
    /// Leading blocks whose KV is held there (see [`Match::kv_blocks`]).
    pub kv_blocks: u32,
}

/// A lookup's answer, compact: rows, plus layers (a bitset of location ids that all matched
/// the same number of blocks). Reused across lookups, it allocates nothing once grown.
#[derive(Clone, Debug, Default)]
pub struct Matches {
    rows: Vec<Row>,
    layers: Vec<Layer>,
    words: Vec<u64>,
    /// The walk in progress: its shard, the index's shards (a location's id in the answer is
    /// its id in its shard times `shards` plus `shard`), where its rows start, its bitsets'
    /// words.
    shard: u32,
    shards: u32,
    rows_start: usize,
    width: usize,
    /// The walk's working sets.
    dense: Vec<u64>,
    sparse: Vec<u32>,
    next: Vec<u32>,
    keep: Vec<u32>,
}

/// A layer: the locations of one shard (a bitset of their ids in the shard,
/// `words[at..at + width]`) that matched `blocks` blocks.
#[derive(Clone, Copy, Debug)]
struct Layer {
    blocks: u32,
    at: u32,
    width: u32,
    shard: u32,
}

#[inline]
fn bit(words: &[u64], id: u32) -> bool {
    words
        .get(id as usize / 64)
        .is_some_and(|w| w >> (id % 64) & 1 != 0)
}

#[inline]
fn set(words: &mut [u64], id: u32) {
    words[id as usize / 64] |= 1 << (id % 64);
}

#[inline]
fn unset(words: &mut [u64], id: u32) {
    words[id as usize / 64] &= !(1 << (id % 64));
}

impl Matches {
    /// An empty answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets the last answer (keeping the memory).
    pub fn clear(&mut self) {
        self.rows.clear();
        self.layers.clear();
        self.words.clear();
    }

    /// Locations matched.
    pub fn len(&self) -> usize {
        self.rows.len()
            + self
                .words
                .iter()
                .map(|w| w.count_ones() as usize)
                .sum::<usize>()
    }

    /// Whether no location matched.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.layers.is_empty()
    }

    /// The id in the answer of location `local` of shard `shard`.
    #[inline]
    fn global(&self, local: u32, shard: u32) -> u32 {
        local * self.shards.max(1) + shard
    }

    /// Every location matched, in [`Matches::iter`]'s order, as its shard and its row with the
    /// location's id within that shard (what a snapshot resolves, without dividing ids).
    #[inline]
    pub(crate) fn for_each_local(&self, mut f: impl FnMut(u32, Row)) {
        let shards = self.shards.max(1);
        for &row in &self.rows {
            let (shard, location) = if shards == 1 {
                (0, row.location)
            } else {
                (row.location % shards, row.location / shards)
            };
            f(shard, Row { location, ..row });
        }
        for layer in &self.layers {
            let words = &self.words[layer.at as usize..(layer.at + layer.width) as usize];
            for (w, &word) in words.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    let row = Row {
                        location: (w * 64) as u32 + b,
                        blocks: layer.blocks,
                        kv_blocks: layer.blocks,
                    };
                    f(layer.shard, row);
                }
            }
        }
    }

    /// Every location matched (in no particular order), as rows.
    pub fn iter(&self) -> impl Iterator<Item = Row> + '_ {
        let layers = self.layers.iter().flat_map(move |layer| {
            let words = &self.words[layer.at as usize..(layer.at + layer.width) as usize];
            words.iter().enumerate().flat_map(move |(w, &word)| {
                let mut bits = word;
                std::iter::from_fn(move || {
                    (bits != 0).then(|| {
                        let b = bits.trailing_zeros();
                        bits &= bits - 1;
                        Row {
                            location: self.global((w * 64) as u32 + b, layer.shard),
                            blocks: layer.blocks,
                            kv_blocks: layer.blocks,
                        }
                    })
                })
            })
        });
        self.rows.iter().copied().chain(layers)
    }

    /// A location with the most blocks (the lowest id among ties), if any matched.
    pub fn best(&self) -> Option<Row> {
        let key = |r: &Row| (r.blocks, std::cmp::Reverse(r.location));
        let row = self.rows.iter().copied().max_by_key(key);
        let layer = self
            .layers
            .iter()
            .filter_map(|layer| {
                let words = &self.words[layer.at as usize..(layer.at + layer.width) as usize];
                let w = words.iter().position(|&x| x != 0)?;
                Some(Row {
                    location: self.global((w * 64) as u32 + words[w].trailing_zeros(), layer.shard),
                    blocks: layer.blocks,
                    kv_blocks: layer.blocks,
                })
            })
            .max_by_key(key);
        match (row, layer) {
            (Some(a), Some(b)) => Some(if key(&a) >= key(&b) { a } else { b }),
            (a, b) => a.or(b),
        }
    }

    /// Starts the walks of shard `shard` of `shards`: the rows they add get ids in the answer
    /// at [`Matches::end_shard`].
    #[inline]
    pub(crate) fn begin_shard(&mut self, shard: u32, shards: u32) {
        self.shard = shard;
        self.shards = shards;
        self.rows_start = self.rows.len();
    }

    /// Ends the walks of the shard begun last: its rows' location ids become the answer's.
    #[inline]
    pub(crate) fn end_shard(&mut self) {
        if self.shards > 1 {
            let (shards, shard) = (self.shards, self.shard);
            for row in &mut self.rows[self.rows_start..] {
                row.location = row.location * shards + shard;
            }
        }
    }

    /// Records the layer of `blocks` blocks whose words start at `at`.
    #[inline]
    fn push_layer(&mut self, blocks: usize, at: usize) {
        self.layers.push(Layer {
            blocks: blocks as u32,
            at: at as u32,
            width: self.width as u32,
            shard: self.shard,
        });
    }

    #[inline]
    fn row(&mut self, location: u32, blocks: usize) {
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        self.rows.push(Row {
            location,
            blocks,
            kv_blocks: blocks,
        });
    }
}

impl IndexState {
    /// Writes to `out` (appending) the matches of `chain` on every location of `block_size`
    /// that holds at least its first block.
    pub(crate) fn lookup_chain(
        &self,
        chain: &[BlockHash],
        block_size: u32,
        now: f64,
        out: &mut Matches,
    ) {
        let Some(counts) = self.locations.size_counts(block_size) else {
            return;
        };
        if chain.is_empty() || counts.locations == 0 {
            return;
        }
        if counts.gapped + counts.complex < counts.locations {
            self.walk_plain(chain, now, &counts.plain, out);
        }
        if counts.complex > 0 {
            self.walk_complex(chain, block_size, now, out);
        }
        if counts.gapped > 0 {
            self.walk_gapped(chain, block_size, now, &counts.gapped_bits, out);
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
            kv_blocks: row.kv_blocks,
        }
    }

    /// The [`Match`] of a row, `None` for a location id this state never gave.
    #[inline]
    pub(crate) fn try_to_match(&self, row: Row) -> Option<Match> {
        ((row.location as usize) < self.locations.len()).then(|| self.to_match(row))
    }

    /// The location of a row.
    pub(crate) fn location(&self, id: u32) -> Option<crate::index::location::LocationKey> {
        ((id as usize) < self.locations.len()).then(|| self.locations.key(id))
    }

    /// The plain locations of `eligible` holding node `id`'s block by a speculative entry.
    #[inline]
    fn speculative_holders<'a>(
        &'a self,
        id: u32,
        node: &Rec,
        eligible: &'a [u64],
        now: f64,
    ) -> impl Iterator<Item = u32> + 'a {
        let extras: &[Entry] = if node.has_extras() {
            self.tree.extras(id)
        } else {
            &[]
        };
        extras
            .iter()
            .filter(move |e| e.speculative_at(now) && bit(eligible, e.location))
            .map(|e| e.location)
    }

    /// The fast path (see the module doc) for the plain locations `eligible` (a bitset).
    fn walk_plain(&self, chain: &[BlockHash], now: f64, eligible: &[u64], m: &mut Matches) {
        // The table slots of the blocks the walk may reach first (then `PREFETCH` blocks
        // ahead), and, one block ahead, the node the table names: the walk's cache misses
        // overlap instead of coming in turn.
        for hash in &chain[..chain.len().min(PREFETCH)] {
            self.tree.prefetch_slot(hash.0);
        }
        // The node the table names for the next block, kept as a hint for its look-up.
        let mut hint = chain
            .get(1)
            .and_then(|next| self.tree.prefetch_candidate(next.0));
        let Some((id, first)) = self.tree.get(chain[0].0) else {
            return;
        };
        let width = self.locations.width();
        m.width = width;
        let mut dense = false;
        match self.tree.holders(first).form() {
            Form::Bits(words) => {
                m.dense.clear();
                m.dense.extend((0..width).map(|i| {
                    words.get(i).copied().unwrap_or(0) & eligible.get(i).copied().unwrap_or(0)
                }));
                dense = true;
                if first.has_extras() {
                    for location in self.speculative_holders(id, first, eligible, now) {
                        set(&mut m.dense, location);
                    }
                }
            }
            Form::Sorted(ids) => {
                m.sparse.clear();
                m.sparse
                    .extend(ids.iter().copied().filter(|&l| bit(eligible, l)));
                if first.has_extras() {
                    m.sparse
                        .extend(self.speculative_holders(id, first, eligible, now));
                    m.sparse.sort_unstable();
                }
            }
        }
        let mut depth = 1;
        while depth < chain.len() {
            if let Some(far) = chain.get(depth + PREFETCH) {
                self.tree.prefetch_slot(far.0);
            }
            let here = hint;
            hint = chain
                .get(depth + 1)
                .and_then(|next| self.tree.prefetch_candidate(next.0));
            if dense {
                let Some((id, node)) = self.tree.get_hinted(chain[depth].0, here) else {
                    break;
                };
                // Speculative holders still matching stay in.
                m.keep.clear();
                if node.has_extras() {
                    let dense_set = &m.dense;
                    m.keep.extend(
                        self.speculative_holders(id, node, eligible, now)
                            .filter(|&l| bit(dense_set, l)),
                    );
                }
                let at = m.words.len();
                m.words.extend_from_slice(&m.dense);
                let layer = &mut m.words[at..];
                let mut left = 0u64;
                match self.tree.holders(node).form() {
                    Form::Bits(words) => {
                        for (i, (a, d)) in m.dense.iter_mut().zip(layer.iter_mut()).enumerate() {
                            let n = *a & words.get(i).copied().unwrap_or(0);
                            *d = *a & !n;
                            *a = n;
                            left |= n;
                        }
                        for &l in &m.keep {
                            set(&mut m.dense, l);
                            unset(layer, l);
                            left = 1;
                        }
                    }
                    Form::Sorted(ids) => {
                        // The set becomes small: list the survivors, the rest is a layer.
                        m.sparse.clear();
                        for &l in ids {
                            if bit(&m.dense, l) {
                                m.sparse.push(l);
                                unset(layer, l);
                            }
                        }
                        if !m.keep.is_empty() {
                            for &l in &m.keep {
                                unset(layer, l);
                            }
                            m.sparse.extend_from_slice(&m.keep);
                            m.sparse.sort_unstable();
                            m.sparse.dedup();
                        }
                        dense = false;
                        left = u64::from(!m.sparse.is_empty());
                    }
                }
                if m.words[at..].iter().any(|&w| w != 0) {
                    m.push_layer(depth, at);
                } else {
                    m.words.truncate(at);
                }
                depth += 1;
                if left == 0 {
                    return;
                }
            } else {
                if m.sparse.is_empty() {
                    return;
                }
                let Some((id, node)) = self.tree.get_hinted(chain[depth].0, here) else {
                    break;
                };
                m.next.clear();
                let extras: &[Entry] = if node.has_extras() {
                    self.tree.extras(id)
                } else {
                    &[]
                };
                let holds = |l: u32, view: &Form<'_>, j: &mut usize| -> bool {
                    let real = match view {
                        Form::Bits(words) => bit(words, l),
                        Form::Sorted(ids) => {
                            while *j < ids.len() && ids[*j] < l {
                                *j += 1;
                            }
                            *j < ids.len() && ids[*j] == l
                        }
                    };
                    real || extras
                        .binary_search_by_key(&l, |e| e.location)
                        .is_ok_and(|i| extras[i].speculative_at(now))
                };
                let holders = self.tree.holders(node);
                let view = holders.form();
                let mut j = 0;
                for &l in &m.sparse {
                    if holds(l, &view, &mut j) {
                        m.next.push(l);
                    } else {
                        let blocks = depth as u32;
                        m.rows.push(Row {
                            location: l,
                            blocks,
                            kv_blocks: blocks,
                        });
                    }
                }
                std::mem::swap(&mut m.sparse, &mut m.next);
                depth += 1;
            }
        }
        if dense {
            if m.dense.iter().any(|&w| w != 0) {
                let at = m.words.len();
                m.words.extend_from_slice(&m.dense);
                m.push_layer(depth, at);
            }
        } else {
            for i in 0..m.sparse.len() {
                let l = m.sparse[i];
                m.row(l, depth);
            }
        }
    }

    /// Whether `entry` gives a non-gapped location (with groups `full`) the block.
    #[inline]
    fn holds(entry: &Entry, full: u32, now: f64) -> bool {
        (full != 0 && entry.mask & full == full) || entry.speculative_at(now)
    }

    /// Complex locations: their holding entries are all extras (a holder has group bit 0
    /// alone, not every full-attention group).
    fn walk_complex(&self, chain: &[BlockHash], block_size: u32, now: f64, m: &mut Matches) {
        let complex = |e: &Entry| {
            let l = self.locations.get(e.location);
            l.key.block_size == block_size
                && l.kind() == Kind::Complex
                && Self::holds(e, l.full_mask, now)
        };
        let Some((id, _)) = self.tree.get(chain[0].0) else {
            return;
        };
        let mut active: Vec<u32> = self
            .tree
            .extras(id)
            .iter()
            .filter(|e| complex(e))
            .map(|e| e.location)
            .collect();
        let mut depth = 1;
        while depth < chain.len() && !active.is_empty() {
            let Some((id, _)) = self.tree.get(chain[depth].0) else {
                break;
            };
            let extras = self.tree.extras(id);
            active.retain(|&l| {
                let keep = extras
                    .binary_search_by_key(&l, |e| e.location)
                    .is_ok_and(|i| complex(&extras[i]));
                if !keep {
                    m.row(l, depth);
                }
                keep
            });
            depth += 1;
        }
        for l in active {
            m.row(l, depth);
        }
    }

    fn walk_gapped(
        &self,
        chain: &[BlockHash],
        block_size: u32,
        now: f64,
        gapped: &[u64],
        out: &mut Matches,
    ) {
        let words = chain.len().div_ceil(64);
        // Per location met: its bitsets (one per group, then one of speculative blocks).
        let mut seen: HashMap<u32, Vec<Vec<u64>>> = HashMap::new();
        let mut note = |location: u32, mask: u32, speculative: bool, i: usize| {
            let groups = self.locations.get(location).groups.len();
            let sets = seen
                .entry(location)
                .or_insert_with(|| vec![vec![0u64; words]; groups + 1]);
            let (word, b) = (i / 64, 1u64 << (i % 64));
            let mut mask = mask & !SPECULATIVE;
            while mask != 0 {
                sets[mask.trailing_zeros() as usize][word] |= b;
                mask &= mask - 1;
            }
            if speculative {
                sets[groups][word] |= b;
            }
        };
        for (i, hash) in chain.iter().enumerate() {
            let Some((id, node)) = self.tree.get(hash.0) else {
                continue;
            };
            match self.tree.holders(node).form() {
                Form::Sorted(ids) => {
                    for &l in ids {
                        if bit(gapped, l) {
                            note(l, PLAIN, false, i);
                        }
                    }
                }
                Form::Bits(bits) => {
                    for (w, (&a, &g)) in bits.iter().zip(gapped).enumerate() {
                        let mut x = a & g;
                        while x != 0 {
                            note((w * 64) as u32 + x.trailing_zeros(), PLAIN, false, i);
                            x &= x - 1;
                        }
                    }
                }
            }
            for entry in self.tree.extras(id) {
                if bit(gapped, entry.location) {
                    note(entry.location, entry.mask, entry.speculative_at(now), i);
                }
            }
        }
        let _ = block_size;
        let mut locations: Vec<u32> = seen.keys().copied().collect();
        locations.sort_unstable();
        for location in locations {
            let (blocks, kv_blocks) = self.admissible(location, &seen[&location], chain.len());
            if kv_blocks > 0 {
                out.rows.push(Row {
                    location,
                    blocks: blocks as u32,
                    kv_blocks: kv_blocks as u32,
                });
            }
        }
    }

    /// The largest `n <= len` that every group of gapped `location` admits, and the largest
    /// that every group but the linear-state ones admits (its KV depth), given the blocks each
    /// group holds (`sets[g]`, `sets[groups]` the speculative ones).
    fn admissible(&self, location: u32, sets: &[Vec<u64>], len: usize) -> (usize, usize) {
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
        let admits = |n: usize, linear: bool| {
            streaks.iter().all(|(kind, streak)| {
                let need = match *kind {
                    GroupKind::SlidingWindow { window } => {
                        let end = n * block_size;
                        let first = end.saturating_sub(window as usize - 1) / block_size;
                        n - first
                    }
                    // A linear state: the checkpoint at block n - 1 (for the restorable depth).
                    _ if linear => 1,
                    _ => 0,
                };
                need == 0 || streak[n - 1] as usize >= need
            })
        };
        if location
            .groups
            .iter()
            .all(|&(_, k)| k == GroupKind::LinearState)
        {
            // No group holds KV (a linear state alone): the depth is the checkpoint's.
            let blocks = (1..=cap).rev().find(|&n| admits(n, true)).unwrap_or(0);
            return (blocks, blocks);
        }
        let kv = (1..=cap).rev().find(|&n| admits(n, false)).unwrap_or(0);
        let blocks = (1..=kv).rev().find(|&n| admits(n, true)).unwrap_or(0);
        (blocks, kv)
    }
}
