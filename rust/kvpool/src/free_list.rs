//! `FreeList`: a lock-free LIFO pool of block ids (a tagged Treiber stack over an index array).
//!
//! Invariants:
//! - every id in `0..capacity` is in the list at most once (callers push an id only when its
//!   last handle is gone, which happens exactly once per allocation; see `block.rs`);
//! - `len()` is exact whenever no push or pop is in flight, and never under-counts the ids a
//!   successful `pop` could return (it is raised before a push publishes and lowered after a pop
//!   unpublishes), so it never underflows;
//! - LIFO: the id pushed last is popped first (its memory is the hottest).
//!
//! The head word packs a 32-bit tag beside the top id; every successful CAS bumps the tag, so a
//! pop that read `next[top]` before another thread popped and re-pushed `top` fails its CAS
//! instead of installing a stale successor (the ABA problem). The tag wraps after 2^32 successful
//! CASes: a pop whose load and CAS are more than 2^32 list operations apart (a thread descheduled
//! that long while the others push and pop the same top back) could still see ABA; at tens of
//! nanoseconds per operation that is minutes of uninterrupted work by the others, which the
//! schedulers it runs under never do. Nodes are slots of an array, never
//! freed, so there is no memory-reclamation problem to solve.

use crossbeam_utils::CachePadded;

use crate::alloc;
use crate::error::{ensure_arg, Result};
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

const NIL: u32 = u32::MAX;

#[inline]
fn pack(tag: u32, id: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(id)
}

#[inline]
fn top_of(head: u64) -> u32 {
    head as u32
}

#[inline]
fn tag_of(head: u64) -> u32 {
    (head >> 32) as u32
}

/// Lock-free LIFO set of ids below a fixed capacity.
pub(crate) struct FreeList {
    head: CachePadded<AtomicU64>,
    len: CachePadded<AtomicUsize>,
    next: Box<[AtomicU32]>,
}

impl FreeList {
    /// An empty list that can hold ids `0..capacity` (`capacity < u32::MAX`).
    ///
    /// # Panics
    /// If `capacity >= u32::MAX` or the list cannot be allocated (the managers use the fallible
    /// constructor instead).
    #[cfg(test)]
    pub(crate) fn new(capacity: usize) -> Self {
        assert!(
            capacity < NIL as usize,
            "FreeList capacity must be below u32::MAX"
        );
        Self::try_new(capacity, "capacity").expect("FreeList: cannot allocate its index array")
    }

    /// [`Self::new`] without panicking: an error naming `name` if `capacity` is out of range or
    /// cannot be allocated (F1).
    pub(crate) fn try_new(capacity: usize, name: &'static str) -> Result<Self> {
        ensure_arg!(
            capacity < NIL as usize,
            name,
            "must be below {NIL}, got {capacity}"
        );
        Ok(Self {
            head: CachePadded::new(AtomicU64::new(pack(0, NIL))),
            len: CachePadded::new(AtomicUsize::new(0)),
            next: alloc::boxed(capacity, name, || AtomicU32::new(NIL))?,
        })
    }

    /// A list holding `ids`, the first of which is popped first.
    #[cfg(test)]
    pub(crate) fn with_ids(capacity: usize, ids: impl DoubleEndedIterator<Item = u32>) -> Self {
        let list = Self::new(capacity);
        list.push_all(ids);
        list
    }

    /// [`Self::with_ids`] without panicking (see [`Self::try_new`]).
    pub(crate) fn try_with_ids(
        capacity: usize,
        ids: impl DoubleEndedIterator<Item = u32>,
        name: &'static str,
    ) -> Result<Self> {
        let list = Self::try_new(capacity, name)?;
        list.push_all(ids);
        Ok(list)
    }

    fn push_all(&self, ids: impl DoubleEndedIterator<Item = u32>) {
        for id in ids.rev() {
            self.push(id);
        }
    }

    /// The largest id plus one that the list can hold.
    pub(crate) fn capacity(&self) -> usize {
        self.next.len()
    }

    /// Number of ids in the list (exact when no operation is in flight).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        // Relaxed: a snapshot; callers that need exactness hold exclusive access or tolerate a
        // value that is stale by the operations in flight.
        self.len.load(Ordering::Relaxed)
    }

    /// Whether the list is empty (exact when no operation is in flight).
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Puts `id` back. The caller guarantees `id` is not in the list.
    #[inline]
    pub(crate) fn push(&self, id: u32) {
        debug_assert!((id as usize) < self.next.len());
        // Relaxed: raised before the id is published (see module doc); the publishing CAS below
        // (Release) orders it before any pop that acquires the head.
        self.len.fetch_add(1, Ordering::Relaxed);
        // Relaxed: the CAS re-checks the head; a stale value only costs a retry.
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // Relaxed: published by the Release CAS that installs `id` as the top.
            self.next[id as usize].store(top_of(head), Ordering::Relaxed);
            // Release on success: a pop that acquires this head sees `next[id]` and everything the
            // releasing thread did with the block before freeing it. Relaxed on failure: retry.
            match self.head.compare_exchange_weak(
                head,
                pack(tag_of(head).wrapping_add(1), id),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => head = current,
            }
        }
    }

    /// Puts back every id of `ids` with one CAS, leaving the list as pushing them one by one
    /// in that order would (the last on top). The caller guarantees none of them is in the list
    /// and that they are distinct.
    pub(crate) fn push_run(&self, ids: &[u32]) {
        let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
            return;
        };
        // The run's own links, each id above the one before it. Relaxed: published by the
        // Release CAS below, like `push`'s link; nobody reads these ids' links before it.
        for pair in ids.windows(2) {
            debug_assert!((pair[1] as usize) < self.next.len());
            self.next[pair[1] as usize].store(pair[0], Ordering::Relaxed);
        }
        // Relaxed: raised before the ids are published (module doc), as in `push`.
        self.len.fetch_add(ids.len(), Ordering::Relaxed);
        // Relaxed: the CAS re-checks the head; a stale value only costs a retry.
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            // Relaxed: published by the Release CAS that installs `last` as the top.
            self.next[first as usize].store(top_of(head), Ordering::Relaxed);
            // Release on success: a pop that acquires this head sees every link of the run and
            // everything the releasing thread did with the blocks before. Relaxed on failure.
            match self.head.compare_exchange_weak(
                head,
                pack(tag_of(head).wrapping_add(1), last),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => head = current,
            }
        }
    }

    /// Takes the most recently pushed id, or `None` when empty.
    #[inline]
    pub(crate) fn pop(&self) -> Option<u32> {
        // Acquire: pairs with the Release CAS of the push that installed this top, so the read of
        // `next[top]` below sees the successor written by that push.
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let top = top_of(head);
            if top == NIL {
                return None;
            }
            // Relaxed: ordered by the Acquire above; if `top` was popped and pushed again since,
            // the tag changed and the CAS below fails, so a stale successor is never installed.
            let next = self.next[top as usize].load(Ordering::Relaxed);
            // Acquire on success (and failure, for the retry's read of `next`): see above.
            match self.head.compare_exchange_weak(
                head,
                pack(tag_of(head).wrapping_add(1), next),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // Relaxed: lowered only after the id is unpublished (module doc).
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    return Some(top);
                }
                Err(current) => head = current,
            }
        }
    }

    /// Detaches the whole list with one CAS and appends its ids to `out`, top first (the order
    /// repeated `pop`s would give); returns how many. Only for a list whose detached ids nobody
    /// pushes again before this returns (their `next` links are read after the detach): the
    /// `released` stack, whose ids stay `QUEUED` (never pushed twice) until the drain that took
    /// them clears the bit, after this call.
    pub(crate) fn take_all(&self, out: &mut Vec<u32>) -> usize {
        // Relaxed: the CAS re-checks the head; a stale value only costs a retry.
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            if top_of(head) == NIL {
                return 0;
            }
            // Acquire on success: pairs with the Release CAS of every push below the top, so the
            // walk sees each `next` link they wrote. Relaxed on failure: retry with the fresh value.
            match self.head.compare_exchange_weak(
                head,
                pack(tag_of(head).wrapping_add(1), NIL),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(current) => head = current,
            }
        }
        let start = out.len();
        let mut id = top_of(head);
        // At most `capacity` steps, so a corrupted list cannot loop forever.
        while id != NIL && out.len() - start < self.next.len() {
            out.push(id);
            // Relaxed: ordered by the Acquire CAS above.
            id = self.next[id as usize].load(Ordering::Relaxed);
        }
        let taken = out.len() - start;
        // Relaxed: lowered only after the ids are unpublished (module doc).
        self.len.fetch_sub(taken, Ordering::Relaxed);
        taken
    }

    /// Pops exactly `n` ids into `out`, or none: if the list runs dry midway, the ids already
    /// taken are pushed back (in their original order) and `false` is returned.
    #[cfg(test)]
    pub(crate) fn pop_n(&self, n: usize, out: &mut Vec<u32>) -> bool {
        let start = out.len();
        out.reserve(n);
        for _ in 0..n {
            match self.pop() {
                Some(id) => out.push(id),
                None => {
                    for &id in out[start..].iter().rev() {
                        self.push(id);
                    }
                    out.truncate(start);
                    return false;
                }
            }
        }
        true
    }

    /// The ids in the list from top to bottom. Exact only without concurrent operations; used by
    /// `check()`. Stops after `capacity` steps so a corrupted list cannot loop forever.
    pub(crate) fn snapshot(&self) -> Vec<u32> {
        let mut ids = Vec::with_capacity(self.len());
        let mut id = top_of(self.head.load(Ordering::Acquire));
        while id != NIL && ids.len() <= self.next.len() {
            ids.push(id);
            id = self.next[id as usize].load(Ordering::Relaxed);
        }
        ids
    }
}

impl std::fmt::Debug for FreeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreeList")
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .finish()
    }
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;

    #[test]
    fn lifo_order_and_len() {
        let list = FreeList::with_ids(8, 1..8u32);
        assert_eq!(list.len(), 7);
        assert_eq!(list.pop(), Some(1));
        assert_eq!(list.pop(), Some(2));
        list.push(1);
        assert_eq!(list.pop(), Some(1), "just-freed id is reused first");
        assert_eq!(list.len(), 5);
        assert_eq!(list.snapshot(), vec![3, 4, 5, 6, 7]);
    }

    #[test]
    fn take_all_empties_in_pop_order() {
        let list = FreeList::with_ids(8, 1..6u32);
        list.push(7);
        let mut out = vec![0];
        assert_eq!(list.take_all(&mut out), 6);
        assert_eq!(out, vec![0, 7, 1, 2, 3, 4, 5], "appended, top first");
        assert!(list.is_empty());
        assert_eq!(list.pop(), None);
        assert_eq!(list.take_all(&mut out), 0);
        list.push(3);
        assert_eq!(
            (list.len(), list.pop()),
            (1, Some(3)),
            "usable after a take"
        );
    }

    #[test]
    fn push_run_is_pushing_one_by_one() {
        let one = FreeList::with_ids(8, [5u32, 6].into_iter());
        let run = FreeList::with_ids(8, [5u32, 6].into_iter());
        for id in [1u32, 3, 2] {
            one.push(id);
        }
        run.push_run(&[1, 3, 2]);
        run.push_run(&[]);
        assert_eq!(run.snapshot(), one.snapshot());
        assert_eq!(run.snapshot(), vec![2, 3, 1, 5, 6]);
        assert_eq!(run.len(), 5);
        let empty = FreeList::new(4);
        empty.push_run(&[0]);
        assert_eq!((empty.len(), empty.pop(), empty.pop()), (1, Some(0), None));
    }

    #[test]
    fn pop_n_is_all_or_nothing() {
        let list = FreeList::with_ids(4, 1..4u32);
        let mut out = vec![];
        assert!(!list.pop_n(4, &mut out));
        assert!(out.is_empty());
        assert_eq!(list.snapshot(), vec![1, 2, 3]);
        assert!(list.pop_n(3, &mut out));
        assert_eq!(out, vec![1, 2, 3]);
        assert!(list.is_empty());
        assert_eq!(list.pop(), None);
    }

    #[test]
    fn concurrent_push_pop_loses_nothing() {
        let list = std::sync::Arc::new(FreeList::with_ids(1024, 0..1024u32));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let list = list.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut got = vec![];
                        for _ in 0..3 {
                            if let Some(id) = list.pop() {
                                got.push(id);
                            }
                        }
                        for id in got {
                            list.push(id);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut ids = list.snapshot();
        ids.sort_unstable();
        assert_eq!(ids, (0..1024).collect::<Vec<_>>());
        assert_eq!(list.len(), 1024);
    }
}
