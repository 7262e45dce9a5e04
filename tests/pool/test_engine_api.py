"""The engine-shaped API: plan() as nano-vllm's can_allocate / vLLM's
get_computed_blocks, a subclassed Sequence with its own attributes, block ids without copying
the table, block_tables(pad=) and slot_mapping(num_tokens=) for chunked prefill (R14, R15, R19).
"""

from __future__ import annotations

import kvpool
import pytest

PROMPT = list(range(100, 112))  # three blocks of 4


class EngineSequence(kvpool.Sequence):
    """An engine's own sequence class: its own constructor and attributes, no twin."""

    def __init__(self, token_ids, sampling_params, *, seq_id=None):
        self.sampling_params = sampling_params
        self.status = "waiting"


def test_subclassed_sequence_carries_its_own_attributes():
    seq = EngineSequence(PROMPT + [1], {"temperature": 0.5}, seq_id=42)
    assert isinstance(seq, kvpool.Sequence)
    assert seq.seq_id == 42 and len(seq) == 13
    assert seq.sampling_params == {"temperature": 0.5} and seq.status == "waiting"
    pool = kvpool.BlockManagerPool(32, 4)
    assert pool.allocate(seq)
    seq.status = "running"
    seq.append_token(7)  # R16: append first, then may_append
    assert pool.may_append(seq)
    assert pool.block_tables([seq]).shape == (1, 4)
    pool.deallocate(seq)
    pool.check()


def test_a_plain_sequence_takes_attributes_but_no_extra_arguments():
    seq = kvpool.Sequence([1, 2])
    seq.request = "r1"
    assert seq.request == "r1"
    with pytest.raises(TypeError):
        kvpool.Sequence([1, 2], "extra")
    with pytest.raises(TypeError):
        kvpool.Sequence([1, 2], bogus=1)


def test_plan_reports_the_hit_before_committing_and_changes_nothing():
    pool = kvpool.BlockManagerPool(32, 4)
    first = kvpool.Sequence(PROMPT + [1])
    pool.allocate(first)
    first.num_computed_tokens = len(first)
    pool.deallocate(first)
    before = pool.stats()
    seq = kvpool.Sequence(PROMPT + [2, 3])
    plan = pool.plan(seq)
    assert plan.num_cached_blocks == 3 and plan.num_cached_tokens == 12
    assert pool.stats() == before, "R15: no side effect (LRU, statistics)"
    assert not seq.is_allocated
    assert pool.allocate(seq, plan=plan)
    assert seq.num_cached_tokens == 12
    pool.check()


def test_block_id_access_without_copying_the_table():
    pool = kvpool.BlockManagerPool(32, 4)
    seq = kvpool.Sequence(PROMPT + [1])
    assert seq.last_block_id is None and seq.block_ids() == [] and seq.num_blocks == 0
    pool.allocate(seq)
    table = seq.block_table.tolist()
    assert seq.block_ids() == table and isinstance(seq.block_ids(), list)
    assert seq.num_blocks == 4
    assert seq.last_block_id == table[-1] == seq.block_id(-1)
    assert [seq.block_id(i) for i in range(4)] == table
    for bad in (4, -5):
        with pytest.raises(IndexError):
            seq.block_id(bad)
    with pytest.raises(TypeError):
        seq.block_id("0")
    for _ in range(4):
        seq.append_token(9)
    pool.may_append(seq)
    assert seq.last_block_id == seq.block_table[-1] != table[-1]


def test_block_tables_pad():
    pool = kvpool.BlockManagerPool(32, 4)
    a, b = kvpool.Sequence(PROMPT + [1]), kvpool.Sequence([1, 2])
    pool.allocate(a)
    pool.allocate(b)
    padded = pool.block_tables([a, b], pad=-1)
    assert padded[1].tolist() == b.block_ids() + [-1, -1, -1]
    assert pool.block_tables([a, b])[1].tolist() == b.block_ids() + [0, 0, 0], "R19: 0 default"
    assert padded[0].tolist() == a.block_ids()
    with pytest.raises(ValueError, match="pad"):
        pool.block_tables([a], pad=2**31)


def test_slot_mapping_per_sequence_count_for_chunked_prefill():
    pool = kvpool.BlockManagerPool(32, 4)
    a, b = kvpool.Sequence(PROMPT + [1]), kvpool.Sequence([5, 6, 7])
    pool.allocate(a)
    pool.allocate(b)
    a.num_computed_tokens = 2

    def slots(seq, start, end):
        return [seq.block_id(p // 4) * 4 + p % 4 for p in range(start, end)]

    got = pool.slot_mapping([a, b], num_tokens=[5, 1]).tolist()
    assert got == slots(a, 2, 7) + slots(b, 0, 1)
    assert pool.slot_mapping([a, b]).tolist() == slots(a, 2, 13) + slots(b, 0, 3)
    assert pool.slot_mapping([a], num_tokens=[0]).tolist() == []
    with pytest.raises(ValueError, match="num_tokens"):
        pool.slot_mapping([a], num_tokens=[12])  # past len(seq)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.slot_mapping([a, b], num_tokens=[1])  # one count per sequence
    # a chunked allocation: the table holds the chunk only
    c = kvpool.Sequence(list(range(300, 320)))
    pool.allocate(c, 8)
    assert pool.slot_mapping([c], num_tokens=[8]).tolist() == slots(c, 0, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.slot_mapping([c], num_tokens=[9])  # past what the table holds
