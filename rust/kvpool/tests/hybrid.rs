//! Hybrid models at the pool level: linear-state checkpoints (R22-R24) and sliding-window
//! groups (R25), with a proptest of random hybrid workloads checking every structure after
//! every step (under each eviction policy, R11a).

use kvpool::{
    BlockHasher, BlockManagerPool, Eviction, KvCacheManager, LinearStateMatch, LinearStateSave,
    PoolConfig, Sequence,
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
    let plan = pool.take_linear_state_plan();
    assert!(plan.restore_src.is_empty() && plan.save_src.is_empty());
    // no restore: the live slot starts from zeros (R24)
    assert_eq!(plan.zero_slots, vec![b.linear_state_slot().unwrap() as i32]);
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
    // A window group with a store of its own (slid-out blocks are freed at once).
    let mut config = PoolConfig::new(64, 4);
    config.sliding_window = Some(8);
    config.swa_num_blocks = Some(64);
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

/// Computes `tokens` whole in `pool` and releases them.
fn computed_and_released(pool: &mut BlockManagerPool, tokens: Vec<u32>) {
    let n = tokens.len();
    let mut seq = Sequence::new(tokens, None, None);
    assert!(pool.allocate(&mut seq, None).unwrap());
    seq.set_num_computed_tokens(n).unwrap();
    pool.cache(&mut seq).unwrap();
    pool.deallocate(&mut seq).unwrap();
}

#[test]
fn chunked_groups_read_from_the_chunk_start_and_keep_chunk_end_hits() {
    // Chunk 16 at block size 4: a query at p reads from p - p % 16. Under a stream of unrelated
    // prompts a sliding window of 16 loses the conversation's hit points (each needs the
    // window's blocks before it); the chunked group's hits at chunk ends need none of its
    // blocks and stay.
    let conversation: Vec<u32> = (100..164).collect();
    let mut hits = Vec::new();
    for chunked in [true, false] {
        let mut config = PoolConfig::new(44, 4);
        config.retention_tokens = 0;
        if chunked {
            config.attention_chunk_size = Some(16);
        } else {
            config.sliding_window = Some(16);
        }
        let mut pool = BlockManagerPool::new(config).unwrap();
        let mut a = Sequence::new(conversation.clone(), None, None);
        assert!(pool.allocate(&mut a, None).unwrap());
        a.set_num_computed_tokens(26).unwrap();
        pool.cache(&mut a).unwrap();
        // the query at 26 reads from 16 (chunked) or 11 (window): blocks before are released
        let table = a.group_block_ids(1).unwrap();
        let released = table.iter().take_while(|&&id| id == 0).count();
        assert_eq!(released, if chunked { 4 } else { 2 });
        a.set_num_computed_tokens(64).unwrap();
        pool.deallocate(&mut a).unwrap();
        for k in 0..6u32 {
            computed_and_released(&mut pool, (0..8).map(|t| k * 1000 + t).collect());
            pool.check().unwrap();
        }
        let got: Vec<usize> = [64usize, 48, 32]
            .iter()
            .map(|&n| {
                let mut probe = conversation[..n].to_vec();
                probe.push(7);
                let mut seq = Sequence::new(probe, None, None);
                assert!(pool.allocate(&mut seq, None).unwrap());
                let hit = seq.num_cached_tokens();
                pool.deallocate(&mut seq).unwrap();
                hit
            })
            .collect();
        pool.check().unwrap();
        hits.push(got);
    }
    assert_eq!(hits, vec![vec![64, 48, 32], vec![0, 0, 0]]);
}

#[test]
fn chunk_options_are_checked() {
    for (chunk, window, own) in [
        (Some(6), None, None),
        (Some(0), None, None),
        (Some(8), Some(8), None),
        (Some(8), None, Some(8)),
    ] {
        let mut config = PoolConfig::new(16, 4);
        config.attention_chunk_size = chunk;
        config.sliding_window = window;
        config.swa_num_blocks = own;
        let error = BlockManagerPool::new(config).err().expect("refused");
        assert!(
            error.to_string().contains("attention_chunk_size"),
            "{error}"
        );
    }
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
        eviction in prop_oneof![Just(Eviction::Lru), Just(Eviction::Slru), Just(Eviction::GhostSlru)],
        shared in any::<bool>(),
    ) {
        let mut config = PoolConfig::new(24, 4);
        config.sliding_window = window;
        // A window store of its own, or one store whose window blocks hang on the nodes
        // (attachments: the classes every eviction policy orders inside, R11a).
        config.swa_num_blocks = window.filter(|_| !shared).map(|_| 12);
        config.eviction = eviction;
        config.linear_state_slots = if slots == 1 { 0 } else { slots };
        if config.linear_state_slots > 0 {
            // "contiguous" hits only with a checkpoint at every block (R23).
            config.checkpoint_interval = Some(if contiguous { 4 } else { 8 });
        }
        config.linear_state_save = if promote { LinearStateSave::Promote } else { LinearStateSave::Copy };
        config.linear_state_match =
            if contiguous { LinearStateMatch::Contiguous } else { LinearStateMatch::Deepest };
        config.enable_events = true;
        let mut pool = BlockManagerPool::new(config).unwrap();
        let mut seqs: Vec<Sequence> = Vec::new();
        let mut plans = Vec::new();
        // Events of every group (R21): gap-free, the window after the linear group, and (no
        // linear group: the index learns a group from its first stored event, and a linear
        // group stores nothing before its first committed checkpoint) an index fed them
        // agreeing with the pool's plan.
        let index = KVIndex::new(IndexConfig::default()).unwrap();
        let mut last = vec![0];
        let window_group = 1 + u32::from(config.linear_state_slots > 0);
        let probes: Vec<Vec<u32>> = (0..4u32).map(|p| (0..17).map(|i| p * 1000 + i).collect()).collect();
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
            let events = pool.drain_events();
            for e in &events {
                if let GroupKind::SlidingWindow { window: w } = e.group_kind {
                    prop_assert_eq!((Some(w as usize), e.group), (window, window_group));
                }
            }
            feed(&index, &events, &mut last);
            if config.linear_state_slots == 0 {
                for probe in &probes {
                    if let Some(plan) = pool.plan(&mut Sequence::new(probe.clone(), None, None), None).unwrap() {
                        prop_assert_eq!(credited(&index, probe, 0), plan.num_cached_blocks());
                    }
                }
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

// ---- KV events of the sliding-window group (R21, R25) ----

use kvpool::{GroupKind, IndexConfig, IndexEvent, KVIndex, KvEvent, KvEventKind, Medium};

fn window_pool(
    num_blocks: usize,
    window: usize,
    swa: Option<usize>,
    dp: usize,
) -> BlockManagerPool {
    let mut config = PoolConfig::new(num_blocks, 4);
    config.sliding_window = Some(window);
    config.swa_num_blocks = swa;
    config.enable_events = true;
    config.dp_size = dp;
    BlockManagerPool::new(config).unwrap()
}

/// Applies `events` to `index`, checking the numbers continue each rank's stream (`last`).
fn feed(index: &KVIndex, events: &[KvEvent], last: &mut [u64]) {
    for e in events {
        assert_eq!(e.sequence, last[e.dp_rank] + 1, "gap-free per rank");
        last[e.dp_rank] = e.sequence;
    }
    let batch: Vec<IndexEvent> = events.iter().map(KvEvent::to_index_event).collect();
    assert!(index.apply(0, batch).unwrap().gaps.is_empty());
}

/// Blocks the index credits `rank`'s device with for `tokens` (block size 4).
fn credited(index: &KVIndex, tokens: &[u32], rank: usize) -> usize {
    let chain = BlockHasher::default().chain(tokens, 4, None);
    index
        .lookup_chain(&chain, 4, 0.0)
        .iter()
        .filter(|m| m.dp_rank as usize == rank && m.medium == Medium::Device)
        .map(|m| m.blocks as usize)
        .max()
        .unwrap_or(0)
}

#[test]
fn window_group_events_carry_every_field_and_follow_the_blocks() {
    let mut pool = window_pool(32, 8, Some(16), 1);
    let tokens: Vec<u32> = (0..20).collect();
    let hashes = BlockHasher::default().chain(&tokens, 4, Some(b"salt"));
    let mut a = Sequence::new(tokens.clone(), None, Some(b"salt"));
    assert!(pool.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(20).unwrap();
    pool.cache(&mut a).unwrap(); // publishes 5 window blocks, then slides 3 out
    let events = pool.drain_events();
    // The rank's groups come first ("group" events, docs/events.md), then the window's.
    let window: Vec<&KvEvent> = events
        .iter()
        .filter(|e| e.group == 1 && e.kind != KvEventKind::Group)
        .collect();
    assert_eq!(window.len(), 2, "{events:?}");
    for e in &window {
        assert_eq!(e.group_kind, GroupKind::SlidingWindow { window: 8 });
        assert_eq!((e.medium, e.dp_rank, e.block_size), (Medium::Device, 0, 4));
        assert_eq!(e.extra_key.as_deref(), Some(&b"salt"[..]));
    }
    assert_eq!(window[0].kind, KvEventKind::Stored);
    assert_eq!(window[0].block_hashes, hashes);
    assert_eq!(
        (window[0].parent_hash, &window[0].token_ids),
        (None, &tokens)
    );
    assert_eq!(
        window[1].kind,
        KvEventKind::Removed,
        "slid out: last handle dropped"
    );
    assert_eq!(window[1].block_hashes, hashes[..3]);
    assert!(
        window[0].sequence < window[1].sequence,
        "a removal after its store"
    );
    let numbers: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    assert_eq!(numbers, (1..=events.len() as u64).collect::<Vec<_>>());
    // The next block is published with its parent; deallocate keeps the tail (no removal).
    a.append_token(20);
    assert!(pool.may_append(&mut a, 0).unwrap());
    a.append_tokens(&[21, 22, 23]);
    assert!(pool.may_append(&mut a, 0).unwrap());
    a.set_num_computed_tokens(24).unwrap();
    pool.cache(&mut a).unwrap();
    let events = pool.drain_events();
    let stored = events
        .iter()
        .find(|e| e.group == 1 && e.kind == KvEventKind::Stored)
        .unwrap();
    assert_eq!(stored.parent_hash, Some(hashes[4]));
    assert_eq!(stored.token_ids, vec![20, 21, 22, 23]);
    pool.deallocate(&mut a).unwrap();
    pool.check().unwrap();
    let events = pool.drain_events();
    assert!(events
        .iter()
        .all(|e| e.group != 1 || e.kind == KvEventKind::Removed));
    assert_eq!(
        pool.window_manager(0).unwrap().num_announced(),
        2,
        "the kept tail"
    );
    // Evicting the kept tail removes it; a reset's device "cleared" covers the group.
    assert_eq!(pool.window_manager_mut(0).unwrap().evict(1), 1);
    let removed: Vec<KvEvent> = pool.drain_events();
    assert_eq!(removed.len(), 1);
    assert_eq!(
        (removed[0].group, removed[0].kind),
        (1, KvEventKind::Removed)
    );
    pool.reset_prefix_cache();
    let events = pool.drain_events();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].kind, events[0].group), (KvEventKind::Cleared, 0));
    assert_eq!(pool.window_manager(0).unwrap().num_announced(), 0);
    pool.check().unwrap();
}

#[test]
fn a_sequence_dropped_on_another_thread_is_removed_at_the_next_drain() {
    // A window group with a store of its own: its blocks die with their last handle.
    let mut pool = window_pool(64, 8, Some(64), 1);
    let tokens: Vec<u32> = (0..17).collect();
    let mut a = Sequence::new(tokens.clone(), None, None);
    assert!(pool.allocate(&mut a, None).unwrap());
    a.set_num_computed_tokens(16).unwrap();
    pool.cache(&mut a).unwrap();
    let index = KVIndex::new(IndexConfig::default()).unwrap();
    let mut last = vec![0];
    feed(&index, &pool.drain_events(), &mut last);
    assert_eq!(credited(&index, &tokens, 0), 4);
    // Dropped without deallocate (R27: lock-free, the pool never sees it).
    std::thread::spawn(move || drop(a)).join().unwrap();
    let events = pool.drain_events();
    assert!(events
        .iter()
        .any(|e| e.group == 1 && e.kind == KvEventKind::Removed));
    feed(&index, &events, &mut last);
    let plan = pool
        .plan(&mut Sequence::new(tokens.clone(), None, None), None)
        .unwrap()
        .unwrap();
    assert_eq!(plan.num_cached_blocks(), 0, "the window blocks are gone");
    assert_eq!(credited(&index, &tokens, 0), 0, "and the index agrees");
    pool.check().unwrap();
}

#[derive(Clone, Debug)]
enum WindowOp {
    Allocate { prefix: u8, len: u8 },
    Step { seq: u8 },
    Free { seq: u8 },
    Drop { seq: u8 },
    Evict { n: u8 },
    Reset,
}

fn window_op() -> impl Strategy<Value = WindowOp> {
    prop_oneof![
        4 => (0u8..4, 1u8..40).prop_map(|(prefix, len)| WindowOp::Allocate { prefix, len }),
        4 => (0u8..8).prop_map(|seq| WindowOp::Step { seq }),
        2 => (0u8..8).prop_map(|seq| WindowOp::Free { seq }),
        1 => (0u8..8).prop_map(|seq| WindowOp::Drop { seq }),
        1 => (1u8..4).prop_map(|n| WindowOp::Evict { n }),
        1 => Just(WindowOp::Reset),
    ]
}

fn window_prompt(prefix: u8, len: u8) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if i < 24 {
                prefix as u32 * 1000 + i
            } else {
                7 * i
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Random workloads on a pool with a sliding window: after every step the events are
    /// gap-free per rank and an index fed them credits each probe with exactly the device hit
    /// the pool's own plan finds (full attention and the window together).
    #[test]
    fn an_index_fed_window_events_agrees_with_the_pool(
        ops in proptest::collection::vec(window_op(), 1..70),
        window in 1usize..14,
        dp in 1usize..3,
    ) {
        let mut pool = window_pool(40, window, Some(14), dp);
        let index = KVIndex::new(IndexConfig::default()).unwrap();
        let mut last = vec![0; dp];
        let mut seqs: Vec<Sequence> = Vec::new();
        let probes: Vec<Vec<u32>> = (0..4u8).map(|p| window_prompt(p, 25)).collect();
        for op in ops {
            match op {
                WindowOp::Allocate { prefix, len } => {
                    let mut seq = Sequence::new(window_prompt(prefix, len), None, None);
                    if pool.allocate(&mut seq, None).unwrap() {
                        seqs.push(seq);
                    }
                }
                WindowOp::Step { seq } if !seqs.is_empty() => {
                    let i = seq as usize % seqs.len();
                    let s = &mut seqs[i];
                    let n = s.len();
                    s.set_num_computed_tokens(n).unwrap();
                    pool.cache(s).unwrap();
                    s.append_token(5);
                    if !pool.may_append(s, 0).unwrap() {
                        let mut s = seqs.swap_remove(i);
                        pool.deallocate(&mut s).unwrap();
                    }
                }
                WindowOp::Free { seq } if !seqs.is_empty() => {
                    let mut s = seqs.swap_remove(seq as usize % seqs.len());
                    pool.deallocate(&mut s).unwrap();
                }
                WindowOp::Drop { seq } if !seqs.is_empty() => {
                    drop(seqs.swap_remove(seq as usize % seqs.len())); // lock-free (R27)
                }
                WindowOp::Evict { n } => {
                    for rank in 0..dp {
                        pool.window_manager_mut(rank).unwrap().evict(n as usize);
                    }
                }
                WindowOp::Reset => pool.reset_prefix_cache(),
                _ => {}
            }
            let events = pool.drain_events();
            for e in &events {
                prop_assert_eq!(e.block_size, 4);
                prop_assert_eq!(e.medium, Medium::Device);
                if e.group == 1 {
                    prop_assert_eq!(e.group_kind, GroupKind::SlidingWindow { window: window as u32 });
                    prop_assert!(e.kind != KvEventKind::Cleared);
                }
            }
            feed(&index, &events, &mut last);
            pool.check().unwrap();
            index.check().unwrap();
            for (rank, &number) in last.iter().enumerate() {
                prop_assert_eq!(pool.last_event_sequence(rank).unwrap(), number);
            }
            for probe in &probes {
                let mut seq = Sequence::new(probe.clone(), None, None);
                if let Some(plan) = pool.plan(&mut seq, None).unwrap() {
                    let held = credited(&index, probe, plan.dp_rank());
                    prop_assert_eq!(held, plan.num_cached_blocks(), "probe {:?}", &probe[..2]);
                }
            }
        }
    }
}

/// R27 with events: sequences dropped on other threads while the pool (behind its lock) keeps
/// serving and draining; once the drops are done, one more drain leaves an index fed every
/// event agreeing with the pool, and no announced window block outlives its handles.
#[test]
fn window_removals_of_concurrent_drops_reach_the_index() {
    let pool = std::sync::Mutex::new(window_pool(400, 8, Some(200), 1));
    let index = KVIndex::new(IndexConfig::default()).unwrap();
    let mut last = vec![0];
    let prompt = |i: u32| -> Vec<u32> { (0..21).map(|t| 100 * (i % 6) + t).collect() };
    let mut batches = Vec::new();
    for round in 0..4u32 {
        let mut seqs = Vec::new();
        for i in 0..12 {
            let mut s = Sequence::new(prompt(round * 12 + i), None, None);
            let mut p = pool.lock().unwrap();
            if p.allocate(&mut s, None).unwrap() {
                s.set_num_computed_tokens(20).unwrap();
                p.cache(&mut s).unwrap();
                seqs.push(s);
            }
        }
        std::thread::scope(|scope| {
            // Three threads drop their sequences one by one while this one drains.
            let mut rest = std::mem::take(&mut seqs);
            while !rest.is_empty() {
                let mine: Vec<Sequence> = rest.drain(..rest.len().min(4)).collect();
                scope.spawn(move || mine.into_iter().for_each(drop));
            }
            for _ in 0..20 {
                let mut p = pool.lock().unwrap();
                // (No check() here: the counts are exact only at quiescence, R2.)
                batches.push(p.drain_events());
            }
        });
        let mut p = pool.lock().unwrap();
        batches.push(p.drain_events());
        for events in batches.drain(..) {
            feed(&index, &events, &mut last);
        }
        p.check().unwrap();
        assert_eq!(
            p.window_manager(0).unwrap().num_announced(),
            0,
            "round {round}"
        );
        for i in 0..6 {
            let tokens = prompt(i);
            let plan = p
                .plan(&mut Sequence::new(tokens.clone(), None, None), None)
                .unwrap()
                .unwrap();
            assert_eq!(credited(&index, &tokens, 0), plan.num_cached_blocks());
            assert_eq!(
                plan.num_cached_blocks(),
                0,
                "no window block is held any more"
            );
        }
    }
    index.check().unwrap();
}

#[test]
fn state_groups_move_the_state_and_cache_only_boundary_states() {
    // Block size 4, one state group: a step's state lives in the block of its last token; the
    // previous block is carried until the step is done; a block is cached only when a step
    // ended on its end boundary.
    let mut config = PoolConfig::new(64, 4);
    config.state_groups = 1;
    let mut pool = BlockManagerPool::new(config).unwrap();
    let prompt: Vec<u32> = (100..111).collect();
    let mut a = Sequence::new(prompt.clone(), None, None);
    assert!(pool.allocate(&mut a, Some(8)).unwrap());
    let ids = a.group_block_ids(1).unwrap();
    assert!(
        ids[0] == 0 && ids[1] != 0,
        "one block, the step's last: {ids:?}"
    );
    a.set_num_computed_tokens(8).unwrap();
    pool.cache(&mut a).unwrap(); // ended on boundary 8: block 1 is cached
    let cached = ids[1];
    assert!(pool.allocate(&mut a, Some(11)).unwrap());
    let ids = a.group_block_ids(1).unwrap();
    assert_eq!((ids[0], ids[1]), (0, cached), "the source is carried");
    assert!(ids[2] != 0);
    a.set_num_computed_tokens(11).unwrap();
    pool.cache(&mut a).unwrap();
    let ids = a.group_block_ids(1).unwrap();
    assert_eq!((ids[0], ids[1]), (0, 0), "the step is done");
    pool.deallocate(&mut a).unwrap();
    pool.check().unwrap();
    // a hit at 8 takes the cached state block; 11 (inside a step's block) is no hit point
    let mut probe = prompt[..10].to_vec();
    probe.push(7);
    let mut b = Sequence::new(probe, None, None);
    assert!(pool.allocate(&mut b, None).unwrap());
    assert_eq!(b.num_cached_tokens(), 8);
    assert_eq!(b.group_block_ids(1).unwrap()[1], cached);
    pool.deallocate(&mut b).unwrap();
    // one step through boundaries 4, 8 and 12 caches none of them
    let other: Vec<u32> = (200..213).collect();
    let mut c = Sequence::new(other.clone(), None, None);
    assert!(pool.allocate(&mut c, None).unwrap());
    c.set_num_computed_tokens(13).unwrap();
    pool.deallocate(&mut c).unwrap();
    let mut d = Sequence::new(
        other[..12].iter().copied().chain([1, 2]).collect(),
        None,
        None,
    );
    assert!(pool.allocate(&mut d, None).unwrap());
    assert_eq!(d.num_cached_tokens(), 0);
    pool.deallocate(&mut d).unwrap();
    pool.check().unwrap();
}
