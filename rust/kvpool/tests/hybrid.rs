//! Hybrid models at the pool level: linear-state checkpoints (R22-R24) and sliding-window
//! groups (R25), with a proptest of random hybrid workloads checking every structure after
//! every step.

use kvpool::{
    BlockHasher, BlockManagerPool, KvCacheManager, LinearStateMatch, LinearStateSave, PoolConfig,
    Sequence,
};
use proptest::prelude::*;

fn hybrid(num_blocks: usize, block_size: usize, slots: usize) -> PoolConfig {
    let mut config = PoolConfig::new(num_blocks, block_size);
    config.linear_state_slots = slots;
    config
}

fn checkpoint(pool: &mut BlockManagerPool, hash: kvpool::BlockHash) {
    let cache = pool.linear_state_cache_mut(0).unwrap();
    cache.reserve_checkpoint(hash).unwrap();
    cache.commit_checkpoint(hash).unwrap();
}

/// Caches blocks 0..4 of `tokens` (17 tokens, block size 4) and returns their chain hashes.
fn warm(pool: &mut BlockManagerPool, tokens: &[u32]) -> Vec<kvpool::BlockHash> {
    let mut a = Sequence::new(tokens.to_vec(), None, None);
    assert!(pool.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(16).unwrap();
    pool.deallocate(&mut a).unwrap(); // publishes block0..block3; no save survives
    BlockHasher::default().chain(&tokens[..16], 4, None)
}

#[test]
fn seed_example_deepest_and_contiguous() {
    // R23, seed section 7.2: KV hits block0..block3, checkpoints at hash0, hash1, hash3.
    let tokens: Vec<u32> = (0..17).collect();
    for (rule, kept, restore_hash) in [
        (LinearStateMatch::Deepest, 4, 3),
        (LinearStateMatch::Contiguous, 2, 1),
    ] {
        let mut config = hybrid(32, 4, 8);
        config.linear_state_match = rule;
        let mut pool = BlockManagerPool::new(config).unwrap();
        let hashes = warm(&mut pool, &tokens);
        for i in [0, 1, 3] {
            checkpoint(&mut pool, hashes[i]);
        }
        let cached_before = pool.counts(0).unwrap().cached;
        assert_eq!(cached_before, 4);
        let mut b = Sequence::new(tokens.clone(), None, None);
        assert!(pool.allocate(&mut b, None).unwrap());
        assert_eq!(b.num_cached_tokens(), kept * 4, "{rule:?}");
        let slot = pool
            .linear_state_cache(0)
            .unwrap()
            .peek(hashes[restore_hash]);
        assert_eq!(b.linear_state_restore_slot(), slot, "{rule:?}");
        // Blocks past the boundary stay cached, not held by the sequence.
        assert_eq!(pool.counts(0).unwrap().cached, 4 - kept, "{rule:?}");
        pool.check().unwrap();
        pool.check_sequence(&b).unwrap();
        let plan = pool.take_linear_state_plan();
        assert_eq!(plan.restore_src, vec![slot.unwrap() as i32]);
        assert_eq!(
            plan.restore_dst,
            vec![b.linear_state_slot().unwrap() as i32]
        );
        assert!(pool
            .linear_state_cache(0)
            .unwrap()
            .is_pinned(hashes[restore_hash]));
        pool.commit_linear_state_plan(&plan).unwrap();
        assert!(!pool
            .linear_state_cache(0)
            .unwrap()
            .is_pinned(hashes[restore_hash]));
        assert!(pool.commit_linear_state_plan(&plan).is_err(), "twice");
        pool.deallocate(&mut b).unwrap();
        pool.check().unwrap();
    }
}

#[test]
fn no_checkpoint_means_no_kv_reuse() {
    let tokens: Vec<u32> = (0..17).collect();
    let mut pool = BlockManagerPool::new(hybrid(32, 4, 8)).unwrap();
    warm(&mut pool, &tokens);
    let mut b = Sequence::new(tokens, None, None);
    assert!(pool.allocate(&mut b, None).unwrap());
    assert_eq!(b.num_cached_tokens(), 0);
    assert_eq!(b.linear_state_restore_slot(), None);
    assert!(pool.take_linear_state_plan().is_empty());
}

#[test]
fn saves_at_prompt_end_and_interval_become_matchable_after_commit() {
    // R24: prompt of 10 tokens, block size 4: its last boundary is 8; interval 8 -> 16, 24...
    let mut config = hybrid(32, 4, 8);
    config.checkpoint_interval = Some(8);
    let mut pool = BlockManagerPool::new(config).unwrap();
    let mut a = Sequence::new((0..10).collect(), None, None);
    assert!(pool.allocate(&mut a, Some(8)).unwrap());
    a.set_num_computed_tokens(8).unwrap();
    pool.cache(&mut a).unwrap();
    let plan = pool.take_linear_state_plan();
    assert_eq!(plan.save_src, vec![a.linear_state_slot().unwrap() as i32]);
    let hash = BlockHasher::default().chain(&a.tokens()[..8], 4, None)[1];
    assert_eq!(plan.save_hashes, vec![hash]);
    let lsc = pool.linear_state_cache(0).unwrap();
    assert!(!lsc.contains(hash), "pending checkpoints never match");
    assert_eq!(lsc.num_pending_checkpoints(), 1);
    pool.commit_linear_state_plan(&plan).unwrap();
    assert!(pool.linear_state_cache(0).unwrap().contains(hash));
    // Caching again at the same boundary plans nothing.
    pool.cache(&mut a).unwrap();
    assert!(pool.take_linear_state_plan().is_empty());
    // A second request with the same prompt restores from it.
    let mut b = Sequence::new((0..10).collect(), None, None);
    assert!(pool.allocate(&mut b, None).unwrap());
    assert_eq!(b.num_cached_tokens(), 8);
    assert_eq!(pool.stats().total.linear_state_hits, 1);
    pool.deallocate(&mut a).unwrap();
    pool.deallocate(&mut b).unwrap();
    pool.check().unwrap();
    assert_eq!(pool.stats().total.num_live_slots, 0);
}

#[test]
fn deallocate_cancels_untaken_and_taken_saves() {
    let mut pool = BlockManagerPool::new(hybrid(32, 4, 8)).unwrap();
    for take_first in [false, true] {
        let mut a = Sequence::new((0..9).collect(), None, None);
        assert!(pool.allocate(&mut a, None).unwrap());
        a.set_num_computed_tokens(8).unwrap();
        pool.cache(&mut a).unwrap();
        let plan = take_first.then(|| pool.take_linear_state_plan());
        pool.deallocate(&mut a).unwrap();
        pool.check().unwrap();
        let lsc = pool.linear_state_cache(0).unwrap();
        assert_eq!(lsc.num_pending_checkpoints(), usize::from(take_first));
        if let Some(plan) = plan {
            pool.commit_linear_state_plan(&plan).unwrap();
        }
        let lsc = pool.linear_state_cache(0).unwrap();
        assert_eq!(lsc.num_pending_checkpoints(), 0);
        assert_eq!(
            lsc.num_committed_checkpoints(),
            0,
            "a cancelled save never commits"
        );
        assert_eq!(lsc.num_free_slots(), 7);
        pool.check().unwrap();
    }
}

#[test]
fn promotion_commits_at_once_and_moves_the_sequence() {
    let mut config = hybrid(32, 4, 8);
    config.linear_state_save = LinearStateSave::Promote;
    let mut pool = BlockManagerPool::new(config).unwrap();
    let mut a = Sequence::new((0..9).collect(), None, None);
    assert!(pool.allocate(&mut a, None).unwrap());
    let old = a.linear_state_slot().unwrap();
    a.set_num_computed_tokens(8).unwrap();
    pool.cache(&mut a).unwrap();
    let fresh = a.linear_state_slot().unwrap();
    assert_ne!(old, fresh);
    let hash = BlockHasher::default().chain(&a.tokens()[..8], 4, None)[1];
    assert_eq!(pool.linear_state_cache(0).unwrap().peek(hash), Some(old));
    let plan = pool.take_linear_state_plan();
    assert_eq!(
        (plan.restore_src.clone(), plan.restore_dst.clone()),
        (vec![old as i32], vec![fresh as i32])
    );
    pool.commit_linear_state_plan(&plan).unwrap();
    pool.deallocate(&mut a).unwrap();
    pool.check().unwrap();
}

#[test]
fn slot_exhaustion_fails_cleanly() {
    // R13/R14: 2 usable slots; a third sequence cannot be allocated and nothing changes.
    let mut pool = BlockManagerPool::new(hybrid(32, 4, 3)).unwrap();
    let mut seqs: Vec<Sequence> = (0..3)
        .map(|i| Sequence::new((i * 100..i * 100 + 6).collect(), None, None))
        .collect();
    assert!(pool.allocate(&mut seqs[0], None).unwrap());
    assert!(pool.allocate(&mut seqs[1], None).unwrap());
    let stats = pool.stats();
    assert!(!pool.can_allocate(&mut seqs[2], None).unwrap());
    assert!(!pool.allocate(&mut seqs[2], None).unwrap());
    assert_eq!(pool.stats(), stats);
    assert_eq!(seqs[2].dp_rank(), None);
    assert!(!seqs[2].is_allocated());
    pool.check().unwrap();
}

#[test]
fn sliding_window_releases_blocks_behind_the_window() {
    // R25: fresh 20-token prefill, window 8, block size 4.
    let mut config = PoolConfig::new(32, 4);
    config.sliding_window = Some(8);
    config.swa_num_blocks = Some(16);
    let mut pool = BlockManagerPool::new(config).unwrap();
    let mut a = Sequence::new((0..20).collect(), None, None);
    assert!(pool.allocate(&mut a, None).unwrap());
    let window = a.group_block_ids(1).unwrap();
    assert_eq!(window.len(), 5);
    assert!(window.iter().all(|&id| id != 0));
    a.set_num_computed_tokens(20).unwrap();
    a.append_token(20);
    assert!(pool.may_append(&mut a, 0).unwrap());
    let after = a.group_block_ids(1).unwrap();
    assert_eq!(&after[..3], &[0, 0, 0]);
    assert_eq!(after.len(), 6);
    assert_eq!(
        a.group_block_ids(0).unwrap().len(),
        6,
        "full group keeps all"
    );
    let free = pool.window_manager(0).unwrap().num_free();
    assert_eq!(free, 15 - 3, "released window ids are free again");
    let slots = pool.slot_mapping(&[&a], 1).unwrap();
    assert_eq!(slots, vec![i64::from(after[5]) * 4]);
    pool.check().unwrap();
    pool.check_sequence(&a).unwrap();
    pool.deallocate(&mut a).unwrap();
    // The published blocks still in the window (3 and 4) are kept for a follow-up request.
    let counts = kvpool::BlockManager::counts(pool.window_manager(0).unwrap());
    assert_eq!((counts.free, counts.cached, counts.used), (13, 2, 0));
    pool.reset_prefix_cache();
    assert_eq!(pool.window_manager(0).unwrap().num_free(), 15);
    pool.check().unwrap();
}

#[test]
fn window_hits_only_while_the_window_is_held_or_kept() {
    let mut config = PoolConfig::new(64, 4);
    config.sliding_window = Some(8);
    let mut pool = BlockManagerPool::new(config).unwrap();
    let prompt: Vec<u32> = (0..33).collect();
    let mut a = Sequence::new(prompt.clone(), None, None);
    assert!(pool.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(33).unwrap();
    pool.cache(&mut a).unwrap();
    // a holds window blocks 6..8 only; a twin prompt can reuse all 8 blocks.
    let mut b = Sequence::new(prompt.clone(), None, None);
    assert!(pool.allocate(&mut b, None).unwrap());
    assert_eq!(b.num_cached_tokens(), 32);
    let ids = b.group_block_ids(1).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 0).count(), 6);
    pool.check().unwrap();
    pool.deallocate(&mut a).unwrap();
    pool.deallocate(&mut b).unwrap();
    // Both finished: the window tail they shared (blocks 6, 7) is kept, so a third request
    // still hits all 8 blocks.
    let window = kvpool::BlockManager::counts(pool.window_manager(0).unwrap());
    assert_eq!((window.cached, window.used), (2, 0));
    let mut c = Sequence::new(prompt.clone(), None, None);
    assert!(pool.allocate(&mut c, None).unwrap());
    assert_eq!(c.num_cached_tokens(), 32);
    pool.deallocate(&mut c).unwrap();
    // Without the kept tail (dropped by reset_prefix_cache, or evicted), the full-attention
    // cache still has the prefix, but the hit would need released window blocks: none (R25).
    pool.reset_prefix_cache();
    let mut a = Sequence::new(prompt.clone(), None, None);
    assert!(pool.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(33).unwrap();
    pool.deallocate(&mut a).unwrap();
    let kept = kvpool::BlockManager::counts(pool.window_manager(0).unwrap()).cached;
    assert_eq!(kept, 2);
    assert_eq!(pool.window_manager_mut(0).unwrap().evict(kept), 2);
    let mut d = Sequence::new(prompt, None, None);
    assert!(pool.allocate(&mut d, None).unwrap());
    assert_eq!(d.num_cached_tokens(), 0);
    pool.deallocate(&mut d).unwrap();
    pool.check().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Allocate { prefix: u8, len: u8, chunk: bool },
    Step { seq: u8 },
    Free { seq: u8 },
    Plan { commit: bool },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4, 1u8..40, any::<bool>()).prop_map(|(prefix, len, chunk)| Op::Allocate {
            prefix,
            len,
            chunk
        }),
        (0u8..8).prop_map(|seq| Op::Step { seq }),
        (0u8..8).prop_map(|seq| Op::Free { seq }),
        any::<bool>().prop_map(|commit| Op::Plan { commit }),
        Just(Op::Reset),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn random_hybrid_workloads_keep_every_invariant(
        ops in proptest::collection::vec(op(), 1..60),
        window in prop_oneof![Just(None), (1usize..12).prop_map(Some)],
        slots in 0usize..6,
        promote in any::<bool>(),
        contiguous in any::<bool>(),
    ) {
        let mut config = PoolConfig::new(24, 4);
        config.sliding_window = window;
        config.swa_num_blocks = window.map(|_| 12);
        config.linear_state_slots = if slots == 1 { 0 } else { slots };
        if config.linear_state_slots > 0 {
            config.checkpoint_interval = Some(8);
        }
        config.linear_state_save = if promote { LinearStateSave::Promote } else { LinearStateSave::Copy };
        config.linear_state_match =
            if contiguous { LinearStateMatch::Contiguous } else { LinearStateMatch::Deepest };
        let mut pool = BlockManagerPool::new(config).unwrap();
        let mut seqs: Vec<Sequence> = Vec::new();
        let mut plans = Vec::new();
        for op in ops {
            match op {
                Op::Allocate { prefix, len, chunk } => {
                    let tokens: Vec<u32> =
                        (0..len as u32).map(|i| if i < 12 { prefix as u32 * 1000 + i } else { 7 * i }).collect();
                    let mut seq = Sequence::new(tokens, None, None);
                    let n = if chunk { Some((len as usize).div_ceil(2)) } else { None };
                    let can = pool.can_allocate(&mut seq, n).unwrap();
                    let before = pool.stats();
                    let ok = pool.allocate(&mut seq, n).unwrap();
                    prop_assert_eq!(can, ok, "R15");
                    if ok {
                        seqs.push(seq);
                    } else {
                        prop_assert_eq!(pool.stats(), before, "R14 rollback");
                    }
                }
                Op::Step { seq } if !seqs.is_empty() => {
                    let index = seq as usize % seqs.len();
                    let s = &mut seqs[index];
                    let target = s.capacity().min(s.len());
                    s.set_num_computed_tokens(target.max(s.num_computed_tokens())).unwrap();
                    pool.cache(s).unwrap();
                    if s.num_computed_tokens() == s.len() {
                        s.append_token(5);
                    }
                    let can = pool.can_append(s, 0).unwrap();
                    let ok = pool.may_append(s, 0).unwrap();
                    prop_assert_eq!(can, ok, "R16");
                    if !ok {
                        let mut s = seqs.swap_remove(index);
                        pool.deallocate(&mut s).unwrap();
                    }
                }
                Op::Free { seq } if !seqs.is_empty() => {
                    let index = seq as usize % seqs.len();
                    let mut s = seqs.swap_remove(index);
                    pool.deallocate(&mut s).unwrap();
                }
                Op::Plan { commit } => {
                    plans.push(pool.take_linear_state_plan());
                    if commit {
                        for plan in plans.drain(..) {
                            pool.commit_linear_state_plan(&plan).unwrap();
                        }
                    }
                }
                Op::Reset => pool.reset_prefix_cache(),
                _ => {}
            }
            pool.check().unwrap();
            for s in &seqs {
                pool.check_sequence(s).unwrap();
            }
        }
        for mut s in seqs.drain(..) {
            pool.deallocate(&mut s).unwrap();
        }
        plans.push(pool.take_linear_state_plan());
        for plan in plans.drain(..) {
            pool.commit_linear_state_plan(&plan).unwrap();
        }
        pool.reset_prefix_cache();
        pool.check().unwrap();
        let stats = pool.stats();
        prop_assert_eq!(stats.total.counts.free, stats.total.counts.total, "every id back");
        if let Some(w) = stats.total.window {
            prop_assert_eq!(w.free, w.total);
        }
        prop_assert_eq!(stats.total.num_live_slots, 0);
        prop_assert_eq!(stats.total.num_pending_checkpoints, 0);
        prop_assert_eq!(stats.total.num_committed_checkpoints, 0);
        prop_assert_eq!(pool.num_pending_linear_state_copies(), 0);
    }
}
