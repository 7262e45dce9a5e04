//! Switch between `std`/`parking_lot` and `loom` synchronisation types.
//!
//! Build with `RUSTFLAGS="--cfg kvpool_loom"` to run the loom models in `tests/loom.rs`: every
//! atomic of the lock-free paths (free list, state words, counters) and the prefix-cache lock
//! of [`crate::ConcurrentBlockManager`] then come from loom, which explores their
//! interleavings. Nothing else in the crate names `std::sync::atomic` for those paths.
//!
//! `Arc` is always `std::sync::Arc`: it only keeps extra keys and the index's tables alive, and
//! its own orderings are std's, so loom has nothing to explore there; loom's `Arc` also lacks
//! unsized payloads (`Arc<[u8]>`), which the core uses. The block store's own reference count
//! (`crate::bulk_arc`) uses the atomics and `fence` below, so loom explores it.

pub(crate) use std::sync::Arc;

#[cfg(kvpool_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(not(kvpool_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// A mutex with `parking_lot`'s interface (`lock()` returns the guard: no poisoning), backed by
/// `parking_lot::Mutex`, or by `loom::sync::Mutex` under loom so that the models explore the
/// interleavings of lock holders with the lock-free paths.
pub(crate) struct Mutex<T> {
    #[cfg(not(kvpool_loom))]
    inner: parking_lot::Mutex<T>,
    #[cfg(kvpool_loom)]
    inner: loom::sync::Mutex<T>,
}

#[cfg(not(kvpool_loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;
#[cfg(kvpool_loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self {
            #[cfg(not(kvpool_loom))]
            inner: parking_lot::Mutex::new(value),
            #[cfg(kvpool_loom)]
            inner: loom::sync::Mutex::new(value),
        }
    }

    /// Blocks until the lock is held.
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(not(kvpool_loom))]
        return self.inner.lock();
        // A loom mutex is poisoned only if a model thread panicked: the model has failed anyway.
        #[cfg(kvpool_loom)]
        return self.inner.lock().expect("loom mutex poisoned");
    }

    /// The lock if it is free now, else `None` (never blocks).
    #[inline]
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        #[cfg(not(kvpool_loom))]
        return self.inner.try_lock();
        #[cfg(kvpool_loom)]
        return self.inner.try_lock().ok();
    }
}
