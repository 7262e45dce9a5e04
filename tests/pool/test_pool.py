"""kvpool.Sequence / kvpool.BlockManagerPool: rules R8, R13-R20.

Events (R21) are in test_events.py, bad input (R29) in test_bad_input.py and the model-based
test in test_pool_stateful.py.
"""

from __future__ import annotations

import random

import kvpool
import numpy as np
import pytest
from conftest import cdiv, seq_snapshot, slow_block_tables, slow_slot_mapping, toks


def table(seq) -> list[int]:
    return [int(x) for x in seq.block_table]


def rank_stats(pool, r=0) -> dict:
    return pool.stats()["ranks"][r]


def compute_all(seq) -> None:
    """The engine ran the forward step over every token the sequence has."""
    seq.num_computed_tokens = len(seq)


# ---------------------------------------------------------------------------------------------
# Sequence basics
# ---------------------------------------------------------------------------------------------


def test_sequence_basics():
    s = kvpool.Sequence(toks(5), seq_id=7)
    assert len(s) == 5
    assert list(s.token_ids) == toks(5)
    assert s.seq_id == 7
    assert s.dp_rank is None
    assert s.num_cached_tokens == 0
    assert s.num_computed_tokens == 0
    bt = s.block_table
    assert isinstance(bt, np.ndarray)
    assert bt.dtype == np.int32
    assert bt.shape == (0,)
    s.append_token(99)
    assert len(s) == 6 and list(s.token_ids)[-1] == 99
    s.append_tokens([100, 101])
    assert list(s.token_ids) == toks(5) + [99, 100, 101]
    s.append_tokens(np.array([5, 6], dtype=np.int64))
    assert len(s) == 10


def test_sequence_extend_to_appends_only_the_tail():
    """extend_to(tokens): the request's whole token list; only the items past len(seq) are read
    (an engine's growing list, synced per step without a slice)."""
    s = kvpool.Sequence(toks(5))
    whole = toks(5) + [99]
    s.extend_to(whole)
    assert list(s.token_ids) == whole
    s.extend_to(whole)  # nothing new: nothing appended
    assert len(s) == 6
    whole += [100, 101, 102]
    s.extend_to(whole)
    assert list(s.token_ids) == whole
    # the prefix is not read again: the sequence keeps its own tokens
    s.extend_to([7] * 9 + [103])
    assert list(s.token_ids) == whole + [103]
    s.extend_to(np.array(list(range(10)) + [5, 6], dtype=np.int64))  # any token container
    assert list(s.token_ids)[-2:] == [5, 6] and len(s) == 12


@pytest.mark.parametrize(
    "bad, error",
    [
        ([1, 2], ValueError),  # shorter than the sequence
        ([0] * 5 + [True], TypeError),  # a bool is not a token id (F10)
        ([0] * 5 + ["x"], TypeError),
        ([0] * 5 + [2**32], ValueError),
        ([0] * 5 + [-1], ValueError),
        ("abcdefg", TypeError),
    ],
)
def test_sequence_extend_to_bad_input_changes_nothing(bad, error):
    s = kvpool.Sequence(toks(5))
    with pytest.raises(error, match="token_ids"):
        s.extend_to(bad)
    assert list(s.token_ids) == toks(5)


def test_sequence_accepts_numpy_tokens():
    s = kvpool.Sequence(np.arange(9, dtype=np.int32))
    assert list(s.token_ids) == list(range(9))


@pytest.mark.parametrize(
    "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
def test_token_conversions_agree(dtype):
    """Every accepted form of token ids gives the same tokens: lists of ints (read through the
    fast path), lists of NumPy scalars, tuples, contiguous and strided arrays of every integer
    dtype (big-endian too); out of range is a ValueError, anything else a TypeError (R29); a
    bool is never a token id (F10: one rule for bools everywhere)."""
    values = [0, 5, 100, 127]
    array = np.array(values, dtype=dtype)
    swapped = array.astype(array.dtype.newbyteorder(">"))
    for form in (values, tuple(values), array, swapped, [dtype(v) for v in values]):
        assert kvpool.Sequence(form).token_ids == values
    assert kvpool.Sequence(np.repeat(np.array(values, dtype=dtype), 2)[::2]).token_ids == values
    assert kvpool.Sequence([2**32 - 1]).token_ids == [2**32 - 1]
    for bad in ([-1], [2**32], [2**70], np.array([2**32], np.int64), np.array([-1], np.int8)):
        with pytest.raises(ValueError, match="token_ids"):
            kvpool.Sequence(bad)
    for bad in (
        [1.5],
        ["a"],
        [1, None],
        "abc",
        b"ab",
        np.zeros((2, 2), np.int32),
        [np.float64(1)],
        [True, 5],
        (5, False),
    ):
        with pytest.raises(TypeError, match="token_ids"):
            kvpool.Sequence(bad)


# ---------------------------------------------------------------------------------------------
# Seed 003 end to end
# ---------------------------------------------------------------------------------------------


def test_seed003_scenario_end_to_end():
    bs = 4
    pool = kvpool.BlockManagerPool(16, bs)
    total = rank_stats(pool)["num_total_blocks"]
    assert total == 15
    assert pool.stats()["num_free_blocks"] == 15

    # A = 11 tokens -> 3 discrete ids, the last page has 1 free slot.
    a = kvpool.Sequence(toks(11))
    assert pool.can_allocate(a)
    assert pool.allocate(a)
    ta = table(a)
    assert len(ta) == 3
    assert len(set(ta)) == 3 and 0 not in ta
    assert a.dp_rank == 0
    assert len(ta) * bs - len(a) == 1
    assert a.num_cached_tokens == 0 and a.num_computed_tokens == 0
    sm = pool.slot_mapping([a])
    assert sm.dtype == np.int64
    assert sm.tolist() == [ta[p // bs] * bs + p % bs for p in range(11)]
    assert pool.stats()["num_used_blocks"] == 3

    # B = 4 tokens -> one full block; append the 5th -> needs a new block.
    b = kvpool.Sequence(toks(4, start=100))
    assert pool.allocate(b)
    assert len(table(b)) == 1
    b.append_token(104)
    free_before = pool.stats()["num_free_blocks"]
    stats_before = pool.stats()
    assert pool.can_append(b) is True
    assert pool.stats() == stats_before, "can_append has no side effect"
    assert len(table(b)) == 1
    tb_before = table(b)
    assert pool.may_append(b) is True
    tb = table(b)
    assert len(tb) == 2, "may_append adds one id"
    assert tb[0] == tb_before[0]
    assert tb[1] not in ta and tb[1] != 0
    assert pool.stats()["num_free_blocks"] == free_before - 1
    # 6 tokens: nothing needed
    b.append_token(105)
    free_before = pool.stats()["num_free_blocks"]
    assert pool.can_append(b)
    assert pool.may_append(b)
    assert len(table(b)) == 2
    assert pool.stats()["num_free_blocks"] == free_before

    # release A then B: the free count is restored (nothing computed, so nothing cached).
    pool.deallocate(a)
    assert pool.stats()["num_free_blocks"] == 15 - 2
    pool.deallocate(b)
    assert pool.stats()["num_free_blocks"] == 15
    assert pool.stats()["num_used_blocks"] == 0
    for s in (a, b):
        assert table(s) == []
        assert s.num_cached_tokens == 0 and s.num_computed_tokens == 0
        assert s.dp_rank == 0, "R18: dp rank kept"
    assert list(a.token_ids) == toks(11) and len(b) == 6, "R18: tokens kept"
    pool.check()


def test_seed003_shared_prefix_two_one_free():
    """Seed 003: a shared full prefix block is held by two sequences, then one, then cached/free."""
    bs = 4
    pool = kvpool.BlockManagerPool(16, bs)
    x = kvpool.Sequence(toks(9))
    assert pool.allocate(x)
    compute_all(x)
    pool.cache(x)
    y = kvpool.Sequence(toks(8) + [500, 501])
    assert pool.allocate(y)
    assert y.num_cached_tokens == 8
    assert y.num_computed_tokens == 8
    assert table(y)[:2] == table(x)[:2], "the prefix blocks are shared"
    assert table(y)[2] not in table(x)
    shared = set(table(x)[:2])
    used_ids = set(table(x)) | set(table(y))
    assert pool.stats()["num_used_blocks"] == len(used_ids) == 4
    pool.deallocate(x)  # ref 2 -> 1: the shared blocks stay with y
    assert pool.stats()["num_used_blocks"] == len(table(y)) == 3
    z = kvpool.Sequence(toks(8, start=900))
    assert pool.allocate(z)
    assert not set(table(z)) & shared, "held shared blocks are not handed out"
    pool.deallocate(z)
    pool.deallocate(y)  # ref 1 -> 0 sequences: only the cache holds them now
    st = pool.stats()
    assert st["num_used_blocks"] == 0
    assert st["num_cached_blocks"] >= 2
    assert st["num_free_blocks"] + st["num_cached_blocks"] == 15
    pool.reset_prefix_cache()
    assert pool.stats()["num_free_blocks"] == 15
    pool.check()


def test_seed003_without_prefix_cache_free_count_restored():
    pool = kvpool.BlockManagerPool(16, 4, enable_prefix_cache=False)
    a = kvpool.Sequence(toks(11))
    assert pool.allocate(a)
    compute_all(a)
    pool.cache(a)
    b = kvpool.Sequence(toks(11))
    assert pool.allocate(b)
    assert b.num_cached_tokens == 0
    assert not set(table(a)) & set(table(b))
    pool.deallocate(a)
    pool.deallocate(b)
    st = pool.stats()
    assert st["num_free_blocks"] == 15 and st["num_cached_blocks"] == 0
    pool.check()


def test_r16_can_append_false_when_no_block_and_may_append_changes_nothing():
    pool = kvpool.BlockManagerPool(5, 4)  # 4 ids
    a = kvpool.Sequence(toks(4))
    b = kvpool.Sequence(toks(12, start=50))
    assert pool.allocate(a) and pool.allocate(b)
    assert pool.stats()["num_free_blocks"] == 0
    a.append_token(7)
    assert pool.can_append(a) is False
    before = (pool.stats(), seq_snapshot(a))
    assert pool.may_append(a) is False
    assert (pool.stats(), seq_snapshot(a)) == before
    pool.deallocate(b)
    assert pool.can_append(a) and pool.may_append(a)
    assert len(table(a)) == 2
    pool.check()


def test_r16_lookahead():
    pool = kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(toks(4))
    assert pool.allocate(s)
    assert pool.can_append(s, lookahead=0)
    assert pool.may_append(s, lookahead=0)
    assert len(table(s)) == 1, "4 tokens fit in one block"
    assert pool.may_append(s, lookahead=5)
    assert len(table(s)) == cdiv(4 + 5, 4) == 3
    assert pool.may_append(s, lookahead=1)
    assert len(table(s)) == 3, "the table never shrinks"
    pool.check()


def test_r16_may_append_all_or_nothing_for_several_blocks():
    pool = kvpool.BlockManagerPool(5, 4)  # 4 ids
    s = kvpool.Sequence(toks(4))
    assert pool.allocate(s)
    before = (pool.stats(), seq_snapshot(s))
    assert pool.can_append(s, lookahead=16) is False  # needs 4 more, 3 left
    assert pool.may_append(s, lookahead=16) is False
    assert (pool.stats(), seq_snapshot(s)) == before
    assert pool.may_append(s, lookahead=12)
    assert len(table(s)) == 4
    pool.check()


# ---------------------------------------------------------------------------------------------
# R8: a match never covers the whole sequence
# ---------------------------------------------------------------------------------------------


def _cached_prefix(pool, tokens, extra_key=None):
    """Run a sequence to completion: its computed full blocks end up cached. Returns its ids."""
    s = kvpool.Sequence(tokens, extra_key=extra_key)
    assert pool.allocate(s)
    compute_all(s)
    ids = table(s)
    pool.deallocate(s)  # R18: caches the computed full blocks, then releases
    return ids


def test_r8_exact_full_match_leaves_one_block_to_compute():
    pool = kvpool.BlockManagerPool(16, 4)
    _cached_prefix(pool, toks(8))
    s = kvpool.Sequence(toks(8))
    assert pool.allocate(s)
    assert s.num_cached_tokens == 4
    assert s.num_computed_tokens == 4
    assert len(table(s)) == 2
    assert pool.slot_mapping([s]).shape == (4,)
    pool.check()


def test_r8_partial_last_block_keeps_every_full_match():
    pool = kvpool.BlockManagerPool(16, 4)
    _cached_prefix(pool, toks(8))
    s = kvpool.Sequence(toks(9))
    assert pool.allocate(s)
    assert s.num_cached_tokens == 8
    assert len(table(s)) == 3


def test_r8_one_block_prompt_fully_cached():
    pool = kvpool.BlockManagerPool(16, 4)
    _cached_prefix(pool, toks(4))
    s = kvpool.Sequence(toks(4))
    assert pool.allocate(s)
    assert s.num_cached_tokens == 0
    assert len(table(s)) == 1


# ---------------------------------------------------------------------------------------------
# R14: allocate, chunked prefill, rollback
# ---------------------------------------------------------------------------------------------


def test_r14_allocate_sets_counters_and_rank():
    pool = kvpool.BlockManagerPool(32, 4)
    _cached_prefix(pool, toks(12))
    s = kvpool.Sequence(toks(12) + toks(6, start=700))
    assert pool.allocate(s)
    assert s.num_cached_tokens == 12
    assert s.num_computed_tokens == 12
    assert s.dp_rank == 0
    assert len(table(s)) == cdiv(18, 4)
    assert pool.slot_mapping([s]).shape == (6,)


def test_r14_chunked_prefill_grows_the_table():
    pool = kvpool.BlockManagerPool(32, 4)
    s = kvpool.Sequence(toks(20))
    assert pool.allocate(s, num_tokens=6)
    t1 = table(s)
    assert len(t1) == 2
    with pytest.raises(ValueError):
        pool.slot_mapping([s])  # tokens 8..19 are not in the table yet (R19)
    s.num_computed_tokens = 6
    with pytest.raises(ValueError):
        pool.slot_mapping([s])  # token 8.. not in the table yet (R19)
    assert pool.can_allocate(s, num_tokens=13)
    assert pool.allocate(s, num_tokens=13)
    t2 = table(s)
    assert len(t2) == 4 and t2[:2] == t1
    assert s.num_computed_tokens == 6, "growing keeps the computed count"
    s.num_computed_tokens = 13
    assert pool.allocate(s)
    t3 = table(s)
    assert len(t3) == 5 and t3[:4] == t2
    assert pool.slot_mapping([s]).tolist() == slow_slot_mapping([s], 4)
    pool.check()


def test_r14_num_tokens_out_of_range_is_value_error():
    pool = kvpool.BlockManagerPool(32, 4)
    s = kvpool.Sequence(toks(10))
    for bad in (0, 11):
        with pytest.raises(ValueError, match="num_tokens"):
            pool.allocate(s, num_tokens=bad)
        with pytest.raises(ValueError, match="num_tokens"):
            pool.can_allocate(s, num_tokens=bad)
    assert s.dp_rank is None and table(s) == []
    assert pool.stats()["num_free_blocks"] == 31


def test_r14_failed_allocate_rolls_back_everything_including_lru():
    bs = 4
    pool = kvpool.BlockManagerPool(11, bs)  # 10 ids
    ta, tb = toks(8), toks(8, start=100)
    _cached_prefix(pool, ta)  # chain A (older)
    _cached_prefix(pool, tb)  # chain B (newer)
    h = kvpool.Sequence(toks(20, start=300))
    assert pool.allocate(h)  # 5 blocks: 1 free, 4 cached left
    st = pool.stats()
    assert st["num_free_blocks"] == 1 and st["num_cached_blocks"] == 4
    x = kvpool.Sequence(ta + toks(20, start=500))  # match A (2 blocks), needs 5 more: only 3
    before_stats = pool.stats()
    before_x = seq_snapshot(x)
    assert pool.can_allocate(x) is False
    assert pool.allocate(x) is False
    assert pool.stats() == before_stats
    assert seq_snapshot(x) == before_x
    assert x.dp_rank is None, "a dp rank it did not have is not kept"
    # the LRU did not move: one eviction takes A's tail, the oldest leaf
    y = kvpool.Sequence(toks(4, start=900))
    assert pool.allocate(y)  # uses the last free block
    z = kvpool.Sequence(toks(4, start=950))
    assert pool.allocate(z)  # evicts one cached block
    assert pool.stats()["num_evictions"] == before_stats["num_evictions"] + 1
    pool.deallocate(h)
    probe_a = kvpool.Sequence(ta + [1])
    probe_b = kvpool.Sequence(tb + [1])
    assert pool.allocate(probe_a) and pool.allocate(probe_b)
    assert probe_a.num_cached_tokens == 4, "A's tail was evicted"
    assert probe_b.num_cached_tokens == 8, "B is intact"
    pool.check()


def test_r14_r15_failed_allocate_keeps_prefix_statistics():
    pool = kvpool.BlockManagerPool(6, 4)  # 5 ids
    _cached_prefix(pool, toks(8))
    st0 = pool.stats()
    s = kvpool.Sequence(toks(8) + toks(30, start=100))
    assert not pool.can_allocate(s)
    assert not pool.allocate(s)
    st1 = pool.stats()
    assert st1["prefix_query_tokens"] == st0["prefix_query_tokens"]
    assert st1["prefix_hit_tokens"] == st0["prefix_hit_tokens"]


def test_r20_prefix_statistics_count_successful_lookups():
    pool = kvpool.BlockManagerPool(32, 4)
    _cached_prefix(pool, toks(8))
    st0 = pool.stats()
    s = kvpool.Sequence(toks(8) + toks(6, start=100))  # 14 tokens: 3 full blocks looked up
    assert pool.allocate(s)
    st1 = pool.stats()
    assert st1["prefix_query_tokens"] - st0["prefix_query_tokens"] == 12
    assert st1["prefix_hit_tokens"] - st0["prefix_hit_tokens"] == 8
    assert st1["prefix_hit_tokens"] <= st1["prefix_query_tokens"]


def test_r14_match_is_pinned_before_new_blocks_are_taken():
    """R14: taking the new blocks can never evict what the match found."""
    pool = kvpool.BlockManagerPool(7, 4)  # 6 ids
    ids_a = _cached_prefix(pool, toks(8))  # A: 2 cached, the least recently used
    ids_b = _cached_prefix(pool, toks(8, start=100))  # B: 2 cached; 2 free
    s = kvpool.Sequence(toks(8) + toks(12, start=500))  # hit A (2) + 3 new: 2 free + evict 1
    assert pool.can_allocate(s)
    assert pool.allocate(s)
    assert s.num_cached_tokens == 8
    assert table(s)[:2] == ids_a[:2]
    assert len(set(table(s))) == 5
    assert pool.stats()["num_evictions"] == 1
    pool.check()
    pool.deallocate(s)
    probe = kvpool.Sequence(toks(8, start=100) + [1])
    assert pool.allocate(probe)
    assert probe.num_cached_tokens == 4, "the eviction took B's tail, not the pinned match"
    assert table(probe)[0] == ids_b[0]
    pool.deallocate(probe)
    t = kvpool.Sequence(toks(8) + toks(20, start=500))  # hit 2 + need 5: only 4 other ids
    assert pool.can_allocate(t) is False and pool.allocate(t) is False
    pool.check()


# ---------------------------------------------------------------------------------------------
# R17: num_computed_tokens and cache(seq)
# ---------------------------------------------------------------------------------------------


def test_r17_computed_tokens_setter_rules():
    pool = kvpool.BlockManagerPool(32, 4)
    s = kvpool.Sequence(toks(10))
    assert pool.allocate(s, num_tokens=5)  # table holds 8 tokens
    s.num_computed_tokens = 3
    s.num_computed_tokens = 3  # same value is not lowering
    with pytest.raises(ValueError):
        s.num_computed_tokens = 2  # lowering
    assert s.num_computed_tokens == 3
    with pytest.raises(ValueError):
        s.num_computed_tokens = 9  # more than the table holds
    assert s.num_computed_tokens == 3
    s.num_computed_tokens = 8
    assert pool.allocate(s)
    with pytest.raises(ValueError):
        s.num_computed_tokens = 11  # more than len(seq)
    s.num_computed_tokens = 10
    assert s.num_computed_tokens == 10


def test_r17_cache_publishes_only_computed_full_blocks():
    pool = kvpool.BlockManagerPool(32, 4)
    s = kvpool.Sequence(toks(14))
    assert pool.allocate(s)
    s.num_computed_tokens = 7
    pool.cache(s)
    p = kvpool.Sequence(toks(14) + [1])
    assert pool.allocate(p)
    assert p.num_cached_tokens == 4, "only block 0 is inside the computed tokens"
    pool.deallocate(p)
    s.num_computed_tokens = 14
    pool.cache(s)
    q = kvpool.Sequence(toks(14) + [1])
    assert pool.allocate(q)
    assert q.num_cached_tokens == 12
    pool.check()


def test_r17_nothing_published_before_compute():
    pool = kvpool.BlockManagerPool(32, 4)
    s = kvpool.Sequence(toks(12))
    assert pool.allocate(s)
    pool.cache(s)
    p = kvpool.Sequence(toks(12) + [1])
    assert pool.allocate(p)
    assert p.num_cached_tokens == 0
    pool.deallocate(s)  # computed == 0: nothing published on release either
    pool.deallocate(p)
    st = pool.stats()
    assert st["num_cached_blocks"] == 0 and st["num_free_blocks"] == 31


# ---------------------------------------------------------------------------------------------
# R18: deallocate
# ---------------------------------------------------------------------------------------------


def test_r18_deallocate_resets_and_recompute_rehits_own_prefix():
    pool = kvpool.BlockManagerPool(32, 4)
    s = kvpool.Sequence(toks(10), extra_key=b"k")
    assert pool.allocate(s)
    compute_all(s)
    s.append_token(42)
    assert pool.may_append(s)
    pool.deallocate(s)  # preemption by recompute
    assert table(s) == []
    assert s.num_cached_tokens == 0 and s.num_computed_tokens == 0
    assert len(s) == 11 and s.dp_rank == 0
    assert pool.allocate(s)
    assert s.num_cached_tokens == 8, "re-hits its own computed prefix"
    assert s.num_computed_tokens == 8
    pool.check()


def test_r18_deallocate_nothing_is_noop():
    pool = kvpool.BlockManagerPool(8, 4)
    s = kvpool.Sequence(toks(5))
    before = pool.stats()
    pool.deallocate(s)
    assert pool.stats() == before
    assert pool.allocate(s)
    pool.deallocate(s)
    pool.deallocate(s)  # second time: holds nothing -> no-op
    assert pool.stats()["num_free_blocks"] == 7
    pool.check()


def test_r18_r29_deallocate_foreign_sequence_is_value_error():
    p1 = kvpool.BlockManagerPool(8, 4)
    p2 = kvpool.BlockManagerPool(8, 4)
    s = kvpool.Sequence(toks(6))
    assert p1.allocate(s)
    b1, b2, snap = p1.stats(), p2.stats(), seq_snapshot(s)
    with pytest.raises(ValueError):
        p2.deallocate(s)
    assert (p1.stats(), p2.stats(), seq_snapshot(s)) == (b1, b2, snap)
    p1.deallocate(s)
    assert p1.stats()["num_free_blocks"] == 7


# ---------------------------------------------------------------------------------------------
# R13: dp rank choice and stickiness
# ---------------------------------------------------------------------------------------------


def test_r13_lowest_rank_on_tie_then_most_available():
    pool = kvpool.BlockManagerPool(10, 4, dp_size=2)
    assert len(pool.stats()["ranks"]) == 2
    s1 = kvpool.Sequence(toks(4))
    assert pool.allocate(s1) and s1.dp_rank == 0
    s2 = kvpool.Sequence(toks(4, start=100))
    assert pool.allocate(s2) and s2.dp_rank == 1
    s3 = kvpool.Sequence(toks(8, start=200))
    assert pool.allocate(s3) and s3.dp_rank == 0  # tie again (8, 8)
    s4 = kvpool.Sequence(toks(4, start=300))
    assert pool.allocate(s4) and s4.dp_rank == 1  # rank 1 has 8 > 6
    r = pool.stats()["ranks"]
    assert [x["num_used_blocks"] for x in r] == [3, 2]
    pool.check()


def test_r13_cached_blocks_count_as_available():
    pool = kvpool.BlockManagerPool(10, 4, dp_size=2)
    a = kvpool.Sequence(toks(20))
    assert pool.allocate(a) and a.dp_rank == 0
    compute_all(a)
    pool.deallocate(a)  # rank 0: 4 free + 5 cached = 9; rank 1: 9 free
    r0 = rank_stats(pool, 0)
    assert r0["num_cached_blocks"] == 5 and r0["num_free_blocks"] == 4
    b = kvpool.Sequence(toks(4, start=100))
    assert pool.allocate(b)
    assert b.dp_rank == 0, "tie on free + cached -> lowest rank"


def test_r13_rank_sticks_across_preemption_no_fallback():
    pool = kvpool.BlockManagerPool(10, 4, dp_size=2)  # 9 ids per rank
    a = kvpool.Sequence(toks(4))
    assert pool.allocate(a) and a.dp_rank == 0
    s = kvpool.Sequence(toks(8, start=100))
    assert pool.allocate(s) and s.dp_rank == 1
    pool.deallocate(s)  # preempted
    assert s.dp_rank == 1
    filler = kvpool.Sequence(toks(8, start=500))
    assert pool.allocate(filler) and filler.dp_rank == 1  # 9 vs 8 -> rank 1
    # now rank 0 has 8 available, rank 1 has 7: s still goes back to rank 1
    assert pool.allocate(s) and s.dp_rank == 1
    pool.deallocate(s)
    big = kvpool.Sequence(toks(24, start=1000))
    assert pool.allocate(big) and big.dp_rank == 0  # rank 0 (8) > rank 1 (7)
    s.append_tokens(toks(24, start=2000))  # 32 tokens = 8 blocks > 7 on rank 1
    pool.deallocate(big)  # rank 0: 8 available, could hold s; no fallback allowed
    before = pool.stats()
    assert pool.can_allocate(s) is False
    assert pool.allocate(s) is False
    assert s.dp_rank == 1
    assert pool.stats() == before
    pool.check()


def _expected_rank(pool, singles_free):
    ranks = pool.stats()["ranks"]
    best = None
    for r, st in enumerate(ranks):
        if singles_free is not None and singles_free[r] == 0:
            continue
        avail = st["num_free_blocks"] + st["num_cached_blocks"]
        if best is None or avail > best[1]:
            best = (r, avail)
    return best


@pytest.mark.parametrize("num_single_blocks", [2, 3])
def test_r13_ranks_with_exhausted_single_pool_are_skipped(num_single_blocks):
    """R13: dp choice skips ranks whose single-block pool is exhausted.

    The per-rank single capacity is read from stats() (the contract does not say whether
    num_single_blocks counts the reserved id 0)."""
    pool = kvpool.BlockManagerPool(20, 4, dp_size=2, num_single_blocks=num_single_blocks)
    cap = [x["num_free_single_blocks"] for x in pool.stats()["ranks"]]
    assert cap[0] == cap[1] >= 1
    singles = list(cap)
    sizes = [4, 40, 4, 4, 4, 4, 4, 4]
    seen_false = False
    alive = []  # a dropped Sequence releases its blocks (R4): keep them
    for i, n in enumerate(sizes):
        s = kvpool.Sequence(toks(n, start=100 * i))
        alive.append(s)
        exp = _expected_rank(pool, singles)
        ok = pool.allocate(s)
        if exp is None:
            assert ok is False
            assert s.dp_rank is None
            seen_false = True
            continue
        r, avail = exp
        assert ok == (cdiv(n, 4) <= avail)
        if ok:
            assert s.dp_rank == r
            assert s.single_block_id is not None and s.single_block_id > 0
            singles[r] -= 1
            got = [x["num_free_single_blocks"] for x in pool.stats()["ranks"]]
            assert got == singles
    assert seen_false
    pool.check()


def test_r13_single_block_ids_distinct_and_returned():
    pool = kvpool.BlockManagerPool(20, 4, num_single_blocks=4)
    cap = rank_stats(pool)["num_free_single_blocks"]
    seqs = [kvpool.Sequence(toks(4, start=10 * i)) for i in range(cap)]
    for s in seqs:
        assert pool.allocate(s)
    ids = [s.single_block_id for s in seqs]
    assert len(set(ids)) == cap and 0 not in ids
    extra = kvpool.Sequence(toks(4, start=999))
    before = pool.stats()
    assert pool.can_allocate(extra) is False
    assert pool.allocate(extra) is False, "no single block left"
    assert pool.stats() == before
    pool.deallocate(seqs[0])
    assert rank_stats(pool)["num_free_single_blocks"] == 1
    assert pool.allocate(extra)
    pool.check()


# ---------------------------------------------------------------------------------------------
# R19: batch exports
# ---------------------------------------------------------------------------------------------


def test_r19_block_tables_and_slot_mapping_match_reference():
    bs = 4
    pool = kvpool.BlockManagerPool(64, bs)
    _cached_prefix(pool, toks(8))
    seqs = [
        kvpool.Sequence(toks(11)),
        kvpool.Sequence(toks(3, start=100)),
        kvpool.Sequence(toks(8) + toks(9, start=40)),
        kvpool.Sequence(toks(1, start=7)),
    ]
    for s in seqs:
        assert pool.allocate(s)
    assert seqs[0].num_computed_tokens == 8  # hit
    seqs[0].num_computed_tokens = 9
    bt = pool.block_tables(seqs)
    assert isinstance(bt, np.ndarray) and bt.dtype == np.int32
    assert bt.shape == (4, 5)
    assert bt.tolist() == slow_block_tables(seqs)
    assert pool.block_tables(seqs, group=0).tolist() == bt.tolist()
    sm = pool.slot_mapping(seqs)
    assert isinstance(sm, np.ndarray) and sm.dtype == np.int64
    assert sm.tolist() == slow_slot_mapping(seqs, bs)
    assert sm.shape == (2 + 3 + 9 + 1,)
    # per-sequence block_table equals its row
    for i, s in enumerate(seqs):
        assert bt[i, : len(s.block_table)].tolist() == table(s)
    # decode step: every sequence appends one token, then may_append
    for s in seqs:
        compute_all(s)
        s.append_token(3)
        assert pool.may_append(s)
    sm = pool.slot_mapping(seqs)
    assert sm.tolist() == slow_slot_mapping(seqs, bs)
    assert len(sm) == 4
    assert pool.slot_mapping([]).shape == (0,)
    pool.check()


def test_r19_slot_mapping_token_beyond_table_is_value_error():
    pool = kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(toks(4))
    assert pool.allocate(s)
    compute_all(s)
    s.append_token(9)
    with pytest.raises(ValueError):
        pool.slot_mapping([s])
    assert pool.may_append(s)
    assert pool.slot_mapping([s]).tolist() == [table(s)[1] * 4]


def test_r19_block_tables_pad_with_zero():
    pool = kvpool.BlockManagerPool(16, 2)
    a, b = kvpool.Sequence(toks(7)), kvpool.Sequence(toks(2, start=9))
    assert pool.allocate(a) and pool.allocate(b)
    bt = pool.block_tables([b, a])
    assert bt.shape == (2, 4)
    assert bt[0].tolist() == table(b) + [0, 0, 0]
    assert bt[1].tolist() == table(a)


# ---------------------------------------------------------------------------------------------
# R20: stats
# ---------------------------------------------------------------------------------------------


def test_r20_stats_keys_and_values():
    pool = kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(toks(9))
    assert pool.allocate(s)
    st = pool.stats()
    for k in (
        "num_total_blocks",
        "num_free_blocks",
        "num_cached_blocks",
        "num_used_blocks",
        "usage",
        "prefix_query_tokens",
        "prefix_hit_tokens",
        "num_evictions",
        "num_free_single_blocks",
        "num_live_slots",
        "num_pending_checkpoints",
        "num_committed_checkpoints",
        "ranks",
    ):
        assert k in st, k
    assert st["num_total_blocks"] == 15
    assert st["num_used_blocks"] == 3
    assert st["usage"] == pytest.approx(3 / 15)
    assert isinstance(st["ranks"], list) and len(st["ranks"]) == 1
    assert st["ranks"][0]["num_used_blocks"] == 3


def test_r20_top_level_counts_are_sums_over_ranks():
    """ASSUMPTION beyond the contract: the top-level block counts of a dp pool sum the ranks."""
    pool = kvpool.BlockManagerPool(10, 4, dp_size=3)
    seqs = [kvpool.Sequence(toks(5, start=20 * i)) for i in range(4)]
    for s in seqs:
        assert pool.allocate(s)
    st = pool.stats()
    for k in ("num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks"):
        assert st[k] == sum(r[k] for r in st["ranks"]), k
    assert st["ranks"][0]["num_total_blocks"] == 9


# ---------------------------------------------------------------------------------------------
# long random workload: check() after every step, everything free at the end
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp_size,seed", [(1, 0), (2, 1), (1, 2)])
def test_long_random_workload_check_every_step(dp_size, seed):
    rng = random.Random(seed)
    bs = 4
    pool = kvpool.BlockManagerPool(24, bs, dp_size=dp_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 9]))] for _ in range(4)]
    waiting: list = []
    running: list = []
    steps = 0
    for _step in range(600):
        steps += 1
        if rng.random() < 0.3:
            p = rng.choice(prefixes)
            toks_ = p + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            waiting.append(kvpool.Sequence(toks_, extra_key=rng.choice([None, b"a"])))
        # admit
        if waiting and rng.random() < 0.6:
            s = waiting[0]
            can = pool.can_allocate(s)
            ok = pool.allocate(s)
            assert ok == can
            if ok:
                waiting.pop(0)
                running.append(s)
        # one forward step for running sequences
        for s in list(running):
            if s not in running:
                continue  # preempted earlier in this step
            if s.num_computed_tokens < len(s):
                s.num_computed_tokens = len(s)  # prefill done in one step
                pool.cache(s)
                continue
            s.append_token(rng.randrange(50))
            while s in running:
                can = pool.can_append(s)
                ok = pool.may_append(s)
                assert ok == can
                if ok:
                    break
                victim = running.pop()  # preempt the newest (recompute)
                pool.deallocate(victim)
                waiting.insert(0, victim)
            if s in running and (len(s) > 40 or rng.random() < 0.05):
                running.remove(s)
                pool.deallocate(s)
        if rng.random() < 0.02:
            pool.reset_prefix_cache()
        pool.check()
        st = pool.stats()
        assert (
            st["num_free_blocks"] + st["num_cached_blocks"] + st["num_used_blocks"]
            == st["num_total_blocks"]
        )
        per_rank_ids: dict = {}
        for s in running:
            per_rank_ids.setdefault(s.dp_rank, set()).update(table(s))
        for r, rs in enumerate(st["ranks"]):
            assert rs["num_used_blocks"] == len(per_rank_ids.get(r, ())), "R2 used == held ids"
    for s in running + waiting:
        pool.deallocate(s)
    pool.reset_prefix_cache()
    pool.check()
    for rs in pool.stats()["ranks"]:
        assert rs["num_free_blocks"] == rs["num_total_blocks"]
        assert rs["num_used_blocks"] == 0 and rs["num_cached_blocks"] == 0
    assert steps == 600


def test_r15_can_allocate_does_not_touch_lru():
    """R15: no side effect of any kind: asking about a sequence that would hit chain A does not
    make A recent, so the next eviction still takes A's tail (A is older than B)."""
    pool = kvpool.BlockManagerPool(7, 4)  # 6 ids
    _cached_prefix(pool, toks(8))  # A, older
    _cached_prefix(pool, toks(8, start=100))  # B, newer; 2 free
    for _ in range(3):
        assert pool.can_allocate(kvpool.Sequence(toks(8) + [1]))
    h = kvpool.Sequence(toks(12, start=300))  # 3 blocks: 2 free + evict 1
    assert pool.allocate(h)
    pool.deallocate(h)
    pa, pb = kvpool.Sequence(toks(8) + [1]), kvpool.Sequence(toks(8, start=100) + [1])
    assert pool.allocate(pa) and pool.allocate(pb)
    assert (pa.num_cached_tokens, pb.num_cached_tokens) == (4, 8)
