//! `Block` handles and the `BlockStore` they point into.
//!
//! A [`Block`] is shared ownership of one physical block id, with exactly `Arc`'s semantics:
//! cloning raises the id's reference count, dropping lowers it, and the drop that takes it to
//! zero pushes the id back to the store's free list: never earlier, never twice (R4). The
//! records live in one slab (`BlockStore`): one atomic state word per id, no heap allocation
//! per block.
//!
//! State word of an id (one `AtomicU32`, so every transition is observed exactly once):
//! - bits 0..30: reference count (handles, including the prefix cache's if cached);
//! - bit 30 `QUEUED`: the id sits in the `released` stack, waiting for the prefix cache to put
//!   it on its LRU list (set only together with the transition described next, cleared only by
//!   the cache after popping it; so `QUEUED` <=> in the stack);
//! - bit 31 `CACHED`: the prefix cache holds one of the references.
//!
//! Invariants (R2): an id is **free** iff its count is 0 (then it is in the free list exactly
//! once), **cached** iff its state is `CACHED | 1` (only the cache holds it), **used** otherwise.
//! `cache_only` counts the cached ids; it changes only on the transitions `CACHED|2 -> CACHED|1`
//! (a handle drop: +1) and `CACHED|1 -> CACHED|2 / 0` (the cache hands out or evicts: -1), each
//! of which is a single atomic update of the state word, so the count cannot drift.
//! A handle drop never takes a lock (R27): it only touches the state word, the free list and the
//! `released` stack, all lock-free.
//!
//! Concurrency (with [`crate::ConcurrentBlockManager`], R27). Handle clones and drops run on any
//! thread at any time; every change of `CACHED` or of the cache's own reference (`mark_cached`,
//! `retain_cached`, `unmark_cached`, `clear_queued`) runs under the cache's lock. Since each
//! transition is one atomic read-modify-write (a CAS loop for drops), the races resolve as:
//! - **last two handles dropped at once**: the two decrements are ordered on the state word; only
//!   the one that moves the count `1 -> 0` pushes the id to the free list (exactly once), and for
//!   a cached block only the one that moves `CACHED|2 -> CACHED|1` queues it.
//! - **match vs. drop** of a cached block (`CACHED|2`): the match's `+1` and the drop's `-1`
//!   commute. Drop first: `CACHED|1|QUEUED` is queued, then the match makes it
//!   `CACHED|2|QUEUED`; the cache later pops it, clears `QUEUED`, sees a count of 2 and keeps it
//!   off the LRU. Match first: `CACHED|3 -> CACHED|2`, nothing queued. The cache-only counter may
//!   briefly see the match's `-1` before the drop's `+1` (see `num_cache_only`).
//! - **evict vs. match**: both hold the lock. Only ids on the LRU are evicted, and an id is on
//!   the LRU only while its state is `CACHED|1` (no handle outside the cache exists, so no thread
//!   can clone or drop one): the LRU push re-reads the state after clearing `QUEUED`, and a match
//!   unlinks the id before handing a handle out. So an eviction never frees a held block.
//! - **drop vs. drain**: the cache pops an id, then clears `QUEUED` and reads the state in one
//!   `fetch_and`. A drop in between sees `QUEUED` still set and does not push the id again; the
//!   drain's read of the state then includes that drop. A drop after it queues the id anew.
//! - **reset vs. drop**: `unmark_cached` may meet an id that a racing drop just queued
//!   (`CACHED|1|QUEUED`); the id is freed with `QUEUED` still set and stays in the stack until the
//!   next drain pops it and, seeing it uncached, skips it. `QUEUED` <=> in the stack still holds.

use crossbeam_utils::CachePadded;

use crate::alloc;
use crate::bulk_arc::{BulkArc, Reserved};
use crate::error::Result;
use crate::free_list::FreeList;
use crate::hash::BlockHash;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// What a [`Block`] holds of its store: `Arc<BlockStore>` whose references a table of handles
/// can make and give up in bulk (bulk_arc.rs).
pub(crate) type StoreRef = BulkArc<BlockStore>;

pub(crate) const COUNT_MASK: u32 = (1 << 30) - 1;
pub(crate) const QUEUED: u32 = 1 << 30;
pub(crate) const CACHED: u32 = 1 << 31;

/// The slab behind every [`Block`] of one manager.
pub(crate) struct BlockStore {
    /// Tokens per block of the manager that owns this store.
    pub(crate) block_size: u32,
    states: Box<[AtomicU32]>,
    hashes: Box<[[AtomicU64; 2]]>,
    pub(crate) free: FreeList,
    /// Ids that just became cache-only, for the prefix cache's LRU (see module doc).
    pub(crate) released: FreeList,
    cache_only: CachePadded<AtomicUsize>,
}

impl BlockStore {
    /// A store of `num_blocks` ids whose free list holds `1..num_blocks` (id 0 is the padding
    /// block and is never handed out, R1); an error naming `name` if it cannot be allocated.
    pub(crate) fn new(num_blocks: usize, block_size: u32, name: &'static str) -> Result<Self> {
        let free = FreeList::try_with_ids(num_blocks, 1..num_blocks as u32, name)?;
        Self::with_free_list(num_blocks, block_size, free, name)
    }

    /// A store of `num_blocks` ids whose free list starts empty: for a manager that keeps the
    /// free ids in a structure of its own and uses the store's free list only as the inbox of
    /// the ids released since its last call (`XTensorBlockManager`'s pages).
    pub(crate) fn with_empty_free_list(
        num_blocks: usize,
        block_size: u32,
        name: &'static str,
    ) -> Result<Self> {
        let free = FreeList::try_new(num_blocks, name)?;
        Self::with_free_list(num_blocks, block_size, free, name)
    }

    fn with_free_list(
        num_blocks: usize,
        block_size: u32,
        free: FreeList,
        name: &'static str,
    ) -> Result<Self> {
        Ok(Self {
            block_size,
            states: alloc::boxed(num_blocks, name, || AtomicU32::new(0))?,
            hashes: alloc::boxed(num_blocks, name, || [AtomicU64::new(0), AtomicU64::new(0)])?,
            free,
            released: FreeList::try_new(num_blocks, name)?,
            cache_only: CachePadded::new(AtomicUsize::new(0)),
        })
    }

    /// Bytes a store spends per id (state word, hash, both free lists' links).
    pub(crate) const BYTES_PER_ID: u128 = 4 + 16 + 4 + 4;

    pub(crate) fn num_blocks(&self) -> usize {
        self.states.len()
    }

    /// Number of cached (cache-only) ids, clamped to `0..num_blocks`.
    ///
    /// The counter is updated right after the state-word transition that justifies it, not in
    /// the same atomic step, so under concurrency it can lag: a handle drop's `+1` may land after
    /// the cache's `-1` for the same id (the cache handed the block out again or evicted it in
    /// between), and the raw word then wraps below zero for a moment. Reading it as signed and
    /// clamping keeps every snapshot in range; at quiescence it is exact (R2).
    #[inline]
    pub(crate) fn num_cache_only(&self) -> usize {
        // Relaxed: a counter snapshot, exact at quiescence (module doc).
        let raw = self.cache_only.load(Ordering::Relaxed) as isize;
        (raw.max(0) as usize).min(self.states.len())
    }

    /// Asks the cache for block `id`'s state word (a hint before a walk reads it).
    #[inline]
    pub(crate) fn prefetch_state(&self, id: u32) {
        crate::prefetch::prefetch(&self.states[id as usize]);
    }

    #[inline]
    pub(crate) fn state(&self, id: u32) -> u32 {
        // Acquire: pairs with the Release of `mark_cached` so a reader that sees CACHED sees the
        // hash written before it.
        self.states[id as usize].load(Ordering::Acquire)
    }

    /// Turns a freshly popped free id's state into its first handle's (the caller makes the
    /// handle: [`StoreRef::take`], [`Reserved::take_block`]).
    #[inline]
    fn take_state(&self, id: u32) {
        let state = &self.states[id as usize];
        // Relaxed, both: the id came out of the free list through an Acquire pop, which already
        // orders everything its previous owner did; only the count itself changes here.
        // A free id's word is 0 or QUEUED (a reset freed it while it sat in `released`). At 0
        // no other thread can write it until we hand the id out: `QUEUED` is set only by a drop
        // from count 2, and the drain's `fetch_and` touches only queued ids. So a plain store
        // suffices there (no read-modify-write on the hot path); a queued id keeps its bit
        // through `fetch_add`, racing the drain's `fetch_and` safely.
        let current = state.load(Ordering::Relaxed);
        debug_assert_eq!(current & COUNT_MASK, 0, "allocated id {id} was not free");
        if current == 0 {
            state.store(1, Ordering::Relaxed);
        } else {
            state.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Adds a handle to a block someone already holds (the caller proves it with `&Block` or, for
    /// the cache, with `CACHED`). Returns the previous state.
    #[inline]
    fn retain(&self, id: u32) -> u32 {
        // Relaxed: like `Arc::clone`, a new reference is made from an existing one, so no other
        // memory needs ordering; the count cannot be zero concurrently.
        self.states[id as usize].fetch_add(1, Ordering::Relaxed)
    }

    /// Drops one handle of `id` (see module doc for the transitions).
    #[inline]
    fn release(&self, id: u32) {
        let state = &self.states[id as usize];
        // Relaxed: the CAS below re-validates.
        let mut current = state.load(Ordering::Relaxed);
        loop {
            let count = current & COUNT_MASK;
            debug_assert!(count >= 1, "release of block {id} with no handle");
            let to_cache_only = current & CACHED != 0 && count == 2;
            let mut new = current - 1;
            if to_cache_only {
                new |= QUEUED;
            }
            // AcqRel: Release so this handle's uses happen-before whoever frees or evicts the
            // block next; Acquire so the last dropper sees every other handle's uses (as Arc's
            // drop does). Relaxed on failure: retry with the fresh value.
            match state.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    if count == 1 {
                        // Last handle: never CACHED here (the cache would hold one more).
                        self.free.push(id);
                    } else if to_cache_only {
                        // Relaxed: a statistic made exact by the single state transition above.
                        self.cache_only.fetch_add(1, Ordering::Relaxed);
                        if current & QUEUED == 0 {
                            self.released.push(id);
                        }
                    }
                    return;
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// `release`'s state-word transition alone, for [`crate::release::release_all`], which
    /// makes the pushes and the cache-only count update of a whole run of ids at once. The same
    /// CAS loop and orderings as `release` (see there); returns what `release` would then do.
    /// (`release` keeps its own copy of the loop: written as this call and a `match`, the
    /// single drop costs 6-7 more instructions, valgrind-counted on the allocate/free cells.)
    #[inline]
    pub(crate) fn release_transition(&self, id: u32) -> Released {
        let state = &self.states[id as usize];
        // Relaxed: the CAS below re-validates.
        let mut current = state.load(Ordering::Relaxed);
        loop {
            let count = current & COUNT_MASK;
            debug_assert!(count >= 1, "release of block {id} with no handle");
            let to_cache_only = current & CACHED != 0 && count == 2;
            let mut new = current - 1;
            if to_cache_only {
                new |= QUEUED;
            }
            // AcqRel, Relaxed on failure: as in `release` (this handle's uses happen-before
            // whoever frees or evicts the block next; the last dropper sees the others' uses).
            match state.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) if count == 1 => return Released::Freed,
                Ok(_) if to_cache_only => {
                    return Released::CacheOnly {
                        queue: current & QUEUED == 0,
                    }
                }
                Ok(_) => return Released::Held,
                Err(actual) => current = actual,
            }
        }
    }

    /// Adds `n` to the cache-only count: the `+1`s of `n` transitions `CACHED|2 -> CACHED|1`
    /// made by [`Self::release_transition`].
    #[inline]
    pub(crate) fn add_cache_only(&self, n: usize) {
        // Relaxed: a statistic made exact by the state transitions (see `num_cache_only`).
        self.cache_only.fetch_add(n, Ordering::Relaxed);
    }

    /// `try_retain`'s state transition: whether `id` got one more handle (it had one).
    #[inline]
    fn try_retain_state(&self, id: u32) -> bool {
        let state = &self.states[id as usize];
        // Relaxed: the CAS below re-validates.
        let mut current = state.load(Ordering::Relaxed);
        loop {
            if current & COUNT_MASK == 0 {
                return false;
            }
            // Acquire on success: like `Weak::upgrade`, see what the other holders published
            // before their handles were made. Relaxed on failure: retry with the fresh value.
            match state.compare_exchange_weak(
                current,
                current + 1,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// One more handle of a cached block, for the prefix cache; returns whether it was
    /// cache-only until now (the caller then takes it out of the cache-only count:
    /// [`Self::sub_cache_only`], once for a whole run).
    #[inline]
    fn retain_cached_state(&self, id: u32) -> bool {
        let previous = self.retain(id);
        debug_assert!(previous & CACHED != 0);
        previous & COUNT_MASK == 1
    }

    /// Takes `n` from the cache-only count: the `-1`s of `n` transitions `CACHED|1 -> CACHED|2`
    /// made by [`Reserved::retain_cached`].
    #[inline]
    pub(crate) fn sub_cache_only(&self, n: usize) {
        if n > 0 {
            // Relaxed: a statistic made exact by the state transitions (see `num_cache_only`).
            self.cache_only.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// The prefix cache takes its reference on a block the caller holds, with its hash.
    pub(crate) fn mark_cached(&self, id: u32, hash: BlockHash) {
        let [high, low] = &self.hashes[id as usize];
        // Relaxed: published by the Release below.
        high.store((hash.0 >> 64) as u64, Ordering::Relaxed);
        low.store(hash.0 as u64, Ordering::Relaxed);
        // Release: a reader that acquires the state and sees CACHED sees the hash.
        let previous = self.states[id as usize].fetch_add(CACHED | 1, Ordering::Release);
        debug_assert!(previous & CACHED == 0 && previous & COUNT_MASK >= 1);
    }

    /// The prefix cache drops its reference (eviction or reset). Returns whether the block was
    /// cache-only (and is now free).
    pub(crate) fn unmark_cached(&self, id: u32) -> bool {
        // AcqRel: as in `release`, this may be the last reference.
        let previous = self.states[id as usize].fetch_sub(CACHED | 1, Ordering::AcqRel);
        debug_assert!(previous & CACHED != 0);
        if previous & COUNT_MASK == 1 {
            // Relaxed: see `release`.
            self.cache_only.fetch_sub(1, Ordering::Relaxed);
            self.free.push(id);
            true
        } else {
            false
        }
    }

    /// Clears `QUEUED` after the id was popped from `released`; returns the state after.
    pub(crate) fn clear_queued(&self, id: u32) -> u32 {
        // Acquire: see the state as of the transition that queued it (or later).
        self.states[id as usize].fetch_and(!QUEUED, Ordering::Acquire) & !QUEUED
    }

    /// The hash recorded for a cached id (garbage if not cached).
    pub(crate) fn hash_of(&self, id: u32) -> BlockHash {
        let [high, low] = &self.hashes[id as usize];
        // Relaxed: ordered by the caller's Acquire load of the state.
        BlockHash(
            (u128::from(high.load(Ordering::Relaxed)) << 64)
                | u128::from(low.load(Ordering::Relaxed)),
        )
    }
}

/// What dropping one handle did to its id ([`BlockStore::release_transition`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Released {
    /// The last handle: the id goes back to the free list.
    Freed,
    /// Only the prefix cache holds it now (cache-only count +1); `queue`: it goes on the
    /// `released` stack (it was not queued already).
    CacheOnly { queue: bool },
    /// Others still hold it.
    Held,
}

/// Shared ownership of one physical KV block (R4).
///
/// `Clone` shares it (the reference count rises); dropping the last handle returns the id to
/// the free list of the manager that handed it out. Managers take handles back by value in
/// `deallocate`, so a handle cannot be released twice.
pub struct Block {
    store: StoreRef,
    id: u32,
}

impl BulkArc<BlockStore> {
    /// The first handle of a freshly popped free id.
    #[inline]
    pub(crate) fn take(&self, id: u32) -> Block {
        self.take_state(id);
        Block {
            store: self.clone(),
            id,
        }
    }

    /// A new handle of `id` if someone still holds it (count > 0), like `Weak::upgrade`; `None`
    /// once the last handle is gone. Used by the sliding-window index, whose entries hold no
    /// reference. Only for stores without a prefix cache (never `CACHED`, so the cache-only
    /// count is not involved).
    pub(crate) fn try_retain(&self, id: u32) -> Option<Block> {
        self.try_retain_state(id).then(|| Block {
            store: self.clone(),
            id,
        })
    }

    /// Called by the prefix cache to hand out a new handle of a cached block.
    #[inline]
    pub(crate) fn retain_cached(&self, id: u32) -> Block {
        if self.retain_cached_state(id) {
            self.sub_cache_only(1);
        }
        Block {
            store: self.clone(),
            id,
        }
    }
}

impl Reserved<BlockStore> {
    /// [`StoreRef::take`] with a reserved store reference (no count update).
    #[inline]
    pub(crate) fn take_block(&mut self, id: u32) -> Block {
        self.owner().take_state(id);
        Block {
            store: self.next_ref(),
            id,
        }
    }

    /// [`StoreRef::retain_cached`] with a reserved store reference, and without the cache-only
    /// count's update: returns whether the block was cache-only, for the caller to take the
    /// run's total out of the count at once ([`BlockStore::sub_cache_only`]).
    #[inline]
    pub(crate) fn retain_cached(&mut self, id: u32) -> (Block, bool) {
        let was_cache_only = self.owner().retain_cached_state(id);
        let block = Block {
            store: self.next_ref(),
            id,
        };
        (block, was_cache_only)
    }
}

impl Block {
    /// The physical block id (never 0: the padding block is never handed out).
    #[inline]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Tokens per block of the manager this block belongs to.
    pub fn block_size(&self) -> usize {
        self.store.block_size as usize
    }

    /// Number of handles, the prefix cache's included.
    pub fn ref_count(&self) -> u32 {
        self.store.state(self.id) & COUNT_MASK
    }

    /// Whether the prefix cache holds this block.
    pub fn is_cached(&self) -> bool {
        self.store.state(self.id) & CACHED != 0
    }

    /// The block's chained hash (R6) while it is in the prefix cache.
    pub fn hash(&self) -> Option<BlockHash> {
        self.is_cached().then(|| self.store.hash_of(self.id))
    }

    /// The handle's store reference and id, without dropping the handle: the caller now owns
    /// that reference and must release the id's handle itself ([`crate::release::release_all`]).
    #[inline]
    pub(crate) fn into_parts(self) -> (StoreRef, u32) {
        let block = std::mem::ManuallyDrop::new(self);
        // SAFETY: `block` is never used or dropped again (`ManuallyDrop`, and it goes out of
        // scope here), so reading its `store` out moves that one store reference to the caller
        // exactly once: the strong count stays right and nothing is freed twice.
        let store = unsafe { std::ptr::read(&block.store) };
        (store, block.id)
    }

    /// Whether this handle was handed out by the manager that owns `store`.
    #[inline]
    pub(crate) fn belongs_to(&self, store: &StoreRef) -> bool {
        StoreRef::ptr_eq(&self.store, store)
    }
}

impl Clone for Block {
    #[inline]
    fn clone(&self) -> Self {
        self.store.retain(self.id);
        Self {
            store: self.store.clone(),
            id: self.id,
        }
    }
}

impl Drop for Block {
    #[inline]
    fn drop(&mut self) {
        self.store.release(self.id);
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("id", &self.id)
            .field("ref_count", &self.ref_count())
            .field("cached", &self.is_cached())
            .finish()
    }
}

impl PartialEq for Block {
    /// Two handles are equal when they share the same physical block of the same manager.
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id && StoreRef::ptr_eq(&self.store, &other.store)
    }
}

impl Eq for Block {}

/// An argument error naming `name` unless every block in `blocks` is an id of `store` (a handle
/// of another manager would corrupt this one's counts).
pub(crate) fn check_owned(store: &StoreRef, blocks: &[Block], name: &'static str) -> Result<()> {
    for block in blocks {
        crate::error::ensure_arg!(
            block.belongs_to(store),
            name,
            "block {} belongs to another manager",
            block.id()
        );
    }
    Ok(())
}
