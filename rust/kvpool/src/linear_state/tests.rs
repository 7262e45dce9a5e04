//! Unit tests of the slot states, the two LRU lists and pinning.

use super::*;

fn h(x: u128) -> BlockHash {
    BlockHash(x)
}

#[test]
fn pending_never_matches_and_commit_makes_it_matchable() {
    let mut cache = LinearStatePrefixCache::new(4).unwrap();
    let slot = cache.reserve_checkpoint(h(1)).unwrap();
    assert!(!cache.contains(h(1)));
    assert_eq!(cache.lookup(h(1)), None);
    assert_eq!(cache.reserve_checkpoint(h(1)), None);
    assert_eq!(cache.commit_checkpoint(h(1)).unwrap(), slot);
    assert_eq!(cache.lookup(h(1)), Some(slot));
    assert_eq!(cache.reserve_checkpoint(h(1)), None);
    cache.check().unwrap();
}

#[test]
fn lru_eviction_skips_pinned() {
    let mut cache = LinearStatePrefixCache::new(4).unwrap();
    for x in 1..=3 {
        cache.reserve_checkpoint(h(x)).unwrap();
        cache.commit_checkpoint(h(x)).unwrap();
    }
    cache.pin(h(1)).unwrap();
    cache.lookup(h(2));
    // LRU: 3 then 2 (1 pinned); a live slot evicts 3.
    let live = cache.acquire_live_slot().unwrap();
    assert!(!cache.contains(h(3)) && cache.contains(h(1)) && cache.contains(h(2)));
    cache.check().unwrap();
    let _ = cache.acquire_live_slot().unwrap(); // evicts 2
    assert!(cache.acquire_live_slot().is_err()); // 1 is pinned
    cache.unpin(h(1)).unwrap();
    assert!(cache.acquire_live_slot().is_ok());
    cache.release_live_slot(live).unwrap();
    cache.check().unwrap();
}

#[test]
fn plain_checkpoints_go_before_kept_ones() {
    let mut cache = LinearStatePrefixCache::new(6).unwrap();
    for (x, kept) in [(1, true), (2, false), (3, false), (4, true)] {
        cache.set_clock(x as u64 * 10);
        cache
            .reserve_planned(h(x), 0, Tail::default(), kept)
            .unwrap();
        cache.commit_planned(h(x)).unwrap();
    }
    assert_eq!(
        (cache.num_plain_checkpoints(), cache.num_kept_checkpoints()),
        (2, 2)
    );
    assert_eq!(cache.next_victim_stamp(), Some(20)); // the oldest plain one
    cache.set_clock(50);
    cache.lookup(h(2)); // a hit keeps it
    assert!(!cache.is_plain(h(2)));
    let order: Vec<BlockHash> = cache
        .lru_order()
        .iter()
        .map(|&s| cache.hash_of[s as usize])
        .collect();
    assert_eq!(order, [h(3), h(1), h(4), h(2)]);
    assert_eq!(cache.evict(2), 2); // 3 (plain), then 1 (the oldest kept)
    assert!(!cache.contains(h(3)) && !cache.contains(h(1)) && cache.contains(h(4)));
    cache.check().unwrap();
}

#[test]
fn promotion_commits_the_old_slot() {
    let mut cache = LinearStatePrefixCache::new(3).unwrap();
    let live = cache.acquire_live_slot().unwrap();
    let fresh = cache.promote(live, h(9)).unwrap();
    assert_ne!(fresh, live);
    assert_eq!(cache.lookup(h(9)), Some(live));
    assert_eq!(cache.num_live_slots(), 1);
    assert!(cache.promote(fresh, h(9)).is_err());
    cache.check().unwrap();
}
