//! `BulkArc<T>`: `Arc<T>` whose references can also be made and given up in bulk; what every
//! [`crate::Block`] handle holds of its manager's block store (`block::StoreRef`), so that the
//! store outlives its last handle.
//!
//! A prefix hit hands out a few hundred handles at once and a release drops a whole table.
//! With `Arc`, each handle's clone and drop is one atomic update of the same shared count,
//! about a third of the work of pinning or releasing a block (benches/RESULTS.md). Here
//! [`BulkArc::reserve`] makes `n` references with one `fetch_add` and [`Reserved::next_ref`]
//! hands them out one by one without touching the count; an [`Absorbed`] takes the references
//! of dropped handles without touching it and gives them back with one `fetch_sub`.
//!
//! Invariant: `refs` is the number of live `BulkArc`s, plus the references a [`Reserved`]
//! holds and has not handed out, plus those an [`Absorbed`] took and has not given back. Both
//! of those also hold a `BulkArc` of their own while they hold any, so a bulk update never
//! takes `refs` to 0: only the drop of a `BulkArc` does, and that drop frees the value after an
//! Acquire fence, exactly as `Arc`'s drop (the orderings below are `Arc`'s). Under loom the
//! count is a loom atomic, so the models of block drops racing each other also explore the last
//! reference's free.

use std::ops::Deref;
use std::ptr::NonNull;

use crate::sync::{fence, AtomicUsize, Ordering};

/// More references than this abort the process, as `Arc` does (it cannot happen: every
/// reference stands for a handle, and handles are bounded by memory long before).
const MAX_REFS: usize = isize::MAX as usize;

struct Shared<T> {
    refs: AtomicUsize,
    value: T,
}

/// One reference to a shared `T` (module doc).
pub(crate) struct BulkArc<T> {
    shared: NonNull<Shared<T>>,
}

// SAFETY: as `Arc<T>`: a `BulkArc` gives out `&T` only, and the last one may drop the value on
// whichever thread holds it; so sending or sharing one needs `T: Send + Sync`.
unsafe impl<T: Send + Sync> Send for BulkArc<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for BulkArc<T> {}

impl<T> BulkArc<T> {
    /// The first reference to `value`.
    pub(crate) fn new(value: T) -> Self {
        let shared = Box::new(Shared {
            refs: AtomicUsize::new(1),
            value,
        });
        Self {
            shared: NonNull::from(Box::leak(shared)),
        }
    }

    #[inline]
    fn shared(&self) -> &Shared<T> {
        // SAFETY: `shared` came from `Box::leak` and is freed only by the drop that takes
        // `refs` to 0; `self` is one of the references counted there, so it is alive.
        unsafe { self.shared.as_ref() }
    }

    /// The number of references (what `Arc::strong_count` says), for tests.
    #[cfg(test)]
    pub(crate) fn count(this: &Self) -> usize {
        // Relaxed: a test's snapshot.
        this.shared().refs.load(Ordering::Relaxed)
    }

    /// Whether both refer to the same value.
    #[inline]
    pub(crate) fn ptr_eq(a: &Self, b: &Self) -> bool {
        a.shared == b.shared
    }

    /// Adds `n` references to the count.
    #[inline]
    fn add_refs(&self, n: usize) {
        // Relaxed: as `Arc::clone`, new references are made from an existing one, so nothing
        // else needs ordering.
        let old = self.shared().refs.fetch_add(n, Ordering::Relaxed);
        if old.checked_add(n).is_none_or(|refs| refs > MAX_REFS) {
            std::process::abort(); // as `Arc`: the count must never wrap
        }
    }

    /// `n` more references with one count update, for [`Reserved::next_ref`] to hand out.
    #[inline]
    pub(crate) fn reserve(&self, n: usize) -> Reserved<T> {
        self.add_refs(n + 1); // the reserve's own reference and `n` to hand out
        Reserved {
            owner: Self {
                shared: self.shared,
            },
            left: n,
        }
    }

    /// This reference as the owner of an [`Absorbed`], which takes the references of other
    /// handles of the same value as they are dropped.
    #[inline]
    pub(crate) fn into_absorber(self) -> Absorbed<T> {
        Absorbed {
            owner: self,
            taken: 0,
        }
    }

    /// Gives `n` references back, knowing that `self` keeps the count above 0.
    #[inline]
    fn give_back(&self, n: usize) {
        if n > 0 {
            // Release: as `Arc`'s drop, so the uses of the value through these references
            // happen-before its free by whoever drops the last reference (Acquire fence there).
            let old = self.shared().refs.fetch_sub(n, Ordering::Release);
            debug_assert!(old > n, "a bulk give-back took the count to 0");
        }
    }
}

impl<T> Deref for BulkArc<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        &self.shared().value
    }
}

impl<T> Clone for BulkArc<T> {
    #[inline]
    fn clone(&self) -> Self {
        self.add_refs(1);
        Self {
            shared: self.shared,
        }
    }
}

impl<T> Drop for BulkArc<T> {
    #[inline]
    fn drop(&mut self) {
        // Release: this reference's uses happen-before the free (as `Arc`'s drop).
        if self.shared().refs.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        // Acquire: every other reference's uses (their Release decrements) happen-before the
        // free below.
        fence(Ordering::Acquire);
        // SAFETY: the count reached 0, so this was the last reference: no other `BulkArc`,
        // `Reserved` or `Absorbed` can reach `shared` any more, and it came from `Box::leak`.
        drop(unsafe { Box::from_raw(self.shared.as_ptr()) });
    }
}

impl<T> std::fmt::Debug for BulkArc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkArc").finish_non_exhaustive()
    }
}

/// References counted in advance by [`BulkArc::reserve`]; those not handed out go back when it
/// drops.
pub(crate) struct Reserved<T> {
    /// Keeps the count above 0 while `left` references are reserved.
    owner: BulkArc<T>,
    left: usize,
}

impl<T> Reserved<T> {
    /// The value the references are of.
    #[inline]
    pub(crate) fn owner(&self) -> &BulkArc<T> {
        &self.owner
    }

    /// One reference, from the reserve while it lasts (no count update), else a clone.
    #[inline]
    pub(crate) fn next_ref(&mut self) -> BulkArc<T> {
        if self.left == 0 {
            return self.owner.clone();
        }
        self.left -= 1;
        // The reference was counted by `reserve`: handing it out keeps `refs` exact.
        BulkArc {
            shared: self.owner.shared,
        }
    }
}

impl<T> Drop for Reserved<T> {
    fn drop(&mut self) {
        self.owner.give_back(self.left);
    }
}

/// Takes the references of dropped handles of one value ([`BulkArc::into_absorber`]) and gives
/// them back with one count update at [`Self::flush`] or when it drops.
pub(crate) struct Absorbed<T> {
    /// Keeps the count above 0 while `taken` references are held.
    owner: BulkArc<T>,
    taken: usize,
}

impl<T> Absorbed<T> {
    /// Whether `other` refers to the value whose references this takes.
    #[inline]
    pub(crate) fn is_for(&self, other: &BulkArc<T>) -> bool {
        BulkArc::ptr_eq(&self.owner, other)
    }

    /// Takes `other`'s reference without a count update: it is given back later.
    #[inline]
    pub(crate) fn absorb(&mut self, other: BulkArc<T>) {
        debug_assert!(self.is_for(&other), "absorbed a reference to another value");
        std::mem::forget(other); // its count now belongs to `taken`
        self.taken += 1;
    }

    /// The value these references are of.
    #[inline]
    pub(crate) fn owner(&self) -> &BulkArc<T> {
        &self.owner
    }

    /// Gives back the references taken so far.
    #[inline]
    pub(crate) fn flush(&mut self) {
        self.owner.give_back(std::mem::take(&mut self.taken));
    }
}

impl<T> Drop for Absorbed<T> {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as Counter;

    /// Counts its drops, to see the value freed exactly once and only at the end.
    struct Tracked<'a>(&'a Counter);

    impl Drop for Tracked<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn reserve_hands_out_counted_references_and_returns_the_rest() {
        let drops = Counter::new(0);
        let first = BulkArc::new(Tracked(&drops));
        let mut reserved = first.reserve(3);
        assert_eq!(BulkArc::count(&first), 5); // first, the reserve's owner, 3 reserved
        let a = reserved.next_ref();
        let b = reserved.next_ref();
        assert!(BulkArc::ptr_eq(&a, &first) && BulkArc::ptr_eq(&b, &first));
        assert!(BulkArc::ptr_eq(reserved.owner(), &first));
        drop(reserved);
        assert_eq!(BulkArc::count(&first), 3); // the unused one went back with the owner
        let mut empty = first.reserve(0);
        let c = empty.next_ref(); // past the reserve: a clone
        drop(empty);
        assert_eq!(BulkArc::count(&first), 4);
        drop((a, b, c));
        assert_eq!(BulkArc::count(&first), 1);
        assert_eq!(drops.load(Ordering::Relaxed), 0);
        drop(first);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn absorbed_references_go_back_at_once() {
        let drops = Counter::new(0);
        let first = BulkArc::new(Tracked(&drops));
        let other = BulkArc::new(Tracked(&drops));
        let clones: Vec<BulkArc<Tracked>> = (0..5).map(|_| first.clone()).collect();
        let mut absorbed = first.clone().into_absorber();
        assert_eq!(BulkArc::count(&first), 7);
        assert!(!absorbed.is_for(&other));
        for r in clones {
            assert!(absorbed.is_for(&r));
            absorbed.absorb(r);
        }
        assert_eq!(BulkArc::count(&first), 7); // nothing given back yet
        absorbed.flush();
        assert_eq!(BulkArc::count(&first), 2);
        assert!(BulkArc::ptr_eq(absorbed.owner(), &first));
        drop(absorbed);
        assert_eq!(BulkArc::count(&first), 1);
        drop((first, other));
        assert_eq!(drops.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_last_reference_frees_the_value_whoever_holds_it() {
        let drops = Counter::new(0);
        let first = BulkArc::new(Tracked(&drops));
        let mut reserved = first.reserve(2);
        let kept = reserved.next_ref();
        let mut absorbed = reserved.next_ref().into_absorber();
        absorbed.absorb(first); // the first reference goes back with the absorber
        drop(reserved);
        drop(absorbed);
        assert_eq!(BulkArc::count(&kept), 1);
        assert_eq!(drops.load(Ordering::Relaxed), 0);
        drop(kept);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }
}

/// loom models: `RUSTFLAGS="--cfg kvpool_loom" CARGO_TARGET_DIR=target/loom cargo test -p
/// kvpool --release --lib bulk_arc` (`make test-loom`).
#[cfg(all(test, kvpool_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize as Counter;
    use loom::thread;

    /// Counts its drops (the counter outlives the value: a loom `Arc`).
    struct Tracked(loom::sync::Arc<Counter>);

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The value is freed exactly once, after every use, whichever of the plain drop, the
    /// reserve's give-back and the absorber's give-back comes last.
    #[test]
    fn the_last_reference_frees_once_whoever_gives_it_back() {
        loom::model(|| {
            let drops = loom::sync::Arc::new(Counter::new(0));
            let first = BulkArc::new(Tracked(drops.clone()));
            let mut reserved = first.reserve(3);
            let (a, b) = (reserved.next_ref(), reserved.next_ref());
            let t = thread::spawn(move || {
                let mut absorbed = a.into_absorber();
                absorbed.absorb(b);
                assert_eq!(absorbed.owner().0.load(Ordering::Relaxed), 0);
            });
            drop(reserved); // one reserved reference unused: given back with the owner's
            drop(first);
            t.join().unwrap();
            assert_eq!(drops.load(Ordering::Relaxed), 1);
        });
    }
}
