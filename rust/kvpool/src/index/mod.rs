//! `KVIndex`: a prefix index over the KV events of many instances, for KV-aware routing
//! (docs/events.md).
//!
//! Each instance's pool (or a reader of another engine's events) sends batches of
//! self-describing events ([`IndexEvent`]); the index answers, for a request (its token ids
//! and extra key, or its hash chain), the matched prefix on every (instance, dp rank, medium)
//! in one call ([`Match`], or compact [`Row`]s resolved through a [`Snapshot`]). Besides the events it keeps speculative entries a router inserts
//! when it routes a request, which lapse after a TTL on the caller's clock unless a stored
//! event confirms them; detects gaps in each source's sequence numbers so that a consumer can
//! replay or resync; bounds its memory (`max_entries`, evicting chains from their tails); and
//! dumps to / loads from a versioned binary format for a warm restart.
//!
//! # Concurrency: reads never wait for the writer, nor the writer for reads
//!
//! What readers read lives in two copies behind an [`arc_swap::ArcSwap`] (an RCU of immutable
//! snapshots with a recycled second copy, as `left-right` does): readers load the published
//! copy (lock-free) and walk it; the one writer of a shard (a mutex orders its writers)
//! brings the other copy level with the published one, applies the new write there, and
//! publishes it with one atomic swap. A reader thus sees the state after some whole write,
//! never a torn one.
//!
//! Only what a lookup reads is in the copies: per block a 24-byte record (its hash, its holder
//! set packed in one word with two flags; `tree/mod.rs`), the holder sets too large to be
//! inline, the few other entries (more groups, speculative ones), and the locations, sources
//! and expiry records. The hash -> node table is one for both copies (`table.rs`): the writer
//! stores a new node there once, and tombstones a deleted one only once the other copy is
//! level too, so that each copy finds exactly its own nodes in it. What only the writer reads
//! (a block's parent, its count of children, its place in the LRU list, the free ids: 16
//! bytes a block) is one, the writer's, outside the copies. So a block costs about 64 bytes
//! (two records, its links and its table slots) where two full copies cost four times that,
//! and the arrays grow in fixed chunks (`chunked.rs`), never copying what they hold.
//!
//! Bringing a copy level is cheap: it copies the records the previous write changed from the
//! published copy (which the writer may read: it is immutable) and replays that write's few
//! steps outside the tree (`state.rs`), so no validation, sequence check or hash probe is
//! done twice. The writer needs the unpublished copy to itself: readers that loaded it before
//! the last swap usually left long ago (a lookup takes microseconds); if one still holds it
//! after a short spin the writer deep-copies the published state (with a table of its own,
//! leaving the old one to the copies readers hold) rather than wait. The table's atomics are
//! explained in `table.rs` (with a loom model there); `arc-swap` and `Arc` provide the
//! publication's orderings; the stress test in `tests/index.rs` checks coherence (every answer
//! equals the answer of some published state).
//!
//! # Several writers: shards by instance
//!
//! `IndexConfig::writers = n` splits the index into `n` shards (`shard.rs`), an instance's
//! events all going to shard `writer_of(instance)` (a multiply-mixed hash of the id). Each
//! shard is the scheme above on its own: its two copies, its table, its links, its writer
//! lock, its share of `max_entries` and its own LRU. Shards share no memory, so writes to
//! different shards run at once with no new atomics anywhere; a reader loads each shard's
//! published copy in turn (a [`Snapshot`] holds one per shard) and walks each, a row's
//! location id in the answer being `id in its shard * n + shard`. An answer is per shard the
//! state after some whole write of that shard; across shards there is no order to keep (their
//! writes are concurrent). The loom model of `shard.rs` (two shards' writers and a slow
//! reader; `publish.rs` makes the copies' publication loom's), the one of `table.rs`
//! (`shards_publish_independently`) and the threaded property test
//! `threaded_writers_match_the_model` (`tests/index.rs`, against the single-threaded model)
//! cover it.
//!
//! Invariants: both copies are equal after each replay (`check` compares them record for
//! record and their dumps); those of [`IndexState::check`] on each, with the writer's links;
//! each shard holds only the instances `writer_of` gives it, and its share of `max_entries`.

mod chunked;
mod dump;
mod event;
mod expiry;
mod holders;
mod location;
mod lookup;
mod publish;
mod sequence;
mod shard;
mod state;
mod table;
mod tree;
pub(crate) mod wire;

use smallvec::SmallVec;

pub use event::{EventKind, GroupKind, IndexEvent, Medium, MAX_GROUPS};
pub use location::LocationKey;
pub use lookup::{Match, Matches, Row};
pub use sequence::{Gap, SourceState};
pub use state::{ApplyReport, IndexConfig, IndexCounters};

use crate::error::{ensure_arg, KvPoolError, Result};
use crate::hash::BlockHash;
use shard::Shard;
use state::IndexState;
use tree::Links;

/// Writers (shards) an index may have.
pub const MAX_WRITERS: usize = 64;

/// Sizes and counters of an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexStats {
    /// Entries (one block hash at one location), speculative ones included.
    pub entries: usize,
    /// Entries inserted speculatively by the router, not yet confirmed by an event.
    pub speculative_entries: usize,
    /// Block hashes held (nodes, including parents kept only for their children; a block
    /// held by instances of two writers' shards counts in each).
    pub blocks: usize,
    /// Distinct (instance, rank, medium, block size) locations known.
    pub locations: usize,
    /// Event sources (instance, rank) seen.
    pub sources: usize,
    /// Sources waiting for a gap in their sequence numbers to be filled.
    pub stalled_sources: usize,
    /// The most entries the index keeps before it evicts.
    pub max_entries: usize,
    /// Running counts of what the index applied, dropped and evicted.
    pub counters: IndexCounters,
}

/// A prefix index over the KV events of many instances (see the module doc).
pub struct KVIndex {
    shards: Box<[Shard]>,
    config: IndexConfig,
}

/// A consistent view of an index for several reads: one published copy of each shard, held
/// alive (each the state after some whole write of that shard).
pub struct Snapshot(SmallVec<[publish::Loaded<IndexState>; 2]>);

/// The shard (writer) of `instance` among `shards`: a multiply-mixed hash, so that ids in
/// any pattern spread.
#[inline]
fn shard_of(instance: u64, shards: usize) -> usize {
    if shards == 1 {
        return 0;
    }
    let mixed = instance.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((mixed >> 32) as usize) % shards
}

/// Shard `shard`'s part of `max_entries` among `shards` (they add up to it).
fn share(max_entries: usize, shard: usize, shards: usize) -> usize {
    max_entries / shards + usize::from(shard < max_entries % shards)
}

impl Snapshot {
    fn shards(&self) -> u32 {
        self.0.len() as u32
    }

    /// The matched prefix of `chain` on every location of `block_size` (see
    /// [`KVIndex::lookup_chain`]), into `out` (cleared first; no allocation once `out` has
    /// grown): the fast path, compact. [`Matches::iter`] lists the rows, [`Matches::best`]
    /// the longest, [`Snapshot::to_match`] resolves one.
    pub fn lookup_into(&self, chain: &[BlockHash], block_size: u32, now: f64, out: &mut Matches) {
        out.clear();
        self.lookup_appending(chain, block_size, now, out);
    }

    fn lookup_appending(&self, chain: &[BlockHash], block_size: u32, now: f64, out: &mut Matches) {
        for (shard, state) in self.0.iter().enumerate() {
            out.begin_shard(shard as u32, self.shards());
            state.lookup_chain(chain, block_size, now, out);
            out.end_shard();
        }
    }

    /// [`Snapshot::lookup_into`] for the chain of `tokens` under `extra_key` (see
    /// [`KVIndex::lookup_tokens`]).
    pub fn lookup_tokens_into(
        &self,
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        now: f64,
        out: &mut Matches,
    ) {
        out.clear();
        // Each block size in use, hashed once for every shard.
        let mut sizes: SmallVec<[u32; 4]> = SmallVec::new();
        for state in &self.0 {
            for (block_size, counts) in state.locations.block_sizes() {
                if counts.locations > 0 && !sizes.contains(&block_size) {
                    sizes.push(block_size);
                }
            }
        }
        sizes.sort_unstable();
        let hasher = self.0[0].hasher;
        for block_size in sizes {
            if tokens.len() < block_size as usize {
                continue;
            }
            let chain = hasher.chain(tokens, block_size as usize, extra_key);
            self.lookup_appending(&chain, block_size, now, out);
        }
    }

    /// See [`KVIndex::lookup_chain`].
    pub fn lookup_chain(&self, chain: &[BlockHash], block_size: u32, now: f64) -> Vec<Match> {
        let mut m = Matches::new();
        self.lookup_into(chain, block_size, now, &mut m);
        self.matches(&m)
    }

    /// See [`KVIndex::lookup_tokens`].
    pub fn lookup_tokens(&self, tokens: &[u32], extra_key: Option<&[u8]>, now: f64) -> Vec<Match> {
        let mut m = Matches::new();
        self.lookup_tokens_into(tokens, extra_key, now, &mut m);
        self.matches(&m)
    }

    /// Every row of `m` (a lookup of this snapshot) as a [`Match`].
    pub fn matches(&self, m: &Matches) -> Vec<Match> {
        let mut out = Vec::with_capacity(m.len());
        m.for_each_local(|shard, row| {
            if let Some(found) = self.0.get(shard as usize).and_then(|s| s.try_to_match(row)) {
                out.push(found);
            }
        });
        out
    }

    /// The lookup of `chain` as rows appended to `out`.
    pub fn lookup_rows_into(
        &self,
        chain: &[BlockHash],
        block_size: u32,
        now: f64,
        out: &mut Vec<Row>,
    ) {
        let mut m = Matches::new();
        self.lookup_into(chain, block_size, now, &mut m);
        out.extend(m.iter());
    }

    /// The shard and the id within it of location `id`.
    #[inline]
    fn split(&self, id: u32) -> (&IndexState, u32) {
        let shards = self.shards();
        if shards == 1 {
            return (&self.0[0], id);
        }
        (&self.0[(id % shards) as usize], id / shards)
    }

    /// The location of a row (`None` for an id this index never gave).
    pub fn location(&self, id: u32) -> Option<LocationKey> {
        let (state, local) = self.split(id);
        state.location(local)
    }

    /// The [`Match`] of a row of this snapshot.
    pub fn to_match(&self, row: Row) -> Option<Match> {
        let (state, location) = self.split(row.location);
        state.try_to_match(Row { location, ..row })
    }
}

impl KVIndex {
    /// An empty index; `Err` if `config.max_entries == 0`, `config.writers` is not in
    /// `1..=MAX_WRITERS` or exceeds `max_entries`.
    pub fn new(config: IndexConfig) -> Result<Self> {
        ensure_arg!(
            (1..=MAX_WRITERS).contains(&config.writers),
            "writers",
            "must be in 1..={MAX_WRITERS}, got {}",
            config.writers
        );
        ensure_arg!(
            config.max_entries >= config.writers.max(1),
            "max_entries",
            "must be >= 1 and >= writers ({}), got {}",
            config.writers,
            config.max_entries
        );
        let shards = (0..config.writers)
            .map(|i| {
                let part = IndexConfig {
                    max_entries: share(config.max_entries, i, config.writers),
                    ..config
                };
                Ok(Shard::new(IndexState::new(part)?, Links::default()))
            })
            .collect::<Result<_>>()?;
        Ok(Self { shards, config })
    }

    /// [`KVIndex::new`]; `blocks`, a hint of how many block hashes the index will hold, sizes
    /// its hash tables up front (its other storage grows as blocks come, so an index holds
    /// memory for what it holds, not for what it may hold).
    pub fn with_capacity(config: IndexConfig, blocks: usize) -> Result<Self> {
        let index = Self::new(config)?;
        let per_shard = blocks / config.writers.max(1);
        for shard in index.shards.iter() {
            shard.write(|state, _, _| {
                state.tree.rebuild_table(per_shard);
                Ok(())
            })?;
        }
        Ok(index)
    }

    /// The index's settings.
    pub fn config(&self) -> IndexConfig {
        self.config
    }

    /// The hasher of token-id lookups (the index's seed).
    pub fn hasher(&self) -> crate::hash::BlockHasher {
        self.shards[0].load().hasher
    }

    /// The writer (shard) that applies `instance`'s events, in `0..config().writers`: threads
    /// applying batches concurrently scale when each writer's instances are one thread's
    /// (sticky, as Dynamo assigns workers to its event threads); two threads on one writer
    /// take turns.
    pub fn writer_of(&self, instance: u64) -> usize {
        shard_of(instance, self.shards.len())
    }

    fn shard(&self, instance: u64) -> &Shard {
        &self.shards[shard_of(instance, self.shards.len())]
    }

    /// Applies a batch of `instance`'s events in order; `Err` (an invalid event, named) changes
    /// nothing. See `sequence.rs` for what gaps and duplicates do. Batches of instances of
    /// different writers ([`KVIndex::writer_of`]) apply concurrently.
    pub fn apply(&self, instance: u64, events: impl AsRef<[IndexEvent]>) -> Result<ApplyReport> {
        let events = events.as_ref();
        self.shard(instance)
            .write(|state, links, journal| state.apply(links, instance, events, journal))
    }

    /// Marks `chain` (a request's hashes from its first block) as held on the device of
    /// (`instance`, `dp_rank`) until `now + ttl`, unless a stored event confirms it first. First
    /// lapses what is due at `now` in that instance's shard. Returns how many blocks were
    /// marked or extended.
    pub fn insert_speculative(
        &self,
        instance: u64,
        dp_rank: u32,
        block_size: u32,
        chain: Vec<BlockHash>,
        now: f64,
        ttl: f64,
    ) -> Result<usize> {
        self.shard(instance).write(|state, links, journal| {
            state.speculate(
                links, instance, dp_rank, block_size, &chain, now, ttl, journal,
            )
        })
    }

    /// [`KVIndex::insert_speculative`] for the chain of `tokens` under `extra_key`.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_speculative_tokens(
        &self,
        instance: u64,
        dp_rank: u32,
        block_size: u32,
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        now: f64,
        ttl: f64,
    ) -> Result<usize> {
        ensure_arg!(block_size >= 1, "block_size", "must be >= 1, got 0");
        let chain = self.hasher().chain(tokens, block_size as usize, extra_key);
        self.insert_speculative(instance, dp_rank, block_size, chain, now, ttl)
    }

    /// Drops the speculative entries that lapse at or before `now`; returns how many.
    pub fn expire(&self, now: f64) -> Result<usize> {
        ensure_arg!(!now.is_nan(), "now", "must be a number, got NaN");
        let mut expired = 0;
        for shard in self.shards.iter() {
            expired += shard.write(|state, links, journal| state.expire(links, now, journal))?;
        }
        Ok(expired)
    }

    /// Drops every entry of (`instance`, `dp_rank`) on every medium and forgets its sequence
    /// number, so that its next event starts it afresh (after a gap the replay buffer cannot
    /// fill). Returns the entries dropped.
    pub fn resync(&self, instance: u64, dp_rank: u32) -> usize {
        self.shard(instance)
            .write(|state, links, journal| state.forget(links, instance, Some(dp_rank), journal))
            .unwrap_or(0)
    }

    /// Drops every entry and source of `instance` (it left the fleet). Returns the entries.
    pub fn remove_instance(&self, instance: u64) -> usize {
        self.shard(instance)
            .write(|state, links, journal| state.forget(links, instance, None, journal))
            .unwrap_or(0)
    }

    /// A consistent view for several reads.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.shards.iter().map(Shard::load).collect())
    }

    /// The matched prefix of `chain` (hashes of `block_size`-token blocks, from the request's
    /// first block) on every location of that block size holding at least one block, with
    /// speculative entries counted if not lapsed at `now`. One row per location, unordered.
    pub fn lookup_chain(&self, chain: &[BlockHash], block_size: u32, now: f64) -> Vec<Match> {
        self.snapshot().lookup_chain(chain, block_size, now)
    }

    /// The matched prefix of `tokens` under `extra_key` (hashed with the index's seed for each
    /// block size in use) on every location.
    pub fn lookup_tokens(&self, tokens: &[u32], extra_key: Option<&[u8]>, now: f64) -> Vec<Match> {
        self.snapshot().lookup_tokens(tokens, extra_key, now)
    }

    /// Whether `apply` would now apply an event numbered `sequence` of (`instance`,
    /// `dp_rank`): not a duplicate, not dropped by a gap or a stall (`sequence.rs`). It
    /// predicts the sequence check only; an invalid event is still refused.
    pub fn can_apply(&self, instance: u64, dp_rank: u32, sequence: u64) -> bool {
        self.shard(instance)
            .load()
            .sources
            .admits(instance, dp_rank, sequence)
    }

    /// Every source's sequence state, sorted by (instance, dp rank).
    pub fn sources(&self) -> Vec<SourceState> {
        let mut out: Vec<SourceState> = self
            .shards
            .iter()
            .flat_map(|shard| shard.load().sources())
            .collect();
        out.sort_by_key(|s| (s.instance, s.dp_rank));
        out
    }

    /// Sizes and counters (summed over the writers' shards).
    pub fn stats(&self) -> IndexStats {
        let mut stats = IndexStats {
            entries: 0,
            speculative_entries: 0,
            blocks: 0,
            locations: 0,
            sources: 0,
            stalled_sources: 0,
            max_entries: self.config.max_entries,
            counters: IndexCounters::default(),
        };
        for shard in self.shards.iter() {
            let state = shard.load();
            let sources = state.sources();
            stats.entries += state.tree.entries;
            stats.speculative_entries += state.tree.speculative;
            stats.blocks += state.tree.len();
            stats.locations += state.locations.len();
            stats.sources += sources.len();
            stats.stalled_sources += sources.iter().filter(|s| s.stalled.is_some()).count();
            stats.counters.add(&state.counters);
        }
        stats
    }

    /// Bytes the index holds by part (capacities, not lengths; a rough account for memory
    /// studies): each copy's records, holder sets and extras, the shared table, the links,
    /// summed over the shards.
    #[doc(hidden)]
    pub fn heap_bytes(&self) -> Vec<(String, usize)> {
        let mut parts: Vec<(String, usize)> = Vec::new();
        for shard in self.shards.iter() {
            let mut mine = Vec::new();
            shard.heap_bytes(&mut mine);
            for (part, bytes) in mine {
                match parts.iter_mut().find(|(p, _)| *p == part) {
                    Some((_, total)) => *total += bytes,
                    None => parts.push((part, bytes)),
                }
            }
        }
        parts
    }

    /// How many writes found the spare copy held by a reader and copied instead of waiting.
    pub fn spare_copies(&self) -> u64 {
        self.shards.iter().map(Shard::spare_copies).sum()
    }

    /// The compact binary dump of the published state (see `dump.rs`): version 1 for an
    /// index of one writer, version 2 (one version-1 image per shard) for more.
    pub fn dump(&self) -> Vec<u8> {
        if self.shards.len() == 1 {
            return self.shards[0].dump();
        }
        let images: Vec<Vec<u8>> = self.shards.iter().map(Shard::dump).collect();
        dump::encode_shards(&images)
    }

    /// An index from a [`KVIndex::dump`] (with the dumped number of writers); `max_entries`
    /// overrides the dumped bound (the loaded index is then evicted down to it).
    /// `Err(InvalidArgument "data")` for a truncated, corrupt or unknown-version dump.
    pub fn load(data: &[u8], max_entries: Option<usize>) -> Result<Self> {
        if let Some(max) = max_entries {
            ensure_arg!(max >= 1, "max_entries", "must be >= 1, got 0");
        }
        let images = dump::decode_shards(data)?;
        let writers = images.len();
        if let Some(max) = max_entries {
            ensure_arg!(
                max >= writers,
                "max_entries",
                "must be >= the dump's writers ({writers}), got {max}"
            );
        }
        let mut shards = Vec::with_capacity(writers);
        let mut total = 0;
        let mut hash_seed = None;
        for (i, image) in images.iter().enumerate() {
            let (mut state, mut links) = dump::decode(image)?;
            if let Some(max) = max_entries {
                state.config.max_entries = share(max, i, writers);
                state.enforce_bound(&mut links);
            }
            if *hash_seed.get_or_insert(state.config.hash_seed) != state.config.hash_seed {
                return Err(KvPoolError::invalid(
                    "data",
                    "shards of different hash seeds",
                ));
            }
            for (_, location) in state.locations.iter() {
                if shard_of(location.key.instance, writers) != i {
                    return Err(KvPoolError::invalid(
                        "data",
                        format!("instance {} in the wrong shard", location.key.instance),
                    ));
                }
            }
            for source in state.sources() {
                if shard_of(source.instance, writers) != i {
                    return Err(KvPoolError::invalid(
                        "data",
                        format!("source of instance {} in the wrong shard", source.instance),
                    ));
                }
            }
            total += state.config.max_entries;
            state.config.writers = writers;
            shards.push(Shard::new(state, links));
        }
        let config = IndexConfig {
            max_entries: total,
            hash_seed: hash_seed.unwrap_or(crate::DEFAULT_HASH_SEED),
            writers,
        };
        Ok(Self {
            shards: shards.into_boxed_slice(),
            config,
        })
    }

    /// Checks every invariant: each shard's (each copy's, and that the two are equal once
    /// levelled), and that each shard holds only its own instances.
    pub fn check(&self) -> Result<()> {
        let shards = self.shards.len();
        for (i, shard) in self.shards.iter().enumerate() {
            shard.check()?;
            let state = shard.load();
            for (_, location) in state.locations.iter() {
                crate::error::ensure_invariant!(
                    shard_of(location.key.instance, shards) == i,
                    "instance {} in shard {i}",
                    location.key.instance
                );
            }
            for source in state.sources() {
                crate::error::ensure_invariant!(
                    shard_of(source.instance, shards) == i,
                    "source of instance {} in shard {i}",
                    source.instance
                );
            }
            crate::error::ensure_invariant!(
                state.config.max_entries == share(self.config.max_entries, i, shards),
                "shard {i} keeps {} entries of {}",
                state.config.max_entries,
                self.config.max_entries
            );
        }
        Ok(())
    }
}

impl std::fmt::Debug for KVIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stats = self.stats();
        write!(
            f,
            "KVIndex(entries={}, blocks={}, locations={}, sources={})",
            stats.entries, stats.blocks, stats.locations, stats.sources
        )
    }
}
