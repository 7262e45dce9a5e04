"""Hybrid models: LinearStatePrefixCache, linear-state checkpoints in the pool,
SlidingWindowBlockManager / CompositeBlockManager and sliding-window pools (R22-R25)."""

from __future__ import annotations

import random

import kvpool
import numpy as np
import pytest

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def commit(lsc, prefix_hash: bytes) -> int:
    slot = lsc.reserve_checkpoint(prefix_hash)
    assert slot is not None
    lsc.commit_checkpoint(prefix_hash)
    return slot


# --- LinearStatePrefixCache (R22) ------------------------------------------------------------


def test_r22_slot_zero_is_padding_and_counts_add_up():
    lsc = kvpool.LinearStatePrefixCache(5)
    slots = [lsc.acquire_live_slot() for _ in range(4)]
    assert sorted(slots) == [1, 2, 3, 4]
    assert lsc.num_live_slots == 4 and lsc.num_free_slots == 0
    with pytest.raises(kvpool.OutOfBlocksError):
        lsc.acquire_live_slot()
    for s in slots:
        lsc.release_live_slot(s)
    assert lsc.num_free_slots == 4
    lsc.check()


def test_r22_pending_checkpoints_never_match():
    lsc = kvpool.LinearStatePrefixCache(4)
    slot = lsc.reserve_checkpoint(h(1))
    assert slot is not None
    assert not lsc.contains(h(1)) and h(1) not in lsc
    assert lsc.lookup(h(1)) is None
    assert lsc.reserve_checkpoint(h(1)) is None, "already pending"
    lsc.commit_checkpoint(h(1))
    assert lsc.contains(h(1)) and lsc.lookup(h(1)) == slot
    assert lsc.reserve_checkpoint(h(1)) is None, "already committed"
    assert lsc.num_pending_checkpoints == 0 and lsc.num_committed_checkpoints == 1
    lsc.check()


def test_r22_lru_order_and_lookup_refreshes_recency():
    lsc = kvpool.LinearStatePrefixCache(5)
    slots = [commit(lsc, h(i)) for i in range(4)]
    assert lsc.lru_order() == slots
    assert lsc.lookup(h(0)) == slots[0]
    assert lsc.lru_order() == slots[1:] + slots[:1]
    # A live slot evicts the least recently used checkpoint: h(1).
    lsc.acquire_live_slot()
    assert not lsc.contains(h(1)) and lsc.contains(h(0))
    assert lsc.evict(2) == 2
    assert [lsc.contains(h(i)) for i in range(4)] == [True, False, False, False]
    assert lsc.stats()["evictions"] == 3
    lsc.check()


def test_r22_pinned_checkpoint_is_not_evicted():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=3)
    tokens = list(range(9))
    hashes = kvpool.hash_blocks(tokens[:8], BS)
    warm = kvpool.Sequence(tokens)
    assert pool.allocate(warm)
    warm.num_computed_tokens = 8
    pool.deallocate(warm)  # publishes 2 blocks
    lsc = pool.linear_state_cache(0)
    commit(lsc, hashes[1])
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)  # restores from hashes[1]: pinned until the plan commits
    assert seq.linear_state_restore_slot == lsc.lookup(hashes[1])
    assert lsc.num_pinned_checkpoints == 1
    assert lsc.evict(1) == 0
    other = kvpool.Sequence(list(range(100, 105)))
    assert not pool.allocate(other), "the only other slot is the pinned checkpoint"
    plan = pool.take_linear_state_plan()
    pool.commit_linear_state_plan(plan)
    assert lsc.num_pinned_checkpoints == 0
    assert pool.allocate(other), "now the checkpoint can be evicted"
    assert not lsc.contains(hashes[1])
    pool.check()


def test_r22_promotion_gives_a_fresh_live_slot_and_commits_the_old_one():
    lsc = kvpool.LinearStatePrefixCache(4)
    live = lsc.acquire_live_slot()
    fresh = lsc.promote(live, h(7))
    assert fresh != live
    assert lsc.lookup(h(7)) == live
    assert lsc.num_live_slots == 1 and lsc.num_committed_checkpoints == 1
    with pytest.raises(ValueError, match="prefix_hash"):
        lsc.promote(fresh, h(7))
    with pytest.raises(ValueError, match="live_slot"):
        lsc.promote(live, h(8))  # a checkpoint, not a live slot
    lsc.check()


def test_r29_linear_state_cache_bad_input():
    with pytest.raises(ValueError, match="num_slots"):
        kvpool.LinearStatePrefixCache(1)
    with pytest.raises(TypeError, match="num_slots"):
        kvpool.LinearStatePrefixCache("4")
    lsc = kvpool.LinearStatePrefixCache(4)
    with pytest.raises(TypeError, match="prefix_hash"):
        lsc.reserve_checkpoint("abc")
    with pytest.raises(ValueError, match="prefix_hash"):
        lsc.reserve_checkpoint(b"short")
    with pytest.raises(ValueError, match="prefix_hash"):
        lsc.commit_checkpoint(h(1))
    with pytest.raises(ValueError, match="slot"):
        lsc.release_live_slot(0)
    with pytest.raises(ValueError, match="slot"):
        lsc.release_live_slot(2)  # free, not live
    with pytest.raises(ValueError, match="n"):
        lsc.evict(-1)
    assert lsc.num_free_slots == 3
    lsc.check()


# --- linear state in the pool (R13, R14, R23, R24) ---------------------------------------------


def warm_prefix(pool, tokens, computed):
    """Publish the full blocks of tokens[:computed] through a throw-away sequence."""
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    seq.num_computed_tokens = computed
    pool.deallocate(seq)
    return kvpool.hash_blocks(tokens[:computed], BS)


@pytest.mark.parametrize(
    ("rule", "kept", "restore_from"), [("deepest", 4, 3), ("contiguous", 2, 1)]
)
def test_r23_seed_example(rule, kept, restore_from):
    """Seed section 7.2: KV hits block0..block3, checkpoints at hash0, hash1, hash3."""
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=8, linear_state_match=rule)
    tokens = list(range(17))
    hashes = warm_prefix(pool, tokens, 16)
    lsc = pool.linear_state_cache(0)
    for i in (0, 1, 3):
        commit(lsc, hashes[i])
    assert pool.stats()["num_cached_blocks"] == 4
    seq = kvpool.Sequence(tokens)
    assert pool.can_allocate(seq)
    assert pool.allocate(seq)
    assert seq.num_cached_tokens == kept * BS
    assert seq.num_computed_tokens == kept * BS
    assert seq.linear_state_restore_slot == lsc.lookup(hashes[restore_from])
    # block2, block3 are not reused: they stay cache-only (released by the trim).
    assert pool.stats()["num_cached_blocks"] == 4 - kept
    plan = pool.take_linear_state_plan()
    assert plan.restore_src.dtype == np.int32
    assert plan.restore_src.tolist() == [seq.linear_state_restore_slot]
    assert plan.restore_dst.tolist() == [seq.linear_state_slot]
    assert plan.restore_dp_rank.tolist() == [0]
    assert len(plan) == 1 and plan.save_src.size == 0
    pool.commit_linear_state_plan(plan)
    with pytest.raises(ValueError, match="plan"):
        pool.commit_linear_state_plan(plan)
    pool.deallocate(seq)
    pool.check()


def test_r23_no_checkpoint_no_kv_reuse_and_r20_slot_stats():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=4)
    tokens = list(range(13))
    warm_prefix(pool, tokens, 12)
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    assert seq.num_cached_tokens == 0 and seq.linear_state_restore_slot is None
    stats = pool.stats()
    assert stats["num_live_slots"] == 1
    assert stats["num_free_linear_state_slots"] == 2  # 3 usable, 1 live
    assert stats["ranks"][0]["num_live_slots"] == 1
    pool.deallocate(seq)
    assert pool.stats()["num_live_slots"] == 0


def test_r24_save_at_prompt_boundary_matchable_only_after_commit():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=8)
    tokens = list(range(10))  # prompt's last block boundary: 8
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq, 8)
    seq.num_computed_tokens = 8
    pool.cache(seq)
    plan = pool.take_linear_state_plan()
    hashes = kvpool.hash_blocks(tokens[:8], BS)
    assert plan.save_src.tolist() == [seq.linear_state_slot]
    assert plan.save_hashes == [hashes[1]]
    lsc = pool.linear_state_cache(0)
    assert lsc.num_pending_checkpoints == 1 and not lsc.contains(hashes[1])
    assert pool.stats()["num_pending_checkpoints"] == 1
    pool.commit_linear_state_plan(plan)
    assert lsc.contains(hashes[1])
    assert pool.stats()["num_committed_checkpoints"] == 1
    pool.deallocate(seq)
    pool.check()


def test_r24_checkpoint_interval_and_validation():
    with pytest.raises(ValueError, match="checkpoint_interval"):
        kvpool.BlockManagerPool(64, BS, linear_state_slots=4, checkpoint_interval=6)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        kvpool.BlockManagerPool(64, BS, checkpoint_interval=8)
    with pytest.raises(ValueError, match="linear_state_match"):
        kvpool.BlockManagerPool(64, BS, linear_state_slots=4, linear_state_match="longest")
    with pytest.raises(ValueError, match="linear_state_slots"):
        kvpool.BlockManagerPool(64, BS, linear_state_slots=1)
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=8, checkpoint_interval=8)
    seq = kvpool.Sequence([1, 2, 3])
    assert pool.allocate(seq)
    saves = []
    for step in range(3, 26):
        seq.num_computed_tokens = step
        pool.cache(seq)
        seq.append_token(step)
        assert pool.may_append(seq)
        plan = pool.take_linear_state_plan()
        saves += [step] * len(plan.save_src)
        pool.commit_linear_state_plan(plan)
    assert saves == [8, 16, 24]
    pool.deallocate(seq)
    pool.check()


@pytest.mark.parametrize("taken", [False, True])
def test_r24_deallocate_cancels_an_unconfirmed_save(taken):
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=4)
    seq = kvpool.Sequence(list(range(9)))
    assert pool.allocate(seq)
    seq.num_computed_tokens = 8
    pool.cache(seq)
    plan = pool.take_linear_state_plan() if taken else None
    pool.deallocate(seq)
    lsc = pool.linear_state_cache(0)
    # A taken copy keeps its slot until the worker confirms it; an untaken one is gone.
    assert lsc.num_pending_checkpoints == int(taken)
    if plan is not None:
        pool.commit_linear_state_plan(plan)
    assert lsc.num_pending_checkpoints == 0 and lsc.num_committed_checkpoints == 0
    assert lsc.num_free_slots == 3
    pool.check()


def test_r22_pool_promotion_mode():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=4, linear_state_save="promote")
    seq = kvpool.Sequence(list(range(9)))
    assert pool.allocate(seq)
    old = seq.linear_state_slot
    seq.num_computed_tokens = 8
    pool.cache(seq)
    assert seq.linear_state_slot != old
    lsc = pool.linear_state_cache(0)
    assert lsc.lookup(kvpool.hash_blocks(list(range(8)), BS)[1]) == old, "committed at once"
    plan = pool.take_linear_state_plan()
    assert (plan.restore_src.tolist(), plan.restore_dst.tolist()) == (
        [old],
        [seq.linear_state_slot],
    )
    pool.commit_linear_state_plan(plan)
    pool.deallocate(seq)
    pool.check()


def test_r13_r14_slot_exhaustion_fails_cleanly():
    pool = kvpool.BlockManagerPool(64, BS, dp_size=2, linear_state_slots=2)
    seqs = [kvpool.Sequence(list(range(i * 50, i * 50 + 6))) for i in range(3)]
    assert pool.allocate(seqs[0]) and pool.allocate(seqs[1])
    assert {seqs[0].dp_rank, seqs[1].dp_rank} == {0, 1}, "R13 skips ranks without a slot"
    before = pool.stats()
    assert not pool.can_allocate(seqs[2])
    assert not pool.allocate(seqs[2])
    assert pool.stats() == before
    assert seqs[2].dp_rank is None and seqs[2].linear_state_slot is None
    assert seqs[2].block_table.size == 0
    pool.deallocate(seqs[0])
    assert pool.allocate(seqs[2]) and seqs[2].dp_rank == seqs[0].dp_rank
    pool.check()


def test_r24_multi_turn_chat_rehits_through_checkpoints():
    """Each turn's prompt is the previous conversation plus a new user message; the pool saves
    a checkpoint at every prompt's last block boundary and every 16 computed tokens, so every
    turn restores the deepest checkpoint inside its KV hit."""
    rng = random.Random(7)
    pool = kvpool.BlockManagerPool(
        1024, BS, linear_state_slots=64, checkpoint_interval=16, enable_events=False
    )
    history: list[int] = list(range(1000, 1000 + 13))  # system prompt
    saved_boundaries: set[int] = set()  # token positions with a committed checkpoint
    published = 0  # tokens whose KV is in the cache for this conversation
    query_tokens = hit_tokens = 0
    for turn in range(6):
        history += [rng.randrange(50_000) for _ in range(rng.randrange(3, 11))]
        prompt_end = len(history) // BS * BS
        # Independent expectation (R8 then R23 deepest rule).
        limit = min((len(history) - 1) // BS * BS, published)
        expected = max((c for c in saved_boundaries if c <= limit), default=0)
        seq = kvpool.Sequence(history)
        # Prefill in two chunks so the first one ends on the prompt's last boundary.
        assert pool.allocate(seq, max(prompt_end, 1))
        assert seq.num_cached_tokens == expected, f"turn {turn}"
        query_tokens += (len(history) - 1) // BS * BS
        hit_tokens += expected
        if turn > 0:
            assert expected > 0
        steps = []

        def step(seq):
            # The engine runs each step's plan before the next forward step (R24; a save left
            # untaken past its boundary is dropped as stale, F6).
            pool.cache(seq)
            pool.commit_linear_state_plan(pool.take_linear_state_plan())

        seq.num_computed_tokens = max(prompt_end, seq.num_computed_tokens)
        steps.append(seq.num_computed_tokens)
        step(seq)
        assert pool.allocate(seq)
        seq.num_computed_tokens = len(seq)
        step(seq)
        for _ in range(rng.randrange(5, 30)):  # decode
            seq.append_token(rng.randrange(50_000))
            assert pool.may_append(seq)
            seq.num_computed_tokens = len(seq) - 1
            step(seq)
            steps.append(seq.num_computed_tokens)
        for c in steps:
            if c % BS == 0 and (c % 16 == 0 or c == prompt_end) and c > 0:
                saved_boundaries.add(c)
        history = seq.token_ids
        published = seq.num_computed_tokens // BS * BS
        pool.deallocate(seq)
        pool.check()
    stats = pool.stats()
    hit_rate = hit_tokens / query_tokens
    print(f"multi-turn hybrid hit rate: {hit_rate:.3f} ({hit_tokens}/{query_tokens} tokens)")
    assert hit_rate > 0
    assert stats["prefix_hit_tokens"] == hit_tokens
    assert stats["prefix_query_tokens"] == query_tokens
    assert stats["linear_state_hits"] == 5


def test_r29_pool_linear_state_api_errors():
    plain = kvpool.BlockManagerPool(16, BS)
    with pytest.raises(ValueError, match="dp_rank"):
        plain.linear_state_cache(0)
    pool = kvpool.BlockManagerPool(16, BS, linear_state_slots=4)
    with pytest.raises(ValueError, match="dp_rank"):
        pool.linear_state_cache(1)
    with pytest.raises(TypeError, match="plan"):
        pool.commit_linear_state_plan(object())
    with pytest.raises(ValueError, match="plan"):
        pool.commit_linear_state_plan(plain.take_linear_state_plan())
    with pytest.raises(ValueError, match="linear_state_save"):
        kvpool.BlockManagerPool(16, BS, linear_state_slots=4, linear_state_save="move")


# --- sliding window (R25) ----------------------------------------------------------------------


def test_r25_seed_window_example():
    pool = kvpool.BlockManagerPool(64, BS, sliding_window=8, swa_num_blocks=16)
    assert pool.num_groups == 2
    seq = kvpool.Sequence(list(range(20)))
    assert pool.allocate(seq)
    window = seq.group_block_table(1)
    assert window.dtype == np.int32 and len(window) == 5 and (window != 0).all()
    seq.num_computed_tokens = 20
    seq.append_token(20)
    assert pool.may_append(seq)
    window = seq.group_block_table(1)
    assert window[:3].tolist() == [0, 0, 0]
    assert (window[3:] != 0).all()
    assert len(seq.group_block_table(0)) == 6 and (seq.group_block_table(0) != 0).all()
    assert np.array_equal(seq.group_block_table(0), seq.block_table)
    stats = pool.stats()["window"]
    assert stats["num_free_blocks"] == 15 - 3, "the 3 released ids are free again"
    assert stats["num_releases"] == 3
    tables = pool.block_tables([seq], group=1)
    assert tables.tolist() == [window.tolist()]
    slots = pool.slot_mapping([seq], group=1)
    assert slots.tolist() == [int(window[5]) * BS]
    pool.check()
    pool.deallocate(seq)
    window = pool.stats()["window"]
    # The published blocks still in the window (entries 3, 4) are kept for a follow-up turn.
    assert (window["num_free_blocks"], window["num_cached_blocks"]) == (13, 2)
    pool.reset_prefix_cache()
    assert pool.stats()["window"]["num_free_blocks"] == 15


def test_r25_window_hit_only_while_window_blocks_are_held_or_kept():
    pool = kvpool.BlockManagerPool(128, BS, sliding_window=8)
    prompt = list(range(33))
    a = kvpool.Sequence(prompt)
    assert pool.allocate(a)
    a.num_computed_tokens = 33
    pool.cache(a)
    b = kvpool.Sequence(prompt)
    assert pool.allocate(b)
    assert b.num_cached_tokens == 32, "a still holds the window blocks 6, 7"
    assert b.group_block_table(1).tolist()[:6] == [0] * 6
    pool.deallocate(a)
    pool.deallocate(b)
    c = kvpool.Sequence(prompt)
    assert pool.allocate(c)
    assert c.num_cached_tokens == 32, "the finished window tail is kept"
    pool.deallocate(c)
    pool.check()
    # (Without the kept tail a hit would need released window blocks: none. The Rust test
    # window_hits_only_while_the_window_is_held_or_kept evicts the tail alone to show it.)


def test_r25_multi_turn_chat_with_a_window_rehits_the_previous_turn():
    pool = kvpool.BlockManagerPool(512, BS, sliding_window=16, swa_num_blocks=64)
    history = list(range(21))
    hits = []
    for turn in range(5):
        history = history + [900 + turn] * 5
        seq = kvpool.Sequence(history)
        assert pool.allocate(seq)
        hits.append(seq.num_cached_tokens)
        seq.num_computed_tokens = len(seq)
        pool.cache(seq)
        for _ in range(7):
            seq.append_token(7)
            assert pool.may_append(seq)
            seq.num_computed_tokens = len(seq) - 1
            pool.cache(seq)
        history = seq.token_ids
        pool.deallocate(seq)
        pool.check()
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    assert pool.stats()["window"]["num_used_blocks"] == 0


def test_r25_window_group_exhaustion_is_all_or_nothing():
    pool = kvpool.BlockManagerPool(64, BS, sliding_window=8, swa_num_blocks=4)
    a = kvpool.Sequence(list(range(12)))
    assert pool.allocate(a)
    b = kvpool.Sequence(list(range(100, 108)))
    before = pool.stats()
    assert not pool.can_allocate(b) and not pool.allocate(b)
    assert pool.stats() == before
    # With 12 computed, block 0 is behind the window: appending reuses its id (R25).
    a.num_computed_tokens = 12
    a.append_token(1)
    assert pool.can_append(a) and pool.may_append(a)
    assert a.group_block_table(1).tolist()[0] == 0
    assert pool.stats()["window"]["num_free_blocks"] == 0
    assert not pool.allocate(b, 4)
    pool.deallocate(a)
    assert pool.allocate(b, 4)
    pool.check()


def test_r29_window_bad_input():
    with pytest.raises(ValueError, match="sliding_window"):
        kvpool.BlockManagerPool(64, BS, sliding_window=0)
    with pytest.raises(ValueError, match="swa_num_blocks"):
        kvpool.BlockManagerPool(64, BS, swa_num_blocks=8)
    with pytest.raises(ValueError, match="swa_num_blocks"):
        kvpool.BlockManagerPool(64, BS, sliding_window=8, swa_num_blocks=1)
    pool = kvpool.BlockManagerPool(64, BS)
    seq = kvpool.Sequence([1, 2, 3])
    assert pool.allocate(seq)
    with pytest.raises(ValueError, match="group"):
        pool.block_tables([seq], group=1)
    with pytest.raises(ValueError, match="group"):
        seq.group_block_table(1)
    with pytest.raises(ValueError, match="group"):
        pool.slot_mapping([seq], group=-1)


def test_r25_sliding_window_and_composite_managers():
    swa = kvpool.SlidingWindowBlockManager(8, BS, 8)
    assert swa.window == 8 and swa.first_needed_block(20) == 3 and swa.first_needed_block(3) == 0
    blocks = swa.allocate(3)
    assert swa.num_free_blocks == 4
    swa.deallocate(blocks)
    assert swa.num_free_blocks == 7
    swa.check()
    comp = kvpool.CompositeBlockManager([(16, 4, None), (8, 8, 32)])
    assert comp.num_groups == 2 and comp.window(0) is None and comp.window(1) == 32
    assert comp.block_size(1) == 8
    full, win = comp.allocate(0, 3), comp.allocate(1, 2)
    assert comp.counts(0)["num_used_blocks"] == 3 and comp.counts(1)["num_used_blocks"] == 2
    comp.deallocate(full + win)
    assert comp.counts(1)["num_free_blocks"] == 7
    with pytest.raises(ValueError, match="group"):
        comp.allocate(2, 1)
    with pytest.raises(TypeError, match="groups"):
        kvpool.CompositeBlockManager([1, 2])
    with pytest.raises(kvpool.OutOfBlocksError):
        comp.allocate(1, 8)
    comp.check()


# --- random hybrid workloads (R2, R20 check after every step) ----------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"linear_state_slots": 16, "checkpoint_interval": 8},
        {"linear_state_slots": 12, "linear_state_save": "promote", "dp_size": 2},
        {"linear_state_slots": 16, "linear_state_match": "contiguous"},
        {"sliding_window": 8, "swa_num_blocks": 20},
        {"sliding_window": 5, "linear_state_slots": 16, "checkpoint_interval": 8, "dp_size": 2},
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_hybrid_workload_check_every_step(options, seed):
    rng = random.Random(seed)
    pool = kvpool.BlockManagerPool(64, BS, **options)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    running: list[kvpool.Sequence] = []
    preempted: list[kvpool.Sequence] = []
    plans = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            if preempted and rng.random() < 0.5:
                seq = preempted.pop()  # recompute preemption: re-hits its own prefix
            else:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(1000) for _ in range(rng.randrange(1, 12))
                ]
                seq = kvpool.Sequence(tokens)
            n = rng.choice([None, max(1, len(seq) // 2)])  # seq: a preempted one is not tokens
            can = pool.can_allocate(seq, n)
            before = pool.stats()
            ok = pool.allocate(seq, n)
            assert can == ok
            if ok:
                running.append(seq)
            else:
                assert pool.stats() == before
        elif op < 0.75 and running:
            seq = rng.choice(running)
            held = len(seq.block_table) * BS
            prompt_end = seq.num_prompt_tokens // BS * BS  # engines end a chunk there (R24)
            target = prompt_end if seq.num_computed_tokens < prompt_end else len(seq)
            seq.num_computed_tokens = max(seq.num_computed_tokens, min(target, held))
            pool.cache(seq)
            if seq.num_computed_tokens == len(seq):
                seq.append_token(rng.randrange(1000))
            if not pool.may_append(seq):
                running.remove(seq)
                pool.deallocate(seq)
            elif rng.random() < 0.6:  # the worker runs this step's copies
                pool.commit_linear_state_plan(pool.take_linear_state_plan())
        elif op < 0.85 and running:
            seq = running.pop(rng.randrange(len(running)))
            pool.deallocate(seq)
            if rng.random() < 0.5:
                preempted.append(seq)
        elif op < 0.97:
            plans.append(pool.take_linear_state_plan())
            if rng.random() < 0.7:
                for plan in plans:
                    pool.commit_linear_state_plan(plan)
                plans.clear()
        else:
            pool.reset_prefix_cache()
        pool.check()
    for seq in running:
        pool.deallocate(seq)
    plans.append(pool.take_linear_state_plan())
    for plan in plans:
        pool.commit_linear_state_plan(plan)
    hits = pool.stats()
    if options.get("linear_state_slots") and "linear_state_match" not in options:
        assert hits["linear_state_hits"] > 0, "the workload must exercise restores"
    elif "sliding_window" in options:
        assert hits["prefix_hit_tokens"] > 0, "the workload must exercise window sharing"
    pool.reset_prefix_cache()
    pool.check()
    stats = pool.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "every id back exactly once"
    assert stats["num_live_slots"] == 0 and stats["num_pending_checkpoints"] == 0
    if stats["window"] is not None:
        assert stats["window"]["num_free_blocks"] == stats["window"]["num_total_blocks"]


def test_c1_a_reset_forgets_the_saved_boundary():
    """docs/contract.md (R24's choices, C1): after reset_prefix_cache dropped a committed
    checkpoint, cache() at the boundary the sequence stands at saves it again; without a reset
    a boundary is saved once."""
    p = kvpool.BlockManagerPool(32, BS, linear_state_slots=4, checkpoint_interval=4)
    view = p.linear_state_cache(0)
    a = kvpool.Sequence(list(range(10)))
    assert p.allocate(a)
    a.num_computed_tokens = 8
    p.cache(a)
    plan = p.take_linear_state_plan()
    assert plan.save_hashes == [kvpool.hash_blocks(list(range(8)), BS)[1]]
    p.commit_linear_state_plan(plan)
    p.cache(a)  # the same boundary again: saved already
    plan = p.take_linear_state_plan()
    assert len(plan.save_dst) == 0
    p.commit_linear_state_plan(plan)
    view.evict(1)  # an LRU eviction is not undone by the same sequence
    p.cache(a)
    plan = p.take_linear_state_plan()
    assert len(plan.save_dst) == 0
    p.commit_linear_state_plan(plan)
    a2 = kvpool.Sequence(list(range(10)))
    assert p.allocate(a2)
    a2.num_computed_tokens = 8
    p.cache(a2)  # another sequence at the same boundary saves it
    plan = p.take_linear_state_plan()
    assert len(plan.save_dst) == 1
    p.commit_linear_state_plan(plan)
    p.deallocate(a2)
    p.reset_prefix_cache()
    assert view.num_committed_checkpoints == 0
    p.cache(a)  # the reset forgot it: the boundary is unsaved again
    plan = p.take_linear_state_plan()
    assert plan.save_hashes == [kvpool.hash_blocks(list(range(8)), BS)[1]], "C1: saved again"
    p.commit_linear_state_plan(plan)
    p.cache(a)
    plan = p.take_linear_state_plan()
    assert len(plan.save_dst) == 0, "and once only"
    p.commit_linear_state_plan(plan)
    p.deallocate(a)
    b = kvpool.Sequence(list(range(8)) + [50, 51])
    assert p.allocate(b) and b.num_cached_tokens == 8, "the new checkpoint restores"
    p.check()
