//! Dedup on publish (R9 revised) in the core pool: the fan-out example, a duplicate
//! that another holder keeps (a pending transfer's handle) is not switched until it is let go,
//! `dedup = false` keeps first writer wins, and the physical level is unchanged.

use kvpool::{
    BlockManager, BlockManagerImpl, BlockManagerPool, KvCacheManager, PoolConfig, Sequence,
};

const SYSTEM: [u32; 8] = [100, 101, 102, 103, 104, 105, 106, 107];

fn prompt(tail: &[u32]) -> Vec<u32> {
    SYSTEM.iter().chain(tail).copied().collect()
}

fn computed(seq: &mut Sequence) {
    seq.set_num_computed_tokens(seq.len()).unwrap();
}

fn fan_out(dedup: bool) -> (BlockManagerPool, Sequence, Sequence) {
    let mut pool = BlockManagerPool::new(PoolConfig {
        dedup,
        ..PoolConfig::new(64, 4)
    })
    .unwrap();
    let mut a = Sequence::new(prompt(&[1, 2, 3, 4, 9]), None, None);
    let mut b = Sequence::new(prompt(&[5, 6, 7, 8, 9]), None, None);
    for s in [&mut a, &mut b] {
        assert!(pool.allocate(s, None).unwrap());
    }
    for s in [&mut a, &mut b] {
        computed(s);
        pool.cache(s).unwrap();
    }
    (pool, a, b)
}

#[test]
fn r9_fan_out_switches_duplicates_and_publishes_the_rest() {
    let (mut pool, a, b) = fan_out(true);
    assert_eq!(pool.counts(0).unwrap().used, 6);
    let ids_a: Vec<u32> = a.block_ids().collect();
    let ids_b: Vec<u32> = b.block_ids().collect();
    assert_eq!(ids_a[..2], ids_b[..2]);
    let switches = pool.drain_block_switches();
    assert_eq!(switches.len(), 2);
    assert!(switches.iter().all(|&(sid, _, _)| sid == b.seq_id()));
    let mut c = Sequence::new(prompt(&[5, 6, 7, 8, 10, 11]), None, None);
    assert!(pool.allocate(&mut c, None).unwrap());
    assert_eq!(c.num_cached_tokens(), 12);
    pool.check().unwrap();
}

#[test]
fn r9_dedup_off_keeps_first_writer_wins() {
    let (mut pool, _a, _b) = fan_out(false);
    assert_eq!(pool.counts(0).unwrap().used, 8);
    assert!(pool.drain_block_switches().is_empty());
    let mut c = Sequence::new(prompt(&[5, 6, 7, 8, 10, 11]), None, None);
    assert!(pool.allocate(&mut c, None).unwrap());
    assert_eq!(c.num_cached_tokens(), 8);
    pool.check().unwrap();
}

#[test]
fn r9_a_duplicate_someone_else_holds_is_not_switched_until_let_go() {
    let mut pool = BlockManagerPool::new(PoolConfig::new(64, 4)).unwrap();
    let mut a = Sequence::new(prompt(&[1]), None, None);
    let mut b = Sequence::new(prompt(&[2]), None, None);
    pool.allocate(&mut a, None).unwrap();
    pool.allocate(&mut b, None).unwrap();
    computed(&mut a);
    computed(&mut b);
    pool.cache(&mut a).unwrap();
    // A second handle of B's first block, as a pending transfer keeps its source blocks.
    let held = b.blocks()[0].clone();
    pool.cache(&mut b).unwrap();
    assert!(
        pool.drain_block_switches().is_empty(),
        "held elsewhere: first writer wins"
    );
    assert_ne!(b.blocks()[0].id(), a.blocks()[0].id());
    pool.check().unwrap();
    drop(held); // the transfer is done
    pool.cache(&mut b).unwrap();
    let switches = pool.drain_block_switches();
    assert_eq!(
        switches.len(),
        2,
        "both shared blocks switch at the next publish"
    );
    assert_eq!(
        b.block_ids().take(2).collect::<Vec<_>>(),
        a.block_ids().take(2).collect::<Vec<_>>()
    );
    pool.check().unwrap();
}

#[test]
fn r9_physical_level_is_unchanged() {
    let mut manager = BlockManagerImpl::new(kvpool::ManagerConfig::new(16, 4)).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let first = manager.allocate(2).unwrap();
    let second = manager.allocate(2).unwrap();
    assert_eq!(manager.cache(&tokens, &first, None).unwrap(), 2);
    assert_eq!(
        manager.cache(&tokens, &second, None).unwrap(),
        0,
        "first writer wins; the duplicate stays with its caller"
    );
    assert!(!second[0].is_cached());
    manager.check().unwrap();
}
