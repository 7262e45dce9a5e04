//! `LinearStatePrefixCache`: recurrent-state (GDN / Mamba) slots and their prefix checkpoints
//! (R22).
//!
//! A linear-attention layer keeps one fixed-size state per sequence instead of per-token KV. The
//! scheduler manages *slots* of those states: slot 0 is padding, the others come from a
//! [`SingleBlockManager`]. A slot is in exactly one state:
//! - **free**: in the slot manager's free list;
//! - **live**: held by a running sequence (the sequence holds the slot's handle), or acquired
//!   through [`LinearStatePrefixCache::acquire_live_slot`] (the cache holds it for the caller);
//! - **pending** checkpoint: reserved for a prefix hash; the worker will write the state into it;
//!   never matchable;
//! - **committed** checkpoint: matchable by prefix hash; on one of two O(1) LRU lists unless
//!   pinned by a planned restore (pinned checkpoints leave their list and come back at its
//!   tail). The **plain** list holds a pool's intermediate saves (a multiple of the checkpoint
//!   interval that no other prompt reached yet); the **kept** list holds the checkpoints a hit
//!   is likely to come back to: a prompt's last boundary, a junction of the prefix tree (R24),
//!   every checkpoint a hit restored, and every checkpoint of the cache's own API. Eviction
//!   takes the plain list first (R23's retention: docs/contract.md), each list oldest first.
//!
//! Invariants (checked by [`LinearStatePrefixCache::check`]): every pending or committed slot
//! (and every slot acquired through the API) is held by one cache handle and sits in the hash
//! index (pending and committed) under its hash. A committed slot that someone else holds too
//! (a pool's planned copy still writing it: a slot promoted before the copy into it was
//! confirmed) is pinned, since evicting it would free nothing (F2). The LRU list holds exactly
//! the unpinned committed slots, each on the list its `kept` flag names, stamps increasing
//! from the oldest end; `free + live + pending + committed == num_slots - 1`; only pending and
//! committed slots carry an anchor.
//!
//! A checkpoint a pool saves records the *link* of its boundary's last block (the anchor of the
//! full-attention entry before it, `crate::chain`) and that block's tokens: the state summarises
//! that one prefix, and the pool restores it only for a query whose verified walk reaches the
//! linked entry and whose last block has those tokens (R7), whatever the prefix hashes collide
//! with. A checkpoint reserved or promoted through this type's own API names a prefix
//! hash alone (anchor 0): its caller vouches for it, and a pool matches it by that hash. A save
//! whose boundary is not cached as its chain's yet carries a ticket (`prefix_cache/anchors.rs`)
//! that matches nothing until the pool resolves it ([`LinearStatePrefixCache::resolve_anchor`]).
//!
//! A pending slot reserved by a pool's save plan ([`LinearStatePrefixCache::reserve_planned`])
//! belongs to that plan: only the pool commits or cancels it (`commit_linear_state_plan`, a
//! deallocate), and the public `commit_checkpoint` / `cancel_checkpoint` refuse it (F3), so a
//! view of a pool's cache can neither make a checkpoint matchable before the worker wrote it nor
//! free a slot the worker is about to write.

mod check;
mod links;
mod lists;

use crate::alloc;
use crate::block::Block;
use crate::error::{ensure_arg, KvPoolError, Result};
use crate::hash::{BlockHash, ByHash};
use crate::manager::{BlockManager, SingleBlockManager};
use crate::prefix_cache::Anchor;

pub(crate) use links::Tail;

const NIL: u32 = u32::MAX;

/// The LRU list of the intermediate checkpoints (evicted first).
const PLAIN: usize = 0;
/// The LRU list of the checkpoints a hit is likely to come back to.
const KEPT: usize = 1;

/// What the cache holds a slot for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// The cache does not hold this slot (free, or live in a sequence).
    No,
    /// Live, acquired through the API.
    Live,
    /// Pending checkpoint.
    Pending,
    /// Committed checkpoint.
    Committed,
}

/// Counters of a [`LinearStatePrefixCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinearStateStats {
    /// Successful `lookup`s (restores planned by a pool count here).
    pub hits: u64,
    /// Committed checkpoints evicted (LRU or explicit `evict`).
    pub evictions: u64,
    /// Checkpoints committed (by `commit_checkpoint` or `promote`).
    pub commits: u64,
}

/// Slots of recurrent states and the prefix checkpoints among them (R22).
pub struct LinearStatePrefixCache {
    slots: SingleBlockManager,
    held: Vec<Option<Block>>,
    kind: Vec<Held>,
    hash_of: Vec<BlockHash>,
    pins: Vec<u32>,
    /// Pending slots that a pool's save plan reserved (see the module doc).
    planned: Vec<bool>,
    /// The link each pending or committed checkpoint records (0: a hash alone; module doc).
    anchors: Vec<Anchor>,
    /// The last block of each pool checkpoint (empty for the others).
    tails: Vec<Tail>,
    /// Pending and committed checkpoints by prefix hash.
    index: ByHash<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Which list a committed checkpoint goes on (`true`: kept).
    kept: Vec<bool>,
    /// When each listed checkpoint was last put on its list (the clock, below).
    stamps: Vec<u64>,
    /// Oldest unpinned committed checkpoint per list (plain, kept).
    head: [u32; 2],
    /// Newest unpinned committed checkpoint per list.
    tail: [u32; 2],
    /// Checkpoints on each list.
    listed: [usize; 2],
    /// The stamp the next listed checkpoint gets: a pool sets it to its prefix cache's clock,
    /// so a checkpoint's recency compares with the KV blocks' (one store, docs/hybrid.md).
    clock: u64,
    num_live_held: usize,
    num_pending: usize,
    num_committed: usize,
    num_pinned: usize,
    stats: LinearStateStats,
    /// Checkpoints committed (`true`) or evicted, for KV events (R21; `pool/events.rs`).
    pub(crate) events: Option<Vec<(bool, BlockHash)>>,
    /// Whether the API may take slots (`acquire_live_slot`, `reserve_checkpoint`, `promote`):
    /// not in a pool whose states take blocks of its one store (the pool secures their memory).
    api_slots: bool,
}

impl LinearStatePrefixCache {
    /// A cache of `num_slots` slots, slot 0 being padding (so `num_slots - 1` are usable).
    pub fn new(num_slots: usize) -> Result<Self> {
        let slots = SingleBlockManager::new(num_slots)?;
        let name = "num_slots";
        Ok(Self {
            slots,
            held: alloc::filled(num_slots, name, || None)?,
            kind: alloc::filled(num_slots, name, || Held::No)?,
            hash_of: alloc::filled(num_slots, name, BlockHash::default)?,
            pins: alloc::filled(num_slots, name, || 0)?,
            planned: alloc::filled(num_slots, name, || false)?,
            anchors: alloc::filled(num_slots, name, || 0)?,
            tails: alloc::filled(num_slots, name, Tail::default)?,
            index: ByHash::default(),
            prev: alloc::filled(num_slots, name, || NIL)?,
            next: alloc::filled(num_slots, name, || NIL)?,
            kept: alloc::filled(num_slots, name, || false)?,
            stamps: alloc::filled(num_slots, name, || 0)?,
            head: [NIL; 2],
            tail: [NIL; 2],
            listed: [0; 2],
            clock: 0,
            num_live_held: 0,
            num_pending: 0,
            num_committed: 0,
            num_pinned: 0,
            stats: LinearStateStats::default(),
            events: None,
            api_slots: true,
        })
    }

    /// Refuses the API's slot takers from now on (module doc of `groups/linear.rs`).
    pub(crate) fn refuse_api_slots(&mut self) {
        self.api_slots = false;
    }

    fn ensure_api_slots(&self) -> Result<()> {
        ensure_arg!(
            self.api_slots,
            "self",
            "this pool's linear states take blocks of its one store (linear_state_blocks): \
             only the pool takes their slots"
        );
        Ok(())
    }

    /// Records a commit (`true`) or an eviction of `hash` for KV events, when on.
    fn note(&mut self, committed: bool, hash: BlockHash) {
        if let Some(events) = self.events.as_mut() {
            events.push((committed, hash));
        }
    }

    /// Bytes a cache of `num_slots` slots allocates (for [`crate::alloc::probe`]).
    pub(crate) fn footprint(num_slots: usize) -> u128 {
        let per_slot = std::mem::size_of::<Option<Block>>()
            + std::mem::size_of::<Held>()
            + std::mem::size_of::<BlockHash>()
            + 4
            + 1
            + 8
            + std::mem::size_of::<Anchor>()
            + std::mem::size_of::<Tail>()
            + 1
            + 8;
        num_slots as u128 * (crate::block::BlockStore::BYTES_PER_ID + per_slot as u128)
    }

    /// Slots including the padding slot 0.
    pub fn num_slots(&self) -> usize {
        self.kind.len()
    }

    /// Free slots.
    pub fn num_free_slots(&self) -> usize {
        self.slots.counts().free
    }

    /// Live slots (held by sequences or acquired through the API).
    pub fn num_live_slots(&self) -> usize {
        self.slots.counts().used - self.num_pending - self.num_committed
    }

    /// Pending checkpoints.
    pub fn num_pending_checkpoints(&self) -> usize {
        self.num_pending
    }

    /// Committed checkpoints.
    pub fn num_committed_checkpoints(&self) -> usize {
        self.num_committed
    }

    /// Committed checkpoints pinned by planned restores.
    pub fn num_pinned_checkpoints(&self) -> usize {
        self.num_pinned
    }

    /// Slots that `acquire_slot` could hand out: free plus unpinned committed.
    pub fn num_available_slots(&self) -> usize {
        self.num_free_slots() + self.num_committed - self.num_pinned
    }

    /// Counters.
    pub fn stats(&self) -> LinearStateStats {
        self.stats
    }

    /// Whether `slot` is a handle of this cache's slot manager.
    pub fn owns(&self, slot: &Block) -> bool {
        self.slots.owns(slot)
    }

    /// Evicts the least-recently-used unpinned committed checkpoint, the plain list first;
    /// false if there is none.
    fn evict_one(&mut self) -> bool {
        let slot = match self.head[PLAIN] {
            NIL => self.head[KEPT],
            slot => slot,
        };
        if slot == NIL {
            return false;
        }
        self.evict_slot(slot);
        true
    }

    /// Evicts the unpinned committed checkpoint in `slot` (on the LRU list).
    fn evict_slot(&mut self, slot: u32) {
        self.unlink(slot);
        let hash = self.hash_of[slot as usize];
        self.index.remove(&hash.0);
        self.kind[slot as usize] = Held::No;
        self.anchors[slot as usize] = 0;
        self.tails[slot as usize] = Tail::default();
        self.kept[slot as usize] = false;
        self.num_committed -= 1;
        self.stats.evictions += 1;
        self.note(false, hash);
        self.held[slot as usize] = None; // drops the handle: the slot is free again
    }

    /// A slot handle for a sequence (R22): a free slot, evicting the least-recently-used
    /// unpinned committed checkpoint if none is free; `None` when every slot is live, pending or
    /// pinned.
    pub fn acquire_slot(&mut self) -> Option<Block> {
        if let Some(slot) = self.slots.allocate_one() {
            return Some(slot);
        }
        if self.evict_one() {
            return self.slots.allocate_one();
        }
        None
    }

    /// Takes a live slot that the cache holds for the caller; `OutOfBlocks` when every slot is
    /// live, pending or pinned.
    pub fn acquire_live_slot(&mut self) -> Result<u32> {
        self.ensure_api_slots()?;
        let slot = self.acquire_slot().ok_or(KvPoolError::OutOfBlocks {
            requested: 1,
            available: 0,
        })?;
        let id = slot.id();
        self.held[id as usize] = Some(slot);
        self.kind[id as usize] = Held::Live;
        self.num_live_held += 1;
        Ok(id)
    }

    fn check_slot(&self, slot: u32, name: &'static str) -> Result<()> {
        ensure_arg!(
            slot >= 1 && (slot as usize) < self.num_slots(),
            name,
            "must be in 1..{}, got {slot}",
            self.num_slots()
        );
        Ok(())
    }

    /// Releases a live slot taken with [`Self::acquire_live_slot`].
    pub fn release_live_slot(&mut self, slot: u32) -> Result<()> {
        self.check_slot(slot, "slot")?;
        ensure_arg!(
            self.kind[slot as usize] == Held::Live,
            "slot",
            "slot {slot} is not a live slot acquired from this cache"
        );
        self.kind[slot as usize] = Held::No;
        self.num_live_held -= 1;
        self.held[slot as usize] = None;
        Ok(())
    }

    /// Reserves a slot for the checkpoint of `prefix_hash` (pending: not matchable). `None` if
    /// the hash is already pending or committed, or if no slot can be had (R22).
    pub fn reserve_checkpoint(&mut self, prefix_hash: BlockHash) -> Option<u32> {
        if !self.api_slots {
            return None;
        }
        self.reserve(prefix_hash, 0, true)
    }

    /// [`Self::reserve_checkpoint`] of a checkpoint that ends at `anchor` (module doc).
    fn reserve(&mut self, prefix_hash: BlockHash, anchor: Anchor, kept: bool) -> Option<u32> {
        if self.index.contains_key(&prefix_hash.0) {
            return None;
        }
        let slot = self.acquire_slot()?;
        let id = slot.id();
        self.kept[id as usize] = kept;
        self.held[id as usize] = Some(slot);
        self.kind[id as usize] = Held::Pending;
        self.hash_of[id as usize] = prefix_hash;
        self.anchors[id as usize] = anchor;
        self.index.insert(prefix_hash.0, id);
        self.num_pending += 1;
        Some(id)
    }

    /// The pool's save plans: [`Self::reserve_checkpoint`] of the state whose last block has
    /// link `link` and is `tail`, the slot then belonging to the plan (module doc); `kept`: it
    /// goes on the kept list once committed.
    pub(crate) fn reserve_planned(
        &mut self,
        prefix_hash: BlockHash,
        link: Anchor,
        tail: Tail,
        kept: bool,
    ) -> Option<u32> {
        let slot = self.reserve(prefix_hash, link, kept)?;
        self.planned[slot as usize] = true;
        self.tails[slot as usize] = tail;
        Some(slot)
    }

    /// Pending checkpoints that belong to a pool's save plans (walks every slot; for `check`).
    pub fn num_planned_checkpoints(&self) -> usize {
        self.planned.iter().filter(|&&p| p).count()
    }

    /// Whether the pending checkpoint of `prefix_hash` belongs to a pool's save plan.
    pub fn is_planned(&self, prefix_hash: BlockHash) -> bool {
        self.index
            .get(&prefix_hash.0)
            .is_some_and(|&slot| self.planned[slot as usize])
    }

    fn pending_slot(&self, prefix_hash: BlockHash, planned: bool) -> Result<u32> {
        match self.index.get(&prefix_hash.0) {
            Some(&slot) if self.kind[slot as usize] == Held::Pending => {
                ensure_arg!(
                    self.planned[slot as usize] == planned,
                    "prefix_hash",
                    "the pending checkpoint {} belongs to a linear-state plan of the pool \
                     (commit_linear_state_plan confirms it, deallocate cancels it)",
                    prefix_hash.to_hex()
                );
                Ok(slot)
            }
            Some(_) => Err(KvPoolError::invalid(
                "prefix_hash",
                format!(
                    "the checkpoint {} is already committed",
                    prefix_hash.to_hex()
                ),
            )),
            None => Err(KvPoolError::invalid(
                "prefix_hash",
                format!(
                    "no pending checkpoint for {} (reserve_checkpoint first)",
                    prefix_hash.to_hex()
                ),
            )),
        }
    }

    /// Makes the pending checkpoint of `prefix_hash` matchable (the worker wrote its state).
    /// Returns its slot. A checkpoint a pool's plan reserved is refused (F3).
    pub fn commit_checkpoint(&mut self, prefix_hash: BlockHash) -> Result<u32> {
        let slot = self.pending_slot(prefix_hash, false)?;
        self.commit_slot(slot);
        Ok(slot)
    }

    /// [`Self::commit_checkpoint`] of a planned save (the pool's plan was confirmed).
    pub(crate) fn commit_planned(&mut self, prefix_hash: BlockHash) -> Result<u32> {
        let slot = self.pending_slot(prefix_hash, true)?;
        self.planned[slot as usize] = false;
        self.commit_slot(slot);
        Ok(slot)
    }

    fn commit_slot(&mut self, slot: u32) {
        self.kind[slot as usize] = Held::Committed;
        self.num_pending -= 1;
        self.num_committed += 1;
        self.stats.commits += 1;
        self.push_tail(slot);
        self.note(true, self.hash_of[slot as usize]);
    }

    /// Drops the pending checkpoint of `prefix_hash` (its save was cancelled); the slot is free.
    /// A checkpoint a pool's plan reserved is refused (F3).
    pub fn cancel_checkpoint(&mut self, prefix_hash: BlockHash) -> Result<()> {
        let slot = self.pending_slot(prefix_hash, false)?;
        self.cancel_slot(slot, prefix_hash);
        Ok(())
    }

    /// [`Self::cancel_checkpoint`] of a planned save (the pool cancelled it).
    pub(crate) fn cancel_planned(&mut self, prefix_hash: BlockHash) -> Result<()> {
        let slot = self.pending_slot(prefix_hash, true)?;
        self.planned[slot as usize] = false;
        self.cancel_slot(slot, prefix_hash);
        Ok(())
    }

    fn cancel_slot(&mut self, slot: u32, prefix_hash: BlockHash) {
        self.index.remove(&prefix_hash.0);
        self.kind[slot as usize] = Held::No;
        self.anchors[slot as usize] = 0;
        self.tails[slot as usize] = Tail::default();
        self.kept[slot as usize] = false;
        self.num_pending -= 1;
        self.held[slot as usize] = None;
    }

    /// Zero-copy save of a sequence's state: `live` becomes the committed checkpoint of
    /// `prefix_hash` and a fresh live slot comes back (the worker reads the old slot and writes
    /// the new one). `Err(live)` hands the slot back unchanged if the hash is already pending or
    /// committed, or no fresh slot can be had.
    pub fn promote_slot(
        &mut self,
        live: Block,
        prefix_hash: BlockHash,
    ) -> std::result::Result<Block, Block> {
        self.promote_anchored(live, prefix_hash, 0, Tail::default(), true)
    }

    /// [`Self::promote_slot`] of the state whose last block has link `link` and is `tail` (a
    /// pool's save, module doc); `kept`: it goes on the kept list.
    pub(crate) fn promote_anchored(
        &mut self,
        live: Block,
        prefix_hash: BlockHash,
        link: Anchor,
        tail: Tail,
        kept: bool,
    ) -> std::result::Result<Block, Block> {
        if self.index.contains_key(&prefix_hash.0) || !self.owns(&live) {
            return Err(live);
        }
        let Some(fresh) = self.acquire_slot() else {
            return Err(live);
        };
        let id = live.id() as usize;
        self.kept[id] = kept;
        self.adopt_committed(live, prefix_hash, link);
        self.tails[id] = tail;
        Ok(fresh)
    }

    fn adopt_committed(&mut self, slot: Block, prefix_hash: BlockHash, anchor: Anchor) {
        let id = slot.id();
        self.held[id as usize] = Some(slot);
        self.kind[id as usize] = Held::Committed;
        self.hash_of[id as usize] = prefix_hash;
        self.anchors[id as usize] = anchor;
        self.index.insert(prefix_hash.0, id);
        self.num_committed += 1;
        self.stats.commits += 1;
        self.push_tail(id);
        self.note(true, prefix_hash);
    }

    /// [`Self::promote_slot`] for a live slot acquired through the API: returns the new live
    /// slot; `ValueError`-style errors name the argument and change nothing.
    pub fn promote(&mut self, live_slot: u32, prefix_hash: BlockHash) -> Result<u32> {
        self.ensure_api_slots()?;
        self.check_slot(live_slot, "live_slot")?;
        ensure_arg!(
            self.kind[live_slot as usize] == Held::Live,
            "live_slot",
            "slot {live_slot} is not a live slot acquired from this cache"
        );
        ensure_arg!(
            !self.index.contains_key(&prefix_hash.0),
            "prefix_hash",
            "a checkpoint of this hash is already pending or committed"
        );
        let fresh = self.acquire_slot().ok_or(KvPoolError::OutOfBlocks {
            requested: 1,
            available: 0,
        })?;
        let Some(old) = self.held[live_slot as usize].take() else {
            // A live slot is held by its kind's invariant (checked by `check`); `fresh` goes back.
            return Err(KvPoolError::Invariant(format!(
                "live slot {live_slot} is not held"
            )));
        };
        self.num_live_held -= 1;
        self.kept[live_slot as usize] = true;
        self.adopt_committed(old, prefix_hash, 0);
        let id = fresh.id();
        self.held[id as usize] = Some(fresh);
        self.kind[id as usize] = Held::Live;
        self.num_live_held += 1;
        Ok(id)
    }

    /// Whether a committed checkpoint of `prefix_hash` exists (pending ones never match).
    pub fn contains(&self, prefix_hash: BlockHash) -> bool {
        self.peek(prefix_hash).is_some()
    }

    /// The slot of the committed checkpoint of `prefix_hash`, without touching recency.
    pub fn peek(&self, prefix_hash: BlockHash) -> Option<u32> {
        let &slot = self.index.get(&prefix_hash.0)?;
        (self.kind[slot as usize] == Held::Committed).then_some(slot)
    }

    /// The slot of the committed checkpoint of `prefix_hash`, refreshing its recency (a hit:
    /// the checkpoint moves to the kept list).
    pub fn lookup(&mut self, prefix_hash: BlockHash) -> Option<u32> {
        let slot = self.peek(prefix_hash)?;
        if self.pins[slot as usize] == 0 {
            self.unlink(slot);
            self.kept[slot as usize] = true;
            self.push_tail(slot);
        } else {
            self.keep_slot(slot);
        }
        self.stats.hits += 1;
        Some(slot)
    }

    /// Whether a pending checkpoint of `prefix_hash` exists.
    pub fn is_pending(&self, prefix_hash: BlockHash) -> bool {
        self.index
            .get(&prefix_hash.0)
            .is_some_and(|&slot| self.kind[slot as usize] == Held::Pending)
    }

    /// Whether the committed checkpoint of `prefix_hash` is pinned.
    pub fn is_pinned(&self, prefix_hash: BlockHash) -> bool {
        self.peek(prefix_hash)
            .is_some_and(|slot| self.pins[slot as usize] > 0)
    }

    /// Pins the committed checkpoint of `prefix_hash` (a restore from it is planned): it cannot
    /// be evicted until unpinned. Returns its slot.
    pub fn pin(&mut self, prefix_hash: BlockHash) -> Result<u32> {
        let slot = self.peek(prefix_hash).ok_or_else(|| {
            KvPoolError::invalid("prefix_hash", "no committed checkpoint for this hash")
        })?;
        if self.pins[slot as usize] == 0 {
            self.unlink(slot);
            self.num_pinned += 1;
        }
        self.pins[slot as usize] += 1;
        Ok(slot)
    }

    /// Undoes one [`Self::pin`]; the last unpin puts the checkpoint back at the LRU tail.
    pub fn unpin(&mut self, prefix_hash: BlockHash) -> Result<()> {
        let slot = self
            .peek(prefix_hash)
            .filter(|&slot| self.pins[slot as usize] > 0)
            .ok_or_else(|| {
                KvPoolError::invalid("prefix_hash", "no pinned checkpoint for this hash")
            })?;
        self.pins[slot as usize] -= 1;
        if self.pins[slot as usize] == 0 {
            self.num_pinned -= 1;
            self.push_tail(slot);
        }
        Ok(())
    }

    /// Evicts up to `n` committed checkpoints, least recently used first, never pinned ones.
    /// Returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        let mut evicted = 0;
        while evicted < n && self.evict_one() {
            evicted += 1;
        }
        evicted
    }

    /// Drops every committed checkpoint that nothing pins (R24's `reset_prefix_cache`).
    pub fn reset(&mut self) {
        while self.evict_one() {}
    }
}

impl std::fmt::Debug for LinearStatePrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinearStatePrefixCache")
            .field("num_slots", &self.num_slots())
            .field("free", &self.num_free_slots())
            .field("live", &self.num_live_slots())
            .field("pending", &self.num_pending)
            .field("committed", &self.num_committed)
            .finish()
    }
}

#[cfg(test)]
mod tests;
