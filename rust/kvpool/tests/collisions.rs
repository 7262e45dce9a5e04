//! R7 beyond the full-attention cache: window blocks and linear-state checkpoints are anchored to
//! the full-attention entries of their chain positions, and the anchors travel with the KV
//! through the host tier (G5, G6); one offload per key (G7); the release order of several tables
//! in one `complete_offloads` (C2). The Python random workloads with a content shadow are in
//! tests/hybrid/test_collisions.py.

use kvpool::{
    BlockHasher, HierarchyBlockManagerPool, HierarchyConfig, KvCacheManager, Sequence, TransferPlan,
};

const BS: usize = 4;

fn seq(tokens: impl IntoIterator<Item = u32>) -> Sequence {
    Sequence::new(tokens.into_iter().collect(), None, None)
}

fn refs(plans: &[TransferPlan]) -> Vec<&TransferPlan> {
    plans.iter().collect()
}

fn compute(p: &mut HierarchyBlockManagerPool, s: &mut Sequence, n: usize) {
    s.set_num_computed_tokens(n).unwrap();
    p.cache(s).unwrap();
}

fn offload_all(p: &mut HierarchyBlockManagerPool) {
    let plans = p.take_offload_plans();
    p.complete_offloads(&refs(&plans)).unwrap();
}

/// Fills the device with fresh tokens and releases them: the device cache is evicted.
fn evict_device(p: &mut HierarchyBlockManagerPool, blocks: usize) {
    let mut filler = seq((0..(blocks * BS) as u32).map(|t| 90_000 + t));
    assert!(p.allocate(&mut filler, None).unwrap());
    p.deallocate(&mut filler).unwrap();
}

/// C2 (docs/contract.md, R10's choices): `complete_offloads` releases the device blocks of the
/// listed plans in list order, each plan's records in planning order, each table tail first.
#[test]
fn c2_complete_offloads_releases_in_plan_order_each_table_tail_first() {
    let mut p = HierarchyBlockManagerPool::new(HierarchyConfig::new(40, 40, BS)).unwrap();
    let mut seqs: Vec<Sequence> = (0..3u32)
        .map(|k| seq((0..13).map(move |t| 1000 * (k + 1) + t)))
        .collect();
    let mut tables = Vec::new();
    for s in &mut seqs {
        assert!(p.allocate(s, None).unwrap());
        compute(&mut p, s, 12);
        tables.push(s.block_ids().take(3).collect::<Vec<u32>>());
    }
    p.deallocate(&mut seqs[0]).unwrap();
    p.deallocate(&mut seqs[1]).unwrap();
    let first = p.take_offload_plans(); // one plan: records of seqs[0], then seqs[1]
    p.deallocate(&mut seqs[2]).unwrap();
    let second = p.take_offload_plans();
    assert_eq!((first.len(), second.len()), (1, 1));
    let cache = |p: &HierarchyBlockManagerPool| {
        p.block_manager(0)
            .unwrap()
            .prefix_cache()
            .unwrap()
            .eviction_order()
    };
    assert!(cache(&p).is_empty(), "pending offloads hold the blocks");
    p.complete_offloads(&[&second[0], &first[0]]).unwrap();
    let expected: Vec<u32> = [2, 0, 1]
        .iter()
        .flat_map(|&k| tables[k].iter().rev().copied())
        .collect();
    assert_eq!(cache(&p), expected);
    p.check().unwrap();
}

/// A window hit through the host tier and back: the anchors of the device entries go to the
/// host entries at the offload, and from there to the device entries the load makes, so the
/// kept window tail still verifies against a chain whose blocks made the round trip (R7).
#[test]
fn window_anchors_survive_an_offload_and_a_load() {
    let mut config = HierarchyConfig::new(12, 32, BS);
    config.pool.sliding_window = Some(8);
    config.pool.swa_num_blocks = Some(40);
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut a = seq(0..22);
    assert!(p.allocate(&mut a, None).unwrap());
    compute(&mut p, &mut a, 22);
    p.deallocate(&mut a).unwrap(); // keeps the window's tail
    offload_all(&mut p);
    evict_device(&mut p, 11);
    let mut b = seq(0..22);
    assert!(p.allocate(&mut b, None).unwrap());
    let loads = p.take_load_plans();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(
        b.num_computed_tokens(),
        20,
        "the host hit, through the kept window tail"
    );
    p.deallocate(&mut b).unwrap(); // its window table is the kept tail again
    offload_all(&mut p);
    // The device entries the load made carry the anchors: a device hit takes the window.
    let mut c = seq(0..22);
    let plan = p.plan(&mut c, None).unwrap().unwrap();
    assert_eq!((plan.device_hit_blocks(), plan.host_hit_blocks()), (5, 0));
    assert!(p.allocate_planned(&mut c, None, Some(&plan), None).unwrap());
    assert_eq!(c.num_computed_tokens(), 20);
    p.check().unwrap();
    p.deallocate(&mut c).unwrap();
    offload_all(&mut p);
    p.check().unwrap();
}

/// G7: a chain whose hashes repeat (a collision inside it) or hit a host entry of another chain
/// is offloaded only up to there, one key per plan entry; `check()` holds throughout.
#[test]
fn g7_an_offload_stops_at_a_colliding_key() {
    let mut config = HierarchyConfig::new(32, 32, 1);
    config.pool.hasher = BlockHasher::with_debug_bits(kvpool::DEFAULT_HASH_SEED, 1);
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    for tokens in [[2u32, 1, 7, 8], [3, 5, 9, 4], [6, 6, 6, 6]] {
        let mut s = seq(tokens);
        assert!(p.allocate(&mut s, None).unwrap());
        compute(&mut p, &mut s, 4);
        p.deallocate(&mut s).unwrap();
        p.check().unwrap();
        let plans = p.take_offload_plans();
        for plan in &plans {
            let mut keys = plan.keys.clone();
            keys.sort();
            keys.dedup();
            assert_eq!(keys.len(), plan.keys.len(), "one offload per key");
            let host = p.host_manager(0).unwrap().prefix_cache().unwrap();
            assert!(
                plan.keys.iter().all(|k| !host.contains(*k)),
                "no key the host holds"
            );
        }
        p.check().unwrap();
        p.complete_offloads(&refs(&plans)).unwrap();
        p.check().unwrap();
    }
    let host = p.host_manager(0).unwrap().prefix_cache().unwrap();
    assert!(host.len() <= 2, "1-bit hashes: at most two keys");
}

/// A checkpoint's link survives the eviction of the full-attention chain it links to: the chain
/// computed again takes its anchors back (`prefix_cache/graves.rs`), so the checkpoint still
/// restores, and only for its own prefix.
#[test]
fn a_checkpoint_survives_its_chain_evicted_and_computed_again() {
    use kvpool::{BlockManagerPool, PoolConfig};
    let mut config = PoolConfig::new(12, BS);
    config.linear_state_slots = 8;
    config.checkpoint_interval = Some(8);
    let mut p = BlockManagerPool::new(config).unwrap();
    let step = |p: &mut BlockManagerPool, s: &mut Sequence, n: usize| {
        s.set_num_computed_tokens(n).unwrap();
        p.cache(s).unwrap();
        let plan = p.take_linear_state_plan();
        p.commit_linear_state_plan(&plan).unwrap();
    };
    let mut a = seq(0..17);
    assert!(p.allocate(&mut a, None).unwrap());
    step(&mut p, &mut a, 8); // saves at 8
    step(&mut p, &mut a, 16); // and at 16
    p.deallocate(&mut a).unwrap();
    // Evict every device block: the checkpoints stay, their chain goes.
    let mut filler = seq(50_000..50_000 + 11 * BS as u32);
    assert!(p.allocate(&mut filler, None).unwrap());
    p.deallocate(&mut filler).unwrap();
    assert_eq!(p.counts(0).unwrap().cached, 0);
    // The chain computed again in one step (no save at 8 this time).
    let mut b = seq(0..17);
    assert!(p.allocate(&mut b, None).unwrap());
    assert_eq!(b.num_cached_tokens(), 0, "no KV left to reuse");
    step(&mut p, &mut b, 16);
    p.deallocate(&mut b).unwrap();
    // A's checkpoint at 8 restores a query that shares only the first 8 tokens.
    let mut c = seq((0..8).chain(900..910));
    assert!(p.allocate(&mut c, None).unwrap());
    assert_eq!(c.num_cached_tokens(), 8);
    let slot = c.linear_state_restore_slot();
    assert!(slot.is_some());
    p.check().unwrap();
    p.deallocate(&mut c).unwrap();
    let plan = p.take_linear_state_plan();
    p.commit_linear_state_plan(&plan).unwrap();
    p.check().unwrap();
}
