"""kvpool.BlockManager / kvpool.Block / kvpool.SingleBlockManager: rules R1-R5 and R10.

Prefix-cache specific behaviour (R6-R12) lives in test_prefix_cache.py; bad input (R29) in
test_bad_input.py; the model-based test in test_manager_stateful.py.
"""

from __future__ import annotations

import gc

import kvpool
import pytest
from conftest import assert_conservation, bm_counts, bm_snapshot, cdiv, toks

# ---------------------------------------------------------------------------------------------
# R1: construction, padding block 0, totals
# ---------------------------------------------------------------------------------------------


def test_error_hierarchy():
    assert issubclass(kvpool.KVPoolError, Exception)
    assert issubclass(kvpool.OutOfBlocksError, kvpool.KVPoolError)
    assert issubclass(kvpool.InvariantError, kvpool.KVPoolError)


@pytest.mark.parametrize("n,bs", [(2, 1), (3, 4), (16, 4), (100, 16), (1025, 128)])
def test_r1_fresh_manager_counts(n, bs):
    bm = kvpool.BlockManager(n, bs)
    assert bm.num_blocks == n
    assert bm.block_size == bs
    assert bm.num_total_blocks == n - 1
    assert bm.num_free_blocks == n - 1
    assert bm.num_cached_blocks == 0
    assert bm.num_used_blocks == 0
    assert bm.num_available_blocks == n - 1
    bm.check()


@pytest.mark.parametrize("n", [0, 1])
def test_r1_too_few_blocks_is_value_error(n):
    with pytest.raises(ValueError, match="num_blocks"):
        kvpool.BlockManager(n, 4)


def test_r1_block_size_zero_is_value_error():
    with pytest.raises(ValueError, match="block_size"):
        kvpool.BlockManager(8, 0)


def test_r1_padding_block_zero_never_handed_out():
    """R1: ids 1..N-1 only, all of them, each once, even after many rounds of reuse."""
    n = 33
    bm = kvpool.BlockManager(n, 2)
    for _round in range(5):
        blocks = bm.allocate(n - 1)
        ids = [b.id for b in blocks]
        assert sorted(ids) == list(range(1, n)), "exactly ids 1..N-1, no 0, no duplicate"
        with pytest.raises(kvpool.OutOfBlocksError):
            bm.allocate(1)
        bm.deallocate(blocks)
        assert bm.num_free_blocks == n - 1


def test_r1_padding_block_zero_not_handed_out_one_by_one():
    bm = kvpool.BlockManager(9, 4)
    got = []
    for _ in range(8):
        (b,) = bm.allocate(1)
        assert b.id != 0
        got.append(b)
    assert sorted(b.id for b in got) == list(range(1, 9))


def test_r1_smallest_manager_has_one_block():
    bm = kvpool.BlockManager(2, 1)
    (b,) = bm.allocate(1)
    assert b.id == 1
    with pytest.raises(kvpool.OutOfBlocksError):
        bm.allocate(1)


# ---------------------------------------------------------------------------------------------
# R2-R4: handles, ref counts, counts
# ---------------------------------------------------------------------------------------------


def test_r2_counts_follow_allocate_and_deallocate(bm):
    a = bm.allocate(5)
    assert bm.num_used_blocks == 5
    assert bm.num_free_blocks == 10
    assert_conservation(bm)
    b = bm.allocate(3)
    assert bm.num_used_blocks == 8
    bm.deallocate(a)
    assert bm.num_used_blocks == 3
    assert bm.num_free_blocks == 12
    bm.deallocate(b)
    assert bm.num_free_blocks == 15
    assert_conservation(bm)
    bm.check()


def test_r3_allocate_zero_returns_empty_list(bm):
    before = bm_snapshot(bm)
    assert bm.allocate(0) == []
    assert bm_snapshot(bm) == before


def test_r4_block_attributes(bm):
    blocks = bm.allocate(3)
    assert len({b.id for b in blocks}) == 3
    for b in blocks:
        assert isinstance(b, kvpool.Block)
        assert 1 <= b.id < 16
        assert b.ref_count == 1
        assert b.hash is None
        assert b.block_size == 4


def test_r4_drop_handle_returns_id(bm):
    """R4: dropping the last Python reference to a handle releases it (like deallocate)."""
    blocks = bm.allocate(4)
    assert bm.num_free_blocks == 11
    del blocks
    gc.collect()
    assert bm.num_free_blocks == 15
    assert bm.num_used_blocks == 0
    bm.check()


def test_r4_drop_one_handle_of_several(bm):
    blocks = bm.allocate(3)
    kept = [blocks[0], blocks[2]]
    dropped_id = blocks[1].id
    del blocks
    gc.collect()
    assert bm.num_used_blocks == 2
    assert bm.num_free_blocks == 13
    # The dropped id is free again; the kept ids are not handed out.
    again = bm.allocate(13)
    ids = {b.id for b in again}
    assert dropped_id in ids
    assert not ids & {b.id for b in kept}
    bm.check()


def test_r4_r5_drop_after_deallocate_is_not_a_second_release(bm):
    """R4/R5: a handle released by deallocate and then garbage collected frees its id once."""
    blocks = bm.allocate(2)
    bm.deallocate(blocks)
    assert bm.num_free_blocks == 15
    del blocks
    gc.collect()
    assert bm.num_free_blocks == 15
    assert_conservation(bm)
    everything = bm.allocate(15)
    assert sorted(b.id for b in everything) == list(range(1, 16)), "no id twice in the free list"
    with pytest.raises(kvpool.OutOfBlocksError):
        bm.allocate(1)
    bm.check()


def test_r5_double_deallocate_is_value_error_and_changes_nothing(bm):
    blocks = bm.allocate(2)
    other = bm.allocate(1)
    bm.deallocate(blocks)
    before = bm_snapshot(bm)
    with pytest.raises(ValueError):
        bm.deallocate(blocks)
    assert bm_snapshot(bm) == before
    with pytest.raises(ValueError):
        bm.deallocate([blocks[0]])
    assert bm_snapshot(bm) == before
    assert other[0].ref_count == 1
    bm.check()


def test_r5_r29_deallocate_list_with_one_released_handle_releases_nothing(bm):
    """R29: an error leaves nothing half-changed: the good handles of the list stay held."""
    a = bm.allocate(2)
    b = bm.allocate(1)
    bm.deallocate(b)
    before = bm_snapshot(bm)
    with pytest.raises(ValueError):
        bm.deallocate([a[0], b[0], a[1]])
    assert bm_snapshot(bm) == before
    assert bm.num_used_blocks == 2
    # The good handles are still valid and can be released normally afterwards.
    bm.deallocate(a)
    assert bm.num_free_blocks == 15
    bm.check()


def test_r5_r29_same_handle_twice_in_one_call_releases_nothing(bm):
    a = bm.allocate(2)
    before = bm_snapshot(bm)
    with pytest.raises(ValueError):
        bm.deallocate([a[0], a[0]])
    assert bm_snapshot(bm) == before
    bm.deallocate(a)
    assert bm.num_free_blocks == 15


def test_r5_deallocate_empty_list_is_noop(bm):
    before = bm_snapshot(bm)
    bm.deallocate([])
    assert bm_snapshot(bm) == before


def test_r3_out_of_blocks_is_all_or_nothing(bm):
    held = bm.allocate(12)
    before = bm_snapshot(bm)
    with pytest.raises(kvpool.OutOfBlocksError):
        bm.allocate(4)
    assert bm_snapshot(bm) == before
    more = bm.allocate(3)
    assert bm.num_free_blocks == 0
    bm.deallocate(held + more)
    bm.check()


def test_r3_out_of_blocks_is_kvpool_error(bm):
    with pytest.raises(kvpool.KVPoolError):
        bm.allocate(16)


# ---------------------------------------------------------------------------------------------
# Seed 003: block_size 4, 11 tokens -> 3 blocks, 1 empty slot in the last
# ---------------------------------------------------------------------------------------------


def test_seed003_eleven_tokens_three_blocks_one_empty_slot():
    bs = 4
    bm = kvpool.BlockManager(32, bs)
    n_tokens = 11
    blocks = bm.allocate(cdiv(n_tokens, bs))
    assert len(blocks) == 3
    assert len({b.id for b in blocks}) == 3
    assert 0 not in {b.id for b in blocks}
    # Internal fragmentation: capacity 12, one empty slot in the last page.
    assert len(blocks) * bs - n_tokens == 1
    # Only the two full blocks can be cached (R6).
    assert bm.cache(toks(n_tokens), blocks) == 2
    assert [b.hash is not None for b in blocks] == [True, True, False]
    assert bm.num_used_blocks == 3
    bm.deallocate(blocks)
    assert bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 31 - 2
    bm.check()


def test_seed003_shared_prefix_ref_count_two_one_zero():
    """Seed 003: a shared prefix block goes ref_count 2 -> 1 (still held) -> 0 (freed)."""
    bm = kvpool.BlockManager(8, 4)
    tokens = toks(4, start=100)
    (a,) = bm.allocate(1)
    assert bm.cache(tokens, [a]) == 1
    assert a.ref_count == 2  # A + the cache
    (b,) = bm.allocate_shared(tokens)
    assert b.id == a.id
    assert a.ref_count == 3 and b.ref_count == 3  # A, B, the cache
    # Drop the cache's reference: now exactly the two sequences share the block (seed picture).
    bm.reset_prefix_cache()
    assert a.ref_count == 2
    free_before = bm.num_free_blocks
    bm.deallocate([a])
    assert b.ref_count == 1
    assert bm.num_free_blocks == free_before, "still held by B: not freed"
    assert bm.num_used_blocks == 1
    bm.deallocate([b])
    assert bm.num_free_blocks == free_before + 1, "last reference gone: freed"
    assert bm.num_used_blocks == 0
    bm.check()


def test_r5_seed000_deallocate_is_not_free_while_cached():
    """R5 / seed 000 3.1: deallocate releases the sequence's handle; the cache keeps the id."""
    bm = kvpool.BlockManager(8, 4)
    blocks = bm.allocate(2)
    bm.cache(toks(8), blocks)
    assert [b.ref_count for b in blocks] == [2, 2]
    bm.deallocate(blocks)
    assert bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 5
    assert bm.num_used_blocks == 0
    assert bm.evict(2) == 2
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == 7
    bm.check()


def test_r4_ref_count_counts_every_handle():
    bm = kvpool.BlockManager(8, 2)
    t = toks(6)
    blocks = bm.allocate(3)
    assert bm.cache(t, blocks) == 3
    hits1 = bm.allocate_shared(t)
    hits2 = bm.allocate_shared(t)
    assert [h.id for h in hits1] == [b.id for b in blocks]
    assert [h.id for h in hits2] == [b.id for b in blocks]
    assert [b.ref_count for b in blocks] == [4, 4, 4]
    bm.deallocate(hits1)
    assert [b.ref_count for b in hits2] == [3, 3, 3]
    del hits2
    gc.collect()
    assert [b.ref_count for b in blocks] == [2, 2, 2]
    assert bm.num_used_blocks == 3
    bm.check()


# ---------------------------------------------------------------------------------------------
# R3 + R10: allocate evicts just enough, all-or-nothing with cached blocks
# ---------------------------------------------------------------------------------------------


def _cache_chain(bm, tokens, extra_key=None):
    """Allocate blocks for `tokens`, cache them, release them: the chain ends up cached."""
    bs = bm.block_size
    blocks = bm.allocate(len(tokens) // bs)
    n = bm.cache(tokens, blocks, extra_key=extra_key)
    hashes = [b.hash for b in blocks]
    ids = [b.id for b in blocks]
    bm.deallocate(blocks)
    return n, ids, hashes


def test_r3_allocate_uses_free_before_evicting():
    bm = kvpool.BlockManager(11, 4)  # 10 ids
    n, _, _ = _cache_chain(bm, toks(12))
    assert n == 3
    assert bm.num_free_blocks == 7
    blocks = bm.allocate(7)
    assert bm.num_cached_blocks == 3, "free ids suffice: nothing evicted"
    assert len(bm.prefix_cache) == 3
    bm.deallocate(blocks)


def test_r3_r10_allocate_evicts_just_enough():
    bm = kvpool.BlockManager(11, 4)  # 10 ids
    _cache_chain(bm, toks(12))  # 3 cached, 7 free
    blocks = bm.allocate(9)
    assert len(blocks) == 9
    assert len({b.id for b in blocks}) == 9
    assert bm.num_cached_blocks == 1, "evicts exactly 9 - 7 = 2"
    assert bm.num_free_blocks == 0
    assert bm.stats()["num_evictions"] == 2
    bm.check()


def test_r3_r10_allocate_all_available_evicts_everything():
    bm = kvpool.BlockManager(11, 4)
    _cache_chain(bm, toks(12))
    _cache_chain(bm, toks(8, start=50))
    assert bm.num_available_blocks == 10
    blocks = bm.allocate(10)
    assert sorted(b.id for b in blocks) == list(range(1, 11))
    assert len(bm.prefix_cache) == 0
    bm.check()


def test_r3_failed_allocate_with_cached_blocks_changes_nothing():
    """R3: free + cached < n -> OutOfBlocksError, no eviction, not even the LRU moves."""
    bm = kvpool.BlockManager(11, 4)
    _, ids_a, hashes_a = _cache_chain(bm, toks(8))  # older
    _, ids_b, hashes_b = _cache_chain(bm, toks(8, start=50))  # newer
    held = bm.allocate(5)
    assert bm.num_available_blocks == 5
    before = bm_snapshot(bm)
    with pytest.raises(kvpool.OutOfBlocksError):
        bm.allocate(6)
    assert bm_snapshot(bm) == before
    pc = bm.prefix_cache
    assert all(pc.contains(h) for h in hashes_a + hashes_b)
    # LRU untouched: the next eviction still takes chain A's tail (the oldest leaf).
    assert bm.evict(1) == 1
    assert not pc.contains(hashes_a[1])
    assert pc.contains(hashes_a[0]) and all(pc.contains(h) for h in hashes_b)
    bm.deallocate(held)
    bm.check()


# ---------------------------------------------------------------------------------------------
# R10: eviction order
# ---------------------------------------------------------------------------------------------


def test_r10_evict_oldest_chain_from_its_tail():
    bm = kvpool.BlockManager(16, 4)
    _, ids_a, ha = _cache_chain(bm, toks(12))  # A: 3 blocks, older
    _, ids_b, hb = _cache_chain(bm, toks(8, start=100))  # B: 2 blocks, newer
    pc = bm.prefix_cache
    order = []
    for _ in range(5):
        free_before = bm.num_free_blocks
        assert bm.evict(1) == 1
        assert bm.num_free_blocks == free_before + 1
        gone = [h for h in ha + hb if not pc.contains(h)]
        order.append([h for h in gone if h not in order][0])
        # prefix-closed at every moment (R10)
        for chain in (ha, hb):
            present = [pc.contains(h) for h in chain]
            assert present == sorted(present, reverse=True), present
    assert order == [ha[2], ha[1], ha[0], hb[1], hb[0]]
    assert bm.evict(1) == 0
    assert bm.num_free_blocks == 15
    bm.check()


def test_r10_r11_hit_makes_chain_recent():
    bm = kvpool.BlockManager(16, 4)
    ta, tb = toks(8), toks(8, start=100)
    _, _, ha = _cache_chain(bm, ta)
    _, _, hb = _cache_chain(bm, tb)
    hits = bm.allocate_shared(ta)  # A is now the most recently used
    assert [h.hash for h in hits] == ha
    bm.deallocate(hits)
    pc = bm.prefix_cache
    assert bm.evict(1) == 1
    assert not pc.contains(hb[1]) and pc.contains(hb[0])
    assert bm.evict(1) == 1
    assert not pc.contains(hb[0])
    assert all(pc.contains(h) for h in ha)
    assert bm.evict(1) == 1
    assert not pc.contains(ha[1]) and pc.contains(ha[0])


def test_r10_leaf_first_even_when_parent_is_older():
    """R10: among cached blocks only leaves are evictable; the LRU leaf goes first.

    A0 is cached first, then B0, then A1 (child of A0). A0 is the oldest block but has a cached
    child, so evict(1) takes B0 (the least recently used leaf).
    Interpretation note for the lead: this reads R10 as "least recently used among the leaves"; an
    implementation that instead evicts the descendants of the LRU block first would evict A1.
    """
    bm = kvpool.BlockManager(16, 4)
    ta = toks(8)
    tb = toks(4, start=100)
    a = bm.allocate(2)
    assert bm.cache(ta[:4], a[:1]) == 1  # A0
    (b,) = bm.allocate(1)
    assert bm.cache(tb, [b]) == 1  # B0
    assert bm.cache(ta, a) == 1  # A1 (A0 already there with the same block)
    ha = [a[0].hash, a[1].hash]
    hb = [b.hash]
    # release in insertion order, so "release refreshes recency" and "it does not" agree
    bm.deallocate([a[0]])
    bm.deallocate([b])
    bm.deallocate([a[1]])
    pc = bm.prefix_cache
    assert all(pc.contains(h) for h in ha + hb)
    assert bm.evict(1) == 1
    assert not pc.contains(hb[0])
    assert pc.contains(ha[0]) and pc.contains(ha[1])
    assert bm.evict(1) == 1
    assert not pc.contains(ha[1]) and pc.contains(ha[0])


def test_r10_never_evicts_a_held_block():
    bm = kvpool.BlockManager(16, 4)
    ta, tb = toks(12), toks(8, start=100)
    _, ids_a, ha = _cache_chain(bm, ta)  # older
    _, ids_b, hb = _cache_chain(bm, tb)
    held = bm.allocate_shared(ta)  # pins A (and refreshes it)
    assert [h.id for h in held] == ids_a
    assert bm.num_used_blocks == 3
    assert bm.num_cached_blocks == 2
    assert bm.evict(10) == 2, "only B's blocks are evictable"
    pc = bm.prefix_cache
    assert all(pc.contains(h) for h in ha)
    assert not any(pc.contains(h) for h in hb)
    assert [h.ref_count for h in held] == [2, 2, 2]
    # allocate can only use free blocks now
    assert bm.num_available_blocks == 12
    with pytest.raises(kvpool.OutOfBlocksError):
        bm.allocate(13)
    bm.deallocate(held)
    assert bm.evict(10) == 3
    assert bm.num_free_blocks == 15
    bm.check()


def test_r10_parent_of_held_block_is_not_evicted():
    """R10: a block is evicted only when no cached block descends from it.

    Holding only A1 (by releasing the A0 handle of a hit) leaves A0 held by the cache alone, but
    A0 has a cached descendant, so it must stay.
    """
    bm = kvpool.BlockManager(16, 4)
    ta = toks(8)
    _, ids_a, ha = _cache_chain(bm, ta)
    hits = bm.allocate_shared(ta)
    bm.deallocate([hits[0]])
    pc = bm.prefix_cache
    assert bm.evict(5) == 0
    assert pc.contains(ha[0]) and pc.contains(ha[1])
    bm.deallocate([hits[1]])
    assert bm.evict(5) == 2
    bm.check()


def test_r10_evict_returns_number_evicted(bm):
    assert bm.evict(3) == 0
    _cache_chain(bm, toks(8))
    assert bm.evict(0) == 0
    assert bm.num_cached_blocks == 2
    assert bm.evict(5) == 2
    assert bm.evict(5) == 0
    assert bm.stats()["num_evictions"] == 2


def test_r12_reset_keeps_held_blocks_with_their_holders():
    bm = kvpool.BlockManager(16, 4)
    ta, tb = toks(8), toks(8, start=100)
    _cache_chain(bm, ta)
    held_blocks = bm.allocate(2)
    bm.cache(tb, held_blocks)
    assert len(bm.prefix_cache) == 4
    bm.reset_prefix_cache()
    assert len(bm.prefix_cache) == 0
    assert bm.num_cached_blocks == 0
    assert bm.num_used_blocks == 2
    assert bm.num_free_blocks == 13
    assert [b.ref_count for b in held_blocks] == [1, 1]
    assert bm.allocate_shared(ta) == []
    assert bm.allocate_shared(tb) == []
    bm.deallocate(held_blocks)
    assert bm.num_free_blocks == 15
    bm.check()


# ---------------------------------------------------------------------------------------------
# stats (R20 at manager level)
# ---------------------------------------------------------------------------------------------


def test_r20_manager_stats_match_properties(bm):
    held = bm.allocate(3)
    _cache_chain(bm, toks(8))
    s = bm.stats()
    assert isinstance(s, dict)
    c = bm_counts(bm)
    for k in ("num_total_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks"):
        assert s[k] == c[k], k
    assert s["usage"] == pytest.approx(3 / 15)
    bm.deallocate(held)


# ---------------------------------------------------------------------------------------------
# prefix caching disabled
# ---------------------------------------------------------------------------------------------


def test_no_prefix_cache_manager():
    """enable_prefix_cache=False: prefix_cache is None, nothing is ever cached.

    Assumption beyond the contract (brief: SingleBlockManager semantics): allocate_shared returns []
    and cache returns 0 when the cache is disabled.
    """
    bm = kvpool.BlockManager(8, 4, enable_prefix_cache=False)
    assert bm.prefix_cache is None
    blocks = bm.allocate(2)
    assert bm.cache(toks(8), blocks) == 0
    assert bm.allocate_shared(toks(8)) == []
    bm.deallocate(blocks)
    assert bm.num_free_blocks == 7
    assert bm.num_cached_blocks == 0
    bm.check()


# ---------------------------------------------------------------------------------------------
# SingleBlockManager
# ---------------------------------------------------------------------------------------------


def test_single_block_manager_basics():
    sb = kvpool.SingleBlockManager(5)
    assert sb.block_size == 1
    assert sb.num_total_blocks == 4
    assert sb.num_free_blocks == 4
    blocks = sb.allocate(4)
    assert sorted(b.id for b in blocks) == [1, 2, 3, 4], "id 0 reserved"
    assert sb.num_used_blocks == 4
    with pytest.raises(kvpool.OutOfBlocksError):
        sb.allocate(1)
    assert sb.allocate_shared([1, 2, 3]) == []
    assert sb.cache([1, 2, 3, 4], blocks) == 0
    sb.deallocate(blocks[:2])
    assert sb.num_free_blocks == 2
    with pytest.raises(ValueError):
        sb.deallocate(blocks[:1])
    del blocks
    gc.collect()
    assert sb.num_free_blocks == 4
    assert sb.num_used_blocks == 0
    sb.check()


def test_single_block_manager_all_or_nothing():
    sb = kvpool.SingleBlockManager(4)
    held = sb.allocate(2)
    before = (sb.num_free_blocks, sb.num_used_blocks)
    with pytest.raises(kvpool.OutOfBlocksError):
        sb.allocate(2)
    assert (sb.num_free_blocks, sb.num_used_blocks) == before
    sb.deallocate(held)
    assert sb.num_free_blocks == 3


@pytest.mark.parametrize("n", [0, 1])
def test_single_block_manager_too_small(n):
    """Assumption beyond the contract: SingleBlockManager mirrors R1 (fewer than 2 slots -> ValueError)."""
    with pytest.raises(ValueError, match="num_slots"):
        kvpool.SingleBlockManager(n)


def test_r3_r10_head_released_before_tail_is_still_evictable():
    """R3: free + cached >= n -> n handles. A chain whose handles were released head first (one
    deallocate per block) is entirely cache-only, so all of it can be evicted, leaf first."""
    bm = kvpool.BlockManager(4, 4)  # 3 ids
    b = bm.allocate(2)
    assert bm.cache(toks(8), b) == 2
    bm.deallocate([b[0]])
    bm.deallocate([b[1]])
    assert bm.num_free_blocks == 1 and bm.num_cached_blocks == 2
    got = bm.allocate(3)
    assert sorted(x.id for x in got) == [1, 2, 3]
    assert len(bm.prefix_cache) == 0
    bm.check()


def test_r10_evict_n_takes_parent_after_its_last_child():
    """evict(n) keeps going: once a leaf is evicted its parent becomes a leaf in the same call."""
    bm = kvpool.BlockManager(8, 4)
    b = bm.allocate(3)
    assert bm.cache(toks(12), b) == 3
    for x in b:  # head first
        bm.deallocate([x])
    assert bm.evict(3) == 3
    assert bm.num_free_blocks == 7
