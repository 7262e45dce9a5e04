//! `PrefixCache`: hash-keyed cache of full KV blocks with prefix-closed LRU eviction.
//!
//! Invariants (checked by [`PrefixCache::check`]):
//! - every entry is a full block of a chain: key = its chained hash (R6), with its tokens, its
//!   parent entry (or none for a chain's first block, then its extra key) kept beside it; a hit
//!   compares hash, parent and tokens, so a hash collision never hands out the wrong KV (R7);
//! - the cached set is closed under prefix: an entry's parent is an entry (R10), and
//!   `children` counts the entries whose parent it is;
//! - the cache holds exactly one reference of each entry's block (`CACHED` in its state word);
//! - the LRU list holds exactly the cache-only entries (state `CACHED|1`) that the cache has
//!   been told about; the others sit in the store's `released` stack (state has `QUEUED`) until
//!   the next operation drains it. Entries enter the LRU at the newest end in the order their
//!   last outside handle went (the stack's order, so a block's place is its release time, not
//!   the time of the drain), and carry a stamp that increases along the list. Whoever releases
//!   a whole table releases it tail first (`Sequence`, `deallocate`), so a chain is evicted
//!   from its tail (R10, R11);
//! - an entry another group anchored to (`anchors.rs`: a window block, a linear-state checkpoint
//!   records it) carries a process-unique anchor for exactly its life.
//!
//! "Least recently used" is the time a block last became cache-only (its last holder released
//! it; a hit makes it held, so the release after a hit refreshes it). Eviction is strictly LRU
//! among the evictable leaves (cache-only entries without children): a walk from the oldest
//! end passes entries that still have children and keeps its place between evictions; when an
//! eviction turns a parent it passed into a leaf, that parent competes by its own recency (F8)
//! among the late leaves, which go before the rest of the walk (segment_walk.rs). A block some
//! sequence holds is never on the list, so it is never evicted. Everything is O(1) per block
//! amortized (each parent is passed once while it stays listed), and O(log n) for a parent that
//! becomes a leaf after the walk passed it, which only arises when a chain's head was released
//! before its tail (or, under SLRU, sits in another segment).
//!
//! That is the default policy, [`Eviction::Lru`]. The others (policy.rs, R11a) split the nodes
//! into segments, each walked the same way (evict.rs); every policy evicts only leaves.

mod anchors;
mod attach;
mod check;
mod dedup;
mod describe;
mod evict;
mod graves;
mod insert;
mod keys;
mod lists;
mod physical;
mod policy;
mod segment_walk;

use crate::alloc;
use crate::block::{Block, StoreRef, CACHED, COUNT_MASK};
use crate::error::Result;
use crate::hash::{BlockHash, BlockHasher};
use crate::prefetch::prefetch;
// std, not the loom shim: a debug counter, outside every loom model.
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) use anchors::{is_ticket, ticket, Anchor, ROOT_LINK};
pub(crate) use attach::{AttachConfig, MAX_ATTACH_GROUPS};
pub(crate) use dedup::Switch;
use keys::{same_tokens, HashIndex};
use lists::{List, Lists};
use policy::HIT;
pub use policy::{Eviction, DEFAULT_PROTECTED_PERCENT};

const NIL: u32 = u32::MAX;

/// Extra key of a chain (cache salt, LoRA id, model namespace). Immutable shared bytes: always
/// `std::sync::Arc`, also under loom (see `sync.rs`).
pub type ExtraKey = std::sync::Arc<[u8]>;

/// One cache line per entry (64-byte aligned: a walk's read of an entry is one miss, not two).
#[derive(Clone)]
#[repr(align(64))]
struct Entry {
    /// A node: its chain hash. An attachment: its node's.
    hash: BlockHash,
    /// A node: its parent node (`NIL` for a chain's first block). An attachment: its node.
    parent: u32,
    depth: u32,
    /// A node: its child nodes. An attachment: how many marks protect it (attach.rs).
    children: u32,
    prev: u32,
    next: u32,
    live: bool,
    /// The eviction list the entry is on ([`List`]), or [`lists::NONE`].
    list: u8,
    /// [`attach::NODE`], or `1 + g` for an attachment of group `g`.
    kind: u8,
    /// A node's marks (attach.rs: `END`, `JUNCTION`), [`ANCHORED`], [`HIT`] (policy.rs) and
    /// `LATE` (segment_walk.rs).
    flags: u8,
    /// When the entry last entered a list (increases from the oldest end to the newest).
    stamp: u64,
    extra_key: Option<ExtraKey>,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            hash: BlockHash(0),
            parent: NIL,
            depth: 0,
            children: 0,
            prev: NIL,
            next: NIL,
            live: false,
            list: lists::NONE,
            kind: attach::NODE,
            flags: 0,
            stamp: 0,
            extra_key: None,
        }
    }
}

/// [`Entry`] flag: `anchors[id]` names this entry (another group anchored to it, `anchors.rs`).
const ANCHORED: u8 = 1 << 7;

impl Entry {
    #[inline]
    fn anchored(&self) -> bool {
        self.flags & ANCHORED != 0
    }

    #[inline]
    fn set_anchored(&mut self) {
        self.flags |= ANCHORED;
    }
}

const _: () = assert!(
    std::mem::size_of::<Entry>() == 64,
    "an entry is one cache line"
);

/// Token ids per cache line: blocks' tokens start on a line boundary (`PrefixCache::token_base`).
const TOKENS_PER_LINE: usize = 64 / std::mem::size_of::<u32>();

/// What happened in the cache, for KV events (R21).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Consecutive blocks of one chain became matchable.
    Stored {
        /// Chain hashes of the blocks.
        block_hashes: Vec<BlockHash>,
        /// Hash of the first block's parent (`None` for a chain's first block).
        parent_hash: Option<BlockHash>,
        /// Tokens of the blocks.
        token_ids: Vec<u32>,
        /// The chain's extra key.
        extra_key: Option<ExtraKey>,
    },
    /// Blocks left the cache (eviction).
    Removed {
        /// Chain hashes of the blocks.
        block_hashes: Vec<BlockHash>,
        /// The chain's extra key.
        extra_key: Option<ExtraKey>,
    },
    /// Every entry was dropped (`reset`).
    Cleared,
}

/// Counters of the cache's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Tokens of full blocks looked up by recorded queries.
    pub query_tokens: u64,
    /// Tokens of those that hit.
    pub hit_tokens: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Blocks inserted.
    pub insertions: u64,
}

/// Result of a side-effect-free lookup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    /// Leading blocks that would hit.
    pub matched: usize,
    /// How many of those are cache-only now (a match would make them used).
    pub cache_only: usize,
}

/// Hash-keyed prefix cache over the blocks of one [`BlockStore`].
pub struct PrefixCache {
    store: StoreRef,
    hasher: BlockHasher,
    block_size: usize,
    index: HashIndex,
    entries: Vec<Entry>,
    /// Every entry's tokens, `block_size` per block from `token_base`, the index of the first
    /// item on a cache-line boundary (so a 16-token block is exactly one line).
    tokens: Vec<u32>,
    token_base: usize,
    /// The eviction lists (lists.rs): the LRU of nodes, and with attachments the low-value and
    /// the protected lists.
    lists: Lists,
    /// Stamp of the next entry pushed on a list.
    clock: u64,
    /// How the nodes are ordered for eviction (policy.rs).
    eviction: Eviction,
    /// Nodes the protected segment may hold (SLRU, policy.rs).
    protected_cap: usize,
    /// Blocks attached to nodes by other groups of a shared store (attach.rs); empty without.
    attach: attach::Attachments,
    epoch: u64,
    stats: CacheStats,
    events: Option<Vec<CacheEvent>>,
    scratch: Vec<u32>,
    /// The anchor of each anchored entry, 0 for the others (`anchors.rs`).
    anchors: Vec<u64>,
    /// What the cache remembers of the anchored entries it removed (`graves.rs`).
    graves: graves::Graveyard,
    /// Whether removed anchored entries leave graves (`graves.rs`: a pool with linear state).
    burying: bool,
    /// Walks of a chain through the index (probes and matches), for tests of admission's one
    /// walk (a debug counter, never part of `stats`).
    walks: AtomicU64,
    /// Hashes of evicted nodes, one per slot (`hash % len`): whether a chain that stops at a
    /// hash stops because that block was evicted ("why no hit", docs/hybrid.md). A filter: a
    /// later eviction may overwrite a slot.
    ghosts: Vec<u64>,
    /// Where the eviction walk of each node segment stands (segment_walk.rs).
    segment_walks: segment_walk::SegmentWalks,
    /// Entries those walks looked at (a debug counter, segment_walk.rs).
    segment_walk_steps: u64,
}

/// Bit set on an id [`PrefixCache::walk`] reports when the cache alone holds the block (ids are
/// below [`crate::MAX_BLOCKS`], so the bit is free).
pub(crate) const CACHE_ONLY_BIT: u32 = 1 << 31;

impl PrefixCache {
    /// Bytes the cache spends per block of `block_size` tokens (entry and tokens).
    pub(crate) fn bytes_per_block(block_size: usize) -> u128 {
        (std::mem::size_of::<Entry>() + 4 * block_size + std::mem::size_of::<u64>()) as u128
    }

    /// The cache of `store`'s blocks; an error naming `num_blocks` if its per-block arrays
    /// cannot be allocated (F1).
    pub(crate) fn new(store: StoreRef, hasher: BlockHasher) -> Result<Self> {
        let n = store.num_blocks();
        let block_size = store.block_size as usize;
        let tokens = alloc::filled(n * block_size + TOKENS_PER_LINE - 1, "num_blocks", || 0)?;
        let misalignment = tokens.as_ptr() as usize % 64 / std::mem::size_of::<u32>();
        let token_base = (TOKENS_PER_LINE - misalignment) % TOKENS_PER_LINE;
        Ok(Self {
            store,
            hasher,
            block_size,
            index: HashIndex::default(),
            entries: alloc::filled(n, "num_blocks", Entry::default)?,
            tokens,
            token_base,
            lists: Lists::default(),
            clock: 0,
            eviction: Eviction::Lru,
            protected_cap: 0,
            attach: attach::Attachments::default(),
            epoch: 0,
            stats: CacheStats::default(),
            events: None,
            scratch: Vec::new(),
            anchors: alloc::filled(n, "num_blocks", || 0)?,
            graves: graves::Graveyard::default(),
            burying: false,
            walks: AtomicU64::new(0),
            ghosts: alloc::filled(n, "num_blocks", || 0)?,
            segment_walks: segment_walk::SegmentWalks::default(),
            segment_walk_steps: 0,
        })
    }

    /// The hasher (seed) of this cache.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Number of cached blocks (entries), held or not.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Incremented by every `reset`; lets callers know published blocks were dropped.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Starts (or stops) recording [`CacheEvent`]s.
    pub fn set_record_events(&mut self, on: bool) {
        self.events = if on { Some(Vec::new()) } else { None };
    }

    /// Takes the recorded events.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Adds to the query/hit statistics.
    pub fn record_query(&mut self, query_blocks: usize, hit_blocks: usize) {
        self.stats.query_tokens += (query_blocks * self.block_size) as u64;
        self.stats.hit_tokens += (hit_blocks * self.block_size) as u64;
    }

    /// The block id cached under `hash`, if any.
    pub fn block_id(&self, hash: BlockHash) -> Option<u32> {
        self.index.get(&hash.0).copied()
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.index.contains_key(&hash.0)
    }

    /// Where block `id`'s tokens start in `tokens`.
    fn token_start(&self, id: u32) -> usize {
        self.token_base + id as usize * self.block_size
    }

    fn block_tokens(&self, id: u32) -> &[u32] {
        let start = self.token_start(id);
        &self.tokens[start..start + self.block_size]
    }

    /// The entry for block `i` of a chain, verified (R7): same hash, same parent entry (or same
    /// extra key for a chain's first block) and same tokens.
    #[inline]
    fn find(
        &self,
        hash: BlockHash,
        parent: u32,
        extra_key: Option<&[u8]>,
        tokens: &[u32],
    ) -> Option<u32> {
        let &id = self.index.get(&hash.0)?;
        self.verified(id, parent, extra_key, tokens).then_some(id)
    }

    /// Whether entry `id` (found under a block's hash) is that block: same parent entry (or
    /// same extra key for a chain's first block) and same tokens (R7).
    #[inline]
    fn verified(&self, id: u32, parent: u32, extra_key: Option<&[u8]>, tokens: &[u32]) -> bool {
        let entry = &self.entries[id as usize];
        let same_parent =
            entry.parent == parent && (parent != NIL || entry.extra_key.as_deref() == extra_key);
        same_parent && same_tokens(self.block_tokens(id), tokens)
    }

    /// Counts the leading blocks of a chain that would hit, without any side effect.
    /// `hashes` are the chain's hashes (R6) of the full blocks of `tokens`.
    pub fn probe(
        &self,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        max_blocks: usize,
    ) -> Probe {
        let mut ids = Vec::new();
        self.walk(hashes, tokens, extra_key, max_blocks, &mut ids);
        Probe {
            matched: ids.len(),
            cache_only: ids.iter().filter(|&&id| id & CACHE_ONLY_BIT != 0).count(),
        }
    }

    /// The one walk of a chain (R7): appends to `out` the ids of its leading cached blocks (at
    /// most `max_blocks`), each with [`CACHE_ONLY_BIT`] set when only the cache holds it. No side
    /// effect but the walk counter; [`Self::retain`] then takes exactly these blocks as long as
    /// the cache was not changed in between (handle drops elsewhere do not change it).
    pub(crate) fn walk(
        &self,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        max_blocks: usize,
        out: &mut Vec<u32>,
    ) {
        // Relaxed: a debug counter.
        self.walks.fetch_add(1, Ordering::Relaxed);
        // Two passes, so that the misses of a long chain overlap (each block's index slot,
        // entry, tokens and state word are usually cold): first the index look-ups, which do
        // not depend on one another, each asking for its entry's lines; then the checks in
        // chain order (R7), cut at the first block that fails. Same answer as one pass.
        let start = out.len();
        for &hash in hashes.iter().take(max_blocks) {
            let Some(&id) = self.index.get(&hash.0) else {
                break;
            };
            prefetch(&self.entries[id as usize]);
            prefetch(&self.tokens[self.token_start(id)]);
            self.store.prefetch_state(id);
            out.push(id);
        }
        let mut parent = NIL;
        for i in 0..out.len() - start {
            let id = out[start + i];
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            if !self.verified(id, parent, extra_key, block) {
                out.truncate(start + i);
                break;
            }
            let state = self.store.state(id);
            let cache_only = state & (CACHED | COUNT_MASK) == CACHED | 1;
            out[start + i] = id | if cache_only { CACHE_ONLY_BIT } else { 0 };
            parent = id;
        }
    }

    /// New handles of the blocks of `ids` (from [`Self::walk`], flags ignored), appended to
    /// `out` in order: they become used, so they leave the LRU. The ids must still be entries
    /// of this cache (no insert, evict or reset since the walk).
    pub(crate) fn retain(&mut self, ids: &[u32], out: &mut Vec<Block>) {
        self.drain_released();
        out.reserve(ids.len());
        // The handles' store references, and the cache-only count's `-1`s, each in one update.
        let mut refs = self.store.reserve(ids.len());
        let mut were_cache_only = 0;
        for &flagged in ids {
            let id = flagged & !CACHE_ONLY_BIT;
            debug_assert!(
                self.entries[id as usize].live,
                "walked block {id} left the cache"
            );
            self.list_unlink(id);
            self.entries[id as usize].flags |= HIT;
            let (block, was_cache_only) = refs.retain_cached(id);
            were_cache_only += usize::from(was_cache_only);
            out.push(block);
        }
        self.store.sub_cache_only(were_cache_only);
    }

    /// Chain walks so far (probes, walks and matches): a debug counter.
    pub(crate) fn num_walks(&self) -> u64 {
        // Relaxed: a debug counter.
        self.walks.load(Ordering::Relaxed)
    }

    /// Hands out new handles of the leading cached blocks of a chain (at most `max_blocks`),
    /// appended to `out`; returns how many. Matched blocks become used, so they leave the LRU.
    /// One walk: each block is retained as it is found.
    pub fn match_prefix(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        extra_key: Option<&[u8]>,
        max_blocks: usize,
        out: &mut Vec<Block>,
    ) -> usize {
        // Relaxed: a debug counter.
        self.walks.fetch_add(1, Ordering::Relaxed);
        self.drain_released();
        let mut parent = NIL;
        let mut matched = 0;
        for (i, &hash) in hashes.iter().enumerate().take(max_blocks) {
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let Some(id) = self.find(hash, parent, extra_key, block) else {
                break;
            };
            self.list_unlink(id);
            self.entries[id as usize].flags |= HIT;
            out.push(self.store.retain_cached(id));
            matched += 1;
            parent = id;
        }
        matched
    }

    /// Moves the blocks whose last outside handle went away onto their eviction list, in the
    /// order they were released (F9: a block's place is its release time, whenever the drain
    /// runs): nodes onto the LRU list, attachments and useless leaves by their class (attach.rs).
    pub fn drain_released(&mut self) {
        self.apply_pending_marks();
        let mut batch = std::mem::take(&mut self.scratch);
        // The whole stack at once (one CAS), then each id's QUEUED bit cleared: from then on a
        // drop may queue it anew, so its link was read first (`take_all`).
        self.store.released.take_all(&mut batch);
        let (store, entries) = (&self.store, &self.entries);
        batch.retain(|&id| {
            let state = store.clear_queued(id);
            let entry = &entries[id as usize];
            state & (CACHED | COUNT_MASK) == CACHED | 1 && entry.live && entry.list == lists::NONE
        });
        // The stack holds the newest release first.
        for &id in batch.iter().rev() {
            match self.class_of(id) {
                List::Main if self.eviction != Eviction::Lru => self.push_node(id),
                list => self.list_push(list, id),
            }
        }
        batch.clear();
        self.scratch = batch;
    }

    /// The cached parent of cached block `id`: `None` for a chain's first block, or when `id`
    /// is not cached.
    pub fn parent_of(&self, id: u32) -> Option<u32> {
        let entry = self.entries.get(id as usize)?;
        (entry.live && entry.parent != NIL).then_some(entry.parent)
    }

    /// Every cached block (held or not) with its cached parent, unordered.
    pub fn entries(&self) -> impl Iterator<Item = (u32, Option<u32>)> + '_ {
        self.index.values().map(|&id| {
            let parent = self.entries[id as usize].parent;
            (id, (parent != NIL).then_some(parent))
        })
    }

    /// How many times a block entered the LRU list so far (became evictable and was drained):
    /// a change tells a caller that some block became cache-only since it last looked.
    pub fn lru_insertions(&self) -> u64 {
        self.clock
    }

    /// Removes a cache-only leaf node on a list and frees its block, with its attachments and
    /// marks (attach.rs); returns its hash and extra key and how many attached blocks it freed.
    fn remove_entry(&mut self, id: u32) -> (BlockHash, Option<ExtraKey>, usize) {
        self.list_unlink(id);
        let attached = self.detach_all(id);
        self.unmark(id);
        if self.entries[id as usize].anchored() {
            // The anchor leaves with the entry; its grave gives it to the next entry of the same
            // chain position.
            let anchor = std::mem::take(&mut self.anchors[id as usize]);
            if self.burying {
                self.bury(id, anchor);
            }
        }
        let entry = std::mem::take(&mut self.entries[id as usize]);
        self.index.remove(&entry.hash.0);
        if entry.parent != NIL {
            self.child_removed(entry.parent);
        }
        let freed = self.store.unmark_cached(id);
        debug_assert!(freed, "evicted block {id} was held");
        self.remember_evicted(entry.hash);
        (entry.hash, entry.extra_key, attached)
    }

    /// Drops every entry (R12): cache-only blocks go back to the free list, held blocks stay
    /// with their holders (they are just no longer cached).
    pub fn reset(&mut self) {
        self.drain_released();
        self.reset_attachments();
        let ids: Vec<u32> = self.index.values().copied().collect();
        self.index.clear();
        for id in ids {
            if self.entries[id as usize].anchored() {
                self.anchors[id as usize] = 0;
            }
            self.entries[id as usize] = Entry::default();
            self.store.unmark_cached(id);
        }
        self.lists_clear();
        self.graves.clear();
        self.epoch += 1;
        if let Some(events) = self.events.as_mut() {
            events.push(CacheEvent::Cleared);
        }
    }

    /// Records an evicted node's hash in the ghost filter.
    fn remember_evicted(&mut self, hash: BlockHash) {
        let len = self.ghosts.len() as u128;
        if len > 0 {
            self.ghosts[(hash.0 % len) as usize] = (hash.0 >> 64) as u64 | 1;
        }
    }

    /// Tells the ghost filter that `hash` was evicted, as an eviction does (tests of ghost
    /// admission that choose what it remembers).
    #[cfg(test)]
    pub(crate) fn ghost_remember(&mut self, hash: BlockHash) {
        self.remember_evicted(hash);
    }

    /// Whether the ghost filter remembers the eviction of `hash`, cached again or not (a later
    /// eviction may have overwritten it).
    #[inline]
    pub(super) fn ghost_remembers(&self, hash: BlockHash) -> bool {
        let len = self.ghosts.len() as u128;
        len > 0 && self.ghosts[(hash.0 % len) as usize] == (hash.0 >> 64) as u64 | 1
    }

    /// Whether block `hash` was evicted from this cache (and is not cached again): the ghost
    /// filter's answer, which may forget an eviction a later one overwrote.
    pub(crate) fn was_evicted(&self, hash: BlockHash) -> bool {
        self.ghost_remembers(hash) && !self.contains(hash)
    }

    /// Hashes of every node (unordered).
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.index.keys().map(|&h| BlockHash(h)).collect()
    }
}
