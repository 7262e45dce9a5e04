//! Reliability: regression tests of the core findings F1-F9 of an outside
//! differential/fuzz campaign, and the property test that would have caught F2 and F4: over
//! random serving workloads with sliding window + prefix cache, linear-state saves (copy and
//! promote, plans taken and committed at random times, sometimes late) and the host tier,
//! `can_allocate` / `can_append` predict `allocate` / `may_append` exactly (R15, R16), a failed
//! call changes nothing (a full state snapshot: statistics, every table, both eviction orders,
//! checkpoint order), and `check()` holds after every step.

use kvpool::{
    BlockManager, BlockManagerImpl, BlockManagerPool, ConcurrentBlockManager,
    HierarchyBlockManagerPool, HierarchyConfig, KvCacheManager, KvPoolError, LinearStatePlan,
    LinearStateSave, ManagerConfig, OffloadPolicy, PoolConfig, Sequence, SlidingWindowBlockManager,
    TransferPlan,
};
use proptest::prelude::*;

fn ids(blocks: &[kvpool::Block]) -> Vec<u32> {
    blocks.iter().map(|b| b.id()).collect()
}

// ------------------------------------------------------------------------------ F1, F5

#[test]
fn f1_huge_allocations_are_out_of_blocks_errors_and_change_nothing() {
    let concurrent = ConcurrentBlockManager::new(ManagerConfig::new(16, 4)).unwrap();
    let mut plain = BlockManagerImpl::new(ManagerConfig::new(16, 4)).unwrap();
    for n in [17, 1 << 31, 1 << 40, 1 << 62, 1 << 63, usize::MAX] {
        assert!(matches!(
            concurrent.allocate(n),
            Err(KvPoolError::OutOfBlocks { requested, .. }) if requested == n
        ));
        assert!(matches!(
            plain.allocate(n),
            Err(KvPoolError::OutOfBlocks { .. })
        ));
    }
    assert_eq!(concurrent.counts().free, 15);
    assert_eq!(plain.counts().free, 15);
    concurrent.check().unwrap();
    plain.check().unwrap();
}

#[test]
fn f1_constructor_sizes_past_the_caps_are_errors_naming_the_argument() {
    let named = |r: kvpool::Result<()>| match r {
        Err(KvPoolError::InvalidArgument { name, .. }) => name,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    let manager = |n, bs| BlockManagerImpl::new(ManagerConfig::new(n, bs)).map(|_| ());
    assert_eq!(named(manager((1 << 30) + 1, 1)), "num_blocks");
    assert_eq!(named(manager(usize::MAX, 1)), "num_blocks");
    assert_eq!(named(manager(16, (1 << 16) + 1)), "block_size");
    assert_eq!(named(manager(1 << 30, 1 << 16)), "num_blocks");
    let single = |n| kvpool::SingleBlockManager::new(n).map(|_| ());
    assert_eq!(named(single((1 << 30) + 1)), "num_slots");
    let linear = |n| kvpool::LinearStatePrefixCache::new(n).map(|_| ());
    assert_eq!(named(linear(usize::MAX)), "num_slots");
    let pool = |f: &dyn Fn(&mut PoolConfig)| {
        let mut c = PoolConfig::new(16, 4);
        f(&mut c);
        BlockManagerPool::new(c).map(|_| ())
    };
    assert_eq!(named(pool(&|c| c.dp_size = 1 << 40)), "dp_size");
    assert_eq!(
        named(pool(&|c| c.num_single_blocks = Some(1 << 31))),
        "num_single_blocks"
    );
    assert_eq!(
        named(pool(&|c| c.linear_state_slots = 1 << 31)),
        "linear_state_slots"
    );
    assert_eq!(
        named(pool(&|c| {
            c.sliding_window = Some(8);
            c.swa_num_blocks = Some(1 << 31);
        })),
        "swa_num_blocks"
    );
    let host = HierarchyBlockManagerPool::new(HierarchyConfig::new(16, 1 << 31, 4)).map(|_| ());
    assert_eq!(named(host), "host_num_blocks");
    // No cap needed: these allocate nothing and their arithmetic is exact.
    pool(&|c| c.sliding_window = Some(usize::MAX)).unwrap();
    pool(&|c| {
        c.linear_state_slots = 4;
        c.checkpoint_interval = Some(usize::MAX - usize::MAX % 4);
    })
    .unwrap();
}

#[test]
fn f5_lookahead_past_usize_is_a_no_on_both_pools() {
    let mut p = BlockManagerPool::new(PoolConfig::new(16, 4)).unwrap();
    let mut h = HierarchyBlockManagerPool::new(HierarchyConfig::new(16, 16, 4)).unwrap();
    let mut a = Sequence::new((0..9).collect(), None, None);
    let mut b = Sequence::new((0..9).collect(), None, None);
    assert!(p.allocate(&mut a, None).unwrap() && h.allocate(&mut b, None).unwrap());
    for lookahead in [1 << 62, 1 << 63, usize::MAX - 8, usize::MAX] {
        assert!(!p.can_append(&a, lookahead).unwrap());
        assert!(!p.may_append(&mut a, lookahead).unwrap());
        assert!(!h.can_append(&b, lookahead).unwrap());
        assert!(!h.may_append(&mut b, lookahead).unwrap());
        assert_eq!(p.may_append_all(&mut [&mut a], lookahead).unwrap(), vec![0]);
        assert_eq!(
            p.advance_and_reserve_all(&mut [&mut a], &[1], lookahead)
                .unwrap(),
            vec![0]
        );
    }
    assert_eq!(a.blocks().len(), 3, "nothing was taken");
    assert_eq!(b.blocks().len(), 3);
    p.check().unwrap();
    h.check().unwrap();
    let w = SlidingWindowBlockManager::new(16, 4, 8, false).unwrap();
    assert_eq!(w.first_needed_block(usize::MAX), (usize::MAX - 7) / 4);
    assert_eq!(w.first_needed_block(7), 0);
    assert_eq!(w.first_needed_block(8), 0);
    assert_eq!(w.first_needed_block(11), 1);
}

// ------------------------------------------------------------------------------ F8, F9

#[test]
fn f8_a_parent_made_a_leaf_competes_by_its_own_recency() {
    let mut m = BlockManagerImpl::new(ManagerConfig::new(16, 2)).unwrap();
    let a_tokens: Vec<u32> = (1..=8).collect(); // A0..A3
    let b_tokens = [9u32, 9];
    let head = m.allocate(3).unwrap();
    m.cache(&a_tokens[..6], &head, None).unwrap();
    let a_ids = ids(&head);
    m.deallocate(head).unwrap(); // A0..A2 cache-only (oldest)
    let hit = m.allocate_shared(&a_tokens[..6], None);
    let tail = m.allocate(1).unwrap();
    let chain: Vec<_> = hit.iter().cloned().chain(tail.iter().cloned()).collect();
    assert_eq!(m.cache(&a_tokens, &chain, None).unwrap(), 1); // A3 hangs under A2
    drop(chain);
    m.deallocate(hit).unwrap(); // A0..A2 cache-only again
    m.deallocate(tail).unwrap(); // A3 newer than them
    let b = m.allocate(1).unwrap();
    m.cache(&b_tokens, &b, None).unwrap();
    let b_id = b[0].id();
    m.deallocate(b).unwrap(); // B0 newest
    assert_eq!(m.evict(2), 2);
    let cache = m.prefix_cache().unwrap();
    let left: Vec<u32> = cache.lru_order();
    assert!(left.contains(&a_ids[0]) && left.contains(&a_ids[1]));
    assert!(
        !left.contains(&a_ids[2]),
        "A2 (older than B0) went right after A3"
    );
    assert!(left.contains(&b_id), "B0 is the newest leaf: kept");
    m.check().unwrap();
}

#[test]
fn f9_a_dropped_sequence_takes_its_lru_place_when_dropped() {
    let mut p = BlockManagerPool::new(PoolConfig::new(10, 4)).unwrap();
    let mut c = Sequence::new(vec![2, 0, 2, 2, 2, 0, 1, 1, 0, 1, 1, 0], None, None);
    let mut a = Sequence::new((100..124).collect(), None, None);
    for s in [&mut c, &mut a] {
        assert!(p.allocate(s, None).unwrap());
        let n = s.len();
        s.set_num_computed_tokens(n).unwrap();
        p.cache(s).unwrap();
    }
    let c_ids: Vec<u32> = c.block_ids().collect();
    let a_ids: Vec<u32> = a.block_ids().collect();
    drop(c); // released first (no deallocate): oldest
    p.deallocate(&mut a).unwrap();
    let order = p
        .block_manager(0)
        .unwrap()
        .prefix_cache()
        .unwrap()
        .eviction_order();
    let expected: Vec<u32> = c_ids
        .iter()
        .rev()
        .chain(a_ids.iter().rev())
        .copied()
        .collect();
    assert_eq!(
        order, expected,
        "release order, each table tail first (R10, R11)"
    );
    let mut x = Sequence::new(vec![7; 8], None, Some(b"x"));
    assert!(p.allocate(&mut x, None).unwrap()); // evicts C's two tail blocks
    let mut probe = Sequence::new((100..124).chain([1]).collect(), None, None);
    assert!(p.allocate(&mut probe, None).unwrap());
    assert_eq!(probe.num_cached_tokens(), 24, "A is intact");
    p.check().unwrap();
}

// ------------------------------------------------------------------------------ F2, F6, F7

fn linear_pool(slots: usize, save: LinearStateSave) -> BlockManagerPool {
    let mut config = PoolConfig::new(32, 4);
    config.linear_state_slots = slots;
    config.checkpoint_interval = Some(4);
    config.linear_state_save = save;
    BlockManagerPool::new(config).unwrap()
}

fn advance_to(p: &mut BlockManagerPool, s: &mut Sequence, n: usize) {
    s.set_num_computed_tokens(n).unwrap();
    p.cache(s).unwrap();
}

#[test]
fn f2_a_promoted_checkpoint_an_in_flight_copy_holds_is_pinned() {
    let mut p = linear_pool(4, LinearStateSave::Promote);
    let mut a = Sequence::new((1..14).collect(), None, None);
    assert!(p.allocate(&mut a, None).unwrap());
    advance_to(&mut p, &mut a, 4); // L1 -> checkpoint(4), a continues in F1
    let plan1 = p.take_linear_state_plan(); // copy L1 -> F1 taken, not confirmed
    advance_to(&mut p, &mut a, 8); // F1 -> checkpoint(8), a continues in F2
    let plan2 = p.take_linear_state_plan();
    p.commit_linear_state_plan(&plan2).unwrap();
    p.check().unwrap();
    let l = p.linear_state_cache(0).unwrap();
    assert_eq!(
        l.num_pinned_checkpoints(),
        2,
        "checkpoint(8) waits for plan1"
    );
    assert_eq!(l.num_available_slots(), 0);
    let mut b = Sequence::new(vec![77; 6], None, None);
    let before = format!("{:?}", p.stats());
    assert!(!p.can_allocate(&mut b, None).unwrap());
    assert!(!p.allocate(&mut b, None).unwrap(), "R15");
    assert_eq!(format!("{:?}", p.stats()), before, "R14: nothing changed");
    p.commit_linear_state_plan(&plan1).unwrap();
    assert_eq!(p.linear_state_cache(0).unwrap().num_pinned_checkpoints(), 0);
    assert!(p.can_allocate(&mut b, None).unwrap() && p.allocate(&mut b, None).unwrap());
    p.check().unwrap();
}

#[test]
fn f6_a_save_left_untaken_past_its_boundary_is_dropped() {
    let mut p = linear_pool(8, LinearStateSave::Copy);
    let toks: Vec<u32> = (1..14).collect();
    let mut a = Sequence::new(toks.clone(), None, None);
    assert!(p.allocate(&mut a, None).unwrap());
    advance_to(&mut p, &mut a, 4);
    advance_to(&mut p, &mut a, 8); // the step ran without taking the plan of boundary 4
    let plan: LinearStatePlan = p.take_linear_state_plan();
    assert_eq!(plan.save_src.len(), 1, "only the boundary-8 save is left");
    p.commit_linear_state_plan(&plan).unwrap();
    p.check().unwrap();
    let mut b = Sequence::new(
        toks[..4].iter().copied().chain([99, 98, 97]).collect(),
        None,
        None,
    );
    assert!(p.allocate(&mut b, None).unwrap());
    assert_eq!(
        b.linear_state_restore_slot(),
        None,
        "no checkpoint holds a wrong state"
    );
    p.check().unwrap();
}

#[test]
fn f7_a_failed_checkpoint_reservation_is_retried_at_the_same_boundary() {
    let mut p = linear_pool(4, LinearStateSave::Copy); // 3 usable slots
    let mut x = Sequence::new(vec![9; 5], None, None);
    let mut y = Sequence::new(vec![8; 5], None, None);
    let mut a = Sequence::new((1..7).collect(), None, None);
    for s in [&mut x, &mut y, &mut a] {
        assert!(p.allocate(s, None).unwrap());
    }
    advance_to(&mut p, &mut a, 4);
    assert_eq!(
        p.stats().total.num_pending_checkpoints,
        0,
        "every slot live"
    );
    p.deallocate(&mut x).unwrap();
    p.cache(&mut a).unwrap();
    assert_eq!(p.stats().total.num_pending_checkpoints, 1, "R24: retried");
    p.check().unwrap();
}

// ------------------------------------------------------------------------------ property test

/// What the workload runs against: a device pool or a hierarchy pool.
trait Harness: KvCacheManager {
    fn snapshot(&self) -> String;
    fn check_all(&self, running: &[Sequence]) -> Result<(), String>;
    fn plans(
        &mut self,
        op: u8,
        taken: &mut Vec<LinearStatePlan>,
        transfers: &mut Vec<Vec<TransferPlan>>,
    );
    fn finish(&mut self, taken: &mut Vec<LinearStatePlan>, transfers: &mut Vec<Vec<TransferPlan>>);
    fn free_everywhere(&self) -> bool;
    /// Blocks `seq`'s rank could hand out now: (full group, window group if any).
    fn room(&self, seq: &Sequence) -> (usize, Option<usize>);
    fn block_size(&self) -> usize;
}

fn device_room(p: &BlockManagerPool, seq: &Sequence) -> (usize, Option<usize>) {
    let rank = seq.dp_rank().unwrap();
    let full = p.counts(rank).unwrap().available();
    (full, p.window_manager(rank).map(|w| w.counts().available()))
}

fn device_snapshot(p: &BlockManagerPool) -> String {
    let mut out = format!("{:?}", p.stats());
    for rank in 0..p.dp_size() {
        if let Some(c) = p.block_manager(rank).unwrap().prefix_cache() {
            out += &format!(" lru{rank}={:?}", c.eviction_order());
        }
        if let Some(l) = p.linear_state_cache(rank) {
            out += &format!(" ckpt{rank}={:?}/{:?}", l.lru_order(), l.stats());
        }
        if let Some(w) = p.window_manager(rank) {
            out += &format!(" win{rank}={:?}", w.counts());
        }
    }
    out
}

impl Harness for BlockManagerPool {
    fn snapshot(&self) -> String {
        device_snapshot(self)
    }
    fn check_all(&self, running: &[Sequence]) -> Result<(), String> {
        for s in running {
            self.check_sequence(s).map_err(|e| e.to_string())?;
        }
        self.check().map_err(|e| e.to_string())
    }
    fn plans(&mut self, op: u8, taken: &mut Vec<LinearStatePlan>, _: &mut Vec<Vec<TransferPlan>>) {
        if op % 2 == 0 {
            taken.push(self.take_linear_state_plan());
        } else if !taken.is_empty() {
            let plan = taken.remove(usize::from(op) % taken.len());
            self.commit_linear_state_plan(&plan).unwrap();
        }
    }
    fn finish(&mut self, taken: &mut Vec<LinearStatePlan>, _: &mut Vec<Vec<TransferPlan>>) {
        taken.push(self.take_linear_state_plan());
        for plan in taken.drain(..) {
            self.commit_linear_state_plan(&plan).unwrap();
        }
    }
    fn room(&self, seq: &Sequence) -> (usize, Option<usize>) {
        device_room(self, seq)
    }
    fn block_size(&self) -> usize {
        BlockManagerPool::block_size(self)
    }
    fn free_everywhere(&self) -> bool {
        (0..self.dp_size()).all(|r| {
            let c = self.counts(r).unwrap();
            c.free == c.total
        })
    }
}

impl Harness for HierarchyBlockManagerPool {
    fn snapshot(&self) -> String {
        let mut out = format!("{:?} {}", self.stats(), device_snapshot(self.device()));
        for rank in 0..self.dp_size() {
            let host = self.host_manager(rank).unwrap().prefix_cache().unwrap();
            out += &format!(" host{rank}={:?}", host.eviction_order());
        }
        out
    }
    fn check_all(&self, running: &[Sequence]) -> Result<(), String> {
        for s in running {
            self.check_sequence(s).map_err(|e| e.to_string())?;
        }
        self.check().map_err(|e| e.to_string())
    }
    fn plans(
        &mut self,
        op: u8,
        _: &mut Vec<LinearStatePlan>,
        transfers: &mut Vec<Vec<TransferPlan>>,
    ) {
        match op % 3 {
            0 => transfers.push(self.take_load_plans()),
            1 => transfers.push(self.take_offload_plans()),
            _ if !transfers.is_empty() => {
                let plans = transfers.remove(usize::from(op) % transfers.len());
                complete(self, &plans);
            }
            _ => {}
        }
    }
    fn finish(&mut self, _: &mut Vec<LinearStatePlan>, transfers: &mut Vec<Vec<TransferPlan>>) {
        transfers.push(self.take_load_plans());
        transfers.push(self.take_offload_plans());
        for plans in transfers.drain(..) {
            complete(self, &plans);
        }
        let offloads = self.take_offload_plans();
        complete(self, &offloads);
    }
    fn room(&self, seq: &Sequence) -> (usize, Option<usize>) {
        device_room(self.device(), seq)
    }
    fn block_size(&self) -> usize {
        HierarchyBlockManagerPool::block_size(self)
    }
    fn free_everywhere(&self) -> bool {
        let s = self.stats();
        s.device.total.counts.free == s.device.total.counts.total
            && s.host.counts.free == s.host.counts.total
    }
}

fn complete(p: &mut HierarchyBlockManagerPool, plans: &[TransferPlan]) {
    let loads: Vec<&TransferPlan> = plans
        .iter()
        .filter(|t| t.direction() == kvpool::TransferDirection::Load)
        .collect();
    let offloads: Vec<&TransferPlan> = plans
        .iter()
        .filter(|t| t.direction() == kvpool::TransferDirection::Offload)
        .collect();
    p.complete_loads(&loads).unwrap();
    p.complete_offloads(&offloads).unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    /// A new request of prefix group `group` (its tail salted by `salt`), `len` tokens,
    /// admitted whole or (chunked) with half its tokens.
    Admit {
        group: u8,
        salt: u8,
        len: usize,
        chunked: bool,
    },
    /// Chunked prefill: grow a running sequence to its full length.
    Grow(usize),
    /// A forward step of a running sequence (all but `behind` of its tokens computed, then
    /// `cache()` if `publish`), then `appended` tokens and room for `lookahead`.
    Step {
        i: usize,
        behind: usize,
        publish: bool,
        appended: usize,
        lookahead: usize,
    },
    /// Deallocate a running sequence; it waits for its next turn (multi-turn chat).
    Finish(usize),
    /// The next turn of a waiting sequence: `extra` more tokens, admitted again (it re-hits its
    /// own prefix and its kept window tail).
    Readmit {
        i: usize,
        extra: usize,
        chunked: bool,
    },
    /// The end of a turn and the next one at once: deallocate a running sequence, append
    /// `extra` tokens (the reply and the next user message) and admit it again.
    Turn {
        i: usize,
        extra: usize,
    },
    /// A sequence dropped without deallocate.
    Drop(usize),
    /// Take / commit linear-state plans, or take / complete transfer plans.
    Plans(u8),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..3, 1usize..30, any::<bool>())
            .prop_map(|(group, salt, len, chunked)| Op::Admit { group, salt, len, chunked }),
        2 => any::<usize>().prop_map(Op::Grow),
        8 => (any::<usize>(), 0usize..3, any::<bool>(), 0usize..6, 0usize..6).prop_map(
            |(i, behind, publish, appended, lookahead)| Op::Step { i, behind, publish, appended, lookahead }
        ),
        3 => any::<usize>().prop_map(Op::Finish),
        4 => (any::<usize>(), 0usize..6, any::<bool>())
            .prop_map(|(i, extra, chunked)| Op::Readmit { i, extra, chunked }),
        4 => (any::<usize>(), 1usize..8).prop_map(|(i, extra)| Op::Turn { i, extra }),
        1 => any::<usize>().prop_map(Op::Drop),
        3 => any::<u8>().prop_map(Op::Plans),
        1 => Just(Op::Reset),
    ]
}

fn tokens(group: u8, salt: u8, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if i < 8 {
                u32::from(group) * 100 + i
            } else {
                u32::from(salt) * 1000 + i
            }
        })
        .collect()
}

/// The oracle of a "no" to growing `seq` to `tokens` tokens, independent of the pool's own
/// prediction: let `cache` slide the window for real (R25), then the blocks missing must
/// exceed what one of the groups has free or cached.
fn no_room<P: Both>(p: &mut P, seq: &mut Sequence, tokens: usize) -> bool {
    // The full group's room as the call saw it: `cache` may free blocks by dedup on publish
    // (R9 revised); the window's once its blocks are published (R25).
    let (full, _) = p.room(seq);
    p.cache(seq).unwrap();
    let need = tokens
        .div_ceil(p.block_size())
        .saturating_sub(seq.blocks().len());
    let (_, window) = p.room(seq);
    need > full || window.is_some_and(|w| need > w)
}

/// R15 / R16 exactly, a failed call changing nothing, and `check()` after every step.
fn run<P: Both>(mut p: P, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut running: Vec<Sequence> = Vec::new();
    let mut waiting: Vec<Sequence> = Vec::new();
    let mut taken = Vec::new();
    let mut transfers = Vec::new();
    for op in ops {
        match op {
            Op::Admit {
                group,
                salt,
                len,
                chunked,
            } => {
                let mut seq = Sequence::new(tokens(group, salt, len), None, None);
                let n = chunked.then_some((len / 2).max(1));
                let predicted = p.can_allocate(&mut seq, n).unwrap();
                let before = (p.snapshot(), format!("{seq:?}"));
                let ok = p.allocate(&mut seq, n).unwrap();
                prop_assert_eq!(predicted, ok, "R15: can_allocate vs allocate");
                if ok {
                    running.push(seq);
                } else {
                    let after = (p.snapshot(), format!("{seq:?}"));
                    prop_assert_eq!(after, before, "R14: a failed allocate changed state");
                }
            }
            Op::Grow(i) if !running.is_empty() => {
                let index = i % running.len();
                let seq = &mut running[index];
                let predicted = p.can_allocate(seq, None).unwrap();
                let before = (p.snapshot(), seq.block_ids().collect::<Vec<_>>());
                let ok = p.allocate(seq, None).unwrap();
                prop_assert_eq!(predicted, ok, "R15: can_allocate vs allocate (growth)");
                if !ok {
                    let after = (p.snapshot(), seq.block_ids().collect::<Vec<_>>());
                    prop_assert_eq!(after, before, "R14: a failed growth changed state");
                    let tokens = seq.len();
                    prop_assert!(no_room(&mut p, seq, tokens), "R15: a needless no (F4)");
                }
            }
            Op::Step {
                i,
                behind,
                publish,
                appended,
                lookahead,
            } if !running.is_empty() => {
                let index = i % running.len();
                let seq = &mut running[index];
                let target = seq.len().saturating_sub(behind).min(seq.capacity());
                if target > seq.num_computed_tokens() {
                    seq.set_num_computed_tokens(target).unwrap();
                }
                if publish {
                    p.cache(seq).unwrap();
                }
                seq.append_tokens(&vec![7; appended]);
                let predicted = p.can_append(seq, lookahead).unwrap();
                let before = (
                    p.snapshot(),
                    seq.block_ids().collect::<Vec<_>>(),
                    seq.group_block_ids(1),
                );
                let ok = p.may_append(seq, lookahead).unwrap();
                prop_assert_eq!(predicted, ok, "R16: can_append vs may_append");
                if !ok {
                    let after = (
                        p.snapshot(),
                        seq.block_ids().collect::<Vec<_>>(),
                        seq.group_block_ids(1),
                    );
                    prop_assert_eq!(after, before, "R16: a failed may_append changed state");
                    let tokens = seq.len() + lookahead;
                    prop_assert!(no_room(&mut p, seq, tokens), "R16: a needless no (F4)");
                    let mut seq = running.swap_remove(index);
                    p.deallocate(&mut seq).unwrap(); // preempt by recompute
                    waiting.push(seq);
                }
            }
            Op::Finish(i) if !running.is_empty() => {
                let mut seq = running.swap_remove(i % running.len());
                p.deallocate(&mut seq).unwrap();
                waiting.push(seq);
            }
            Op::Readmit { i, extra, chunked } if !waiting.is_empty() => {
                let mut seq = waiting.swap_remove(i % waiting.len());
                seq.append_tokens(&vec![5; extra]);
                let n = chunked.then_some((seq.len() / 2).max(1));
                let predicted = p.can_allocate(&mut seq, n).unwrap();
                let before = (p.snapshot(), format!("{seq:?}"));
                let ok = p.allocate(&mut seq, n).unwrap();
                prop_assert_eq!(predicted, ok, "R15: can_allocate vs allocate (next turn)");
                if ok {
                    running.push(seq);
                } else {
                    let after = (p.snapshot(), format!("{seq:?}"));
                    prop_assert_eq!(after, before, "R14: a failed allocate changed state");
                    waiting.push(seq);
                }
            }
            Op::Turn { i, extra } if !running.is_empty() => {
                let mut seq = running.swap_remove(i % running.len());
                p.deallocate(&mut seq).unwrap();
                seq.append_tokens(&vec![3; extra]);
                let predicted = p.can_allocate(&mut seq, None).unwrap();
                let before = (p.snapshot(), format!("{seq:?}"));
                let ok = p.allocate(&mut seq, None).unwrap();
                prop_assert_eq!(predicted, ok, "R15: can_allocate vs allocate (next turn)");
                if ok {
                    running.push(seq);
                } else {
                    let after = (p.snapshot(), format!("{seq:?}"));
                    prop_assert_eq!(after, before, "R14: a failed allocate changed state");
                    waiting.push(seq);
                }
            }
            Op::Drop(i) if !running.is_empty() => {
                drop(running.swap_remove(i % running.len()));
            }
            Op::Plans(k) => p.plans(k, &mut taken, &mut transfers),
            Op::Reset => p.reset_prefix_cache_all(),
            _ => {}
        }
        waiting.truncate(8);
        if let Err(e) = p.check_all(&running) {
            prop_assert!(false, "check failed: {}", e);
        }
    }
    for seq in &mut running {
        p.deallocate(seq).unwrap();
    }
    p.finish(&mut taken, &mut transfers);
    p.reset_prefix_cache_all();
    if let Err(e) = p.check_all(&[]) {
        prop_assert!(false, "final check failed: {}", e);
    }
    prop_assert!(p.free_everywhere(), "every id is free at the end");
    Ok(())
}

/// `reset_prefix_cache` of either pool.
trait ResetAll {
    fn reset_prefix_cache_all(&mut self);
}

impl ResetAll for BlockManagerPool {
    fn reset_prefix_cache_all(&mut self) {
        self.reset_prefix_cache();
    }
}

impl ResetAll for HierarchyBlockManagerPool {
    fn reset_prefix_cache_all(&mut self) {
        self.reset_prefix_cache();
    }
}

trait Both: Harness + ResetAll {}
impl<T: Harness + ResetAll> Both for T {}

/// Full-attention group of `full` blocks of `bs` tokens, a window group of `swa` blocks and a
/// window of `window` tokens; with a small window group, the window is what runs out (F4).
fn window_pool(
    dp: usize,
    (bs, window): (usize, usize),
    full: usize,
    swa: usize,
    linear: Option<LinearStateSave>,
) -> BlockManagerPool {
    let mut c = PoolConfig::new(full, bs);
    c.dp_size = dp;
    c.sliding_window = Some(window);
    c.swa_num_blocks = Some(swa);
    if let Some(save) = linear {
        c.linear_state_slots = 5;
        c.checkpoint_interval = Some(2 * bs);
        c.linear_state_save = save;
    }
    BlockManagerPool::new(c).unwrap()
}

fn promote_pool(dp: usize) -> BlockManagerPool {
    let mut c = PoolConfig::new(16, 2);
    c.dp_size = dp;
    c.linear_state_slots = 5;
    c.checkpoint_interval = Some(4);
    c.linear_state_save = LinearStateSave::Promote;
    BlockManagerPool::new(c).unwrap()
}

fn host_pool(dp: usize, on_evict: bool) -> HierarchyBlockManagerPool {
    let mut c = HierarchyConfig::new(12, 9, 2);
    c.pool.dp_size = dp;
    if on_evict {
        c.offload_policy = OffloadPolicy::OnEvict;
    }
    HierarchyBlockManagerPool::new(c).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn r15_r16_sliding_window_with_prefix_cache(
        ops in proptest::collection::vec(op(), 1..120), dp in 1usize..3,
        shape in prop_oneof![Just((2, 5)), Just((2, 7)), Just((4, 9)), Just((4, 17))],
        full in 12usize..40, swa in 6usize..16,
    ) {
        run(window_pool(dp, shape, full, swa, None), ops)?;
    }

    #[test]
    fn r15_r16_promote_saves(ops in proptest::collection::vec(op(), 1..120), dp in 1usize..3) {
        run(promote_pool(dp), ops)?;
    }

    #[test]
    fn r15_r16_window_with_linear_state(
        ops in proptest::collection::vec(op(), 1..120), promote in any::<bool>(),
    ) {
        let save = if promote { LinearStateSave::Promote } else { LinearStateSave::Copy };
        run(window_pool(1, (2, 5), 24, 10, Some(save)), ops)?;
    }

    #[test]
    fn r15_r16_host_tier(
        ops in proptest::collection::vec(op(), 1..120), dp in 1usize..3, on_evict in any::<bool>(),
    ) {
        run(host_pool(dp, on_evict), ops)?;
    }
}

// ------------------------------------------------------------------------------ F4

/// The kept window tail of a finished turn, re-hit by the next turn, becomes evictable when the
/// slide lets go of it: `can_append` counts it exactly as `may_append` then uses it (R16).
#[test]
fn f4_can_append_counts_the_kept_tail_the_slide_makes_evictable() {
    let mut c = PoolConfig::new(37, 4);
    c.sliding_window = Some(17);
    c.swa_num_blocks = Some(12);
    let mut p = BlockManagerPool::new(c).unwrap();
    let toks = [
        35, 16, 30, 14, 33, 43, 14, 15, 16, 1, 18, 18, 24, 41, 47, 23, 44, 36, 14, 11, 14, 10,
    ];
    let mut s = Sequence::new(toks.to_vec(), None, Some(b"a"));
    assert!(p.allocate(&mut s, None).unwrap());
    s.set_num_computed_tokens(20).unwrap();
    s.append_tokens(&[34, 29, 31, 39, 40, 31, 38, 10]);
    p.deallocate(&mut s).unwrap(); // keeps the window tail of this turn
    assert!(p.allocate(&mut s, None).unwrap()); // re-admitted: hits its own prefix
    let mut t = Sequence::new(
        vec![35, 16, 30, 14, 33, 43, 14, 15, 16, 1, 18, 18, 11, 13, 1],
        None,
        None,
    );
    s.append_token(43);
    assert!(p.allocate(&mut t, None).unwrap());
    s.set_num_computed_tokens(31).unwrap();
    let predicted = p.can_append(&s, 5).unwrap();
    assert!(predicted, "the slide makes a kept tail block evictable");
    assert_eq!(p.may_append(&mut s, 5).unwrap(), predicted);
    p.check().unwrap();
}

/// The same for a chunked-prefill growth: `can_allocate` predicts `allocate` (R15).
#[test]
fn f4_can_allocate_predicts_the_growth_of_an_allocated_sequence() {
    let mut c = PoolConfig::new(19, 2);
    c.dp_size = 2;
    c.sliding_window = Some(11);
    c.swa_num_blocks = Some(11);
    let mut p = BlockManagerPool::new(c).unwrap();
    let mut s = Sequence::new(vec![44, 6, 33, 40, 10, 27, 25, 2, 13, 5, 16, 5], None, None);
    assert!(p.allocate(&mut s, None).unwrap());
    s.append_tokens(&[32, 34, 40, 23, 40]);
    s.set_num_computed_tokens(12).unwrap();
    p.deallocate(&mut s).unwrap();
    assert!(p.allocate(&mut s, None).unwrap());
    assert!(p.may_append(&mut s, 2).unwrap());
    s.append_tokens(&[27, 27, 33, 37, 41, 23, 13, 16, 23, 21]);
    s.set_num_computed_tokens(20).unwrap();
    let predicted = p.can_allocate(&mut s, None).unwrap();
    assert!(predicted);
    assert_eq!(p.allocate(&mut s, None).unwrap(), predicted);
    p.check().unwrap();
}
