"""What an engine's step loop asks of the pool beyond R14-R19 (docs/contract.md, "Choice: sizing
a chunk" and R9's switches with their group): the frictions an outside engine found while
putting a real model's KV in kvpool.

- ``allocate(seq, num_new_tokens=n)``: the table holds the hit plus ``n`` tokens, one chain walk;
- ``drain_block_switches(with_group=True)``: ``(seq_id, group, old, new)``, the triples unchanged.
"""

from __future__ import annotations

import kvpool
import pytest
from conftest import pool_snapshot, raises_bad_arg, seq_snapshot

BS = 4


def warm(pool, tokens, computed):
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq, max(computed, 1))
    seq.num_computed_tokens = computed
    pool.deallocate(seq)


def test_r14_num_new_tokens_sizes_the_first_chunk_past_the_hit_in_one_walk():
    pool = kvpool.BlockManagerPool(64, BS)
    tokens = list(range(40))
    warm(pool, tokens, 16)  # 4 blocks cached
    seq = kvpool.Sequence(tokens)
    walks = pool.debug_counters()["device_chain_walks"]
    assert pool.allocate(seq, num_new_tokens=6)
    assert pool.debug_counters()["device_chain_walks"] == walks + 1
    assert seq.num_computed_tokens == 16
    assert seq.num_blocks == -(-(16 + 6) // BS)  # the hit plus 6 tokens
    # on an allocated sequence: grows to num_computed_tokens + n, capped at len(seq)
    seq.num_computed_tokens = 22
    assert pool.allocate(seq, num_new_tokens=5)
    assert seq.num_blocks == -(-27 // BS)
    assert pool.allocate(seq, num_new_tokens=10_000)
    assert seq.num_blocks == 10
    pool.check()


def test_r14_num_tokens_still_takes_the_whole_hit():
    """The friction: num_tokens smaller than the hit gives the hit, not hit + num_tokens."""
    pool = kvpool.BlockManagerPool(64, BS)
    tokens = list(range(40))
    warm(pool, tokens, 16)
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq, 6)
    assert seq.num_blocks == 4 and seq.num_computed_tokens == 16


def test_r15_plan_and_can_allocate_with_num_new_tokens():
    pool = kvpool.BlockManagerPool(9, BS)  # 8 usable blocks
    tokens = list(range(40))
    warm(pool, tokens, 16)
    seq = kvpool.Sequence(tokens)
    plan = pool.plan(seq, num_new_tokens=8)
    assert plan.num_cached_tokens == 16 and plan.num_tokens == 24 and plan.num_blocks == 6
    assert pool.can_allocate(seq, num_new_tokens=8)
    assert pool.can_allocate(seq, num_new_tokens=16), "4 hit + 4 new blocks"
    assert not pool.can_allocate(seq, num_new_tokens=17), "9 blocks"
    before = (pool_snapshot(pool), seq_snapshot(seq))
    assert pool.plan(seq, num_new_tokens=40) is None
    assert (pool_snapshot(pool), seq_snapshot(seq)) == before, "R15: no side effect"
    walks = pool.debug_counters()["device_chain_walks"]
    assert pool.allocate(seq, num_new_tokens=8, plan=plan)
    assert pool.debug_counters()["device_chain_walks"] == walks, "the plan's walk is reused"
    assert seq.num_blocks == 6
    pool.check()


def test_r15_a_num_new_tokens_plan_serves_the_count_it_resolved_to():
    pool = kvpool.BlockManagerPool(64, BS)
    tokens = list(range(40))
    warm(pool, tokens, 16)
    seq = kvpool.Sequence(tokens)
    plan = pool.plan(seq, num_new_tokens=8)
    walks = pool.debug_counters()["device_chain_walks"]
    assert pool.allocate(seq, plan.num_tokens, plan=plan)
    assert pool.debug_counters()["device_chain_walks"] == walks
    assert seq.num_blocks == 6


def test_r26_num_new_tokens_counts_past_a_host_hit():
    pool = kvpool.HierarchyBlockManagerPool(13, 64, BS)  # 12 device blocks
    tokens = list(range(40))
    warm(pool, tokens, 24)
    pool.complete_offloads(pool.take_offload_plans())
    warm(pool, list(range(100, 148)), 48)  # takes every device block: the cache is evicted
    pool.complete_offloads(pool.take_offload_plans())
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq, num_new_tokens=4)
    loads = pool.take_load_plans()
    assert sum(len(p.src) for p in loads) == 6
    assert seq.num_blocks == 7  # 6 loaded + 4 new tokens
    pool.complete_loads(loads)
    assert seq.num_computed_tokens == 24
    pool.check()


def test_r29_num_new_tokens_bad_input_changes_nothing():
    pool = kvpool.BlockManagerPool(64, BS)
    seq = kvpool.Sequence(list(range(10)))
    before = (pool_snapshot(pool), seq_snapshot(seq))
    raises_bad_arg("num_new_tokens", pool.allocate, seq, 4, num_new_tokens=4)
    raises_bad_arg("num_new_tokens", pool.allocate, seq, num_new_tokens=0)
    raises_bad_arg("num_new_tokens", pool.allocate, seq, num_new_tokens=-1, int_range=True)
    raises_bad_arg("num_new_tokens", pool.allocate, seq, num_new_tokens=True)
    raises_bad_arg("num_new_tokens", pool.plan, seq, num_new_tokens="3")
    raises_bad_arg("num_new_tokens", pool.can_allocate, seq, num_new_tokens=0)
    raises_bad_arg("num_new_tokens", pool.allocate, kvpool.Sequence([]), num_new_tokens=1)
    assert (pool_snapshot(pool), seq_snapshot(seq)) == before


def test_r9_switches_with_their_group_keep_the_triples():
    for with_group in (False, True):
        pool = kvpool.BlockManagerPool(64, BS, sliding_window=8)
        tokens = list(range(13))
        a, b = kvpool.Sequence(tokens), kvpool.Sequence(tokens)
        assert pool.allocate(a) and pool.allocate(b)  # both miss: two copies of 3 blocks
        table_b = [int(x) for x in b.block_table]
        for s in (a, b):
            s.num_computed_tokens = 12
            pool.cache(s)
        switches = pool.drain_block_switches(with_group=with_group)
        assert len(switches) == 3
        for sw, old in zip(switches, table_b, strict=False):
            if with_group:
                seq_id, group, old_id, new_id = sw
                assert group == 0, "only the full-attention group dedups"
            else:
                seq_id, old_id, new_id = sw
            assert seq_id == b.seq_id and old_id == old
            assert new_id == int(a.block_table[table_b.index(old)])
        assert pool.drain_block_switches(with_group=with_group) == []
        pool.check()
    with pytest.raises(TypeError, match="with_group"):
        pool.drain_block_switches(with_group=1)
