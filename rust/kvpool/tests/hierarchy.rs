//! `HierarchyBlockManagerPool` (R26): load / offload plans, pinning on both tiers, the ticket
//! scheme, and a proptest of random workloads with `check()` after every step.

use kvpool::{
    HierarchyBlockManagerPool, HierarchyConfig, KvCacheManager, OffloadPolicy, Sequence,
    TransferPlan,
};
use proptest::prelude::*;

const BS: usize = 4;

fn pool(device: usize, host: usize) -> HierarchyBlockManagerPool {
    HierarchyBlockManagerPool::new(HierarchyConfig::new(device, host, BS)).unwrap()
}

fn seq(tokens: std::ops::Range<u32>) -> Sequence {
    Sequence::new(tokens.collect(), None, None)
}

fn refs(plans: &[TransferPlan]) -> Vec<&TransferPlan> {
    plans.iter().collect()
}

/// Runs a sequence to the end of its prompt and releases it; returns the offload plans.
fn run_and_release(p: &mut HierarchyBlockManagerPool, s: &mut Sequence) -> Vec<TransferPlan> {
    assert!(p.allocate(s, None).unwrap());
    s.set_num_computed_tokens(s.len()).unwrap();
    p.deallocate(s).unwrap();
    p.take_offload_plans()
}

#[test]
fn offload_holds_device_blocks_until_confirmed() {
    let mut p = pool(16, 16);
    let mut a = seq(0..13); // 3 full blocks + 1 token
    let plans = run_and_release(&mut p, &mut a);
    assert_eq!(plans.len(), 1);
    assert_eq!(plans[0].len(), 3, "the 3 full computed blocks go to host");
    // R26: device blocks stay held (used) until the offload is confirmed.
    let st = p.stats();
    assert_eq!(st.device.total.counts.used, 3);
    assert_eq!(st.host.pending_offload_blocks, 3);
    assert_eq!(
        st.host.counts.used, 3,
        "host destinations are held, not cached"
    );
    p.check().unwrap();
    p.complete_offloads(&refs(&plans)).unwrap();
    let st = p.stats();
    assert_eq!(st.device.total.counts.used, 0);
    assert_eq!(st.device.total.counts.cached, 3);
    assert_eq!(st.host.counts.cached, 3);
    assert_eq!(st.host.offloaded_blocks, 3);
    p.check().unwrap();
    // Never offloaded twice.
    let mut b = seq(0..13);
    let plans = run_and_release(&mut p, &mut b);
    assert!(plans.is_empty());
}

#[test]
fn host_hit_after_device_eviction_loads_and_counts_after_confirmation() {
    let mut p = pool(16, 16);
    let mut a = seq(0..13);
    let plans = run_and_release(&mut p, &mut a);
    p.complete_offloads(&refs(&plans)).unwrap();
    // Evict the device copies by filling the device.
    let mut big = seq(1000..1060); // 15 blocks: every device block
    assert!(p.allocate(&mut big, None).unwrap());
    p.deallocate(&mut big).unwrap();
    assert!(
        p.take_offload_plans().is_empty(),
        "nothing computed, nothing offloaded"
    );
    assert_eq!(p.stats().device.total.counts.cached, 0);

    let mut b = seq(0..13);
    assert!(p.allocate(&mut b, None).unwrap());
    assert_eq!(
        b.num_cached_tokens(),
        0,
        "not cached before the load is confirmed"
    );
    let loads = p.take_load_plans();
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].len(), 3);
    let table: Vec<i32> = b.block_ids().map(|id| id as i32).collect();
    assert_eq!(loads[0].dst, table[..3].to_vec());
    p.check().unwrap();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(b.num_cached_tokens(), 12);
    assert_eq!(b.num_computed_tokens(), 12);
    let st = p.stats();
    assert_eq!(st.host.hit_tokens, 12);
    assert_eq!(st.host.loaded_blocks, 3);
    // Loaded blocks are published in the device cache: a second sequence hits on device.
    let mut c = seq(0..13);
    assert!(p.allocate(&mut c, None).unwrap());
    assert_eq!(c.num_cached_tokens(), 12);
    assert!(p.take_load_plans().is_empty());
    // slot_mapping folds the load: only the last token is left to compute.
    let slots = p.slot_mapping(&mut [&mut b]).unwrap();
    assert_eq!(slots.len(), 1);
    p.deallocate(&mut b).unwrap();
    p.deallocate(&mut c).unwrap();
    p.check().unwrap();
}

#[test]
fn plans_complete_once_and_only_in_their_pool() {
    let mut p = pool(16, 16);
    let mut q = pool(16, 16);
    let mut a = seq(0..9);
    let plans = run_and_release(&mut p, &mut a);
    assert!(q.complete_offloads(&refs(&plans)).is_err(), "foreign plan");
    assert!(p.complete_loads(&refs(&plans)).is_err(), "wrong direction");
    let twice = [&plans[0], &plans[0]];
    assert!(p.complete_offloads(&twice).is_err(), "listed twice");
    p.complete_offloads(&refs(&plans)).unwrap();
    assert!(
        p.complete_offloads(&refs(&plans)).is_err(),
        "completed twice"
    );
    p.check().unwrap();
}

#[test]
fn deallocate_during_pending_load_keeps_blocks_and_leaks_nothing() {
    let mut p = pool(16, 16);
    let mut a = seq(0..13);
    let plans = run_and_release(&mut p, &mut a);
    p.complete_offloads(&refs(&plans)).unwrap();
    // Evict the device copies.
    let mut big = seq(1000..1060);
    assert!(p.allocate(&mut big, None).unwrap());
    p.deallocate(&mut big).unwrap();

    let mut b = seq(0..13);
    assert!(p.allocate(&mut b, None).unwrap());
    let loads = p.take_load_plans();
    p.deallocate(&mut b).unwrap();
    assert_eq!(b.num_cached_tokens(), 0);
    // Plans never name a block that was freed: the destinations stay used.
    let st = p.stats();
    assert_eq!(st.device.total.counts.used, 3);
    // Reallocating meanwhile gets other device blocks and a second load.
    assert!(p.allocate(&mut b, None).unwrap());
    let again = p.take_load_plans();
    assert!(again[0].dst.iter().all(|d| !loads[0].dst.contains(d)));
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(
        b.num_cached_tokens(),
        0,
        "an old ticket does not touch the new allocation"
    );
    p.complete_loads(&refs(&again)).unwrap();
    assert_eq!(b.num_cached_tokens(), 12);
    p.deallocate(&mut b).unwrap();
    let offloads = p.take_offload_plans();
    assert!(offloads.is_empty(), "loaded blocks are on host already");
    p.reset_prefix_cache();
    let st = p.stats();
    assert_eq!(st.device.total.counts.free, 15);
    assert_eq!(st.host.counts.free, 15);
    p.check().unwrap();
}

#[test]
fn offload_confirmed_after_reallocation_leaks_no_device_block() {
    let mut p = pool(16, 16);
    let mut a = seq(0..13);
    let plans = run_and_release(&mut p, &mut a);
    // Reallocate before the offload completes: it hits its own device prefix.
    assert!(p.allocate(&mut a, None).unwrap());
    assert_eq!(a.num_cached_tokens(), 12);
    p.complete_offloads(&refs(&plans)).unwrap();
    assert_eq!(p.stats().device.total.counts.used, 4);
    p.deallocate(&mut a).unwrap();
    assert!(p.take_offload_plans().is_empty());
    p.reset_prefix_cache();
    let st = p.stats();
    assert_eq!(st.device.total.counts.free, 15);
    assert_eq!(st.host.counts.free, 15);
    p.check().unwrap();
}

#[test]
fn short_host_offloads_the_longest_prefix_that_fits() {
    let mut p = pool(16, 3); // 2 host blocks
    let mut a = seq(0..17); // 4 full blocks
    let plans = run_and_release(&mut p, &mut a);
    assert_eq!(plans[0].len(), 2);
    p.complete_offloads(&refs(&plans)).unwrap();
    let mut b = seq(100..117);
    let plans = run_and_release(&mut p, &mut b);
    assert_eq!(plans[0].len(), 2, "host LRU evicts a's chain, leaves first");
    p.complete_offloads(&refs(&plans)).unwrap();
    assert_eq!(p.stats().host.evictions, 2);
    p.check().unwrap();
}

#[test]
fn on_evict_offloads_only_blocks_this_release_makes_evictable() {
    let mut config = HierarchyConfig::new(16, 16, BS);
    config.offload_policy = OffloadPolicy::OnEvict;
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut a = seq(0..13);
    assert!(p.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(13).unwrap();
    p.cache(&mut a).unwrap();
    let mut b = Sequence::new((0..8).chain(50..55).collect(), None, None);
    assert!(p.allocate(&mut b, None).unwrap());
    assert_eq!(b.num_cached_tokens(), 8, "b shares a's first two blocks");
    p.deallocate(&mut a).unwrap();
    assert!(
        p.take_offload_plans().is_empty(),
        "a's first block is still held by b: the chain waits"
    );
    b.set_num_computed_tokens(13).unwrap();
    p.deallocate(&mut b).unwrap();
    let plans = p.take_offload_plans();
    assert_eq!(plans[0].len(), 3);
    p.complete_offloads(&refs(&plans)).unwrap();
    p.check().unwrap();
}

#[test]
fn bad_arguments_name_themselves() {
    let e = HierarchyBlockManagerPool::new(HierarchyConfig::new(16, 1, BS))
        .err()
        .unwrap();
    assert!(e.to_string().starts_with("host_num_blocks"), "{e}");
    assert!(OffloadPolicy::parse("never")
        .unwrap_err()
        .to_string()
        .starts_with("offload_policy"));
}

// ------------------------------------------------------------------------------------------
// Random workloads: check() after every step, everything free after cleanup (R2, R26).
// ------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Admit { prefix: u8, len: u8 },
    Step(u8),
    Release(u8),
    TakeLoads,
    TakeOffloads,
    CompleteLoads,
    CompleteOffloads,
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..14).prop_map(|(prefix, len)| Op::Admit { prefix, len }),
        3 => any::<u8>().prop_map(Op::Step),
        3 => any::<u8>().prop_map(Op::Release),
        2 => Just(Op::TakeLoads),
        2 => Just(Op::TakeOffloads),
        2 => Just(Op::CompleteLoads),
        2 => Just(Op::CompleteOffloads),
        1 => Just(Op::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_workloads_keep_both_tiers_sound(
        ops in prop::collection::vec(op(), 1..80),
        on_evict in any::<bool>(),
        dp in 1usize..3,
    ) {
        let mut config = HierarchyConfig::new(9, 8, 2);
        config.pool.dp_size = dp;
        if on_evict { config.offload_policy = OffloadPolicy::OnEvict; }
        let mut p = HierarchyBlockManagerPool::new(config).unwrap();
        let mut running: Vec<Sequence> = Vec::new();
        let mut loads: Vec<TransferPlan> = Vec::new();
        let mut offloads: Vec<TransferPlan> = Vec::new();
        for op in ops {
            match op {
                Op::Admit { prefix, len } => {
                    let tokens: Vec<u32> = (0..len as u32)
                        .map(|t| if t < 4 { t } else { t + 100 * prefix as u32 })
                        .collect();
                    let mut s = Sequence::new(tokens, None, None);
                    let can = p.can_allocate(&mut s, None).unwrap();
                    let before = p.stats();
                    let ok = p.allocate(&mut s, None).unwrap();
                    prop_assert_eq!(can, ok, "R15");
                    if ok { running.push(s); } else { prop_assert_eq!(before, p.stats(), "R14"); }
                }
                Op::Step(i) if !running.is_empty() => {
                    let k = i as usize % running.len();
                    let s = &mut running[k];
                    let n = (s.num_computed_tokens() + 5).min(s.len()).min(s.capacity());
                    s.set_num_computed_tokens(n).unwrap();
                    p.cache(s).unwrap();
                    if s.num_computed_tokens() == s.len() {
                        s.append_token(7);
                        let _ = p.may_append(s, 0).unwrap();
                    }
                }
                Op::Release(i) if !running.is_empty() => {
                    let mut s = running.swap_remove(i as usize % running.len());
                    p.deallocate(&mut s).unwrap();
                    prop_assert!(s.blocks().is_empty());
                }
                Op::TakeLoads => loads.extend(p.take_load_plans()),
                Op::TakeOffloads => offloads.extend(p.take_offload_plans()),
                Op::CompleteLoads => {
                    p.complete_loads(&refs(&loads)).unwrap();
                    prop_assert!(p.complete_loads(&refs(&loads)).is_err() || loads.is_empty());
                    loads.clear();
                }
                Op::CompleteOffloads => {
                    p.complete_offloads(&refs(&offloads)).unwrap();
                    offloads.clear();
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
        p.check().unwrap();
        p.reset_prefix_cache();
        let st = p.stats();
        prop_assert_eq!(st.device.total.counts.free, st.device.total.counts.total);
        prop_assert_eq!(st.host.counts.free, st.host.counts.total);
        prop_assert_eq!(st.host.pending_load_blocks + st.host.pending_offload_blocks, 0);
    }
}
