//! One pool: a host tier composes with every other feature (R22-R26), admission
//! plans once and walks the chain once per tier (R14, R15), `plan` has no side effect, and the
//! seed's `allocate_shared`. Random workloads check every structure after every step and get
//! every id back at the end.

use kvpool::{
    BlockHasher, BlockManagerPool, HierarchyBlockManagerPool, HierarchyConfig, KvCacheManager,
    LinearStatePlan, PoolConfig, Sequence, TransferPlan,
};
use proptest::prelude::*;

const BS: usize = 4;

fn seq(tokens: impl IntoIterator<Item = u32>) -> Sequence {
    Sequence::new(tokens.into_iter().collect(), None, None)
}

fn refs(plans: &[TransferPlan]) -> Vec<&TransferPlan> {
    plans.iter().collect()
}

/// Everything observable of a pool's state: statistics, eviction orders of every cache,
/// checkpoint LRUs, pending copies and transfers.
fn snapshot(p: &BlockManagerPool) -> String {
    let mut out = format!("{:?} {:?}", p.stats(), p.host_stats());
    for rank in 0..p.dp_size() {
        if let Some(c) = p.block_manager(rank).unwrap().prefix_cache() {
            out += &format!(" dev{rank}={:?}/{:?}", c.eviction_order(), c.stats());
        }
        if let Some(h) = p.host_manager(rank).and_then(|m| m.prefix_cache()) {
            out += &format!(" host{rank}={:?}/{:?}", h.eviction_order(), h.stats());
        }
        if let Some(l) = p.linear_state_cache(rank) {
            out += &format!(" ckpt{rank}={:?}/{:?}", l.lru_order(), l.stats());
        }
        if let Some(w) = p.window_manager(rank) {
            out += &format!(" win{rank}={:?}", kvpool::BlockManager::counts(w));
        }
    }
    out + &format!(" copies={}", p.num_pending_linear_state_copies())
}

/// Computes `s` to `n` tokens and publishes (a forward step).
fn compute(p: &mut BlockManagerPool, s: &mut Sequence, n: usize) {
    s.set_num_computed_tokens(n).unwrap();
    p.cache(s).unwrap();
}

/// Fills the device with a sequence of fresh tokens and releases it: the device cache's
/// blocks are evicted (their copies stay on host).
fn evict_device(p: &mut BlockManagerPool, blocks: usize) {
    let mut filler = seq((0..(blocks * BS) as u32).map(|t| 90_000 + t));
    assert!(p.allocate(&mut filler, None).unwrap());
    p.deallocate(&mut filler).unwrap();
    assert!(
        p.take_offload_plans().is_empty(),
        "nothing computed, nothing offloaded"
    );
}

fn offload_all(p: &mut BlockManagerPool) {
    let plans = p.take_offload_plans();
    p.complete_offloads(&refs(&plans)).unwrap();
}

// ------------------------------------------------------------------------------------------
// Plan once: one walk per tier per admission; the plan has no side effect.
// ------------------------------------------------------------------------------------------

#[test]
fn one_chain_walk_per_admission_through_plan_and_allocate() {
    let mut p = BlockManagerPool::new(PoolConfig::new(64, BS)).unwrap();
    let mut a = seq(0..33);
    assert!(p.allocate(&mut a, None).unwrap());
    compute(&mut p, &mut a, 33);
    let mut b = seq(0..40);
    let before = p.debug_counters();
    let plan = p.plan(&mut b, None).unwrap().expect("fits");
    assert_eq!(
        plan.num_cached_blocks(),
        8,
        "R7, R8: the whole shared prefix"
    );
    assert!(p.allocate_planned(&mut b, None, Some(&plan), None).unwrap());
    let after = p.debug_counters();
    assert_eq!(
        after.device_chain_walks - before.device_chain_walks,
        1,
        "one walk"
    );
    assert_eq!(b.num_cached_tokens(), 32);
    // Without a plan, allocate walks once too (the old path walked up to three times).
    let mut c = seq(0..40);
    let before = p.debug_counters();
    assert!(p.allocate(&mut c, None).unwrap());
    assert_eq!(
        p.debug_counters().device_chain_walks - before.device_chain_walks,
        1
    );
    // A stale plan (the pool changed since) is planned again: still correct.
    let mut d = seq(0..40);
    let stale = p.plan(&mut d, None).unwrap().unwrap();
    p.cache(&mut c).unwrap();
    assert!(p
        .allocate_planned(&mut d, None, Some(&stale), None)
        .unwrap());
    assert_eq!(d.num_cached_tokens(), 32);
    // A plan of another sequence is not used for this one.
    let mut e = seq(500..540);
    assert!(p
        .allocate_planned(&mut e, None, Some(&stale), None)
        .unwrap());
    assert_eq!(e.num_cached_tokens(), 0);
    for s in [&mut a, &mut b, &mut c, &mut d, &mut e] {
        p.check_sequence(s).unwrap();
        p.deallocate(s).unwrap();
    }
    p.check().unwrap();
}

#[test]
fn one_walk_per_tier_with_a_host_tier() {
    let mut p = HierarchyBlockManagerPool::new(HierarchyConfig::new(12, 32, BS)).unwrap();
    let mut a = seq(0..21);
    assert!(p.allocate(&mut a, None).unwrap());
    compute(&mut p, &mut a, 21);
    p.deallocate(&mut a).unwrap();
    offload_all(&mut p);
    evict_device(&mut p, 11);
    let mut b = seq(0..21);
    let before = p.debug_counters();
    let plan = p.plan(&mut b, None).unwrap().unwrap();
    assert_eq!((plan.device_hit_blocks(), plan.host_hit_blocks()), (0, 5));
    assert!(p.allocate_planned(&mut b, None, Some(&plan), None).unwrap());
    let after = p.debug_counters();
    assert_eq!(after.device_chain_walks - before.device_chain_walks, 1);
    assert_eq!(after.host_chain_walks - before.host_chain_walks, 1);
    let loads = p.take_load_plans();
    assert_eq!(loads[0].len(), 5);
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(b.num_cached_tokens(), 20);
    p.deallocate(&mut b).unwrap();
    offload_all(&mut p);
    p.check().unwrap();
}

#[test]
fn plan_has_no_side_effect_of_any_kind() {
    let mut config = HierarchyConfig::new(12, 32, BS);
    config.pool.linear_state_slots = 6;
    config.pool.checkpoint_interval = Some(8);
    config.pool.enable_events = true;
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut a = seq(0..22);
    assert!(p.allocate(&mut a, None).unwrap());
    for n in [8, 16, 22] {
        compute(&mut p, &mut a, n);
        let plan = p.take_linear_state_plan();
        p.commit_linear_state_plan(&plan).unwrap();
    }
    p.deallocate(&mut a).unwrap();
    offload_all(&mut p);
    evict_device(&mut p, 11);
    p.drain_events();
    let mut b = seq(0..22);
    let before = snapshot(&p);
    let plan = p.plan(&mut b, None).unwrap().unwrap();
    let again = p.plan(&mut b, None).unwrap().unwrap();
    assert_eq!(plan, again, "the same answer twice");
    assert_eq!(snapshot(&p), before, "no side effect");
    assert!(p.drain_events().is_empty());
    assert!(p.take_load_plans().is_empty() && p.take_linear_state_plan().is_empty());
    assert!(!b.is_allocated() && b.dp_rank().is_none());
    p.check().unwrap();
}

#[test]
fn allocate_shared_takes_the_hit_only_and_allocate_grows_it() {
    let mut config = PoolConfig::new(16, BS);
    config.linear_state_slots = 4;
    let mut p = BlockManagerPool::new(config).unwrap();
    let mut a = seq(0..17);
    assert!(p.allocate(&mut a, None).unwrap());
    compute(&mut p, &mut a, 16); // R24: the prompt's last boundary gets a checkpoint
    let plan = p.take_linear_state_plan();
    p.commit_linear_state_plan(&plan).unwrap();
    p.deallocate(&mut a).unwrap();
    let mut b = seq(0..17);
    let free = p.counts(0).unwrap().free;
    assert!(p.allocate_shared(&mut b).unwrap());
    assert_eq!(b.blocks().len(), 4, "the hit's blocks, no new block");
    assert_eq!(p.counts(0).unwrap().free, free, "nothing fresh taken");
    assert!(b.single_block_id().is_some() && b.linear_state_slot().is_some());
    assert_eq!(b.num_computed_tokens(), 16);
    assert!(
        b.linear_state_restore_slot().is_some(),
        "R23: restored at the hit"
    );
    assert!(p.allocate_shared(&mut b).is_err(), "holds blocks already");
    assert!(p.allocate(&mut b, None).unwrap(), "grows it");
    assert_eq!(b.blocks().len(), 5);
    let mut empty = seq(500..503);
    assert!(p.allocate_shared(&mut empty).unwrap());
    assert_eq!(
        empty.blocks().len(),
        0,
        "no hit: nothing but the single block and the slot"
    );
    p.check_sequence(&empty).unwrap();
    p.check().unwrap();
    for s in [&mut b, &mut empty] {
        p.deallocate(s).unwrap();
    }
    let plan = p.take_linear_state_plan();
    p.commit_linear_state_plan(&plan).unwrap();
    p.check().unwrap();
}

#[test]
fn counts_of_a_rank_past_the_last_is_an_error_not_a_panic() {
    let p = BlockManagerPool::new(PoolConfig::new(8, BS)).unwrap();
    let e = p.counts(1).unwrap_err();
    assert!(matches!(
        e,
        kvpool::KvPoolError::InvalidArgument { name: "rank", .. }
    ));
}

// ------------------------------------------------------------------------------------------
// The rule across groups and tiers: a hit counts only up to the boundary every group serves.
// ------------------------------------------------------------------------------------------

/// R23 over the combined hit: checkpoints live on the device, so a host hit is trimmed to a
/// committed device checkpoint's boundary.
#[test]
fn host_hit_is_trimmed_to_a_device_checkpoint() {
    let mut config = HierarchyConfig::new(12, 32, BS);
    config.pool.linear_state_slots = 6;
    config.pool.checkpoint_interval = Some(8);
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let tokens: Vec<u32> = (0..22).collect();
    let mut a = seq(tokens.clone());
    assert!(p.allocate(&mut a, None).unwrap());
    for n in [8, 16, 22] {
        compute(&mut p, &mut a, n); // checkpoints at 8 and 16 (22 is no boundary)
        let plan = p.take_linear_state_plan();
        p.commit_linear_state_plan(&plan).unwrap();
    }
    p.deallocate(&mut a).unwrap();
    offload_all(&mut p);
    evict_device(&mut p, 11);
    let mut b = seq(tokens.clone());
    let plan = p.plan(&mut b, None).unwrap().unwrap();
    let hashes = BlockHasher::default().chain(&tokens[..20], BS, None);
    assert_eq!(plan.device_hit_blocks(), 0);
    assert_eq!(
        plan.host_hit_blocks(),
        4,
        "5 on host, trimmed to the checkpoint at block 4"
    );
    assert_eq!(plan.restore_checkpoint(), Some(hashes[3]));
    assert!(p.allocate_planned(&mut b, None, Some(&plan), None).unwrap());
    let copies: LinearStatePlan = p.take_linear_state_plan();
    assert_eq!(
        copies.restore_src.len(),
        1,
        "the restore of the checkpoint at 16 tokens"
    );
    let loads = p.take_load_plans();
    assert_eq!(loads.iter().map(TransferPlan::len).sum::<usize>(), 4);
    assert_eq!(
        b.num_cached_tokens(),
        0,
        "R26: counted once the load is confirmed"
    );
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!((b.num_cached_tokens(), b.num_computed_tokens()), (16, 16));
    p.commit_linear_state_plan(&copies).unwrap();
    p.check_sequence(&b).unwrap();
    // A step at 22 tokens: no save of a boundary at or before the restored one.
    compute(&mut p, &mut b, 22);
    p.deallocate(&mut b).unwrap();
    offload_all(&mut p);
    let plan = p.take_linear_state_plan();
    p.commit_linear_state_plan(&plan).unwrap();
    p.check().unwrap();
}

/// The window group needs the blocks of the last w tokens before the boundary: held as the kept
/// tail of the first turn, the host hit is whole; once they are evicted, it is trimmed away.
#[test]
fn host_hit_needs_the_window_blocks_before_its_boundary() {
    let mut config = HierarchyConfig::new(12, 32, BS);
    config.pool.sliding_window = Some(8);
    config.pool.swa_num_blocks = Some(40);
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut a = seq(0..22);
    assert!(p.allocate(&mut a, None).unwrap());
    compute(&mut p, &mut a, 22);
    p.deallocate(&mut a).unwrap(); // R25: keeps the window's tail
    offload_all(&mut p);
    evict_device(&mut p, 11);
    let mut b = seq(0..22);
    let plan = p.plan(&mut b, None).unwrap().unwrap();
    assert_eq!((plan.device_hit_blocks(), plan.host_hit_blocks()), (0, 5));
    assert!(p.allocate_planned(&mut b, None, Some(&plan), None).unwrap());
    assert_eq!(
        &b.group_block_ids(1).unwrap()[..3],
        &[0, 0, 0],
        "R25: before the window"
    );
    let loads = p.take_load_plans();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(b.num_computed_tokens(), 20);
    p.check_sequence(&b).unwrap();
    p.deallocate(&mut b).unwrap();
    offload_all(&mut p);
    // Without the window's blocks the host hit cannot be served at any boundary.
    let kept = kvpool::BlockManager::counts(p.window_manager(0).unwrap()).cached;
    assert!(kept > 0);
    p.window_manager_mut(0).unwrap().evict(kept);
    evict_device(&mut p, 11);
    let mut c = seq(0..22);
    let plan = p.plan(&mut c, None).unwrap().unwrap();
    assert_eq!(
        plan.num_cached_blocks(),
        0,
        "trimmed where the window blocks are missing"
    );
    assert!(p.allocate_planned(&mut c, None, Some(&plan), None).unwrap());
    assert!(p.take_load_plans().is_empty());
    p.deallocate(&mut c).unwrap();
    offload_all(&mut p);
    p.check().unwrap();
}

/// Remote hits are taken only where every group is full attention (docs/host_tier.md).
#[test]
fn remote_is_not_asked_where_a_group_could_not_follow_a_partial_fetch() {
    let mut config = HierarchyConfig::new(12, 32, BS);
    config.pool.linear_state_slots = 4;
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut s = seq(0..21);
    assert!(p.remote_query(&mut s, None).unwrap().is_none());
    let hits = kvpool::RemoteHits { from: 0, to: 5 };
    assert!(p.allocate_with_remote(&mut s, None, Some(hits)).unwrap());
    assert!(p.take_fetch_plans().is_empty());
    assert_eq!(s.num_cached_tokens(), 0);
    p.deallocate(&mut s).unwrap();
    p.check().unwrap();
}

// ------------------------------------------------------------------------------------------
// Random workloads of every new combination.
// ------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Setup {
    dp: usize,
    linear: bool,
    window: bool,
    batch: bool,
}

#[derive(Clone, Debug)]
enum Op {
    Admit {
        prefix: u8,
        len: u8,
        mode: u8,
    },
    Step(u8),
    Decode,
    Release(u8),
    TakeLoads,
    TakeOffloads,
    CompleteLoads,
    CompleteOffloads,
    LinearPlan {
        commit: bool,
    },
    /// See [`pressure`].
    Pressure(u8),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..2, 1u8..30, 0u8..6).prop_map(|(prefix, len, mode)| Op::Admit { prefix, len, mode }),
        5 => any::<u8>().prop_map(Op::Step),
        3 => any::<u8>().prop_map(Op::Pressure),
        2 => Just(Op::Decode),
        3 => any::<u8>().prop_map(Op::Release),
        2 => Just(Op::TakeLoads),
        2 => Just(Op::TakeOffloads),
        3 => Just(Op::CompleteLoads),
        3 => Just(Op::CompleteOffloads),
        2 => any::<bool>().prop_map(|commit| Op::LinearPlan { commit }),
        1 => Just(Op::Reset),
    ]
}

/// Fillers of fresh tokens as large as the ranks can take, released at once (each goes to the
/// rank with the most available, R13): evicts the device caches, so later hits continue in the
/// host tier.
fn pressure(p: &mut BlockManagerPool, dp: usize, salt: u8) {
    let mut fillers = Vec::new();
    for r in 0..dp {
        let free = (0..dp)
            .map(|q| p.counts(q).unwrap().available())
            .max()
            .unwrap_or(0);
        let base = 50_000 + 1000 * (salt as u32 + r as u32);
        let mut filler = seq((0..(free * BS) as u32).map(|t| base + t));
        if free > 0 && p.allocate(&mut filler, None).unwrap() {
            fillers.push(filler);
        }
    }
    for mut filler in fillers {
        p.deallocate(&mut filler).unwrap();
    }
}

fn run(setup: Setup, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut config = HierarchyConfig::new(14, 24, BS);
    config.pool.dp_size = setup.dp;
    if setup.linear {
        config.pool.linear_state_slots = 7;
        config.pool.checkpoint_interval = Some(8);
    }
    if setup.window {
        config.pool.sliding_window = Some(6);
        config.pool.swa_num_blocks = Some(30);
    }
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut running: Vec<Sequence> = Vec::new();
    let (mut loads, mut offloads): (Vec<TransferPlan>, Vec<TransferPlan>) =
        (Vec::new(), Vec::new());
    let mut copies: Vec<LinearStatePlan> = Vec::new();
    let mut history: Vec<Vec<u32>> = Vec::new();
    for op in ops {
        match op {
            Op::Admit { prefix, len, mode } => {
                // Modes 3..: an earlier conversation returns after its device blocks were
                // evicted (its hit continues in the host tier).
                let returning = mode >= 3 && !history.is_empty();
                if returning {
                    pressure(&mut p, setup.dp, len);
                }
                let (mode, prefix) = (mode % 3, if returning { 0 } else { prefix });
                // Half the admissions continue an earlier conversation (its tokens, then more).
                let tokens: Vec<u32> = match history.len() {
                    n if n > 0 && prefix == 0 => {
                        let mut t = history[len as usize % n].clone();
                        t.extend((0..len as u32 % 6).map(|x| 700 + x));
                        t
                    }
                    _ => (0..len as u32)
                        .map(|t| if t < 17 { t } else { t + 100 * prefix as u32 })
                        .collect(),
                };
                let mut s = seq(tokens);
                let before = snapshot(&p);
                let plan = p.plan(&mut s, None).unwrap();
                prop_assert_eq!(&before, &snapshot(&p), "plan: no side effect");
                let can = p.can_allocate(&mut s, None).unwrap();
                prop_assert_eq!(can, plan.is_some(), "R15");
                let ok = match mode {
                    0 => p
                        .allocate_planned(&mut s, None, plan.as_ref(), None)
                        .unwrap(),
                    1 => p.allocate(&mut s, None).unwrap(),
                    _ => {
                        let ok = p.allocate_shared(&mut s).unwrap();
                        ok && {
                            let grown = p.allocate(&mut s, None).unwrap();
                            if !grown {
                                p.deallocate(&mut s).unwrap();
                            }
                            grown
                        }
                    }
                };
                if mode < 2 {
                    prop_assert_eq!(can, ok, "R15: can_allocate predicts allocate");
                }
                if ok {
                    running.push(s);
                } else if mode < 2 {
                    prop_assert_eq!(before, snapshot(&p), "R14: a failure changes nothing");
                }
            }
            Op::Step(i) if !running.is_empty() => {
                let k = i as usize % running.len();
                let s = &mut running[k];
                let n = (s.num_computed_tokens() + 8).min(s.len()).min(s.capacity());
                s.set_num_computed_tokens(n).unwrap();
                p.cache(s).unwrap();
                if s.num_computed_tokens() == s.len() {
                    s.append_token(7);
                    let _ = p.may_append(s, 0).unwrap();
                }
                if i & 1 == 1 {
                    // The engine runs the step's copies at once (else LinearPlan confirms them).
                    let plan = p.take_linear_state_plan();
                    p.commit_linear_state_plan(&plan).unwrap();
                }
            }
            Op::Pressure(salt) => pressure(&mut p, setup.dp, salt),
            Op::Decode => {
                // The batch API over the sequences that hold every token.
                let mut batch: Vec<&mut Sequence> = running
                    .iter_mut()
                    .filter(|s| s.capacity() >= s.len())
                    .collect();
                let tokens = vec![11u32; batch.len()];
                if setup.batch {
                    let _ = p.advance_and_reserve_all(&mut batch, &tokens, 0).unwrap();
                } else {
                    p.advance_all(&mut batch, &tokens).unwrap();
                    let _ = p.may_append_all(&mut batch, 0).unwrap();
                }
            }
            Op::Release(i) if !running.is_empty() => {
                let mut s = running.swap_remove(i as usize % running.len());
                p.deallocate(&mut s).unwrap();
                prop_assert!(s.blocks().is_empty() && !s.is_allocated());
                history.push(s.tokens().to_vec());
                if i % 2 == 0 {
                    // The engine runs the offload at once (else it waits for CompleteOffloads).
                    offloads.extend(p.take_offload_plans());
                    p.complete_offloads(&refs(&offloads)).unwrap();
                    offloads.clear();
                }
            }
            Op::TakeLoads => loads.extend(p.take_load_plans()),
            Op::TakeOffloads => offloads.extend(p.take_offload_plans()),
            Op::CompleteLoads => {
                loads.extend(p.take_load_plans());
                p.complete_loads(&refs(&loads)).unwrap();
                loads.clear();
            }
            Op::CompleteOffloads => {
                offloads.extend(p.take_offload_plans());
                p.complete_offloads(&refs(&offloads)).unwrap();
                offloads.clear();
            }
            Op::LinearPlan { commit } => {
                copies.push(p.take_linear_state_plan());
                if commit {
                    for plan in copies.drain(..) {
                        p.commit_linear_state_plan(&plan).unwrap();
                    }
                }
            }
            Op::Reset => p.reset_prefix_cache(),
            _ => {}
        }
        p.check().unwrap();
        for s in &running {
            p.check_sequence(s).unwrap();
        }
    }
    for mut s in running.drain(..) {
        p.deallocate(&mut s).unwrap();
    }
    loads.extend(p.take_load_plans());
    offloads.extend(p.take_offload_plans());
    p.complete_loads(&refs(&loads)).unwrap();
    p.complete_offloads(&refs(&offloads)).unwrap();
    copies.push(p.take_linear_state_plan());
    for plan in copies.drain(..) {
        p.commit_linear_state_plan(&plan).unwrap();
    }
    p.check().unwrap();
    p.reset_prefix_cache();
    p.check().unwrap();
    let st = p.stats();
    let d = st.device.total;
    prop_assert_eq!(d.counts.free, d.counts.total, "every device id back");
    prop_assert_eq!(
        st.host.counts.free,
        st.host.counts.total,
        "every host id back"
    );
    prop_assert_eq!(
        d.num_free_single_blocks,
        setup.dp * 13,
        "every single block back"
    );
    if let Some(w) = d.window {
        prop_assert_eq!(w.free, w.total, "every window id back");
    }
    if setup.linear {
        prop_assert_eq!(
            d.num_free_linear_state_slots,
            setup.dp * 6,
            "every slot back"
        );
    }
    prop_assert_eq!(p.num_pending_linear_state_copies(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn random_host_tier_with_linear_state(ops in prop::collection::vec(op(), 1..90), dp in 1usize..3) {
        run(Setup { dp, linear: true, window: false, batch: false }, ops)?;
    }

    #[test]
    fn random_host_tier_with_a_sliding_window(ops in prop::collection::vec(op(), 1..90), dp in 1usize..3) {
        run(Setup { dp, linear: false, window: true, batch: false }, ops)?;
    }

    #[test]
    fn random_host_tier_dp_ranks_and_the_batch_api(
        ops in prop::collection::vec(op(), 1..90),
        dp in 2usize..4,
        batch in any::<bool>(),
    ) {
        run(Setup { dp, linear: false, window: false, batch }, ops)?;
    }

    #[test]
    fn random_host_tier_with_every_group(ops in prop::collection::vec(op(), 1..90), dp in 1usize..3) {
        run(Setup { dp, linear: true, window: true, batch: true }, ops)?;
    }
}
