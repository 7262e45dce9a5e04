//! `ConcurrentBlockManager`: the thread-safe physical allocator (xLLM's
//! `ConcurrentBlockManagerImpl`, R27).
//!
//! Every method takes `&self`; share the manager as `Arc<ConcurrentBlockManager>` (it is
//! `Send + Sync`). Layout: the lock-free [`BlockStore`] (free list, per-id state words, the
//! `released` stack) is shared with a [`BlockManagerImpl`] that sits behind one mutex and is used
//! only for its prefix cache.
//!
//! Which path takes the lock:
//! - **never**: dropping or cloning a [`Block`] (state word, free list and `released` stack are
//!   all lock-free atomics); `counts`, `owns`, `block_size`; `allocate` whenever the free list
//!   holds enough ids (it pops them with no lock); `deallocate` (it drops the handles, then drains
//!   the `released` stack only if the lock is free right now: `try_lock`, never waiting).
//! - **the cache lock** (a `parking_lot` mutex): `allocate` when it must evict, `allocate_shared`
//!   (match), `cache` (insert), `evict`, `reset_prefix_cache`, `check`. Hashing is done before
//!   the lock is taken.
//!
//! Because a handle drop never takes the lock, an eviction or reset that frees blocks while
//! holding it never re-enters it: xLLM needs a recursive mutex for exactly that case (a block
//! destructor calling back into `free()` under the allocator's lock); kvpool needs none.
//!
//! Invariants:
//! - R2/R4 hold at every moment for each id's state word (each transition is one atomic update;
//!   see `block.rs`); the derived counts (`free`, `cached`, `used`) are snapshots that may lag
//!   the operations in flight and are exact at quiescence (no call in flight on any thread).
//!   `check()` is therefore exact only at quiescence; run concurrently it may report a transient
//!   difference as a violation.
//! - `allocate(n)` never hands out a partial result: it either returns `n` handles or gives back
//!   every id it popped (in their original order) and returns `OutOfBlocks`. Under concurrency
//!   `OutOfBlocks` means "not available when tried": other threads may hold ids for a moment
//!   (their own all-or-nothing attempt) or take the blocks this call evicted. When the request
//!   exceeds `free + cached` up front, nothing is changed (R3); when eviction ran first and other
//!   threads then took the freed ids, the evicted blocks stay free (available to everyone).
//! - An id is handed out at most once at a time and returns to the free list exactly once per
//!   allocation: the free list is a tagged Treiber stack and only the last reference (one atomic
//!   decrement to zero) pushes it (loom models in `tests/loom.rs`).
//! - Match vs. eviction vs. handle drop of the same block: match and eviction are serialised by
//!   the lock; a drop racing with either is one CAS on the state word, and the cache re-reads the
//!   word under the lock before acting (see the "Concurrency" section of `block.rs`).

use crate::block::{Block, StoreRef};
use crate::error::{KvPoolError, Result};
use crate::hash::BlockHasher;
use crate::manager::{BlockCounts, BlockManager, BlockManagerImpl, ManagerConfig};
use crate::prefix_cache::{CacheStats, ExtraKey, PrefixCache};
use crate::sync::Mutex;

/// Thread-safe block allocator with a prefix cache: lock-free allocate (when the free list
/// suffices) and handle drops, prefix cache behind one lock (R27).
///
/// ```
/// use std::sync::Arc;
/// use kvpool::{ConcurrentBlockManager, ManagerConfig};
///
/// let manager = Arc::new(ConcurrentBlockManager::new(ManagerConfig::new(64, 4)).unwrap());
/// let tokens: Vec<u32> = (0..8).collect();
/// let workers: Vec<_> = (0..4)
///     .map(|_| {
///         let manager = Arc::clone(&manager);
///         let tokens = tokens.clone();
///         std::thread::spawn(move || {
///             let mut blocks = manager.allocate_shared(&tokens, None); // prefix hit
///             blocks.extend(manager.allocate(2 - blocks.len()).unwrap()); // the rest
///             manager.cache(&tokens, &blocks, None).unwrap(); // first writer wins (R9)
///             manager.deallocate(blocks).unwrap();
///         })
///     })
///     .collect();
/// for worker in workers {
///     worker.join().unwrap();
/// }
/// manager.check().unwrap(); // exact once no thread is working
/// assert_eq!(manager.counts().used, 0);
/// ```
pub struct ConcurrentBlockManager {
    /// The same store as `inner`'s: used with no lock on the fast paths.
    store: StoreRef,
    hasher: BlockHasher,
    block_size: usize,
    cache_enabled: bool,
    /// Only its prefix cache (and `check`) is used, always under this lock.
    inner: Mutex<BlockManagerImpl>,
}

// R27: the manager is shared between threads as `Arc<ConcurrentBlockManager>`, and handles move
// between threads. A compile-time check (no dependency needed).
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ConcurrentBlockManager>();
    assert_send_sync::<Block>();
};

impl ConcurrentBlockManager {
    /// A manager per `config` (R1: id 0 reserved).
    pub fn new(config: ManagerConfig) -> Result<Self> {
        let inner = BlockManagerImpl::new(config)?;
        Ok(Self {
            store: inner.store().clone(),
            hasher: config.hasher,
            block_size: config.block_size,
            cache_enabled: config.enable_prefix_cache,
            inner: Mutex::new(inner),
        })
    }

    /// Ids in the pool, padding included.
    pub fn num_blocks(&self) -> usize {
        self.store.num_blocks()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether a prefix cache is kept.
    pub fn prefix_cache_enabled(&self) -> bool {
        self.cache_enabled
    }

    /// The hasher used for chains (also when the cache is off).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Whether `block` was handed out by this manager.
    #[inline]
    pub fn owns(&self, block: &Block) -> bool {
        block.belongs_to(&self.store)
    }

    /// Block counts (R2); a snapshot, exact at quiescence (module doc). Takes no lock.
    pub fn counts(&self) -> BlockCounts {
        let total = self.store.num_blocks() - 1;
        let free = self.store.free.len().min(total);
        let cached = self.store.num_cache_only().min(total - free);
        BlockCounts {
            total,
            free,
            cached,
            used: total - free - cached,
        }
    }

    /// Free plus cached blocks (a snapshot).
    #[inline]
    pub fn num_available(&self) -> usize {
        self.store.free.len() + self.store.num_cache_only()
    }

    /// `n` fresh blocks, evicting cached ones if needed; all-or-nothing (R3, module doc).
    ///
    /// Lock-free when the free list holds `n` ids; takes the cache lock only to evict.
    pub fn allocate(&self, n: usize) -> Result<Vec<Block>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        // F1: never size anything by `n` before knowing it can be had. More than the manager's
        // ids can never succeed (R3: nothing changed).
        let total = self.store.num_blocks() - 1;
        if n > total {
            return Err(KvPoolError::OutOfBlocks {
                requested: n,
                available: self.num_available().min(total),
            });
        }
        let mut out = Vec::new();
        if self.store.free.len() >= n {
            // Fast path: no lock. Ids become handles as they are popped.
            out.reserve_exact(n); // n <= total: bounded by the manager's size
            if self.pop_into(n, &mut out) {
                return Ok(out);
            }
            // Racing threads took ids since `len()` was read: give back (never partial).
            Self::give_back(&mut out);
        }
        self.allocate_locked(n, out)
    }

    /// Pops free ids into handles until `out` holds `n`; whether it got there.
    #[inline]
    fn pop_into(&self, n: usize, out: &mut Vec<Block>) -> bool {
        // the handles' store references in one count update (bulk_arc.rs)
        let mut refs = self.store.reserve(n.saturating_sub(out.len()));
        while out.len() < n {
            match self.store.free.pop() {
                Some(id) => out.push(refs.take_block(id)),
                None => return false,
            }
        }
        true
    }

    /// Drops fresh handles newest first: each is the id's only reference, so its drop pushes the
    /// id back, and the free list ends up in its original order.
    fn give_back(out: &mut Vec<Block>) {
        while let Some(block) = out.pop() {
            drop(block);
        }
    }

    /// The slow path of `allocate`: under the cache lock, evict what the free list lacks, then
    /// take the ids, until `n` are held or nothing more can be evicted. Evicting before popping
    /// mirrors `BlockManagerImpl::allocate_into` (same ids, same order, single-threaded) and hands
    /// out the just-evicted (hottest) ids first.
    fn allocate_locked(&self, n: usize, mut out: Vec<Block>) -> Result<Vec<Block>> {
        let mut inner = self.inner.lock();
        let available = out.len() + self.num_available();
        if n > available {
            // R3: nothing changed (no eviction, no LRU update).
            Self::give_back(&mut out);
            return Err(KvPoolError::OutOfBlocks {
                requested: n,
                available,
            });
        }
        out.reserve_exact(n - out.len());
        // Terminates without spinning: insertions and matches need this lock, so while it is
        // held the cache only shrinks, and every round that does not return evicted at least one
        // block.
        loop {
            let missing = n - out.len();
            let short = missing.saturating_sub(self.store.free.len());
            if short > 0 {
                if let Some(cache) = inner.prefix_cache_mut() {
                    cache.evict(short);
                }
            }
            if self.pop_into(n, &mut out) {
                return Ok(out);
            }
            // Came up short: some blocks could not be evicted (their descendants are held), or
            // racing threads took the freed ids or hold ids for their own attempt. Evict for
            // the rest; if nothing more can go, give back everything (never partial).
            let more = inner
                .prefix_cache_mut()
                .map_or(0, |c| c.evict(n - out.len()));
            if more == 0 {
                let available = out.len() + self.num_available();
                Self::give_back(&mut out);
                return Err(KvPoolError::OutOfBlocks {
                    requested: n,
                    available,
                });
            }
        }
    }

    fn check_owned(&self, blocks: &[Block], name: &'static str) -> Result<()> {
        crate::block::check_owned(&self.store, blocks, name)
    }

    /// Logical release of handles (R5): all are checked before any is dropped. Never waits for
    /// the cache lock (module doc).
    pub fn deallocate(&self, blocks: Vec<Block>) -> Result<()> {
        self.check_owned(&blocks, "blocks")?;
        // Deepest first: the tail of a chain becomes evictable before its head.
        for block in blocks.into_iter().rev() {
            drop(block);
        }
        if self.cache_enabled {
            // Opportunistic: the next cache operation drains the stack anyway.
            if let Some(mut inner) = self.inner.try_lock() {
                if let Some(cache) = inner.prefix_cache_mut() {
                    cache.drain_released();
                }
            }
        }
        Ok(())
    }

    /// Handles of the longest cached prefix of `tokens` (R7). Hashes before taking the lock.
    pub fn allocate_shared(&self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block> {
        if !self.cache_enabled {
            return Vec::new();
        }
        let hashes = self.hasher.chain(tokens, self.block_size, extra_key);
        let mut out = Vec::new();
        let mut inner = self.inner.lock();
        if let Some(cache) = inner.prefix_cache_mut() {
            let hit = cache.match_prefix(&hashes, tokens, extra_key, hashes.len(), &mut out);
            cache.record_query(hashes.len(), hit);
        }
        out
    }

    /// Publishes the full blocks of `tokens` held in `blocks` (R9); returns how many are new.
    /// Hashes before taking the lock.
    pub fn cache(
        &self,
        tokens: &[u32],
        blocks: &[Block],
        extra_key: Option<&[u8]>,
    ) -> Result<usize> {
        self.check_owned(blocks, "blocks")?;
        if !self.cache_enabled {
            return Ok(0);
        }
        let full = (tokens.len() / self.block_size).min(blocks.len());
        let hashes = self.hasher.chain(
            &tokens[..full * self.block_size],
            self.block_size,
            extra_key,
        );
        let key: Option<ExtraKey> = extra_key.map(ExtraKey::from);
        let mut inner = self.inner.lock();
        Ok(inner.prefix_cache_mut().map_or(0, |c| {
            c.insert(&hashes, tokens, blocks, 0, key.as_ref(), false).0
        }))
    }

    /// Evicts up to `n` cached blocks (R10); returns how many.
    pub fn evict(&self, n: usize) -> usize {
        if !self.cache_enabled || n == 0 {
            return 0;
        }
        self.inner.lock().evict(n)
    }

    /// Drops every cached entry (R12).
    pub fn reset_prefix_cache(&self) {
        if self.cache_enabled {
            self.inner.lock().reset_prefix_cache();
        }
    }

    /// Walks every structure (R2, R10). Exact only at quiescence (module doc).
    pub fn check(&self) -> Result<()> {
        self.inner.lock().check()
    }

    /// Runs `f` on the prefix cache under the lock (after draining released blocks onto the
    /// LRU), or returns `None` when the cache is off.
    pub fn with_prefix_cache<T>(&self, f: impl FnOnce(&PrefixCache) -> T) -> Option<T> {
        let mut inner = self.inner.lock();
        let cache = inner.prefix_cache_mut()?;
        cache.drain_released();
        Some(f(cache))
    }

    /// Prefix-cache counters (zero when the cache is off).
    pub fn cache_stats(&self) -> CacheStats {
        self.with_prefix_cache(PrefixCache::stats)
            .unwrap_or_default()
    }
}

impl std::fmt::Debug for ConcurrentBlockManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConcurrentBlockManager")
            .field("block_size", &self.block_size)
            .field("counts", &self.counts())
            .finish()
    }
}

/// `BlockManager` for the manager and for shared references to it (like `std::io::Write for
/// &File`), so generic code written against the trait works on a shared concurrent manager.
macro_rules! impl_block_manager {
    ($($target:ty),+) => {$(
        impl BlockManager for $target {
            fn block_size(&self) -> usize {
                ConcurrentBlockManager::block_size(self)
            }
            fn owns(&self, block: &Block) -> bool {
                ConcurrentBlockManager::owns(self, block)
            }
            fn counts(&self) -> BlockCounts {
                ConcurrentBlockManager::counts(self)
            }
            fn allocate(&mut self, n: usize) -> Result<Vec<Block>> {
                ConcurrentBlockManager::allocate(self, n)
            }
            fn deallocate(&mut self, blocks: Vec<Block>) -> Result<()> {
                ConcurrentBlockManager::deallocate(self, blocks)
            }
            fn allocate_shared(&mut self, tokens: &[u32], extra_key: Option<&[u8]>) -> Vec<Block> {
                ConcurrentBlockManager::allocate_shared(self, tokens, extra_key)
            }
            fn cache(
                &mut self,
                tokens: &[u32],
                blocks: &[Block],
                extra_key: Option<&[u8]>,
            ) -> Result<usize> {
                ConcurrentBlockManager::cache(self, tokens, blocks, extra_key)
            }
            fn evict(&mut self, n: usize) -> usize {
                ConcurrentBlockManager::evict(self, n)
            }
            fn reset_prefix_cache(&mut self) {
                ConcurrentBlockManager::reset_prefix_cache(self)
            }
            fn check(&self) -> Result<()> {
                ConcurrentBlockManager::check(self)
            }
        }
    )+};
}

impl_block_manager!(ConcurrentBlockManager, &ConcurrentBlockManager);
