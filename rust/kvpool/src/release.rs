//! Releasing a whole table of handles at once (`release_all`): what dropping each handle does,
//! with the per-block shared work batched.
//!
//! Dropping a [`Block`] makes four atomic updates besides its store reference's: the CAS on the
//! id's state word, then the push of the id on the free list (its last handle) or the
//! cache-only count's `+1` and the push on the `released` stack (only the cache holds it now).
//! A request that frees a table of a few hundred blocks pays them per block. `release_all`
//! makes the state-word CAS of each id (that cannot be shared) and collects the ids; each run of
//! up to `RUN` ids of one store then goes on the free list and on the `released` stack with one
//! CAS each ([`FreeList::push_run`]) and into the cache-only count with one add, and the
//! handles' store references go back with one count update per store ([`Absorbed`]).
//!
//! Invariants kept (block.rs's, unchanged): every transition of a state word is the one
//! dropping that handle makes, in the same order (the table's last block first, as
//! `while blocks.pop().is_some() {}`); each list ends up in the order the one-by-one pushes
//! give (so the LRU order the cache drains from `released`, F9, and the free list's LIFO
//! order are the same). What batching changes is only when the pushes and the count update
//! land: after the run's CASes instead of right after each. `release` itself already has that
//! window between its CAS and its push (`QUEUED` set, not yet in the stack; count 0, not yet
//! in the free list; the count's `+1` after the transition), and block.rs's races are argued
//! for any length of it; nothing runs between the CASes and the flush on this thread.

use crate::block::{Block, BlockStore, Released, StoreRef};
use crate::bulk_arc::Absorbed;

/// Ids collected per kind before a flush (bounded on the stack, no allocation).
const RUN: usize = 64;

/// The ids of one store released since the last flush, not yet pushed.
struct Run {
    /// The store, and the references of the run's handles, given back when the run ends.
    store: Absorbed<BlockStore>,
    freed: [u32; RUN],
    num_freed: usize,
    queued: [u32; RUN],
    num_queued: usize,
    cache_only: usize,
}

impl Run {
    fn new(store: StoreRef) -> Self {
        Self {
            store: store.into_absorber(),
            freed: [0; RUN],
            num_freed: 0,
            queued: [0; RUN],
            num_queued: 0,
            cache_only: 0,
        }
    }

    /// Makes the pushes and the count update of the ids collected so far.
    fn flush(&mut self) {
        let store = self.store.owner();
        if self.cache_only > 0 {
            store.add_cache_only(self.cache_only);
        }
        store.free.push_run(&self.freed[..self.num_freed]);
        store.released.push_run(&self.queued[..self.num_queued]);
        self.num_freed = 0;
        self.num_queued = 0;
        self.cache_only = 0;
    }

    /// Drops the handle of `id` (whose store reference the caller gave up).
    fn release(&mut self, id: u32) {
        match self.store.owner().release_transition(id) {
            Released::Freed => {
                self.freed[self.num_freed] = id;
                self.num_freed += 1;
            }
            Released::CacheOnly { queue } => {
                self.cache_only += 1;
                if queue {
                    self.queued[self.num_queued] = id;
                    self.num_queued += 1;
                }
            }
            Released::Held => {}
        }
        if self.num_freed == RUN || self.num_queued == RUN {
            self.flush();
        }
    }
}

/// Drops every handle in `blocks`, the last first (as `while blocks.pop().is_some() {}` does,
/// which `deallocate` relies on: a chain's tail becomes cache-only before its head), leaving
/// `blocks` empty; the same effects as dropping each (module doc), with one push per list and
/// one count update per run of up to `RUN` ids of one store. Handles of several stores may be
/// mixed (each change of store flushes).
pub(crate) fn release_all(blocks: &mut Vec<Block>) {
    let Some(first) = blocks.pop() else {
        return;
    };
    // The run keeps the first handle's store reference until the end, so the store outlives
    // the loop (dropping it last, as the one-by-one drops would, if it is the store's last);
    // the other handles' references of that store go back with it, in one count update.
    let (store, id) = first.into_parts();
    let mut run = Run::new(store);
    run.release(id);
    while let Some(block) = blocks.pop() {
        let (store, id) = block.into_parts();
        if run.store.is_for(&store) {
            run.store.absorb(store); // the handle's own reference, given back with the run's
        } else {
            run.flush();
            // the old store's references go back (and its last, if it is) before the new run
            drop(std::mem::replace(&mut run.store, store.into_absorber()));
        }
        run.release(id);
    }
    run.flush();
}

#[cfg(all(test, not(kvpool_loom)))]
mod tests {
    use super::*;
    use crate::block::{CACHED, COUNT_MASK, QUEUED};
    use crate::hash::BlockHash;

    /// A store of `n` ids and `k` fresh handles out of it.
    fn store_with(n: usize, k: usize) -> (StoreRef, Vec<Block>) {
        let store = StoreRef::new(BlockStore::new(n, 1, "num_blocks").unwrap());
        let blocks = (0..k)
            .map(|_| {
                let id = store.free.pop().unwrap();
                store.take(id)
            })
            .collect();
        (store, blocks)
    }

    /// Builds the same handles twice (cached, shared or private), drops one copy one by one and
    /// releases the other with `release_all`: the same states, lists and counts (R4).
    #[test]
    fn release_all_is_dropping_one_by_one() {
        let make = || {
            let (store, blocks) = store_with(200, 150);
            let mut extra = Vec::new();
            for (i, block) in blocks.iter().enumerate() {
                if i % 3 != 0 {
                    store.mark_cached(block.id(), BlockHash(i as u128));
                }
                if i % 5 == 0 {
                    extra.push(block.clone()); // still held by someone else afterwards
                }
            }
            (store, blocks, extra)
        };
        let (one, mut one_blocks, one_extra) = make();
        let (all, mut all_blocks, all_extra) = make();
        while one_blocks.pop().is_some() {}
        release_all(&mut all_blocks);
        assert!(all_blocks.is_empty());
        let view = |s: &BlockStore| {
            let states: Vec<u32> = (0..200).map(|id| s.state(id)).collect();
            (
                states,
                s.free.snapshot(),
                s.released.snapshot(),
                s.num_cache_only(),
                s.free.len(),
                s.released.len(),
            )
        };
        assert_eq!(view(&all), view(&one));
        let (states, _, released, cache_only, _, _) = view(&all);
        assert!(
            cache_only > RUN && released.len() > RUN,
            "several runs were flushed"
        );
        assert!(states.iter().all(|s| s & COUNT_MASK <= 2));
        assert!(released
            .iter()
            .all(|&id| states[id as usize] == CACHED | QUEUED | 1));
        drop((one_extra, all_extra));
        assert_eq!(view(&all), view(&one));
    }

    /// Handles of two stores, interleaved: each id goes back to its own store.
    #[test]
    fn release_all_mixed_stores() {
        let (a, a_blocks) = store_with(8, 3);
        let (b, b_blocks) = store_with(8, 2);
        let mut mixed: Vec<Block> = Vec::new();
        let (mut a_it, mut b_it) = (a_blocks.into_iter(), b_blocks.into_iter());
        loop {
            match (a_it.next(), b_it.next()) {
                (None, None) => break,
                (x, y) => mixed.extend(x.into_iter().chain(y)),
            }
        }
        release_all(&mut mixed);
        assert_eq!(a.free.len(), 7);
        assert_eq!(b.free.len(), 7);
        assert_eq!(StoreRef::count(&a), 1);
        assert_eq!(StoreRef::count(&b), 1);
        release_all(&mut mixed); // empty: nothing
    }
}

/// loom models: `RUSTFLAGS="--cfg kvpool_loom" CARGO_TARGET_DIR=target/loom cargo test -p
/// kvpool --release --lib release` (`make test-loom`).
#[cfg(all(test, kvpool_loom))]
mod loom_tests {
    use super::*;
    use crate::block::{CACHED, COUNT_MASK, QUEUED};
    use crate::hash::BlockHash;
    use loom::thread;

    fn take(store: &StoreRef) -> Block {
        let id = store.free.pop().unwrap();
        store.take(id)
    }

    /// R4: a table released with `release_all` while another thread drops the other handles of
    /// its blocks: each id ends free exactly once (private) or cache-only and queued exactly
    /// once (cached), whoever drops last.
    #[test]
    fn release_all_racing_with_drops() {
        loom::model(|| {
            let store = StoreRef::new(BlockStore::new(3, 1, "num_blocks").unwrap());
            let (a, b) = (take(&store), take(&store));
            store.mark_cached(b.id(), BlockHash(7));
            let (a2, b2) = (a.clone(), b.clone());
            let t = thread::spawn(move || {
                drop(b2);
                drop(a2);
            });
            let mut table = vec![a, b];
            release_all(&mut table);
            t.join().unwrap();
            assert_eq!(store.free.snapshot(), vec![1]);
            assert_eq!(store.released.snapshot(), vec![2]);
            assert_eq!(store.state(1) & COUNT_MASK, 0);
            assert_eq!(store.state(2), CACHED | QUEUED | 1);
            assert_eq!(store.num_cache_only(), 1);
        });
    }

    /// A run pushed on the free list while another thread pops and pushes it: nothing lost or
    /// duplicated.
    #[test]
    fn release_all_racing_with_allocation() {
        loom::model(|| {
            let store = StoreRef::new(BlockStore::new(4, 1, "num_blocks").unwrap());
            let mut table = vec![take(&store), take(&store)];
            let other = store.clone();
            let t = thread::spawn(move || {
                if let Some(id) = other.free.pop() {
                    drop(other.take(id));
                }
            });
            release_all(&mut table);
            t.join().unwrap();
            let mut free = store.free.snapshot();
            free.sort_unstable();
            assert_eq!(free, vec![1, 2, 3]);
            assert_eq!(store.free.len(), 3);
        });
    }
}
