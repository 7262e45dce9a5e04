"""Prefix cache at the manager level: R6 (hashing), R7 (token verification), R8-R12.

`debug_hash_bits=k` is the test hook that keeps only the low k bits of every block hash, so hash
collisions are easy to forge (R7: a hit compares tokens, so the wrong block is never returned).
"""

from __future__ import annotations

import os
import subprocess
import sys

import kvpool
import numpy as np
import pytest
from conftest import bm_snapshot, toks
from hypothesis import given
from hypothesis import strategies as st

# ---------------------------------------------------------------------------------------------
# R6: hash_blocks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,bs,expected", [(0, 4, 0), (3, 4, 0), (4, 4, 1), (11, 4, 2), (12, 4, 3), (7, 1, 7)]
)
def test_r6_hash_blocks_only_full_blocks(n, bs, expected):
    hs = kvpool.hash_blocks(toks(n), bs)
    assert isinstance(hs, list)
    assert len(hs) == expected
    for h in hs:
        assert isinstance(h, bytes)
        assert len(h) == 16


def test_r6_hash_blocks_deterministic_and_distinct():
    t = toks(32)
    a = kvpool.hash_blocks(t, 4)
    b = kvpool.hash_blocks(list(t), 4)
    assert a == b
    assert len(set(a)) == len(a)


def test_r6_chain_prefix_property():
    """Block i's hash depends on blocks 0..i and nothing after."""
    t = toks(16)
    base = kvpool.hash_blocks(t, 4)
    for i in range(4):
        u = list(t)
        u[i * 4 + 1] += 1000
        h = kvpool.hash_blocks(u, 4)
        assert h[:i] == base[:i], "earlier blocks unchanged"
        assert all(h[j] != base[j] for j in range(i, 4)), "block i and every descendant change"
    # longer sequence: same leading hashes
    assert kvpool.hash_blocks(t + toks(8, 500), 4)[:4] == base
    # a partial trailing block does not change anything
    assert kvpool.hash_blocks(t + [1, 2, 3], 4) == base


def test_r6_parent_matters():
    """The same tokens in block 1 under different parents hash differently (chain, not flat)."""
    x = [1, 2, 3, 4] + [9, 9, 9, 9]
    y = [5, 6, 7, 8] + [9, 9, 9, 9]
    assert kvpool.hash_blocks(x, 4)[1] != kvpool.hash_blocks(y, 4)[1]


def test_r6_order_and_block_size_sensitive():
    assert kvpool.hash_blocks([1, 2], 2) != kvpool.hash_blocks([2, 1], 2)
    assert kvpool.hash_blocks(toks(4), 4)[0] != kvpool.hash_blocks(toks(4), 2)[0]


def test_r6_full_u32_range_tokens():
    hs = kvpool.hash_blocks([0, 2**32 - 1, 2**31, 7], 2)
    assert len(hs) == 2
    assert kvpool.hash_blocks([2**32 - 1, 0], 2) != kvpool.hash_blocks([0, 2**32 - 1], 2)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64, np.int16])
def test_r6_numpy_tokens_equal_list(dtype):
    t = toks(20, start=3)
    assert kvpool.hash_blocks(np.array(t, dtype=dtype), 4) == kvpool.hash_blocks(t, 4)


def test_r6_extra_key_separates_namespaces():
    t = toks(12)
    h_none = kvpool.hash_blocks(t, 4)
    h_a = kvpool.hash_blocks(t, 4, extra_key=b"lora-a")
    h_b = kvpool.hash_blocks(t, 4, extra_key=b"lora-b")
    assert kvpool.hash_blocks(t, 4, extra_key=b"lora-a") == h_a
    for i in range(3):
        assert len({h_none[i], h_a[i], h_b[i]}) == 3


def test_r6_hash_seed_configurable():
    t = toks(12)
    d = kvpool.hash_blocks(t, 4)
    s1 = kvpool.hash_blocks(t, 4, hash_seed=1)
    s2 = kvpool.hash_blocks(t, 4, hash_seed=2)
    assert kvpool.hash_blocks(t, 4, hash_seed=1) == s1
    assert s1 != s2
    assert all(a != b for a, b in zip(s1, s2, strict=True))
    assert kvpool.hash_blocks(t, 4, hash_seed=None) == d


def test_r6_same_hashes_in_every_process():
    """R6: the default seed is fixed: another process (other PYTHONHASHSEED) gets the same bytes."""
    code = (
        "import kvpool;"
        "print(kvpool.hash_blocks(list(range(40)), 8, extra_key=b'k')[-1].hex());"
        "print(kvpool.hash_blocks(list(range(40)), 8)[0].hex())"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        outs.add(r.stdout)
    assert len(outs) == 1
    here = (
        kvpool.hash_blocks(list(range(40)), 8, extra_key=b"k")[-1].hex()
        + "\n"
        + kvpool.hash_blocks(list(range(40)), 8)[0].hex()
        + "\n"
    )
    assert outs == {here}


def test_r6_block_hash_equals_hash_blocks():
    """A cached Block's hash is its R6 chain hash (same seed)."""
    t = toks(10, start=7)
    for seed, kw in ((None, {}), (99, {"hash_seed": 99})):
        bm = kvpool.BlockManager(8, 4, **kw)
        blocks = bm.allocate(3)
        assert bm.cache(t, blocks, extra_key=b"ns") == 2
        expected = kvpool.hash_blocks(t, 4, extra_key=b"ns", hash_seed=seed)
        assert [b.hash for b in blocks[:2]] == expected
        assert blocks[2].hash is None
        assert all(bm.prefix_cache.contains(h) for h in expected)
        assert [bm.prefix_cache.block_id(h) for h in expected] == [b.id for b in blocks[:2]]


# ---------------------------------------------------------------------------------------------
# R7 / R9: match and insert
# ---------------------------------------------------------------------------------------------


def test_r7_match_returns_longest_cached_prefix():
    bm = kvpool.BlockManager(16, 4)
    t = toks(12)
    blocks = bm.allocate(3)
    assert bm.cache(t, blocks) == 3
    ids = [b.id for b in blocks]
    assert [h.id for h in bm.allocate_shared(t)] == ids
    # Note: at the manager level the whole sequence may match (R8 applies at the pool level).
    assert [h.id for h in bm.allocate_shared(t + [1, 2])] == ids, "trailing partial block ignored"
    assert [h.id for h in bm.allocate_shared(t[:10])] == ids[:2], "only full blocks match"
    assert bm.allocate_shared(t[:3]) == []
    u = list(t)
    u[9] = 777
    assert [h.id for h in bm.allocate_shared(u)] == ids[:2], "stops at the first differing block"
    assert bm.allocate_shared(t[4:]) == [], "a non-prefix slice misses (chain hashes)"
    v = [555] + t[1:]
    assert bm.allocate_shared(v) == []
    bm.check()


def test_r7_hit_handles_are_new_handles():
    bm = kvpool.BlockManager(8, 4)
    t = toks(8)
    blocks = bm.allocate(2)
    bm.cache(t, blocks)
    hits = bm.allocate_shared(t)
    assert all(isinstance(h, kvpool.Block) for h in hits)
    assert [h.hash for h in hits] == [b.hash for b in blocks]
    assert [h.ref_count for h in hits] == [3, 3]
    bm.deallocate(blocks)
    # the hit handles are independent: they still hold the blocks
    assert bm.num_used_blocks == 2
    bm.deallocate(hits)
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 2


def test_r7_hit_pins_cached_blocks():
    bm = kvpool.BlockManager(8, 4)
    t = toks(8)
    blocks = bm.allocate(2)
    bm.cache(t, blocks)
    bm.deallocate(blocks)
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 0
    hits = bm.allocate_shared(t)
    assert bm.num_cached_blocks == 0
    assert bm.num_used_blocks == 2
    assert bm.num_free_blocks == 5
    bm.deallocate(hits)
    assert bm.num_cached_blocks == 2
    bm.check()


def test_r9_cache_counts_only_new_full_blocks():
    bm = kvpool.BlockManager(16, 4)
    t = toks(14)
    blocks = bm.allocate(4)
    assert bm.cache(t[:5], blocks) == 1, "5 tokens: one full block"
    assert bm.cache(t[:5], blocks) == 0, "already cached: nothing new"
    assert bm.cache(t, blocks) == 2, "blocks 1 and 2 are new, block 3 is partial"
    assert bm.cache(t, blocks) == 0
    assert len(bm.prefix_cache) == 3
    assert [b.ref_count for b in blocks] == [2, 2, 2, 1]
    bm.deallocate(blocks)
    assert bm.num_cached_blocks == 3
    assert bm.num_free_blocks == 12


def test_r9_cache_with_fewer_blocks_than_full_blocks():
    bm = kvpool.BlockManager(16, 4)
    t = toks(16)
    blocks = bm.allocate(2)
    assert bm.cache(t, blocks) == 2
    assert len(bm.prefix_cache) == 2


def test_r9_cache_hit_blocks_plus_new_blocks():
    bm = kvpool.BlockManager(16, 4)
    t = toks(12)
    first = bm.allocate(1)
    bm.cache(t[:4], first)
    bm.deallocate(first)
    hits = bm.allocate_shared(t)
    assert len(hits) == 1
    new = bm.allocate(2)
    assert bm.cache(t, hits + new) == 2
    assert len(bm.prefix_cache) == 3
    assert [b.hash is not None for b in new] == [True, True]
    bm.deallocate(hits + new)
    assert bm.num_cached_blocks == 3
    bm.check()


def test_r9_first_writer_wins_and_insertion_stops():
    """R9: a duplicate stays private, and so does the rest of its chain."""
    bm = kvpool.BlockManager(16, 4)
    t = toks(12)
    a = bm.allocate(1)
    assert bm.cache(t[:4], a) == 1
    b = bm.allocate(3)  # computed the same prefix privately (e.g. admitted before A cached)
    assert bm.cache(t, b) == 0, "block 0 is already cached with A's block: stop there"
    pc = bm.prefix_cache
    h = kvpool.hash_blocks(t, 4)
    assert pc.block_id(h[0]) == a[0].id, "first writer wins"
    assert not pc.contains(h[1]) and not pc.contains(h[2]), "the rest of B's chain stays private"
    assert [x.ref_count for x in b] == [1, 1, 1]
    assert b[0].hash is None
    assert len(pc) == 1
    assert [x.id for x in bm.allocate_shared(t)] == [a[0].id]
    bm.check()
    # B's private blocks go back to the free list when B releases them (not cached).
    # (R9 allows publishing B's blocks 1.. on release; we only check the duplicate block 0.)
    free_before = bm.num_free_blocks
    dup_id = b[0].id
    bm.deallocate(b)
    assert pc.block_id(h[0]) == a[0].id
    assert bm.num_free_blocks >= free_before + 1
    assert dup_id not in [pc.block_id(x) for x in h]
    bm.check()


def test_r9_cache_skips_partial_last_block(bm):
    t = toks(7)
    blocks = bm.allocate(2)
    assert bm.cache(t, blocks) == 1
    assert blocks[1].hash is None
    assert blocks[1].ref_count == 1


def test_r7_r8_manager_matches_whole_sequence():
    """At the manager level every full block may match (R8's "leave one token" is the pool's)."""
    bm = kvpool.BlockManager(8, 4)
    t = toks(8)
    blocks = bm.allocate(2)
    bm.cache(t, blocks)
    assert len(bm.allocate_shared(t)) == 2


# ---------------------------------------------------------------------------------------------
# R7: forged hash collisions through debug_hash_bits
# ---------------------------------------------------------------------------------------------


def test_r7_forged_collision_first_block_never_returns_wrong_block():
    """k=1: of three distinct single-block prompts two must share a hash (pigeonhole).

    Whatever the cache does with the colliding inserts, a lookup may only return a block whose
    tokens equal the query, and the first writer is always found.
    """
    bm = kvpool.BlockManager(32, 2, debug_hash_bits=1)
    prompts = [[i, i + 1] for i in range(10, 40, 3)]  # 10 distinct one-block prompts
    content = {}
    held = []
    for p in prompts:
        blocks = bm.allocate(1)
        bm.cache(p, blocks)
        content[blocks[0].id] = tuple(p)
        held.append(blocks)
    # At most 2 distinct hash values exist for a block 0 with 1 bit: collisions happened.
    pc = bm.prefix_cache
    hashes = {b[0].hash for b in held if b[0].hash is not None}
    assert len(hashes) <= 2, "debug_hash_bits=1 leaves at most two distinct hashes for block 0"
    assert len(pc) < len(prompts) or len(hashes) < len(pc)  # collisions are real
    first = held[0][0]
    for p in prompts:
        hits = bm.allocate_shared(p)
        for h in hits:
            assert content[h.id] == tuple(p), f"hash collision handed out block {h.id} for {p}"
        bm.deallocate(hits)
    assert [h.id for h in bm.allocate_shared(prompts[0])] == [first.id]
    # queries never cached at all: no hit may come back
    for q in ([1000, 1001], [5, 5], [0, 0], [2**32 - 1, 3]):
        assert bm.allocate_shared(q) == []
    bm.check()


def test_r7_forged_collision_deep_block():
    """k=1, shared block 0: many different block-1 contents under one parent; about half share
    X1's hash, none may get X1."""
    for r in range(1, 40):
        bm = kvpool.BlockManager(32, 2, debug_hash_bits=1)
        root = [r, r + 1]
        x = bm.allocate(2)
        if bm.cache(root + [1, 1], x) == 2:  # X's own blocks may collide with each other (R9)
            break
    else:
        pytest.fail("no two-block chain could be cached with debug_hash_bits=1")
    for second in [[i, i] for i in range(2, 14)]:
        hits = bm.allocate_shared(root + second)
        assert [h.id for h in hits] == [x[0].id], "only the shared root block may match"
        bm.deallocate(hits)
    assert [h.id for h in bm.allocate_shared(root + [1, 1])] == [x[0].id, x[1].id]
    bm.check()


def test_r7_forged_collision_same_tokens_different_parent():
    """k=2: X = [a, s] is cached; Y0 = [b] (a different block 0, cached with another hash) is
    cached; the query [b, s] reaches block 1 with the same block tokens as X1. For about a
    quarter of the (b, s) pairs the truncated hashes collide too. X1 holds KV computed after
    [a], not [b]: it must never be returned (R7: "a hash collision can never hand out the wrong
    KV"; comparing the block's own tokens is not enough, the parent must match too)."""
    tried = 0
    for s in range(10, 22):
        for a in range(30, 60):
            bm = kvpool.BlockManager(64, 2, debug_hash_bits=2)
            x = bm.allocate(2)
            if bm.cache([a, a, s, s], x) == 2:
                break
        else:
            continue
        for b in range(100, 116):
            y0 = bm.allocate(1)
            if bm.cache([b, b], y0) != 1:
                bm.deallocate(y0)
                continue
            tried += 1
            hits = bm.allocate_shared([b, b, s, s])
            assert [h.id for h in hits] == [y0[0].id], f"[{b}, {b}, {s}, {s}] got {hits}"
            bm.deallocate(hits)
            bm.deallocate(y0)
            bm.evict(1)
        bm.check()
    assert tried >= 20


def test_r6_r7_forged_collision_same_tokens_other_namespace():
    """k=1: the same tokens under other extra keys; roots collide for about half of the keys, but
    different keys never share blocks (R6) and no collision hands out wrong KV (R7)."""
    bm = kvpool.BlockManager(16, 2, debug_hash_bits=1)
    t = [4, 5]
    x = bm.allocate(1)
    assert bm.cache(t, x) == 1
    for i in range(16):
        hits = bm.allocate_shared(t, extra_key=b"key-%d" % i)
        assert hits == [], f"extra_key {i} matched the default namespace"
    assert [h.id for h in bm.allocate_shared(t)] == [b.id for b in x]


@given(
    bits=st.integers(1, 3),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["cache", "query", "release", "evict"]),
            st.lists(st.integers(0, 2), min_size=2, max_size=8),
            st.sampled_from([None, b"x"]),
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_r7_random_collisions_never_return_wrong_kv(bits, ops):
    """Random inserts/lookups with 1-3 hash bits: every hit's (extra_key, token prefix) is exact.

    `content[id]` is the "KV" written into a block: the namespace and the whole token prefix up to
    the end of that block (KV depends on every earlier token).
    """
    bs = 2
    bm = kvpool.BlockManager(24, bs, debug_hash_bits=bits)
    content: dict[int, tuple] = {}
    groups: list[list] = []
    for kind, tokens, key in ops:
        nfull = len(tokens) // bs
        if kind == "cache":
            hits = bm.allocate_shared(tokens, extra_key=key)
            for i, h in enumerate(hits):
                assert content[h.id] == (key, tuple(tokens[: (i + 1) * bs]))
            need = nfull - len(hits)
            try:
                new = bm.allocate(need)
            except kvpool.OutOfBlocksError:
                bm.deallocate(hits)
                continue
            for j, b in enumerate(new):
                i = len(hits) + j
                content[b.id] = (key, tuple(tokens[: (i + 1) * bs]))  # "compute" the KV
            bm.cache(tokens, hits + new, extra_key=key)
            groups.append(hits + new)
        elif kind == "query":
            hits = bm.allocate_shared(tokens, extra_key=key)
            for i, h in enumerate(hits):
                assert content[h.id] == (key, tuple(tokens[: (i + 1) * bs]))
            bm.deallocate(hits)
        elif kind == "release" and groups:
            bm.deallocate(groups.pop(tokens[0] % len(groups)))
        elif kind == "evict":
            bm.evict(tokens[0] + 1)
        bm.check()
        assert bm.num_free_blocks + bm.num_cached_blocks + bm.num_used_blocks == 23


# ---------------------------------------------------------------------------------------------
# extra_key namespaces (R6)
# ---------------------------------------------------------------------------------------------


def test_r6_extra_keys_isolate_namespaces():
    bm = kvpool.BlockManager(16, 4)
    t = toks(8)
    a = bm.allocate(2)
    assert bm.cache(t, a, extra_key=b"tenant-a") == 2
    assert bm.allocate_shared(t) == []
    assert bm.allocate_shared(t, extra_key=b"tenant-b") == []
    hits = bm.allocate_shared(t, extra_key=b"tenant-a")
    assert [h.id for h in hits] == [x.id for x in a]
    bm.deallocate(hits)
    # the same tokens under another key get their own entries and blocks
    b = bm.allocate(2)
    assert bm.cache(t, b, extra_key=b"tenant-b") == 2
    c = bm.allocate(2)
    assert bm.cache(t, c) == 2
    assert len(bm.prefix_cache) == 6
    assert [h.id for h in bm.allocate_shared(t, extra_key=b"tenant-b")] == [x.id for x in b]
    assert [h.id for h in bm.allocate_shared(t)] == [x.id for x in c]
    bm.check()


def test_r6_extra_key_str_accepted():
    bm = kvpool.BlockManager(16, 4)
    t = toks(4)
    a = bm.allocate(1)
    assert bm.cache(t, a, extra_key="lora7") == 1
    hits = bm.allocate_shared(t, extra_key="lora7")
    assert [h.id for h in hits] == [a[0].id]
    assert bm.allocate_shared(t, extra_key="lora8") == []


def test_str_extra_key_equals_utf8_bytes():
    """ASSUMPTION beyond the contract: a str extra_key is its UTF-8 encoding (same namespace as bytes)."""
    t = toks(8)
    assert kvpool.hash_blocks(t, 4, extra_key="é-key") == kvpool.hash_blocks(
        t, 4, extra_key="é-key".encode()
    )


# ---------------------------------------------------------------------------------------------
# PrefixCache view
# ---------------------------------------------------------------------------------------------


def test_prefix_cache_view_contents():
    bm = kvpool.BlockManager(16, 4)
    pc = bm.prefix_cache
    assert isinstance(pc, kvpool.PrefixCache)
    assert len(pc) == 0
    t = toks(12)
    h = kvpool.hash_blocks(t, 4)
    assert not pc.contains(h[0])
    assert pc.block_id(h[0]) is None
    blocks = bm.allocate(3)
    bm.cache(t, blocks)
    assert len(pc) == 3
    assert [pc.block_id(x) for x in h] == [b.id for b in blocks]
    assert pc.block_id(b"\x00" * 16) is None
    assert not pc.contains(b"\x01" * 16)
    bm.deallocate(blocks)
    assert len(pc) == 3, "entries stay after the sequence releases them"
    bm.evict(1)
    assert len(pc) == 2
    bm.reset_prefix_cache()
    assert len(pc) == 0
    assert not any(pc.contains(x) for x in h)


def test_prefix_cache_view_lookups_do_not_touch_lru():
    """contains / block_id are read-only: they must not refresh recency (R11 is for hits)."""
    bm = kvpool.BlockManager(16, 4)
    ta, tb = toks(4), toks(4, start=50)
    a = bm.allocate(1)
    bm.cache(ta, a)
    bm.deallocate(a)
    b = bm.allocate(1)
    bm.cache(tb, b)
    bm.deallocate(b)
    ha = kvpool.hash_blocks(ta, 4)[0]
    hb = kvpool.hash_blocks(tb, 4)[0]
    pc = bm.prefix_cache
    for _ in range(3):
        assert pc.contains(ha)
        assert pc.block_id(ha) is not None
    assert bm.evict(1) == 1
    assert not pc.contains(ha) and pc.contains(hb)


def test_prefix_cache_query_and_hit_tokens():
    """ASSUMPTION beyond the contract (R20 defines these for the pool): at the manager level every
    allocate_shared looks up its full blocks (query_tokens += full blocks * block_size) and
    hit_tokens grows by the matched blocks * block_size."""
    bm = kvpool.BlockManager(16, 4)
    pc = bm.prefix_cache
    q0, h0 = pc.query_tokens, pc.hit_tokens
    assert (q0, h0) == (0, 0)
    t = toks(10)
    blocks = bm.allocate(2)
    bm.cache(t, blocks)
    bm.deallocate(bm.allocate_shared(t[:4] + [99] * 6))  # 2 full blocks looked up, 1 hit
    assert pc.query_tokens == 8
    assert pc.hit_tokens == 4
    bm.deallocate(bm.allocate_shared(t))
    assert pc.query_tokens == 16
    assert pc.hit_tokens == 12


def test_prefix_cache_hit_tokens_never_exceed_query_tokens():
    bm = kvpool.BlockManager(16, 4)
    pc = bm.prefix_cache
    t = toks(16)
    blocks = bm.allocate(4)
    bm.cache(t, blocks)
    for n in (0, 3, 4, 9, 16):
        bm.deallocate(bm.allocate_shared(t[:n]))
        assert 0 <= pc.hit_tokens <= pc.query_tokens


def test_r12_reset_prefix_cache_frees_cached_ids():
    bm = kvpool.BlockManager(16, 4)
    blocks = bm.allocate(4)
    bm.cache(toks(16), blocks)
    bm.deallocate(blocks)
    assert bm.num_cached_blocks == 4
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == 15
    assert bm.allocate_shared(toks(16)) == []
    bm.check()


def test_r3_r7_allocate_shared_miss_changes_no_counts():
    bm = kvpool.BlockManager(16, 4)
    before = bm_snapshot(bm)
    assert bm.allocate_shared(toks(3)) == []
    after = bm_snapshot(bm)
    for k in ("num_free_blocks", "num_cached_blocks", "num_used_blocks"):
        assert after[k] == before[k]
