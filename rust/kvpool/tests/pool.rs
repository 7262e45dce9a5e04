//! Lifecycle tests of `BlockManagerPool` (R8, R13-R21) and a proptest of random pool workloads
//! checking R2 and `check()` after every step.

use kvpool::{BlockManagerPool, KvCacheManager, KvEventKind, PoolConfig, Sequence};
use proptest::prelude::*;

fn pool(num_blocks: usize, block_size: usize) -> BlockManagerPool {
    BlockManagerPool::new(PoolConfig::new(num_blocks, block_size)).unwrap()
}

fn table(seq: &Sequence) -> Vec<u32> {
    seq.block_ids().collect()
}

#[test]
fn seed_scenario_end_to_end() {
    let mut p = pool(16, 4);
    let total = p.counts(0).unwrap().free;
    let mut a = Sequence::new((0..11).collect(), None, None);
    assert!(p.allocate(&mut a, None).unwrap());
    assert_eq!(
        table(&a).len(),
        3,
        "11 tokens -> 3 blocks, last with 1 free slot"
    );
    let mut b = Sequence::new((100..104).collect(), None, None);
    assert!(p.allocate(&mut b, None).unwrap());
    assert_eq!(table(&b).len(), 1);
    b.append_token(104);
    assert!(
        p.can_append(&b, 0).unwrap(),
        "5th token crosses into a new block"
    );
    let free = p.counts(0).unwrap().free;
    assert!(p.may_append(&mut b, 0).unwrap());
    assert_eq!(table(&b).len(), 2);
    assert_eq!(p.counts(0).unwrap().free, free - 1);
    b.append_token(105);
    assert!(p.may_append(&mut b, 0).unwrap());
    assert_eq!(table(&b).len(), 2, "6 tokens fit in 2 blocks");
    p.deallocate(&mut a).unwrap();
    p.deallocate(&mut b).unwrap();
    let counts = p.counts(0).unwrap();
    assert_eq!(
        counts.free + counts.cached,
        total,
        "every block is back (free or cached)"
    );
    assert_eq!(counts.used, 0);
    p.check().unwrap();
}

#[test]
fn r8_a_match_leaves_one_token_and_preemption_rehits_its_prefix() {
    let mut p = pool(16, 4);
    let mut a = Sequence::new((0..8).collect(), None, None);
    assert!(p.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(8).unwrap();
    p.deallocate(&mut a).unwrap();
    assert_eq!(a.len(), 8, "tokens kept");
    assert_eq!(a.dp_rank(), Some(0), "rank kept");
    assert!(p.allocate(&mut a, None).unwrap());
    assert_eq!(
        a.num_cached_tokens(),
        4,
        "block-aligned: the last block is recomputed (R8)"
    );
    assert_eq!(a.num_computed_tokens(), 4);
    p.check().unwrap();
}

#[test]
fn r13_rank_choice_and_stickiness() {
    let mut config = PoolConfig::new(8, 2);
    config.dp_size = 2;
    let mut p = BlockManagerPool::new(config).unwrap();
    let mut a = Sequence::new(vec![1; 6], None, None);
    assert!(p.allocate(&mut a, None).unwrap());
    assert_eq!(a.dp_rank(), Some(0), "tie: lowest rank");
    let mut b = Sequence::new(vec![2; 2], None, None);
    assert!(p.allocate(&mut b, None).unwrap());
    assert_eq!(b.dp_rank(), Some(1), "most available blocks");
    p.deallocate(&mut a).unwrap();
    let mut c = Sequence::new(vec![3; 10], None, None);
    assert!(p.allocate(&mut c, None).unwrap());
    assert_eq!(c.dp_rank(), Some(0));
    assert!(
        !p.allocate(&mut a, None).unwrap(),
        "rank 0 is full: no fallback to rank 1"
    );
    assert_eq!(a.dp_rank(), Some(0));
    p.check().unwrap();
}

#[test]
fn r14_failure_changes_nothing_and_chunked_prefill_grows() {
    let mut p = pool(6, 2);
    let mut a = Sequence::new((0..6).collect(), None, None);
    assert!(p.allocate(&mut a, Some(2)).unwrap());
    assert_eq!(table(&a).len(), 1);
    assert!(p.allocate(&mut a, Some(6)).unwrap());
    assert_eq!(table(&a).len(), 3);
    let mut b = Sequence::new((10..16).collect(), None, None);
    let before = p.stats();
    assert!(!p.can_allocate(&mut b, None).unwrap());
    assert!(!p.allocate(&mut b, None).unwrap());
    assert_eq!(p.stats(), before);
    assert_eq!(b.dp_rank(), None);
    assert!(table(&b).is_empty());
    assert!(
        p.allocate(&mut a, Some(7)).is_err(),
        "num_tokens > len is a ValueError"
    );
    assert!(p.allocate(&mut a, Some(0)).is_err());
}

#[test]
fn r17_only_computed_full_blocks_are_published() {
    let mut p = pool(16, 4);
    let mut a = Sequence::new((0..10).collect(), None, None);
    assert!(p.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(5).unwrap();
    p.cache(&mut a).unwrap();
    assert_eq!(p.block_manager(0).unwrap().prefix_cache().unwrap().len(), 1);
    assert!(
        a.set_num_computed_tokens(4).is_err(),
        "lowering is an error"
    );
    assert!(a.set_num_computed_tokens(11).is_err(), "past len");
    a.set_num_computed_tokens(10).unwrap();
    p.cache(&mut a).unwrap();
    assert_eq!(p.block_manager(0).unwrap().prefix_cache().unwrap().len(), 2);
}

#[test]
fn r18_foreign_sequences_are_rejected() {
    let mut p1 = pool(8, 2);
    let mut p2 = pool(8, 2);
    let mut a = Sequence::new(vec![1, 2, 3], None, None);
    assert!(p1.allocate(&mut a, None).unwrap());
    assert!(p2.deallocate(&mut a).is_err());
    assert!(p2.allocate(&mut a, None).is_err());
    assert!(p2.cache(&mut a).is_err());
    p1.deallocate(&mut a).unwrap();
    p1.deallocate(&mut a).unwrap(); // no-op
    assert!(
        p2.allocate(&mut a, None).unwrap(),
        "after release it may go anywhere"
    );
}

#[test]
fn r19_exports_and_r21_events() {
    let mut config = PoolConfig::new(16, 4);
    config.enable_events = true;
    let mut p = BlockManagerPool::new(config).unwrap();
    let mut a = Sequence::new((0..9).collect(), None, Some(b"salt"));
    assert!(p.allocate(&mut a, None).unwrap());
    let (tables, width) = p.block_tables(&[&a], 0).unwrap();
    assert_eq!(width, 3);
    let ids = table(&a);
    assert_eq!(tables, ids.iter().map(|&i| i as i32).collect::<Vec<_>>());
    let slots = p.slot_mapping(&[&a], 0).unwrap();
    assert_eq!(slots.len(), 9);
    assert_eq!(slots[5], i64::from(ids[1]) * 4 + 1);
    a.set_num_computed_tokens(9).unwrap();
    p.cache(&mut a).unwrap();
    let events = p.drain_events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, KvEventKind::Stored);
    assert_eq!(events[0].block_hashes.len(), 2);
    assert_eq!(events[0].parent_hash, None);
    assert_eq!(events[0].token_ids, (0..8).collect::<Vec<u32>>());
    assert_eq!(events[0].extra_key.as_deref(), Some(&b"salt"[..]));
    p.reset_prefix_cache();
    assert_eq!(p.drain_events()[0].kind, KvEventKind::Cleared);
    assert!(p.drain_events().is_empty());
}

/// Events numbered 1, 2, 3, ... per rank, self-describing, replayable from the
/// bounded buffer; the index applies them as they are.
#[test]
fn events_are_numbered_per_rank_and_replayable() {
    let mut config = PoolConfig::new(6, 4);
    config.enable_events = true;
    config.dp_size = 2;
    config.event_replay = 3;
    let mut p = BlockManagerPool::new(config).unwrap();
    // C5: numbers start at 1, so "from 0" is "from 1": everything, nothing lost yet.
    assert_eq!(p.events_since(0, 0).unwrap(), Some(Vec::new()));
    let mut all = Vec::new();
    let mut held: Option<Sequence> = None;
    for i in 0..12u32 {
        let mut a = Sequence::new((100 * i..100 * i + 8).collect(), None, None);
        assert!(p.allocate(&mut a, None).unwrap());
        a.set_num_computed_tokens(8).unwrap();
        p.cache(&mut a).unwrap();
        // Two sequences at a time: the second goes to the other rank.
        if let Some(mut previous) = held.replace(a) {
            p.deallocate(&mut previous).unwrap();
        }
        all.extend(p.drain_events());
        p.check().unwrap();
    }
    for rank in 0..2 {
        let numbers: Vec<u64> = all
            .iter()
            .filter(|e| e.dp_rank == rank)
            .map(|e| e.sequence)
            .collect();
        let last = p.last_event_sequence(rank).unwrap();
        assert_eq!(numbers, (1..=last).collect::<Vec<_>>(), "rank {rank}");
        assert!(last > 3, "rank {rank}: {last} events");
        let tail = p.events_since(rank, last - 2).unwrap().unwrap();
        assert_eq!(
            tail.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            vec![last - 2, last - 1, last]
        );
        assert!(
            p.events_since(rank, last - 3).unwrap().is_none(),
            "beyond the buffer"
        );
        assert!(
            p.events_since(rank, 0).unwrap().is_none(),
            "event 1 was dropped"
        );
        assert!(p.events_since(rank, last + 1).unwrap().unwrap().is_empty());
        assert!(p.events_since(rank, last + 2).is_err());
    }
    assert!(p.events_since(2, 1).is_err());
    assert!(all.iter().all(|e| e.medium == kvpool::Medium::Device
        && e.group == 0
        && e.group_kind == kvpool::GroupKind::FullAttention
        && e.block_size == 4));
    let index = kvpool::KVIndex::new(kvpool::IndexConfig::default()).unwrap();
    let batch: Vec<kvpool::IndexEvent> = all.iter().map(|e| e.to_index_event()).collect();
    let report = index.apply(0, batch).unwrap();
    assert!(report.gaps.is_empty());
}

/// The batch calls do what the per-sequence calls do, step by step, on twin pools (R16, R17);
/// a decode step whose tokens fit publishes nothing and takes nothing (the fast path).
#[test]
fn r16_r17_batch_calls_equal_per_sequence_calls() {
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| (0..(3 + 5 * i)).map(|t| (t * 7 + i) % 11).collect())
        .collect();
    let mut one = pool(48, 4);
    let mut all = pool(48, 4);
    let mut a: Vec<Sequence> = prompts
        .iter()
        .map(|p| Sequence::new(p.clone(), None, None))
        .collect();
    let mut b: Vec<Sequence> = prompts
        .iter()
        .map(|p| Sequence::new(p.clone(), None, None))
        .collect();
    for (x, y) in a.iter_mut().zip(&mut b) {
        assert!(one.allocate(x, None).unwrap());
        assert!(all.allocate(y, None).unwrap());
    }
    for step in 0..30u32 {
        if step == 10 {
            // a new epoch: held blocks are published again at the next step (R12, R17)
            one.reset_prefix_cache();
            all.reset_prefix_cache();
        }
        let tokens: Vec<u32> = (0..a.len() as u32).map(|i| (step + i) % 5).collect();
        let mut ok = Vec::new();
        for (x, &t) in a.iter_mut().zip(&tokens) {
            one.advance(x, t).unwrap();
            ok.push(one.may_append(x, 1).unwrap());
        }
        let mut refs: Vec<&mut Sequence> = b.iter_mut().collect();
        let failed = if step % 2 == 0 {
            all.advance_all(&mut refs, &tokens).unwrap();
            all.may_append_all(&mut refs, 1).unwrap()
        } else {
            all.advance_and_reserve_all(&mut refs, &tokens, 1).unwrap()
        };
        let expected: Vec<usize> = (0..ok.len()).filter(|&i| !ok[i]).collect();
        assert_eq!(failed, expected);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(table(x), table(y));
            assert_eq!(x.num_computed_tokens(), y.num_computed_tokens());
            assert_eq!(x.tokens(), y.tokens());
        }
        assert_eq!(one.counts(0).unwrap(), all.counts(0).unwrap());
        all.check().unwrap();
        // the ones without room leave, in both
        for &i in expected.iter().rev() {
            one.deallocate(&mut a[i]).unwrap();
            all.deallocate(&mut b[i]).unwrap();
            a.remove(i);
            b.remove(i);
        }
    }
    for y in &mut b {
        all.deallocate(y).unwrap();
    }
    all.check().unwrap();
    assert_eq!(
        all.counts(0).unwrap().free + all.counts(0).unwrap().cached,
        47,
        "every id came back"
    );
}

/// R29: a batch call with a bad member changes nothing.
#[test]
fn r29_batch_calls_check_every_member_first() {
    let mut p = pool(16, 4);
    let mut x = Sequence::new(vec![1, 2, 3], None, None);
    let mut y = Sequence::new(vec![4, 5, 6, 7], None, None);
    assert!(p.allocate(&mut x, None).unwrap());
    assert!(p.allocate(&mut y, None).unwrap());
    let mut stranger = Sequence::new(vec![9], None, None);
    let before = (
        x.tokens().to_vec(),
        y.tokens().to_vec(),
        p.counts(0).unwrap(),
    );
    let err = p
        .advance_all(&mut [&mut x, &mut y, &mut stranger], &[1, 2, 3])
        .unwrap_err();
    assert!(err.to_string().contains("seqs"), "{err}");
    let err = p.advance_all(&mut [&mut x, &mut y], &[1]).unwrap_err();
    assert!(err.to_string().contains("token_ids"), "{err}");
    let err = p
        .may_append_all(&mut [&mut x, &mut stranger], 0)
        .unwrap_err();
    assert!(err.to_string().contains("seqs"), "{err}");
    assert_eq!(x.tokens(), &before.0[..]);
    assert_eq!(y.tokens(), &before.1[..]);
    assert_eq!(p.counts(0).unwrap(), before.2);
    // y's table is full (4 tokens in 1 block): after its token, advance needs may_append first
    p.advance_all(&mut [&mut x, &mut y], &[1, 2]).unwrap();
    let err = p.advance_all(&mut [&mut x, &mut y], &[1, 2]).unwrap_err();
    assert!(err.to_string().contains("may_append"), "{err}");
    assert_eq!(x.len(), 4, "x was not advanced either");
    assert!(p
        .may_append_all(&mut [&mut x, &mut y], 0)
        .unwrap()
        .is_empty());
    p.check().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Admit(u8, usize),
    Step(usize, usize),
    Finish(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1usize..14).prop_map(|(g, n)| Op::Admit(g, n)),
        5 => (any::<usize>(), 1usize..4).prop_map(|(i, n)| Op::Step(i, n)),
        2 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::Reset),
    ]
}

/// One random serving workload: can_allocate predicts allocate (R15), can_append predicts
/// may_append (R16), counts add up (R2), check() holds after every step, and every id is free
/// at the end.
fn run_pool_workload(ops: Vec<Op>, dp: usize) -> Result<(), TestCaseError> {
    let mut config = PoolConfig::new(10, 2);
    config.dp_size = dp;
    let mut p = BlockManagerPool::new(config).unwrap();
    let mut running: Vec<Sequence> = Vec::new();
    for op in ops {
        match op {
            Op::Admit(group, len) => {
                let tokens: Vec<u32> = (0..len as u32)
                    .map(|i| u32::from(group) * 1000 + i)
                    .collect();
                let mut seq = Sequence::new(tokens, None, None);
                let predicted = p.can_allocate(&mut seq, None).unwrap();
                let before = p.stats();
                let ok = p.allocate(&mut seq, None).unwrap();
                prop_assert_eq!(predicted, ok, "R15");
                if ok {
                    running.push(seq);
                } else {
                    prop_assert_eq!(p.stats(), before, "R14");
                }
            }
            Op::Step(i, n) if !running.is_empty() => {
                let index = i % running.len();
                let seq = &mut running[index];
                let computed = seq.len();
                seq.set_num_computed_tokens(computed).unwrap();
                p.cache(seq).unwrap();
                seq.append_tokens(&vec![7; n]);
                let predicted = p.can_append(seq, 0).unwrap();
                prop_assert_eq!(predicted, p.may_append(seq, 0).unwrap(), "R16");
                if !predicted {
                    // Preempt by recompute.
                    let mut seq = running.swap_remove(index);
                    p.deallocate(&mut seq).unwrap();
                }
            }
            Op::Finish(i) if !running.is_empty() => {
                let mut seq = running.swap_remove(i % running.len());
                p.deallocate(&mut seq).unwrap();
            }
            Op::Reset => p.reset_prefix_cache(),
            _ => {}
        }
        for seq in &running {
            p.check_sequence(seq).unwrap();
        }
        if let Err(e) = p.check() {
            prop_assert!(false, "check failed: {e}");
        }
    }
    for seq in &mut running {
        p.deallocate(seq).unwrap();
    }
    p.reset_prefix_cache();
    p.check().unwrap();
    for rank in 0..dp {
        prop_assert_eq!(p.counts(rank).unwrap().free, 9);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn random_pool_workload(ops in proptest::collection::vec(op(), 1..150), dp in 1usize..3) {
        run_pool_workload(ops, dp)?;
    }
}

/// The minimal workload proptest found (2026-11-30): can_append said yes, may_append could not.
#[test]
fn regression_can_append_predicts_may_append_after_reset() {
    use Op::*;
    let ops = vec![
        Admit(0, 1),
        Admit(1, 10),
        Step(0, 1),
        Step(0, 3),
        Step(0, 2),
        Step(3833294454330364241, 1),
        Finish(0),
        Admit(0, 4),
        Step(22314506151738, 3),
        Admit(0, 11),
        Admit(0, 2),
        Reset,
        Step(1534456757305391597, 3),
        Finish(2041566988635792700),
        Step(562313560054773517, 2),
        Step(10453123789395844395, 2),
        Step(7774248466559148264, 3),
    ];
    run_pool_workload(ops, 1).unwrap();
}
