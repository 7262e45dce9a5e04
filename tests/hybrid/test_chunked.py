"""Chunked local attention groups (``attention_chunk_size``, Llama 4; docs/hybrid.md "Chunked
local attention"): a query at position p reads the tokens from its chunk's start
``p - p % chunk``, so a chunked group's table holds its blocks from there, slides a chunk at a
time, and a hit at a chunk's end needs none of its blocks. The random workloads with a KV
shadow, check() after every step and R15/R16 are test_shared_store.py's "chunked" configs."""

from __future__ import annotations

import kvpool
import pytest

BS = 4


def _computed(pool, tokens, upto=None):
    seq = kvpool.Sequence(tokens)
    assert pool.allocate(seq)
    seq.num_computed_tokens = len(tokens) if upto is None else upto
    pool.cache(seq)
    return seq


def test_tables_hold_the_blocks_from_the_chunk_start():
    pool = kvpool.BlockManagerPool(64, BS, attention_chunk_size=8)
    assert pool.num_groups == 2
    first = list(range(100, 140))
    seq = _computed(pool, first, upto=26)
    # the query at 26 reads from 24: blocks 0-5 slid out, block 6 (tokens 24-27) on
    assert seq.group_block_table(1).tolist()[:6] == [0] * 6
    assert all(seq.group_block_table(1).tolist()[6:])
    seq.num_computed_tokens = len(first)
    pool.cache(seq)
    full = seq.group_block_table(0).tolist()
    pool.deallocate(seq)
    for prefix, hit, run in ((32, 32, 0), (28, 28, 1), (30, 28, 1), (26, 24, 0)):
        probe = kvpool.Sequence(first[:prefix] + [7] * 5)
        assert pool.allocate(probe)
        assert probe.num_cached_tokens == hit
        table = probe.group_block_table(1).tolist()
        # the hit shares the run from its chunk's start (none at a chunk's end), zeros before
        start = hit // BS - run
        assert table[:start] == [0] * start and all(table[start:])
        assert probe.group_block_table(0).tolist()[: hit // BS] == full[: hit // BS]
        pool.deallocate(probe)
        pool.check()


def test_a_chunk_ends_hit_needs_no_chunked_block_and_survives_pressure():
    """Under the same stream of unrelated prompts a sliding window of the chunk's size loses the
    conversation's hit points (each needs the window's blocks before it), while the chunked
    group's hits at chunk ends need none of its blocks and stay."""
    hits = {}
    for name, option in (("chunked", "attention_chunk_size"), ("window", "sliding_window")):
        pool = kvpool.BlockManagerPool(44, BS, retention_tokens=0, **{option: 16})
        pool.deallocate(_computed(pool, list(range(100, 164))))  # 16 blocks, 4 chunks
        for k in range(6):
            pool.deallocate(_computed(pool, [k * 1000 + t for t in range(8)]))
            pool.check()
        assert pool.stats()["num_evictions"] > 0
        hits[name] = [
            pool.plan(kvpool.Sequence(list(range(100, 100 + n)) + [7])).num_cached_tokens
            for n in (64, 48, 32)
        ]
    assert hits == {"chunked": [64, 48, 32], "window": [0, 0, 0]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attention_chunk_size": 6}, "attention_chunk_size: must be a positive multiple"),
        ({"attention_chunk_size": 0}, "attention_chunk_size: must be a positive multiple"),
        ({"attention_chunk_size": 8, "sliding_window": 8}, "attention_chunk_size: is not with"),
        (
            {"attention_chunk_size": 8, "swa_num_blocks": 8},
            "attention_chunk_size: needs the shared",
        ),
        ({"attention_chunk_size": 8, "shared_blocks": False}, "attention_chunk_size: needs the"),
    ],
)
def test_bad_chunk_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        kvpool.BlockManagerPool(16, BS, **options)


def test_a_host_tier_needs_the_shared_store_named():
    with pytest.raises(ValueError, match="attention_chunk_size: needs the shared store"):
        kvpool.HierarchyBlockManagerPool(16, 16, BS, attention_chunk_size=8)
    pool = kvpool.HierarchyBlockManagerPool(32, 16, BS, attention_chunk_size=8, shared_blocks=True)
    assert pool.num_groups == 2
    pool.check()
