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
//! The state lives in two copies behind an [`arc_swap::ArcSwap`] (an RCU of immutable
//! snapshots with a recycled second copy, as `left-right` does): readers load the published
//! copy (lock-free) and walk it; the one writer (a mutex orders writers among themselves)
//! brings the other copy level with the published one, applies the new write there, and
//! publishes it with one atomic swap. A reader thus sees the state after some whole write,
//! never a torn one. Bringing a copy level is cheap: it copies the nodes the previous write
//! changed from the published copy (which the writer may read: it is immutable) and replays
//! that write's few steps outside the tree (`state.rs`), so no validation, sequence check or
//! hash probe is done twice; and the hash -> node table is one for both copies (`table.rs`):
//! the writer stores a new node there once, and tombstones a deleted one only once the other
//! copy is level too, so that each copy finds exactly its own nodes in it. The writer needs the unpublished copy to itself: readers that loaded it
//! before the last swap usually left long ago (a lookup takes microseconds); if one still
//! holds it after a short spin the writer deep-copies the published state (with a table of its
//! own, leaving the old one to the copies readers hold) rather than wait. Costs: two copies of
//! the nodes in memory, every node a write changes copied once more. The table's atomics are explained in
//! `table.rs` (with a loom model there); `arc-swap` and `Arc` provide the publication's
//! orderings; the stress test in `tests/index.rs` checks coherence (every answer equals the
//! answer of some published state).
//!
//! Invariants: both copies are equal after each replay (`check` compares their dumps); those
//! of [`IndexState::check`] on each.

mod dump;
mod event;
mod expiry;
mod holders;
mod location;
mod lookup;
mod sequence;
mod state;
mod table;
mod tree;
pub(crate) mod wire;

use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;

pub use event::{EventKind, GroupKind, IndexEvent, Medium, MAX_GROUPS};
pub use location::LocationKey;
pub use lookup::{Match, Matches, Row};
pub use sequence::{Gap, SourceState};
pub use state::{ApplyReport, IndexConfig, IndexCounters};

use crate::error::{ensure_invariant, KvPoolError, Result};
use crate::hash::BlockHash;
use state::{IndexState, Journal};

/// Spins (yielding) this many times for a reader to leave the unpublished copy before the
/// writer copies the published one instead.
const SPARE_SPINS: usize = 64;

/// Sizes and counters of an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexStats {
    /// Entries (one block hash at one location), speculative ones included.
    pub entries: usize,
    /// Entries inserted speculatively by the router, not yet confirmed by an event.
    pub speculative_entries: usize,
    /// Block hashes held (nodes, including parents kept only for their children).
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

struct Writer {
    /// The unpublished copy: equal to the published one once `journal` is replayed on it.
    spare: Arc<IndexState>,
    /// The published copy (the writer's own reference: it reads it to level the spare one).
    current: Arc<IndexState>,
    /// The last write's journal (replayed on `spare` when `pending`).
    journal: Journal,
    pending: bool,
    /// A write failed after changing the spare copy: copy the published one instead.
    dirty: bool,
    /// Nodes each copy reserves room for.
    capacity: usize,
    /// Writes that found the spare copy held by a reader and copied the published one.
    copies: u64,
}

/// A prefix index over the KV events of many instances (see the module doc).
pub struct KVIndex {
    published: ArcSwap<IndexState>,
    writer: Mutex<Writer>,
}

/// A consistent view of an index for several reads (holds one published copy alive).
pub struct Snapshot(Guard<Arc<IndexState>>);

impl Snapshot {
    /// The matched prefix of `chain` on every location of `block_size` (see
    /// [`KVIndex::lookup_chain`]), into `out` (cleared first; no allocation once `out` has
    /// grown): the fast path, compact. [`Matches::iter`] lists the rows, [`Matches::best`]
    /// the longest, [`Snapshot::to_match`] resolves one.
    pub fn lookup_into(&self, chain: &[BlockHash], block_size: u32, now: f64, out: &mut Matches) {
        out.clear();
        self.0.lookup_chain(chain, block_size, now, out);
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
        self.0.lookup_tokens(tokens, extra_key, now, out);
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
        out.extend(m.iter().map(|r| self.0.to_match(r)));
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

    /// The location of a row (`None` for an id this index never gave).
    pub fn location(&self, id: u32) -> Option<LocationKey> {
        self.0.location(id)
    }

    /// The [`Match`] of a row of this snapshot.
    pub fn to_match(&self, row: Row) -> Option<Match> {
        self.0.location(row.location).map(|_| self.0.to_match(row))
    }
}

impl KVIndex {
    /// An empty index; `Err` if `config.max_entries == 0`.
    pub fn new(config: IndexConfig) -> Result<Self> {
        Self::with_capacity(config, 0)
    }

    /// An empty index with room for `blocks` block hashes reserved (and its pages touched) in
    /// both copies, so that it does not grow (rehash, fault pages in) until it holds more.
    pub fn with_capacity(config: IndexConfig, blocks: usize) -> Result<Self> {
        Ok(Self::from_state(IndexState::new(config, blocks)?, blocks))
    }

    fn from_state(state: IndexState, capacity: usize) -> Self {
        let mut spare = state.clone(); // the same table: both copies are equal
        spare.tree.reserve(capacity);
        let current = Arc::new(state);
        Self {
            published: ArcSwap::new(Arc::clone(&current)),
            writer: Mutex::new(Writer {
                current,
                spare: Arc::new(spare),
                journal: Journal::default(),
                pending: false,
                dirty: false,
                capacity,
                copies: 0,
            }),
        }
    }

    /// The index's settings.
    pub fn config(&self) -> IndexConfig {
        self.published.load().config
    }

    /// The hasher of token-id lookups (the index's seed).
    pub fn hasher(&self) -> crate::hash::BlockHasher {
        self.published.load().hasher
    }

    /// Runs one write: brings the spare copy level, applies `write` to it (recording its
    /// journal) and publishes it.
    fn write<T>(
        &self,
        write: impl FnOnce(&mut IndexState, &mut Journal) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.writer.lock();
        let writer = &mut *guard;
        self.level_spare(writer)?;
        writer.journal.clear();
        let state = Arc::get_mut(&mut writer.spare)
            .ok_or_else(|| KvPoolError::Invariant("the spare copy is shared".into()))?;
        state.tree.begin_write();
        let before = state.tree.changed();
        match write(state, &mut writer.journal) {
            Ok(value) => {
                let next = Arc::clone(&writer.spare);
                // The old published copy comes back as the spare one; the writer's own
                // reference moves to the new one.
                writer.current = Arc::clone(&next);
                writer.spare = self.published.swap(next);
                writer.pending = true;
                Ok(value)
            }
            Err(e) => {
                // Validation comes first, so a failed write normally changed nothing.
                let state = &writer.spare;
                writer.dirty |= !writer.journal.steps.is_empty() || state.tree.changed() != before;
                Err(e)
            }
        }
    }

    /// Makes the spare copy the writer's alone and equal to the published one.
    fn level_spare(&self, writer: &mut Writer) -> Result<()> {
        let mut spins = 0;
        while Arc::get_mut(&mut writer.spare).is_none() && spins < SPARE_SPINS {
            std::thread::yield_now();
            spins += 1;
        }
        if writer.dirty || Arc::get_mut(&mut writer.spare).is_none() {
            // A reader still holds it: start from a copy of the published state, with a
            // table of its own (the old one stays as it is for the copies readers hold).
            let mut copy = IndexState::clone(&writer.current);
            copy.tree.reserve(writer.capacity);
            copy.tree.rebuild_table(2 * (copy.tree.len() + 1));
            writer.spare = Arc::new(copy);
            writer.pending = false;
            writer.dirty = false;
            writer.copies += 1;
            return Ok(());
        }
        if !writer.pending {
            return Ok(());
        }
        writer.pending = false;
        let state = Arc::get_mut(&mut writer.spare)
            .ok_or_else(|| KvPoolError::Invariant("the spare copy is shared".into()))?;
        let published = &writer.current;
        state.level_with(published, &writer.journal)?;
        // Neither copy holds the nodes the write deleted now (unless it made them again).
        state.tree.drop_deleted(published.tree.deleted());
        Ok(())
    }

    /// Applies a batch of `instance`'s events in order; `Err` (an invalid event, named) changes
    /// nothing. See `sequence.rs` for what gaps and duplicates do.
    pub fn apply(&self, instance: u64, events: impl AsRef<[IndexEvent]>) -> Result<ApplyReport> {
        let events = events.as_ref();
        self.write(|state, journal| state.apply(instance, events, journal))
    }

    /// Marks `chain` (a request's hashes from its first block) as held on the device of
    /// (`instance`, `dp_rank`) until `now + ttl`, unless a stored event confirms it first. First
    /// lapses what is due at `now`. Returns how many blocks were marked or extended.
    pub fn insert_speculative(
        &self,
        instance: u64,
        dp_rank: u32,
        block_size: u32,
        chain: Vec<BlockHash>,
        now: f64,
        ttl: f64,
    ) -> Result<usize> {
        self.write(|state, journal| {
            state.speculate(instance, dp_rank, block_size, &chain, now, ttl, journal)
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
        crate::error::ensure_arg!(block_size >= 1, "block_size", "must be >= 1, got 0");
        let chain = self
            .published
            .load()
            .hasher
            .chain(tokens, block_size as usize, extra_key);
        self.insert_speculative(instance, dp_rank, block_size, chain, now, ttl)
    }

    /// Drops the speculative entries that lapse at or before `now`; returns how many.
    pub fn expire(&self, now: f64) -> Result<usize> {
        self.write(|state, journal| state.expire(now, journal))
    }

    /// Drops every entry of (`instance`, `dp_rank`) on every medium and forgets its sequence
    /// number, so that its next event starts it afresh (after a gap the replay buffer cannot
    /// fill). Returns the entries dropped.
    pub fn resync(&self, instance: u64, dp_rank: u32) -> usize {
        self.write(|state, journal| state.forget(instance, Some(dp_rank), journal))
            .unwrap_or(0)
    }

    /// Drops every entry and source of `instance` (it left the fleet). Returns the entries.
    pub fn remove_instance(&self, instance: u64) -> usize {
        self.write(|state, journal| state.forget(instance, None, journal))
            .unwrap_or(0)
    }

    /// A consistent view for several reads.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.published.load())
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
        self.published
            .load()
            .sources
            .admits(instance, dp_rank, sequence)
    }

    /// Every source's sequence state, sorted by (instance, dp rank).
    pub fn sources(&self) -> Vec<SourceState> {
        self.published.load().sources()
    }

    /// Sizes and counters.
    pub fn stats(&self) -> IndexStats {
        let state = self.published.load();
        let sources = state.sources();
        IndexStats {
            entries: state.tree.entries,
            speculative_entries: state.tree.speculative,
            blocks: state.tree.len(),
            locations: state.locations.len(),
            sources: sources.len(),
            stalled_sources: sources.iter().filter(|s| s.stalled.is_some()).count(),
            max_entries: state.config.max_entries,
            counters: state.counters,
        }
    }

    /// How many writes found the spare copy held by a reader and copied instead of waiting.
    pub fn spare_copies(&self) -> u64 {
        self.writer.lock().copies
    }

    /// The compact binary dump of the published state (see `dump.rs`).
    pub fn dump(&self) -> Vec<u8> {
        dump::encode(&self.published.load())
    }

    /// An index from a [`KVIndex::dump`]; `max_entries` overrides the dumped bound (the
    /// loaded index is then evicted down to it). `Err(InvalidArgument "data")` for a
    /// truncated, corrupt or unknown-version dump.
    pub fn load(data: &[u8], max_entries: Option<usize>) -> Result<Self> {
        let mut state = dump::decode(data)?;
        if let Some(max) = max_entries {
            crate::error::ensure_arg!(max >= 1, "max_entries", "must be >= 1, got 0");
            state.config.max_entries = max;
            state.enforce_bound();
        }
        Ok(Self::from_state(state, 0))
    }

    /// Checks every invariant: each copy's, and that the two are equal once levelled.
    pub fn check(&self) -> Result<()> {
        let mut writer = self.writer.lock();
        self.level_spare(&mut writer)?;
        let spare = &writer.spare;
        let published = self.published.load();
        published.check()?;
        spare.check()?;
        spare.tree.check_same_as(&published.tree)?;
        ensure_invariant!(
            dump::encode(spare) == dump::encode(&published),
            "the two copies differ after the replay"
        );
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
