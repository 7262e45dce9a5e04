//! `HierarchyBlockManagerPool` (R26): load / offload plans, pinning on both tiers, the ticket
//! scheme, remote-tier fetch records, and a proptest of random workloads with
//! `check()` after every step.

use std::collections::HashSet;

use kvpool::{
    HierarchyBlockManagerPool, HierarchyConfig, KvCacheManager, OffloadPolicy, RemoteHits,
    Sequence, TransferDirection, TransferPlan,
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
    // slot_mapping counts the load as computed: only the last token is left to compute.
    let slots = p.slot_mapping(&[&b], 0).unwrap();
    assert_eq!(slots.len(), 1);
    p.deallocate(&mut b).unwrap();
    p.deallocate(&mut c).unwrap();
    p.check().unwrap();
}

/// The host cache's events are "host" events of the rank's stream, and the remote
/// tier's stores the caller reports are "remote" events, chained from the host cache.
#[test]
fn host_and_remote_events_share_the_rank_stream() {
    let mut config = HierarchyConfig::new(16, 16, BS);
    config.pool.enable_events = true;
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut a = seq(0..13);
    let plans = run_and_release(&mut p, &mut a);
    p.complete_offloads(&refs(&plans)).unwrap();
    let hashes = plans[0].keys.clone();
    assert_eq!(
        p.record_remote_events(0, kvpool::KvEventKind::Stored, &hashes)
            .unwrap(),
        1,
        "one chain"
    );
    let events = p.drain_events();
    let media: Vec<(u64, kvpool::Medium)> = events.iter().map(|e| (e.sequence, e.medium)).collect();
    assert_eq!(
        media,
        vec![
            (1, kvpool::Medium::Device),
            (2, kvpool::Medium::Host),
            (3, kvpool::Medium::Remote)
        ]
    );
    let remote = &events[2];
    assert_eq!(remote.block_hashes, hashes);
    assert_eq!(remote.parent_hash, None);
    assert_eq!(remote.token_ids, (0..12).collect::<Vec<u32>>());
    assert!(p
        .record_remote_events(0, kvpool::KvEventKind::Cleared, &hashes)
        .is_err());
    assert!(p
        .record_remote_events(1, kvpool::KvEventKind::Stored, &hashes)
        .is_err());
    p.reset_prefix_cache();
    let kinds: Vec<_> = p
        .drain_events()
        .iter()
        .map(|e| (e.kind, e.medium, e.sequence))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (kvpool::KvEventKind::Cleared, kvpool::Medium::Device, 4),
            (kvpool::KvEventKind::Cleared, kvpool::Medium::Host, 5)
        ]
    );
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
// Remote tier: remote_query, allocate_with_remote, fetch records and their tickets.
// ------------------------------------------------------------------------------------------

/// Allocates `s` with every queried block reported present remotely; returns the query's
/// `from` and number of hashes.
fn allocate_all_remote(p: &mut HierarchyBlockManagerPool, s: &mut Sequence) -> (usize, usize) {
    let q = p.remote_query(s, None).unwrap().expect("something to ask");
    let hits = RemoteHits {
        from: q.from,
        to: q.from + q.hashes.len(),
    };
    assert!(p.allocate_with_remote(s, None, Some(hits)).unwrap());
    (q.from, q.hashes.len())
}

fn all_free(p: &mut HierarchyBlockManagerPool) {
    p.check().unwrap();
    p.reset_prefix_cache();
    let st = p.stats();
    assert_eq!(st.device.total.counts.free, st.device.total.counts.total);
    assert_eq!(st.host.counts.free, st.host.counts.total);
    assert_eq!(
        st.host.pending_load_blocks + st.host.pending_offload_blocks + st.host.pending_fetch_blocks,
        0
    );
}

#[test]
fn remote_query_is_side_effect_free_and_names_the_chain_past_the_local_reach() {
    let mut p = pool(16, 16);
    let mut s = seq(0..13); // R8: 3 blocks may hit
    let before = p.stats();
    let q = p.remote_query(&mut s, None).unwrap().unwrap();
    assert_eq!(q.from, 0);
    let mut chain = Vec::new();
    kvpool::BlockHasher::new(kvpool::DEFAULT_HASH_SEED).extend_chain(
        &mut chain,
        s.tokens(),
        BS,
        None,
    );
    assert_eq!(
        q.hashes,
        chain[..3].to_vec(),
        "R6 chain hashes are the remote keys"
    );
    assert_eq!(before, p.stats(), "R15: no side effect");
    assert!(s.blocks().is_empty());
    // A sequence fully on device has nothing to ask.
    let plans = run_and_release(&mut p, &mut seq(0..13));
    p.complete_offloads(&refs(&plans)).unwrap();
    assert!(p.remote_query(&mut s, None).unwrap().is_none());
    let mut t = seq(0..21); // blocks 0..3 local, 3..5 asked
    let q = p.remote_query(&mut t, None).unwrap().unwrap();
    assert_eq!((q.from, q.hashes.len()), (3, 2));
    // Nothing to ask when allocate would fail (R15: no round trip for a request that waits).
    let mut huge = seq(0..400);
    assert!(p.remote_query(&mut huge, None).unwrap().is_none());
}

#[test]
fn remote_hits_fetch_into_host_staging_then_load_and_count_after_confirmation() {
    let mut p = pool(16, 16);
    let mut s = seq(0..13);
    assert!(p.can_allocate(&mut s, None).unwrap());
    assert_eq!(allocate_all_remote(&mut p, &mut s), (0, 3));
    assert_eq!(
        s.num_cached_tokens(),
        0,
        "nothing counts before the fetch and load"
    );
    assert!(
        p.take_load_plans().is_empty(),
        "the load waits for the fetch"
    );
    let fetches = p.take_fetch_plans();
    assert_eq!(fetches.len(), 1);
    assert_eq!(fetches[0].direction(), TransferDirection::Fetch);
    assert_eq!(fetches[0].len(), 3);
    assert!(fetches[0].src.is_empty());
    assert_eq!(
        fetches[0].keys,
        p.remote_query(&mut seq(0..13), None)
            .unwrap()
            .unwrap()
            .hashes
    );
    let st = p.stats();
    assert_eq!(st.host.remote_hit_blocks, 3);
    assert_eq!(st.host.pending_fetch_blocks, 3);
    assert_eq!(
        st.host.counts.used, 3,
        "staging blocks are held, not cached"
    );
    p.check().unwrap();
    p.complete_fetches(&refs(&fetches), None).unwrap();
    assert!(
        p.complete_fetches(&refs(&fetches), None).is_err(),
        "a plan completes once"
    );
    assert_eq!(s.num_cached_tokens(), 0, "still not loaded");
    let loads = p.take_load_plans();
    assert_eq!(loads.len(), 1);
    assert_eq!(
        loads[0].src, fetches[0].dst,
        "the load reads the staging blocks"
    );
    let table: Vec<i32> = s.block_ids().map(|id| id as i32).collect();
    assert_eq!(loads[0].dst, table[..3].to_vec());
    p.check().unwrap();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(s.num_cached_tokens(), 12);
    assert_eq!(s.num_computed_tokens(), 12);
    let st = p.stats();
    assert_eq!(st.host.fetched_blocks, 3);
    assert_eq!(
        st.host.counts.free, 15,
        "staging blocks are freed after the load"
    );
    // Published on device: the next sequence hits there, nothing to ask remotely.
    let mut t = seq(0..13);
    assert!(p.remote_query(&mut t, None).unwrap().is_none());
    p.deallocate(&mut s).unwrap();
    let offloads = p.take_offload_plans();
    assert_eq!(
        offloads[0].keys.len(),
        3,
        "offload plans name the hashes written through"
    );
    p.complete_offloads(&refs(&offloads)).unwrap();
    all_free(&mut p);
}

#[test]
fn partial_fetch_keeps_the_leading_run_and_the_ticket_says_so() {
    let mut p = pool(16, 16);
    let mut s = seq(0..17); // 4 blocks may hit
    allocate_all_remote(&mut p, &mut s);
    let fetches = p.take_fetch_plans();
    assert_eq!(fetches[0].len(), 4);
    // Block 1 failed its checksum: blocks 2 and 3 are useless (the chain breaks).
    p.complete_fetches(&refs(&fetches), Some(&[vec![true, false, true, true]]))
        .unwrap();
    let st = p.stats();
    assert_eq!(
        (st.host.fetched_blocks, st.host.failed_fetch_blocks),
        (1, 3)
    );
    assert_eq!(
        st.host.counts.used, 1,
        "staging blocks past the run are freed"
    );
    let loads = p.take_load_plans();
    assert_eq!(loads[0].len(), 1);
    p.check().unwrap();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(s.num_cached_tokens(), 4, "only what arrived counts");
    assert_eq!(s.num_computed_tokens(), 4);
    s.set_num_computed_tokens(17).unwrap();
    p.deallocate(&mut s).unwrap();
    let offloads = p.take_offload_plans();
    p.complete_offloads(&refs(&offloads)).unwrap();
    all_free(&mut p);
}

#[test]
fn failed_fetch_keeps_the_host_part_and_a_wholly_failed_one_finishes_at_the_device_hit() {
    let mut p = pool(16, 16);
    // Host holds blocks 0..2 (offloaded, then evicted from the device).
    let plans = run_and_release(&mut p, &mut seq(0..9));
    p.complete_offloads(&refs(&plans)).unwrap();
    let mut big = seq(1000..1060);
    assert!(p.allocate(&mut big, None).unwrap());
    p.deallocate(&mut big).unwrap();
    let mut s = seq(0..17);
    assert_eq!(allocate_all_remote(&mut p, &mut s), (2, 2));
    let fetches = p.take_fetch_plans();
    assert_eq!(fetches[0].len(), 2);
    p.check().unwrap();
    p.fail_fetches(&refs(&fetches)).unwrap();
    let loads = p.take_load_plans();
    assert_eq!(loads[0].len(), 2, "the host hits still load");
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(s.num_cached_tokens(), 8);
    p.deallocate(&mut s).unwrap();

    // No host part: a failed fetch leaves nothing to load; the sequence recomputes.
    let mut t = seq(500..517);
    allocate_all_remote(&mut p, &mut t);
    let fetches = p.take_fetch_plans();
    p.fail_fetches(&refs(&fetches)).unwrap();
    assert!(p.take_load_plans().is_empty());
    assert_eq!(t.num_cached_tokens(), 0);
    assert_eq!(t.num_computed_tokens(), 0);
    p.check().unwrap();
    t.set_num_computed_tokens(17).unwrap();
    p.deallocate(&mut t).unwrap();
    let offloads = p.take_offload_plans();
    p.complete_offloads(&refs(&offloads)).unwrap();
    all_free(&mut p);
}

#[test]
fn fetch_outlives_its_sequence_and_never_touches_a_new_allocation() {
    let mut p = pool(16, 16);
    let mut s = seq(0..13);
    allocate_all_remote(&mut p, &mut s);
    let fetches = p.take_fetch_plans();
    p.deallocate(&mut s).unwrap(); // released while the fetch is in flight
    assert!(s.blocks().is_empty());
    p.check().unwrap();
    assert!(p.allocate(&mut s, None).unwrap(), "reallocated meanwhile");
    p.complete_fetches(&refs(&fetches), None).unwrap();
    let loads = p.take_load_plans();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(s.num_cached_tokens(), 0, "the old ticket does not apply");
    p.deallocate(&mut s).unwrap();
    all_free(&mut p);
}

#[test]
fn remote_hits_not_reaching_back_to_the_local_reach_are_ignored_and_shapes_are_checked() {
    let mut p = pool(16, 16);
    let mut s = seq(0..13);
    let hits = RemoteHits { from: 1, to: 3 }; // block 0 is nowhere: the chain cannot start
    assert!(p.allocate_with_remote(&mut s, None, Some(hits)).unwrap());
    assert!(p.take_fetch_plans().is_empty());
    p.deallocate(&mut s).unwrap();
    // Short host: the longest run of staging blocks that fits.
    let mut p = pool(16, 3);
    let mut s = seq(0..17);
    allocate_all_remote(&mut p, &mut s);
    let fetches = p.take_fetch_plans();
    assert_eq!(fetches[0].len(), 2);
    let e = p
        .complete_fetches(&refs(&fetches), Some(&[vec![true]]))
        .unwrap_err();
    assert!(e.to_string().starts_with("arrived"), "{e}");
    assert!(
        p.complete_loads(&refs(&fetches)).is_err(),
        "not a load plan"
    );
    p.check().unwrap();
    p.complete_fetches(&refs(&fetches), None).unwrap();
    let loads = p.take_load_plans();
    p.complete_loads(&refs(&loads)).unwrap();
    assert_eq!(s.num_cached_tokens(), 8);
    p.deallocate(&mut s).unwrap();
    let offloads = p.take_offload_plans();
    p.complete_offloads(&refs(&offloads)).unwrap();
    all_free(&mut p);
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
    TakeFetches,
    CompleteFetches(u8),
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
        2 => Just(Op::TakeFetches),
        2 => any::<u8>().prop_map(Op::CompleteFetches),
        1 => Just(Op::Reset),
    ]
}

/// One random workload: check() after every step, everything free after cleanup.
fn run_workload(ops: Vec<Op>, on_evict: bool, dp: usize) -> Result<(), TestCaseError> {
    let mut config = HierarchyConfig::new(9, 8, 2);
    config.pool.dp_size = dp;
    if on_evict {
        config.offload_policy = OffloadPolicy::OnEvict;
    }
    let mut p = HierarchyBlockManagerPool::new(config).unwrap();
    let mut running: Vec<Sequence> = Vec::new();
    let mut loads: Vec<TransferPlan> = Vec::new();
    let mut offloads: Vec<TransferPlan> = Vec::new();
    let mut fetches: Vec<TransferPlan> = Vec::new();
    // The remote tier: hashes written through by completed offloads.
    let mut remote: HashSet<u128> = HashSet::new();
    for op in ops {
        match op {
            Op::Admit { prefix, len } => {
                let tokens: Vec<u32> = (0..len as u32)
                    .map(|t| if t < 4 { t } else { t + 100 * prefix as u32 })
                    .collect();
                let mut s = Sequence::new(tokens, None, None);
                let can = p.can_allocate(&mut s, None).unwrap();
                let before = p.stats();
                let hits = p.remote_query(&mut s, None).unwrap().map(|q| {
                    let n = q
                        .hashes
                        .iter()
                        .take_while(|h| remote.contains(&h.0))
                        .count();
                    RemoteHits {
                        from: q.from,
                        to: q.from + n,
                    }
                });
                prop_assert_eq!(&before, &p.stats(), "remote_query has no side effect");
                let ok = p.allocate_with_remote(&mut s, None, hits).unwrap();
                prop_assert_eq!(can, ok, "R15");
                if ok {
                    running.push(s);
                } else {
                    prop_assert_eq!(before, p.stats(), "R14");
                }
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
                remote.extend(offloads.iter().flat_map(|o| o.keys.iter().map(|h| h.0)));
                offloads.clear();
            }
            Op::TakeFetches => fetches.extend(p.take_fetch_plans()),
            Op::CompleteFetches(mask) => {
                let arrived: Vec<Vec<bool>> = fetches
                    .iter()
                    .map(|f| (0..f.len()).map(|j| mask & (1 << (j % 8)) != 0).collect())
                    .collect();
                p.complete_fetches(&refs(&fetches), Some(&arrived)).unwrap();
                fetches.clear();
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
    fetches.extend(p.take_fetch_plans());
    p.complete_fetches(&refs(&fetches), None).unwrap();
    loads.extend(p.take_load_plans());
    offloads.extend(p.take_offload_plans());
    p.complete_loads(&refs(&loads)).unwrap();
    p.complete_offloads(&refs(&offloads)).unwrap();
    p.check().unwrap();
    p.reset_prefix_cache();
    let st = p.stats();
    prop_assert_eq!(st.device.total.counts.free, st.device.total.counts.total);
    prop_assert_eq!(st.host.counts.free, st.host.counts.total);
    prop_assert_eq!(
        st.host.pending_load_blocks + st.host.pending_offload_blocks + st.host.pending_fetch_blocks,
        0
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_workloads_keep_both_tiers_sound(
        ops in prop::collection::vec(op(), 1..80),
        on_evict in any::<bool>(),
        dp in 1usize..3,
    ) {
        run_workload(ops, on_evict, dp)?;
    }
}

/// The minimal workload proptest found in CI (2026-11-30): a fetch taken for a sequence whose
/// remote hit began past a host hit that a prefix-cache reset had left behind.
#[test]
fn regression_fetch_after_reset_keeps_its_record_consistent() {
    use Op::*;
    let ops = vec![
        Admit { prefix: 0, len: 4 },
        Step(0),
        Release(0),
        TakeOffloads,
        CompleteOffloads,
        Admit { prefix: 0, len: 3 },
        Reset,
        Release(0),
        Admit { prefix: 0, len: 5 },
        Admit { prefix: 0, len: 5 },
        TakeFetches,
        CompleteFetches(1),
    ];
    run_workload(ops, false, 1).unwrap();
}
