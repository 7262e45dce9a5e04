"""Plan once: ``pool.plan(seq)`` decides an allocation with no side effect of any
kind, ``allocate(seq, plan=plan)`` carries it out walking the prefix chain once per tier (R14,
R15), and xLLM's fourth KVCacheManager method, ``allocate_shared(seq)``."""

from __future__ import annotations

import kvpool
import pytest

BS = 4


def _computed(pool, tokens):
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    seq.num_computed_tokens = len(seq)
    pool.cache(seq)
    return seq


def test_plan_says_what_allocate_will_do():
    pool = kvpool.BlockManagerPool(64, BS, dp_size=2)
    a = _computed(pool, list(range(33)))
    seq = kvpool.Sequence(list(range(40)))
    plan = pool.plan(seq)
    assert isinstance(plan, kvpool.AllocationPlan)
    assert plan.dp_rank != a.dp_rank, "R13: the other rank has more blocks available"
    assert plan.num_cached_blocks == 0
    b = kvpool.Sequence(list(range(40)))
    pool2 = kvpool.BlockManagerPool(64, BS)
    _computed(pool2, list(range(33)))
    plan = pool2.plan(b)
    assert (plan.num_cached_blocks, plan.num_cached_tokens) == (8, 32)
    assert (plan.device_hit_tokens, plan.host_hit_tokens, plan.remote_hit_tokens) == (32, 0, 0)
    assert plan.num_new_blocks == 2 and plan.num_blocks == 10 and plan.num_tokens == 40
    assert plan.restore_checkpoint is None and not plan.is_growth and plan.dp_rank == 0
    assert pool2.allocate(b, plan=plan)
    assert b.num_cached_tokens == 32 and b.dp_rank == plan.dp_rank
    grow = pool2.plan(b)
    assert grow.is_growth and grow.num_new_blocks == 0 and grow.num_cached_tokens == 0
    pool.check()
    pool2.check()


def test_r15_plan_is_none_exactly_when_allocate_fails():
    pool = kvpool.BlockManagerPool(5, BS)
    big = kvpool.Sequence(list(range(20)))
    assert pool.plan(big) is None and not pool.can_allocate(big)
    assert not pool.allocate(big)
    small = kvpool.Sequence(list(range(16)))
    assert pool.plan(small) is not None and pool.allocate(small)


def test_one_chain_walk_per_admission():
    pool = kvpool.BlockManagerPool(64, BS)
    _computed(pool, list(range(33)))
    seq = kvpool.Sequence(list(range(40)))
    before = pool.debug_counters()["device_chain_walks"]
    plan = pool.plan(seq)
    assert pool.allocate(seq, plan=plan)
    assert pool.debug_counters()["device_chain_walks"] - before == 1, "plan + allocate(plan=)"
    other = kvpool.Sequence(list(range(40)))
    before = pool.debug_counters()["device_chain_walks"]
    assert pool.allocate(other)
    assert pool.debug_counters()["device_chain_walks"] - before == 1, "allocate alone"


def test_one_walk_per_tier_with_a_host_tier():
    pool = kvpool.HierarchyBlockManagerPool(12, 32, BS)
    first = _computed(pool, list(range(21)))
    pool.deallocate(first)
    pool.complete_offloads(pool.take_offload_plans())
    filler = kvpool.Sequence(list(range(9000, 9000 + 11 * BS)))
    assert pool.allocate(filler)  # evicts the device copies
    pool.deallocate(filler)
    seq = kvpool.Sequence(list(range(21)))
    before = pool.debug_counters()
    plan = pool.plan(seq)
    assert (plan.device_hit_tokens, plan.host_hit_tokens) == (0, 20)
    assert pool.allocate(seq, plan=plan)
    after = pool.debug_counters()
    assert after["device_chain_walks"] - before["device_chain_walks"] == 1
    assert after["host_chain_walks"] - before["host_chain_walks"] == 1
    assert seq.num_cached_tokens == 0, "R26: counted once the load is confirmed"
    pool.complete_loads(pool.take_load_plans())
    assert seq.num_cached_tokens == 20


def _snapshot(pool, seqs):
    views = []
    for rank in range(pool.dp_size):
        lsc = pool.linear_state_cache(rank)
        views.append((lsc.lru_order(), lsc.stats(), lsc.num_free_slots, lsc.num_pinned_checkpoints))
    seq_state = [
        (
            s.block_table.tolist(),
            s.num_cached_tokens,
            s.num_computed_tokens,
            s.dp_rank,
            s.is_allocated,
            s.linear_state_slot,
        )
        for s in seqs
    ]
    return pool.stats(), views, seq_state


@pytest.mark.parametrize("host", [False, True])
def test_plan_has_no_side_effect_of_any_kind(host):
    options = dict(linear_state_slots=6, checkpoint_interval=8, dp_size=2, enable_events=True)
    pool = (
        kvpool.HierarchyBlockManagerPool(24, 32, BS, **options)
        if host
        else kvpool.BlockManagerPool(24, BS, **options)
    )
    first = kvpool.Sequence(list(range(22)))
    assert pool.allocate(first)
    for n in (8, 16, 22):
        first.num_computed_tokens = n
        pool.cache(first)
        pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.deallocate(first)
    if host:
        pool.complete_offloads(pool.take_offload_plans())
    pool.drain_events()
    seq = kvpool.Sequence(list(range(22)) + [99])
    before = _snapshot(pool, [seq, first])
    plan = pool.plan(seq)
    again = pool.plan(seq, 10)
    assert plan is not None and again is not None
    assert plan.restore_checkpoint == kvpool.hash_blocks(list(range(16)), BS)[-1], "R23"
    assert _snapshot(pool, [seq, first]) == before, "no side effect"
    assert pool.drain_events() == [] and len(pool.take_linear_state_plan()) == 0
    if host:
        assert pool.take_load_plans() == [] and pool.take_offload_plans() == []
    pool.check()
    assert pool.allocate(seq, plan=pool.plan(seq)) and seq.num_cached_tokens == 16
    pool.check()


def test_a_stale_or_foreign_plan_is_planned_again():
    pool = kvpool.BlockManagerPool(64, BS)
    _computed(pool, list(range(33)))
    a, b = kvpool.Sequence(list(range(40))), kvpool.Sequence(list(range(500, 540)))
    plan_a = pool.plan(a)
    assert pool.allocate(b, plan=plan_a), "another sequence's plan is not used for this one"
    assert b.num_cached_tokens == 0
    assert pool.allocate(a, plan=plan_a), "stale: planned again"
    assert a.num_cached_tokens == 32
    other = kvpool.BlockManagerPool(64, BS)
    c = kvpool.Sequence(list(range(40)))
    assert other.allocate(c, plan=pool.plan(kvpool.Sequence(list(range(40)))))
    assert c.num_cached_tokens == 0, "a plan of another pool names nothing of this one"
    with pytest.raises(TypeError, match="plan"):
        pool.allocate(kvpool.Sequence([1, 2]), plan="yes")
    other.check()
    pool.check()


def test_allocate_shared_takes_the_hit_and_allocate_grows_it():
    pool = kvpool.BlockManagerPool(16, BS, linear_state_slots=4)
    first = kvpool.Sequence(list(range(17)))
    assert pool.allocate(first)
    first.num_computed_tokens = 16
    pool.cache(first)  # R24: the prompt's last block boundary gets a checkpoint
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.deallocate(first)
    seq = kvpool.Sequence(list(range(17)))
    free = pool.stats()["num_free_blocks"]
    assert pool.allocate_shared(seq)
    assert len(seq.block_table) == 4 and pool.stats()["num_free_blocks"] == free, "no new block"
    assert seq.single_block_id is not None and seq.linear_state_slot is not None
    assert seq.num_computed_tokens == 16 and seq.linear_state_restore_slot is not None
    with pytest.raises(ValueError, match="seq"):
        pool.allocate_shared(seq)
    assert pool.allocate(seq) and len(seq.block_table) == 5
    pool.deallocate(seq)
    nothing = kvpool.Sequence([7, 8, 9])
    assert pool.allocate_shared(nothing) and len(nothing.block_table) == 0
    pool.check()
    pool.deallocate(nothing)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.check()
