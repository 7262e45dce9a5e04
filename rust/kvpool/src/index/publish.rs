//! The publication of a shard's copies: an atomic pointer to the published copy (readers load
//! it lock-free) and the reference-counted copies themselves, whose counts tell the writer
//! whether a reader still holds the spare one (`Arc::get_mut`).
//!
//! Normally [`Published`] is `arc_swap::ArcSwap` and [`Shared`] `std::sync::Arc`. Under loom
//! (`--cfg kvpool_loom`) they are `loom::sync::Arc` behind a `loom::sync::Mutex`: a
//! linearizable cell, as `ArcSwap` is, so that the loom model of `shard.rs` explores the race
//! the two copies depend on (a reader still holding the copy the writer wants to recycle)
//! through loom's reference counts. `arc-swap` itself is not loom-aware; its own orderings are
//! its own crate's to prove.

#[cfg(not(kvpool_loom))]
pub(crate) type Shared<T> = std::sync::Arc<T>;
#[cfg(kvpool_loom)]
pub(crate) type Shared<T> = loom::sync::Arc<T>;

/// What a reader holds while it reads a published copy.
#[cfg(not(kvpool_loom))]
pub(crate) type Loaded<T> = arc_swap::Guard<std::sync::Arc<T>>;
#[cfg(kvpool_loom)]
pub(crate) type Loaded<T> = loom::sync::Arc<T>;

/// The published copy.
pub(crate) struct Published<T> {
    #[cfg(not(kvpool_loom))]
    inner: arc_swap::ArcSwap<T>,
    #[cfg(kvpool_loom)]
    inner: loom::sync::Mutex<loom::sync::Arc<T>>,
}

impl<T> Published<T> {
    pub(crate) fn new(value: Shared<T>) -> Self {
        Self {
            #[cfg(not(kvpool_loom))]
            inner: arc_swap::ArcSwap::new(value),
            #[cfg(kvpool_loom)]
            inner: loom::sync::Mutex::new(value),
        }
    }

    /// The published copy, held until the result is dropped (lock-free but under loom).
    #[inline]
    pub(crate) fn load(&self) -> Loaded<T> {
        #[cfg(not(kvpool_loom))]
        return self.inner.load();
        #[cfg(kvpool_loom)]
        return self.inner.lock().expect("loom mutex poisoned").clone();
    }

    /// Publishes `next`; returns the copy published before.
    #[inline]
    pub(crate) fn swap(&self, next: Shared<T>) -> Shared<T> {
        #[cfg(not(kvpool_loom))]
        return self.inner.swap(next);
        #[cfg(kvpool_loom)]
        return std::mem::replace(&mut *self.inner.lock().expect("loom mutex poisoned"), next);
    }
}

/// Lets a reader still holding a copy run (the writer's short spin).
#[inline]
pub(crate) fn yield_now() {
    #[cfg(not(kvpool_loom))]
    std::thread::yield_now();
    #[cfg(kvpool_loom)]
    loom::thread::yield_now();
}
