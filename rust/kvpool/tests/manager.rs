//! Lifecycle tests of `BlockManagerImpl` and `SingleBlockManager` (R1-R12), seed examples
//! included, plus a proptest model-based test of random operation sequences.

use kvpool::{
    Block, BlockHasher, BlockManager, BlockManagerImpl, KvPoolError, ManagerConfig,
    SingleBlockManager,
};
use proptest::prelude::*;

fn manager(num_blocks: usize, block_size: usize) -> BlockManagerImpl {
    BlockManagerImpl::new(ManagerConfig::new(num_blocks, block_size)).unwrap()
}

fn ids(blocks: &[Block]) -> Vec<u32> {
    blocks.iter().map(Block::id).collect()
}

#[test]
fn r1_padding_block_is_never_handed_out() {
    let mut m = manager(5, 4);
    assert_eq!(m.counts().total, 4);
    let blocks = m.allocate(4).unwrap();
    assert!(!ids(&blocks).contains(&0));
    assert!(matches!(
        m.allocate(1),
        Err(KvPoolError::OutOfBlocks {
            requested: 1,
            available: 0
        })
    ));
    for bad in [(0, 4), (1, 4), (4, 0)] {
        assert!(matches!(
            BlockManagerImpl::new(ManagerConfig::new(bad.0, bad.1)),
            Err(KvPoolError::InvalidArgument { .. })
        ));
    }
}

#[test]
fn seed_eleven_tokens_take_three_blocks_and_shared_block_frees_at_zero() {
    // Seed 003: block_size 4, 11 tokens -> ceil(11/4) = 3 blocks, 1 empty slot in the last.
    let mut m = manager(16, 4);
    let tokens: Vec<u32> = (100..111).collect();
    let a = m.allocate(11usize.div_ceil(4)).unwrap();
    assert_eq!(a.len(), 3);
    assert_eq!(3 * 4 - tokens.len(), 1);
    assert_eq!(
        m.cache(&tokens, &a, None).unwrap(),
        2,
        "only full blocks are cached (R6)"
    );
    // Another sequence shares the first two blocks.
    let b = m.allocate_shared(&tokens, None);
    assert_eq!(ids(&b), ids(&a[..2]));
    assert_eq!(a[0].ref_count(), 3, "sequence A, sequence B and the cache");
    m.deallocate(a).unwrap();
    assert_eq!(b[0].ref_count(), 2);
    let counts = m.counts();
    assert_eq!((counts.used, counts.cached), (2, 0));
    m.deallocate(b).unwrap();
    assert_eq!(
        m.counts().cached,
        2,
        "deallocate != free: the cache still holds them (R5)"
    );
    m.reset_prefix_cache();
    assert_eq!(
        m.counts().free,
        15,
        "last reference gone: ids back in the free list (R4)"
    );
    m.check().unwrap();
}

#[test]
fn r3_allocate_is_all_or_nothing_and_evicts_just_enough() {
    let mut m = manager(5, 2);
    let a = m.allocate(3).unwrap();
    m.cache(&[1, 2, 3, 4, 5, 6], &a, None).unwrap();
    m.deallocate(a).unwrap();
    assert_eq!(m.counts().cached, 3);
    assert!(m.allocate(5).is_err());
    assert_eq!(m.counts().cached, 3, "failed allocate changed nothing");
    let b = m.allocate(2).unwrap();
    assert_eq!(m.counts().cached, 2, "one free id plus one eviction");
    assert_eq!(m.prefix_cache().unwrap().stats().evictions, 1);
    drop(b);
    m.check().unwrap();
}

#[test]
fn r10_eviction_is_lru_and_leaves_first_and_never_held() {
    let mut m = manager(16, 2);
    let chain_a = [1, 2, 3, 4, 5, 6];
    let chain_b = [7, 8, 9, 10];
    let a = m.allocate(3).unwrap();
    let b = m.allocate(2).unwrap();
    m.cache(&chain_a, &a, None).unwrap();
    m.cache(&chain_b, &b, None).unwrap();
    let (a_ids, b_ids) = (ids(&a), ids(&b));
    m.deallocate(a).unwrap();
    m.deallocate(b).unwrap();
    // A hit refreshes A (R11): B becomes the least recently used chain.
    let hit = m.allocate_shared(&chain_a, None);
    assert_eq!(hit.len(), 3);
    m.deallocate(hit).unwrap();
    assert_eq!(m.evict(1), 1);
    let order = m.prefix_cache().unwrap().lru_order();
    assert!(!order.contains(&b_ids[1]), "B's tail went first");
    assert_eq!(
        order,
        vec![b_ids[0], a_ids[2], a_ids[1], a_ids[0]],
        "leaves before parents"
    );
    // Hold A's head: its descendants stay evictable, the head itself never is.
    let head = m.allocate_shared(&chain_a[..2], None);
    assert_eq!(m.evict(100), 3, "B's head and A's two tail blocks");
    assert_eq!(ids(&head), vec![a_ids[0]]);
    assert_eq!(m.prefix_cache().unwrap().len(), 1);
    m.check().unwrap();
    drop(head);
    assert_eq!(m.evict(100), 1);
    assert_eq!(m.counts().free, 15);
    m.check().unwrap();
}

#[test]
fn r7_collision_never_returns_the_wrong_block() {
    // One-bit hashes: almost every block collides; tokens and parents decide.
    let mut config = ManagerConfig::new(32, 2);
    config.hasher = BlockHasher::with_debug_bits(1, 1);
    let mut m = BlockManagerImpl::new(config).unwrap();
    let mut held = vec![];
    for chain in [[1u32, 2, 3, 4], [5, 6, 7, 8], [1, 2, 7, 8]] {
        let hit = m.allocate_shared(&chain, None);
        let fresh = m.allocate(2 - hit.len()).unwrap();
        let blocks: Vec<Block> = hit.into_iter().chain(fresh).collect();
        m.cache(&chain, &blocks, None).unwrap();
        held.push(blocks);
    }
    // [5,6,...] must not match [1,2,...]'s entry even if their hashes collide.
    let probe = m.allocate_shared(&[5, 6, 7, 8], None);
    assert_eq!(ids(&probe)[..], ids(&held[1])[..probe.len()]);
    let probe = m.allocate_shared(&[9, 9], None);
    assert!(probe.is_empty(), "no block with tokens [9, 9] exists");
    m.check().unwrap();
}

#[test]
fn r6_extra_keys_isolate_namespaces() {
    let mut m = manager(8, 2);
    let a = m.allocate(2).unwrap();
    m.cache(&[1, 2, 3, 4], &a, Some(b"lora-1")).unwrap();
    assert!(m.allocate_shared(&[1, 2, 3, 4], None).is_empty());
    assert!(m.allocate_shared(&[1, 2, 3, 4], Some(b"lora-2")).is_empty());
    assert_eq!(m.allocate_shared(&[1, 2, 3, 4], Some(b"lora-1")).len(), 2);
}

#[test]
fn r9_first_writer_wins_and_the_rest_stays_private() {
    let mut m = manager(16, 2);
    let tokens = [1, 2, 3, 4, 5, 6];
    let first = m.allocate(3).unwrap();
    let second = m.allocate(3).unwrap();
    assert_eq!(m.cache(&tokens[..4], &first[..2], None).unwrap(), 2);
    assert_eq!(
        m.cache(&tokens, &second, None).unwrap(),
        0,
        "block 0 is cached with another id: stop"
    );
    assert!(!second[2].is_cached());
    assert_eq!(
        m.cache(&tokens, &first, None).unwrap(),
        1,
        "the owner extends its own chain"
    );
    m.check().unwrap();
}

#[test]
fn r12_reset_keeps_held_blocks_with_their_holders() {
    let mut m = manager(8, 2);
    let a = m.allocate(2).unwrap();
    m.cache(&[1, 2, 3, 4], &a, None).unwrap();
    m.reset_prefix_cache();
    assert_eq!(a[0].ref_count(), 1);
    assert!(a[0].hash().is_none());
    assert_eq!(m.counts().used, 2);
    drop(a);
    assert_eq!(m.counts().free, 7);
    m.check().unwrap();
}

#[test]
fn single_block_manager_has_no_cache() {
    let mut m = SingleBlockManager::new(3).unwrap();
    assert_eq!(m.block_size(), 1);
    let a = m.allocate(2).unwrap();
    assert!(m.allocate(1).is_err());
    assert_eq!(m.cache(&[1, 2], &a, None).unwrap(), 0);
    assert!(m.allocate_shared(&[1, 2], None).is_empty());
    drop(a);
    assert_eq!(m.counts().free, 2);
    assert!(SingleBlockManager::new(1).is_err());
    m.check().unwrap();
}

#[test]
fn foreign_blocks_are_rejected() {
    let mut m1 = manager(8, 2);
    let mut m2 = manager(8, 2);
    let a = m1.allocate(1).unwrap();
    assert!(matches!(
        m2.cache(&[1, 2], &a, None),
        Err(KvPoolError::InvalidArgument { name: "blocks", .. })
    ));
    assert!(m2.deallocate(a).is_err());
    assert_eq!(
        m1.counts().free,
        7,
        "the rejected handles were dropped, not lost"
    );
    m1.check().unwrap();
    m2.check().unwrap();
}

/// Operations of the model-based test.
#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    Share(usize),
    Drop(usize),
    Insert(usize, u8),
    Match(u8, usize),
    Evict(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..6).prop_map(Op::Allocate),
        2 => any::<usize>().prop_map(Op::Share),
        4 => any::<usize>().prop_map(Op::Drop),
        3 => (any::<usize>(), 0u8..4).prop_map(|(h, c)| Op::Insert(h, c)),
        3 => (0u8..4, 1usize..5).prop_map(|(c, n)| Op::Match(c, n)),
        1 => (0usize..4).prop_map(Op::Evict),
        1 => Just(Op::Reset),
    ]
}

/// Token chains: chain c, block i has tokens [c/2, i, i] so chains 0/1 and 2/3 share nothing
/// and every block of a chain differs.
fn chain_tokens(chain: u8, blocks: usize) -> Vec<u32> {
    (0..blocks)
        .flat_map(|i| [u32::from(chain), i as u32])
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// R2-R5, R10 against a model: after every step the counts add up, the handles we hold
    /// are exactly the used ids, check() passes; at the end every id is free exactly once.
    #[test]
    fn model_based_random_workload(ops in proptest::collection::vec(op(), 1..120), bits in prop_oneof![Just(128u32), Just(2u32)]) {
        let num_blocks = 12;
        let mut config = ManagerConfig::new(num_blocks, 2);
        config.hasher = BlockHasher::with_debug_bits(7, bits);
        let mut m = BlockManagerImpl::new(config).unwrap();
        // Groups of handles we hold (a group = one "sequence").
        let mut groups: Vec<Vec<Block>> = Vec::new();
        for op in ops {
            let before = m.counts();
            match op {
                Op::Allocate(n) => match m.allocate(n) {
                    Ok(blocks) => {
                        prop_assert_eq!(blocks.len(), n);
                        groups.push(blocks);
                    }
                    Err(KvPoolError::OutOfBlocks { .. }) => {
                        prop_assert!(before.available() < n);
                        prop_assert_eq!(m.counts(), before, "failed allocate changed counts (R3)");
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                Op::Share(i) if !groups.is_empty() => {
                    let g = groups[i % groups.len()].clone();
                    groups.push(g);
                }
                Op::Drop(i) if !groups.is_empty() => {
                    let g = groups.swap_remove(i % groups.len());
                    m.deallocate(g).unwrap();
                }
                Op::Insert(i, chain) if !groups.is_empty() => {
                    let g = &groups[i % groups.len()];
                    let tokens = chain_tokens(chain, g.len());
                    let newly = m.cache(&tokens, g, None).unwrap();
                    prop_assert!(newly <= g.len());
                }
                Op::Match(chain, n) => {
                    let hit = m.allocate_shared(&chain_tokens(chain, n), None);
                    // Whatever hit carries exactly this chain's tokens (R7).
                    for block in &hit {
                        prop_assert!(block.is_cached());
                    }
                    if !hit.is_empty() {
                        groups.push(hit);
                    }
                }
                Op::Evict(n) => {
                    let evicted = m.evict(n);
                    prop_assert!(evicted <= n);
                    prop_assert_eq!(m.counts().cached + evicted, before.cached);
                }
                Op::Reset => m.reset_prefix_cache(),
                _ => {}
            }
            let counts = m.counts();
            prop_assert_eq!(counts.free + counts.cached + counts.used, counts.total);
            let mut held: Vec<u32> = groups.iter().flatten().map(Block::id).collect();
            held.sort_unstable();
            held.dedup();
            prop_assert_eq!(held.len(), counts.used, "used ids are exactly the held ones (R2)");
            if let Err(e) = m.check() {
                prop_assert!(false, "check failed: {e}");
            }
        }
        groups.clear();
        m.reset_prefix_cache();
        m.check().unwrap();
        prop_assert_eq!(m.counts().free, num_blocks - 1, "every id came back exactly once");
    }
}

#[test]
fn allocate_one_takes_free_then_evicts_then_fails_cleanly() {
    // R3 for the single-block fast path.
    let mut m = BlockManagerImpl::new(ManagerConfig::new(3, 2)).unwrap();
    let a = m.allocate_one().unwrap();
    let b = m.allocate_one().unwrap();
    m.cache(&[1, 2, 3, 4], &[a.clone(), b.clone()], None)
        .unwrap();
    drop(b); // cache-only now; `a` still held
    let c = m.allocate_one().unwrap(); // evicts b's block
    assert_eq!(m.counts().cached, 0);
    assert!(matches!(
        m.allocate_one(),
        Err(KvPoolError::OutOfBlocks { requested: 1, .. })
    ));
    drop((a, c));
    m.check().unwrap();
    let counts = m.counts();
    assert_eq!(
        (counts.free, counts.cached),
        (1, 1),
        "a's block stays cached (R5)"
    );
}
