"""Linear-state rules an engine relies on (R22-R24; docs/contract.md "Choice: linear-state
plans"), found while putting a Gated DeltaNet model's state in kvpool's slots:

- a live slot taken without a restore is zeroed by the worker: the plan lists it
  (``zero_slots``), since a recycled slot holds an earlier sequence's state;
- ``next_checkpoint_boundary(seq)`` says where a prefill chunk must end for its boundary to be
  saved; a chunk that passes a boundary without ending on it saves nothing there;
- ``linear_state_match="contiguous"`` needs ``checkpoint_interval == block_size``.
"""

from __future__ import annotations

import kvpool
import kvpool.kernels
import numpy as np
import pytest
from conftest import raises_bad_arg

BS = 4


def run_plan(pool, state):
    """A worker: zeros, then restores, then saves (R24), then the confirmation."""
    plan = pool.take_linear_state_plan()
    state[plan.zero_slots] = 0
    if len(plan.restore_src):
        kvpool.kernels.copy_linear_state(state, plan.restore_src, plan.restore_dst, backend="numpy")
    if len(plan.save_src):
        kvpool.kernels.copy_linear_state(state, plan.save_src, plan.save_dst, backend="numpy")
    pool.commit_linear_state_plan(plan)
    return plan


def test_r24_a_fresh_live_slot_is_zeroed_by_the_plan_and_a_recycled_one_needs_it():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=3)  # two usable slots
    state = np.zeros((3, 5), np.float32)
    a = kvpool.Sequence(list(range(10)))
    assert pool.allocate(a)
    plan = run_plan(pool, state)
    assert plan.zero_slots.tolist() == [a.linear_state_slot] and plan.zero_dp_rank.tolist() == [0]
    assert len(plan) == 1 and plan
    slot = a.linear_state_slot
    state[slot] = 7.0  # the forward steps of `a` write its state
    pool.deallocate(a)
    b = kvpool.Sequence(list(range(50, 57)))  # no prefix in common: no restore
    assert pool.allocate(b)
    assert b.linear_state_restore_slot is None
    if b.linear_state_slot == slot:
        assert (state[slot] == 7.0).all(), "the recycled slot holds a's state until zeroed"
    run_plan(pool, state)
    assert (state[b.linear_state_slot] == 0).all()
    pool.check()


def test_r24_a_restore_is_not_zeroed_and_a_release_before_the_take_drops_the_zero():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=8, checkpoint_interval=8)
    tokens = list(range(12))
    a = kvpool.Sequence(tokens)
    assert pool.allocate(a)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    a.num_computed_tokens = 8
    pool.cache(a)  # plans the save of boundary 8
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.deallocate(a)
    b = kvpool.Sequence(tokens)
    assert pool.allocate(b) and b.linear_state_restore_slot is not None
    plan = pool.take_linear_state_plan()
    assert plan.zero_slots.size == 0 and plan.restore_dst.tolist() == [b.linear_state_slot]
    pool.commit_linear_state_plan(plan)
    c = kvpool.Sequence(list(range(100, 105)))
    assert pool.allocate(c)
    pool.deallocate(c)  # released before any plan was taken: nothing to zero
    plan = pool.take_linear_state_plan()
    assert plan.zero_slots.size == 0 and len(plan) == 0 and not plan
    pool.commit_linear_state_plan(plan)
    pool.check()


def test_r24_next_checkpoint_boundary():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=8, checkpoint_interval=8)
    seq = kvpool.Sequence(list(range(22)))  # the prompt's last block boundary: 20
    assert pool.next_checkpoint_boundary(seq) == 8, "before allocation: from 0"
    assert pool.allocate(seq)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    expected = {0: 8, 3: 8, 8: 16, 15: 16, 16: 20, 20: None, 21: None}
    for computed, boundary in expected.items():
        seq.num_computed_tokens = computed
        assert pool.next_checkpoint_boundary(seq) == boundary, computed
    seq.append_tokens(list(range(22, 40)))
    assert pool.next_checkpoint_boundary(seq) == 24, "decode: the next multiple of 8"
    plain = kvpool.BlockManagerPool(64, BS)
    assert plain.next_checkpoint_boundary(kvpool.Sequence(list(range(30)))) is None
    raises_bad_arg("seq", plain.next_checkpoint_boundary, seq)  # of another pool
    with pytest.raises(TypeError):
        pool.next_checkpoint_boundary([1, 2, 3])
    no_interval = kvpool.BlockManagerPool(64, BS, linear_state_slots=8)
    assert no_interval.next_checkpoint_boundary(kvpool.Sequence(list(range(22)))) == 20


@pytest.mark.parametrize("ends_on_boundary", [True, False])
def test_r24_a_chunk_that_passes_a_boundary_saves_nothing_there(ends_on_boundary):
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=8, checkpoint_interval=8)
    tokens = list(range(30))
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    chunks = [8, 4] if ends_on_boundary else [12]
    saves = 0
    for n in chunks:  # each chunk: a forward step, then its plan runs before the next one
        seq.num_computed_tokens += n
        pool.cache(seq)
        plan = pool.take_linear_state_plan()
        saves += len(plan.save_src)
        pool.commit_linear_state_plan(plan)
    assert saves == (1 if ends_on_boundary else 0)
    pool.deallocate(seq)
    probe = kvpool.Sequence(tokens)
    assert pool.allocate(probe)
    assert probe.num_cached_tokens == (8 if ends_on_boundary else 0)
    pool.check()


def test_r24_chunks_sized_by_next_checkpoint_boundary_save_every_boundary():
    pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=16, checkpoint_interval=8)
    tokens = list(range(45))  # prompt boundary 44
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq, num_new_tokens=13)
    saved = []
    while seq.num_computed_tokens < len(seq) - 1:
        c = seq.num_computed_tokens
        n = min(13, len(seq) - 1 - c)
        b = pool.next_checkpoint_boundary(seq)
        if b is not None and b < c + n:
            n = b - c
        assert pool.allocate(seq, num_new_tokens=n)
        seq.num_computed_tokens = c + n
        pool.cache(seq)
        plan = pool.take_linear_state_plan()
        saved += [seq.num_computed_tokens] * len(plan.save_src)
        pool.commit_linear_state_plan(plan)
    assert saved == [8, 16, 24, 32, 40, 44]
    pool.check()


def test_r23_contiguous_needs_a_checkpoint_at_every_block():
    for interval in (8, 12, 64):
        raises_bad_arg(
            "checkpoint_interval",
            kvpool.BlockManagerPool,
            64,
            BS,
            linear_state_slots=8,
            checkpoint_interval=interval,
            linear_state_match="contiguous",
        )
    pool = kvpool.BlockManagerPool(
        64, BS, linear_state_slots=16, checkpoint_interval=BS, linear_state_match="contiguous"
    )
    kvpool.BlockManagerPool(64, BS, linear_state_slots=8, checkpoint_interval=8)  # deepest: fine
    tokens = list(range(14))
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    pool.commit_linear_state_plan(pool.take_linear_state_plan())
    for _ in range(3):
        seq.num_computed_tokens += BS
        pool.cache(seq)
        pool.commit_linear_state_plan(pool.take_linear_state_plan())
    pool.deallocate(seq)
    again = kvpool.Sequence(tokens)
    assert pool.allocate(again) and again.num_cached_tokens == 12
    pool.check()


def _prefill(pool, seq, state):
    """An engine's prefill: chunks end at the pool's checkpoint boundaries; returns the
    computed-token counts where a save was planned."""
    saved = []
    run_plan(pool, state)  # the admission's restore or zero
    while (end := pool.next_checkpoint_boundary(seq)) is not None:
        seq.num_computed_tokens = end
        pool.cache(seq)
        saved += [end] * len(run_plan(pool, state).save_src)
    seq.num_computed_tokens = len(seq)
    pool.cache(seq)
    run_plan(pool, state)
    return saved


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_junction_is_saved_and_restored(tier):
    """R24's junction save: a prompt whose KV hit reaches past its restored checkpoint saves the
    state where it left the cached chains, so the next prompt of that prefix restores there
    instead of at the grid below it."""
    if tier == "host":
        pool = kvpool.HierarchyBlockManagerPool(
            64, 64, BS, linear_state_slots=12, checkpoint_interval=16
        )
    else:
        pool = kvpool.BlockManagerPool(64, BS, linear_state_slots=12, checkpoint_interval=16)
    state = np.zeros((12, 3), np.float32)
    shared = list(range(1000, 1040))  # 10 blocks: the grid saves at 16 and 32 only
    first = kvpool.Sequence(shared + list(range(8)))
    assert pool.allocate(first) and first.num_cached_tokens == 0
    assert _prefill(pool, first, state) == [16, 32, 48]
    pool.deallocate(first)
    second = kvpool.Sequence(shared + list(range(100, 108)))
    assert pool.allocate(second)
    assert second.num_cached_tokens == 32, "the grid: the checkpoint at 32, the KV reaches 40"
    assert pool.next_checkpoint_boundary(second) == 40, "the junction comes first"
    assert _prefill(pool, second, state) == [40, 48]
    pool.deallocate(second)
    third = kvpool.Sequence(shared + list(range(200, 208)))
    assert pool.allocate(third)
    assert third.num_cached_tokens == 40, "restored at the junction"
    assert third.linear_state_restore_slot is not None
    pool.deallocate(third)
    pool.check()
