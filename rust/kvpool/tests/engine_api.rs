//! What an engine's step loop asks of the pool (docs/contract.md, R9, R14, R23, R24 choices):
//! a chunk sized past the hit in one walk (`TableExtent::NewTokens`), switches with their group,
//! zeroed live slots, the next checkpoint boundary, and "contiguous" needing a checkpoint at
//! every block.

use kvpool::{
    BlockManagerPool, KvCacheManager, LinearStateMatch, PoolConfig, Sequence, TableExtent,
};

const BS: usize = 4;

fn seq(tokens: impl IntoIterator<Item = u32>) -> Sequence {
    Sequence::new(tokens.into_iter().collect(), None, None)
}

fn warm(pool: &mut BlockManagerPool, tokens: &[u32], computed: usize) {
    let mut s = seq(tokens.iter().copied());
    assert!(pool.allocate(&mut s, Some(computed.max(1))).unwrap());
    if computed > 0 {
        s.set_num_computed_tokens(computed).unwrap();
    }
    pool.deallocate(&mut s).unwrap();
}

#[test]
fn num_new_tokens_counts_past_the_hit_in_one_walk() {
    let mut pool = BlockManagerPool::new(PoolConfig::new(64, BS)).unwrap();
    let tokens: Vec<u32> = (0..40).collect();
    warm(&mut pool, &tokens, 16);
    let mut s = seq(tokens.iter().copied());
    let walks = pool.debug_counters().device_chain_walks;
    let extent = Some(TableExtent::NewTokens(6));
    let plan = pool.plan_extent(&mut s, extent).unwrap().unwrap();
    assert_eq!((plan.num_cached_tokens(), plan.num_tokens()), (16, 22));
    assert!(pool
        .allocate_extent(&mut s, extent, Some(&plan), None)
        .unwrap());
    assert_eq!(pool.debug_counters().device_chain_walks, walks + 1);
    assert_eq!(s.blocks().len(), 6);
    s.set_num_computed_tokens(22).unwrap();
    let grow = Some(TableExtent::NewTokens(100));
    assert!(pool.allocate_extent(&mut s, grow, None, None).unwrap());
    assert_eq!(s.blocks().len(), 10, "capped at len(seq)");
    assert!(pool
        .allocate_extent(&mut s, Some(TableExtent::NewTokens(0)), None, None)
        .is_err());
    assert!(TableExtent::from_args(Some(1), Some(1)).is_err());
    pool.check().unwrap();
}

#[test]
fn switches_carry_their_group_and_the_triples_stay() {
    let mut config = PoolConfig::new(64, BS);
    config.sliding_window = Some(8);
    let mut pool = BlockManagerPool::new(config).unwrap();
    let mut a = seq(0..13);
    let mut b = seq(0..13);
    assert!(pool.allocate(&mut a, None).unwrap() && pool.allocate(&mut b, None).unwrap());
    for s in [&mut a, &mut b] {
        s.set_num_computed_tokens(12).unwrap();
        pool.cache(s).unwrap();
    }
    let switches = pool.drain_block_switches_by_group();
    assert_eq!(switches.len(), 3);
    assert!(switches
        .iter()
        .all(|&(id, group, _, _)| id == b.seq_id() && group == 0));
    assert!(pool.drain_block_switches().is_empty());
    pool.check().unwrap();
}

#[test]
fn a_live_slot_without_restore_is_zeroed_once_and_a_release_drops_it() {
    let mut config = PoolConfig::new(64, BS);
    config.linear_state_slots = 4;
    config.checkpoint_interval = Some(8);
    let mut pool = BlockManagerPool::new(config).unwrap();
    let mut a = seq(0..12);
    assert!(pool.allocate(&mut a, None).unwrap());
    let mut gone = seq(100..105);
    assert!(pool.allocate(&mut gone, None).unwrap());
    pool.check().unwrap();
    pool.deallocate(&mut gone).unwrap();
    let plan = pool.take_linear_state_plan();
    assert_eq!(plan.zero_slots, vec![a.linear_state_slot().unwrap() as i32]);
    assert_eq!(plan.len(), 1);
    pool.commit_linear_state_plan(&plan).unwrap();
    a.set_num_computed_tokens(8).unwrap();
    pool.cache(&mut a).unwrap();
    let plan = pool.take_linear_state_plan();
    assert_eq!((plan.zero_slots.len(), plan.save_src.len()), (0, 1));
    pool.commit_linear_state_plan(&plan).unwrap();
    pool.deallocate(&mut a).unwrap();
    let mut b = seq(0..12);
    assert!(pool.allocate(&mut b, None).unwrap());
    let plan = pool.take_linear_state_plan();
    assert!(plan.zero_slots.is_empty(), "a restore needs no zero");
    assert_eq!(
        plan.restore_dst,
        vec![b.linear_state_slot().unwrap() as i32]
    );
    pool.commit_linear_state_plan(&plan).unwrap();
    pool.check().unwrap();
}

#[test]
fn next_checkpoint_boundary_and_contiguous_intervals() {
    let mut config = PoolConfig::new(64, BS);
    config.linear_state_slots = 8;
    config.checkpoint_interval = Some(8);
    let mut pool = BlockManagerPool::new(config).unwrap();
    let mut s = seq(0..22);
    assert!(pool.allocate(&mut s, None).unwrap());
    for (computed, expected) in [(0, Some(8)), (8, Some(16)), (16, Some(20)), (20, None)] {
        if computed > 0 {
            s.set_num_computed_tokens(computed).unwrap();
        }
        assert_eq!(pool.next_checkpoint_boundary(&mut s).unwrap(), expected);
    }
    config.linear_state_match = LinearStateMatch::Contiguous;
    assert!(BlockManagerPool::new(config).is_err());
    config.checkpoint_interval = Some(BS);
    assert!(BlockManagerPool::new(config).is_ok());
    let plain = BlockManagerPool::new(PoolConfig::new(64, BS)).unwrap();
    assert_eq!(
        plain.next_checkpoint_boundary(&mut seq(0..30)).unwrap(),
        None
    );
}
