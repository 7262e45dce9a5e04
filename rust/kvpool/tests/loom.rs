//! loom models of the lock-free paths (R4, R27). Every interleaving of the atomics and of the
//! cache lock, up to a preemption bound, is explored. Run with
//! `RUSTFLAGS="--cfg kvpool_loom" LOOM_MAX_PREEMPTIONS=3 CARGO_TARGET_DIR=target/loom
//! CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true cargo test -p kvpool --release --test loom`
//! (`make test-loom`; the debug assertions check every state-word transition of `block.rs` in
//! every interleaving). Models are kept tiny (2 or 3 ids, 2 or 3 threads) so that the run takes
//! about a second (about 5 s with no preemption bound at all).
#![cfg(kvpool_loom)]

use std::sync::Arc;

use kvpool::{ConcurrentBlockManager, KvPoolError, ManagerConfig};
use loom::thread;

fn manager(num_blocks: usize, enable_prefix_cache: bool) -> Arc<ConcurrentBlockManager> {
    let mut config = ManagerConfig::new(num_blocks, 1);
    config.enable_prefix_cache = enable_prefix_cache;
    Arc::new(ConcurrentBlockManager::new(config).unwrap())
}

/// Asserts R2 at quiescence and that every id `1..num_blocks` is free exactly once.
fn assert_all_free(m: &ConcurrentBlockManager) {
    m.check().unwrap();
    let counts = m.counts();
    assert_eq!(counts.free, counts.total, "{counts:?}");
    assert_eq!(counts.cached + counts.used, 0, "{counts:?}");
}

/// R4: the last two handles of a block dropped at once: the id returns exactly once.
#[test]
fn concurrent_drop_of_last_two_handles() {
    loom::model(|| {
        let m = manager(2, false);
        let a = m.allocate(1).unwrap().pop().unwrap();
        let b = a.clone();
        assert_eq!(a.ref_count(), 2);
        let t = thread::spawn(move || drop(b));
        drop(a);
        t.join().unwrap();
        // check() finds the id in the free list exactly once, with count 0.
        assert_all_free(&m);
        // And it can be handed out again, once.
        let again = m.allocate(1).unwrap();
        assert_eq!(again[0].id(), 1);
        assert!(m.allocate(1).is_err());
    });
}

/// R2, R4, R27: the last two outside handles of a cached block dropped at once: exactly one drop
/// makes it cache-only (queued once), and it is evictable exactly once afterwards.
#[test]
fn concurrent_drop_of_last_two_handles_of_cached_block() {
    loom::model(|| {
        let m = manager(2, true);
        let a = m.allocate(1).unwrap().pop().unwrap();
        assert_eq!(m.cache(&[7], std::slice::from_ref(&a), None).unwrap(), 1);
        let b = a.clone();
        assert_eq!(a.ref_count(), 3);
        let t = thread::spawn(move || drop(b));
        drop(a);
        t.join().unwrap();
        m.check().unwrap();
        let counts = m.counts();
        assert_eq!((counts.free, counts.cached, counts.used), (0, 1, 0));
        assert_eq!(m.evict(2), 1);
        assert_all_free(&m);
    });
}

/// R3, R27: two threads allocate from a free list that cannot serve both (2 ids; 2 + 1
/// requested): never the same id twice, never a partial result, never a lost id, and one of the
/// two requests always succeeds.
#[test]
fn concurrent_allocate_from_nearly_empty_free_list() {
    loom::model(|| {
        let m = manager(3, false);
        let m2 = Arc::clone(&m);
        let t = thread::spawn(move || m2.allocate(1));
        let mine = m.allocate(2);
        let theirs = t.join().unwrap();
        let mut ids: Vec<u32> = Vec::new();
        for result in [&mine, &theirs] {
            match result {
                Ok(blocks) => ids.extend(blocks.iter().map(|b| b.id())),
                Err(KvPoolError::OutOfBlocks { .. }) => {}
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        assert!(mine.is_ok() || theirs.is_ok(), "both requests failed");
        assert_eq!(mine.as_ref().map_or(2, Vec::len), 2, "partial allocation");
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            mine.as_ref().map_or(0, Vec::len) + theirs.as_ref().map_or(0, Vec::len),
            "an id was handed out twice"
        );
        drop((mine, theirs));
        assert_all_free(&m);
    });
}

/// R4, R27: two threads each take one of the last two ids and drop it: the ids come back exactly
/// once and nothing else is handed out.
#[test]
fn concurrent_allocate_one_each_from_two_ids() {
    loom::model(|| {
        let m = manager(3, false);
        let m2 = Arc::clone(&m);
        let t = thread::spawn(move || m2.allocate(1).unwrap().pop().unwrap());
        let mine = m.allocate(1).unwrap().pop().unwrap();
        let theirs = t.join().unwrap();
        assert_ne!(mine.id(), theirs.id());
        assert_eq!(m.counts().free, 0);
        // Dropped concurrently too.
        let t = thread::spawn(move || drop(theirs));
        drop(mine);
        t.join().unwrap();
        assert_all_free(&m);
    });
}

/// R10, R27: eviction racing with a match of the same block while its last outside handle is
/// being dropped. Whatever the order, a matched handle is never of an evicted block, the id is
/// never lost or freed twice, and the accounting is exact afterwards.
#[test]
fn eviction_racing_with_match_of_same_block() {
    loom::model(|| {
        let m = manager(2, true);
        let a = m.allocate(1).unwrap().pop().unwrap();
        assert_eq!(m.cache(&[5], std::slice::from_ref(&a), None).unwrap(), 1);
        // Thread 1: the sequence releases the block (CACHED|2 -> CACHED|1, queued).
        let t1 = thread::spawn(move || drop(a));
        // Thread 2: another request evicts.
        let m2 = Arc::clone(&m);
        let t2 = thread::spawn(move || m2.evict(1));
        // This thread: a request matches the same prefix.
        let hit = m.allocate_shared(&[5], None);
        for block in &hit {
            // Held: the cache's reference and ours at least; never evicted under our feet.
            assert!(block.is_cached(), "matched block was evicted while held");
            assert!(block.ref_count() >= 2);
        }
        let evicted = t2.join().unwrap();
        t1.join().unwrap();
        // The match holds its handle until after both joins, so exactly one of the two got the
        // block: the match (the eviction ran before the release, or after the match, and found
        // nothing evictable) or the eviction (the match then missed).
        assert_eq!(
            hit.len() + evicted,
            1,
            "hit {} evicted {evicted}",
            hit.len()
        );
        let still_cached = usize::from(evicted == 0);
        drop(hit);
        m.check().unwrap();
        let counts = m.counts();
        assert_eq!(counts.used, 0, "{counts:?}");
        assert_eq!(counts.cached, still_cached, "{counts:?}");
        assert_eq!(counts.free, 1 - still_cached, "{counts:?}");
    });
}

/// R3, R10, R27: an allocation that must evict (slow path, under the cache lock) races with a
/// lock-free allocation of the last free id and with a match of the block it wants to evict:
/// never partial, never an id twice, never a held block evicted, nothing lost.
#[test]
fn allocate_with_eviction_racing_with_allocate_and_match() {
    loom::model(|| {
        let m = manager(3, true);
        let a = m.allocate(1).unwrap();
        assert_eq!(m.cache(&[5], &a, None).unwrap(), 1);
        m.deallocate(a).unwrap();
        // Now: one cache-only block, one free id.
        let m1 = Arc::clone(&m);
        let t1 = thread::spawn(move || m1.allocate(2));
        let m2 = Arc::clone(&m);
        let t2 = thread::spawn(move || {
            let hit = m2.allocate_shared(&[5], None);
            for block in &hit {
                assert!(
                    block.is_cached() && block.ref_count() >= 2,
                    "evicted while held"
                );
            }
            hit.len()
        });
        let mine = m.allocate(1);
        let big = t1.join().unwrap();
        let hit = t2.join().unwrap();
        let mut ids: Vec<u32> = Vec::new();
        for blocks in [&big, &mine].into_iter().flatten() {
            ids.extend(blocks.iter().map(|b| b.id()));
        }
        assert_eq!(big.as_ref().map_or(2, Vec::len), 2, "partial allocation");
        let total = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), total, "an id was handed out twice");
        assert!(hit <= 1);
        drop((big, mine));
        m.check().unwrap();
        let counts = m.counts();
        assert_eq!(counts.used, 0, "{counts:?}");
        assert_eq!(counts.free + counts.cached, 2, "{counts:?}");
    });
}

/// R4, R12, R27: a reset races with the drop of the last outside handle of a cached block (the
/// drop may queue the id just before the reset frees it): the id is freed exactly once, and a
/// later life of the same id (allocated, cached, released) is queued and evictable as usual.
#[test]
fn reset_racing_with_drop_of_cached_block() {
    loom::model(|| {
        let m = manager(2, true);
        let a = m.allocate(1).unwrap();
        assert_eq!(m.cache(&[3], &a, None).unwrap(), 1);
        let t = thread::spawn(move || drop(a));
        m.reset_prefix_cache();
        t.join().unwrap();
        assert_all_free(&m);
        // The next life of id 1.
        let b = m.allocate(1).unwrap();
        assert_eq!(m.cache(&[4], &b, None).unwrap(), 1);
        m.deallocate(b).unwrap();
        m.check().unwrap();
        assert_eq!(m.counts().cached, 1);
        assert_eq!(m.evict(1), 1);
        assert_all_free(&m);
    });
}
