"""R29: every public entry validates its arguments.

ValueError / TypeError with a message naming the argument; OverflowError accepted for integers out
of range; exhaustion is OutOfBlocksError (manager) or False (pool); misuse is ValueError; and no
error leaves anything changed.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import kvpool
import numpy as np
import pytest
from conftest import bm_snapshot, raises_bad_arg, seq_snapshot, toks

BAD_TOKEN_LISTS_RANGE = [[-1], [1, 2, -5], [2**32], [1, 2**40]]
BAD_TOKEN_LISTS_TYPE = [["a"], [1.5], [1, None], [[1, 2]]]


# ---------------------------------------------------------------------------------------------
# constructors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,arg,int_range",
    [
        ({"num_blocks": 1, "block_size": 4}, "num_blocks", False),
        ({"num_blocks": 0, "block_size": 4}, "num_blocks", False),
        ({"num_blocks": -3, "block_size": 4}, "num_blocks", True),
        ({"num_blocks": 8, "block_size": 0}, "block_size", False),
        ({"num_blocks": 8, "block_size": -1}, "block_size", True),
        ({"num_blocks": "8", "block_size": 4}, "num_blocks", False),
        ({"num_blocks": 8.0, "block_size": 4}, "num_blocks", False),
        ({"num_blocks": 8, "block_size": None}, "block_size", False),
        ({"num_blocks": 2**80, "block_size": 4}, "num_blocks", True),
    ],
)
def test_r1_r29_block_manager_constructor(kwargs, arg, int_range):
    raises_bad_arg(
        arg, kvpool.BlockManager, kwargs["num_blocks"], kwargs["block_size"], int_range=int_range
    )


@pytest.mark.parametrize("bits", [0, 129, 1000])
def test_r29_debug_hash_bits_range(bits):
    raises_bad_arg("debug_hash_bits", kvpool.BlockManager, 8, 4, debug_hash_bits=bits)


def test_r29_debug_hash_bits_bounds_accepted():
    kvpool.BlockManager(8, 4, debug_hash_bits=1)
    kvpool.BlockManager(8, 4, debug_hash_bits=128)


def test_r29_debug_hash_bits_type():
    raises_bad_arg("debug_hash_bits", kvpool.BlockManager, 8, 4, debug_hash_bits="3")
    raises_bad_arg("debug_hash_bits", kvpool.BlockManager, 8, 4, debug_hash_bits=-1, int_range=True)


def test_r29_hash_seed_bad():
    raises_bad_arg("hash_seed", kvpool.BlockManager, 8, 4, hash_seed="seed")
    raises_bad_arg("hash_seed", kvpool.BlockManager, 8, 4, hash_seed=-1, int_range=True)
    raises_bad_arg("hash_seed", kvpool.hash_blocks, toks(8), 4, hash_seed=-1, int_range=True)
    raises_bad_arg("hash_seed", kvpool.hash_blocks, toks(8), 4, hash_seed=1.5)


def test_r29_single_block_manager_constructor():
    raises_bad_arg("num_slots", kvpool.SingleBlockManager, "4")
    raises_bad_arg("num_slots", kvpool.SingleBlockManager, -4, int_range=True)


@pytest.mark.parametrize(
    "args,kwargs,arg,int_range",
    [
        ((1, 4), {}, "num_blocks", False),
        ((16, 0), {}, "block_size", False),
        ((16, 4), {"dp_size": 0}, "dp_size", False),
        ((16, 4), {"dp_size": -1}, "dp_size", True),
        ((16, 4), {"dp_size": "2"}, "dp_size", False),
        (("16", 4), {}, "num_blocks", False),
        ((16, 4), {"hash_seed": "x"}, "hash_seed", False),
    ],
)
def test_r29_pool_constructor(args, kwargs, arg, int_range):
    raises_bad_arg(arg, kvpool.BlockManagerPool, *args, int_range=int_range, **kwargs)


# ---------------------------------------------------------------------------------------------
# BlockManager methods
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def busy():
    """A manager with some used, cached and free blocks."""
    bm = kvpool.BlockManager(16, 4)
    cached = bm.allocate(2)
    bm.cache(toks(8), cached)
    bm.deallocate(cached)
    held = bm.allocate(3)
    bm.cache(toks(12, start=100), held)
    return bm, held


def test_r29_allocate_bad_n(busy):
    bm, _ = busy
    before = bm_snapshot(bm)
    raises_bad_arg("n", bm.allocate, -1, int_range=True)
    raises_bad_arg("n", bm.allocate, "2")
    raises_bad_arg("n", bm.allocate, 1.0)
    raises_bad_arg("n", bm.allocate, None)
    assert bm_snapshot(bm) == before


def test_r29_allocate_huge_n(busy):
    bm, _ = busy
    before = bm_snapshot(bm)
    for n in (16, 10**6):
        with pytest.raises(kvpool.OutOfBlocksError):
            bm.allocate(n)
    assert bm_snapshot(bm) == before


HUGE_N_SCRIPT = """
import kvpool
bm = kvpool.BlockManager(16, 4)
held = bm.allocate(3)
for n in (2**31, 2**32 + 1, 2**63 - 1, 2**64 - 1, 2**70):
    try:
        bm.allocate(n)
    except (OverflowError, kvpool.OutOfBlocksError, ValueError):
        pass
    else:
        raise SystemExit("allocate(%d) returned" % n)
    assert bm.num_free_blocks == 12, n
bm.check()
print("OK")
"""


def test_r29_allocate_huge_n_neither_panics_nor_aborts():
    """Huge n: OutOfBlocksError (or OverflowError / ValueError), never a Rust panic or an abort.

    Run in a subprocess: an allocation failure inside Rust aborts the whole interpreter."""
    r = subprocess.run(
        [sys.executable, "-c", HUGE_N_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "OK", (r.returncode, r.stderr[-2000:])


def test_r29_deallocate_bad_types(busy):
    bm, held = busy
    before = bm_snapshot(bm)
    raises_bad_arg("blocks", bm.deallocate, None)
    raises_bad_arg("blocks", bm.deallocate, 3)
    raises_bad_arg("blocks", bm.deallocate, [1, 2])
    raises_bad_arg("blocks", bm.deallocate, [held[0], "x"])
    assert bm_snapshot(bm) == before
    assert [b.ref_count for b in held] == [2, 2, 2]


def test_r29_deallocate_block_of_another_manager():
    """Foreign handle: ValueError and neither manager changes.

    Not listed word for word in R29 (it lists foreign *sequences*); a foreign handle is the same
    misuse at the manager level.
    """
    a = kvpool.BlockManager(8, 4)
    b = kvpool.BlockManager(8, 4)
    ha = a.allocate(2)
    hb = b.allocate(1)
    sa, sb = bm_snapshot(a), bm_snapshot(b)
    with pytest.raises(ValueError):
        b.deallocate(ha)
    with pytest.raises(ValueError):
        b.deallocate(hb + ha[:1])
    assert (bm_snapshot(a), bm_snapshot(b)) == (sa, sb)
    with pytest.raises(ValueError):
        b.cache(toks(8), ha)
    assert (bm_snapshot(a), bm_snapshot(b)) == (sa, sb)
    a.deallocate(ha)
    b.deallocate(hb)
    assert a.num_free_blocks == 7 and b.num_free_blocks == 7


@pytest.mark.parametrize("bad", BAD_TOKEN_LISTS_RANGE)
def test_r29_allocate_shared_tokens_out_of_range(busy, bad):
    bm, _ = busy
    before = bm_snapshot(bm)
    raises_bad_arg("token_ids", bm.allocate_shared, bad, int_range=True)
    assert bm_snapshot(bm) == before


@pytest.mark.parametrize("bad", BAD_TOKEN_LISTS_TYPE + [None, 5, "abcd"])
def test_r29_allocate_shared_tokens_bad_type(busy, bad):
    bm, _ = busy
    before = bm_snapshot(bm)
    raises_bad_arg("token_ids", bm.allocate_shared, bad)
    assert bm_snapshot(bm) == before


def test_r29_numpy_tokens_bad(busy):
    bm, _ = busy
    before = bm_snapshot(bm)
    raises_bad_arg("token_ids", bm.allocate_shared, np.array([1.0, 2.0, 3.0, 4.0]))
    raises_bad_arg(
        "token_ids", bm.allocate_shared, np.array([1, -2, 3, 4], dtype=np.int64), int_range=True
    )
    raises_bad_arg(
        "token_ids", bm.allocate_shared, np.array([1, 2**33, 3, 4], dtype=np.int64), int_range=True
    )
    raises_bad_arg("token_ids", bm.allocate_shared, np.zeros((2, 4), dtype=np.int64))
    assert bm_snapshot(bm) == before


def test_r29_numpy_tokens_good(busy):
    bm, _ = busy
    hits = bm.allocate_shared(np.arange(8, dtype=np.int64))
    assert len(hits) == 2
    hits2 = bm.allocate_shared(np.arange(8, dtype=np.uint32))
    assert [h.id for h in hits2] == [h.id for h in hits]


@pytest.mark.parametrize("bad", [5, 1.5, ["a"], object()])
def test_r29_extra_key_bad_type(busy, bad):
    bm, held = busy
    before = bm_snapshot(bm)
    raises_bad_arg("extra_key", bm.allocate_shared, toks(8), extra_key=bad)
    raises_bad_arg("extra_key", bm.cache, toks(12, start=100), held, extra_key=bad)
    raises_bad_arg("extra_key", kvpool.hash_blocks, toks(8), 4, extra_key=bad)
    assert bm_snapshot(bm) == before


def test_r29_cache_bad_args(busy):
    bm, held = busy
    before = bm_snapshot(bm)
    fresh = bm.allocate(2)
    before = bm_snapshot(bm)
    raises_bad_arg("token_ids", bm.cache, [-1] * 8, fresh, int_range=True)
    raises_bad_arg("token_ids", bm.cache, None, fresh)
    raises_bad_arg("blocks", bm.cache, toks(8, start=300), None)
    raises_bad_arg("blocks", bm.cache, toks(8, start=300), [1, 2])
    assert bm_snapshot(bm) == before
    assert [b.hash for b in fresh] == [None, None]


def test_r29_cache_with_released_handle_is_value_error(busy):
    bm, _ = busy
    fresh = bm.allocate(2)
    dead = bm.allocate(1)
    bm.deallocate(dead)
    before = bm_snapshot(bm)
    with pytest.raises(ValueError):
        bm.cache(toks(12, start=300), fresh + dead)
    assert bm_snapshot(bm) == before
    assert [b.hash for b in fresh] == [None, None]
    with pytest.raises(ValueError):
        bm.cache(toks(4, start=400), dead)
    assert bm_snapshot(bm) == before


def test_r29_evict_bad_n(busy):
    bm, _ = busy
    before = bm_snapshot(bm)
    raises_bad_arg("n", bm.evict, -1, int_range=True)
    raises_bad_arg("n", bm.evict, "1")
    assert bm_snapshot(bm) == before


def test_r29_hash_blocks_bad(busy):
    raises_bad_arg("block_size", kvpool.hash_blocks, toks(8), 0)
    raises_bad_arg("block_size", kvpool.hash_blocks, toks(8), -4, int_range=True)
    raises_bad_arg("block_size", kvpool.hash_blocks, toks(8), "4")
    raises_bad_arg("token_ids", kvpool.hash_blocks, [1, -1], 2, int_range=True)
    raises_bad_arg("token_ids", kvpool.hash_blocks, ["x", "y"], 2)


def test_r29_prefix_cache_view_bad_hash(busy):
    bm, _ = busy
    pc = bm.prefix_cache
    raises_bad_arg("block_hash", pc.contains, "not bytes")
    raises_bad_arg("block_hash", pc.block_id, 123)
    # Assumption beyond the contract: a hash that is not 16 bytes long is a ValueError (it can
    # never be a block hash); returning False/None would also be defensible.
    raises_bad_arg("block_hash", pc.contains, b"short")


def test_r29_single_block_manager_methods():
    sb = kvpool.SingleBlockManager(4)
    held = sb.allocate(1)
    before = (sb.num_free_blocks, sb.num_used_blocks)
    raises_bad_arg("n", sb.allocate, -1, int_range=True)
    raises_bad_arg("blocks", sb.deallocate, [1])
    sb.deallocate(held)
    with pytest.raises(ValueError):
        sb.deallocate(held)
    assert (sb.num_free_blocks, sb.num_used_blocks) == (before[0] + 1, before[1] - 1)
    del held
    gc.collect()
    assert sb.num_free_blocks == 3


# ---------------------------------------------------------------------------------------------
# Sequence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_TOKEN_LISTS_RANGE)
def test_r29_sequence_tokens_out_of_range(bad):
    raises_bad_arg("token_ids", kvpool.Sequence, bad, int_range=True)


@pytest.mark.parametrize("bad", BAD_TOKEN_LISTS_TYPE + [None, 3])
def test_r29_sequence_tokens_bad_type(bad):
    raises_bad_arg("token_ids", kvpool.Sequence, bad)


def test_r29_sequence_extra_key_bad_type():
    raises_bad_arg("extra_key", kvpool.Sequence, toks(4), extra_key=7)


def test_r29_append_token_bad_leaves_sequence_unchanged():
    s = kvpool.Sequence(toks(5))
    snap = seq_snapshot(s)
    for bad in (-1, 2**32):
        with pytest.raises((ValueError, OverflowError)):
            s.append_token(bad)
    with pytest.raises(TypeError):
        s.append_token("a")
    with pytest.raises(TypeError):
        s.append_token(None)
    assert seq_snapshot(s) == snap
    with pytest.raises((ValueError, OverflowError)):
        s.append_tokens([7, 8, -1])
    assert seq_snapshot(s) == snap, "append_tokens is all-or-nothing"
    with pytest.raises(TypeError):
        s.append_tokens([7, "x"])
    assert seq_snapshot(s) == snap
    with pytest.raises(TypeError):
        s.append_tokens(None)
    assert seq_snapshot(s) == snap


def test_r17_r29_num_computed_tokens_bad_values():
    pool = kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(toks(10))
    assert pool.allocate(s, num_tokens=6)  # holds 8 tokens
    s.num_computed_tokens = 4
    snap = seq_snapshot(s)
    before = pool.stats()
    for bad in (3, 9, 11, 10**6):
        with pytest.raises(ValueError, match="num_computed_tokens"):
            s.num_computed_tokens = bad
    with pytest.raises((ValueError, OverflowError)):
        s.num_computed_tokens = -1
    with pytest.raises(TypeError):
        s.num_computed_tokens = "5"
    with pytest.raises(TypeError):
        s.num_computed_tokens = 5.0
    assert seq_snapshot(s) == snap
    assert pool.stats() == before


def test_r17_num_computed_tokens_on_unallocated_sequence():
    s = kvpool.Sequence(toks(10))
    with pytest.raises(ValueError, match="num_computed_tokens"):
        s.num_computed_tokens = 1  # the (empty) table holds no token
    assert s.num_computed_tokens == 0


# ---------------------------------------------------------------------------------------------
# BlockManagerPool methods
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def pool_with_seq():
    pool = kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(toks(10))
    assert pool.allocate(s)
    return pool, s


@pytest.mark.parametrize("method", ["allocate", "can_allocate"])
def test_r14_r29_num_tokens_bad(pool_with_seq, method):
    pool, _ = pool_with_seq
    fresh = kvpool.Sequence(toks(10, start=100))
    fn = getattr(pool, method)
    before, snap = pool.stats(), seq_snapshot(fresh)
    for bad in (0, 11, 10**6):
        raises_bad_arg("num_tokens", fn, fresh, bad)
    raises_bad_arg("num_tokens", fn, fresh, -1, int_range=True)
    raises_bad_arg("num_tokens", fn, fresh, "3")
    raises_bad_arg("num_tokens", fn, fresh, num_tokens=2.5)
    assert pool.stats() == before
    assert seq_snapshot(fresh) == snap


@pytest.mark.parametrize(
    "method", ["allocate", "can_allocate", "can_append", "may_append", "cache", "deallocate"]
)
@pytest.mark.parametrize("bad", [None, "seq", 5, [1, 2]])
def test_r29_pool_seq_argument_type(pool_with_seq, method, bad):
    pool, _ = pool_with_seq
    before = pool.stats()
    raises_bad_arg("seq", getattr(pool, method), bad)
    assert pool.stats() == before


@pytest.mark.parametrize("method", ["can_append", "may_append"])
def test_r16_r29_lookahead_bad(pool_with_seq, method):
    pool, s = pool_with_seq
    before, snap = pool.stats(), seq_snapshot(s)
    raises_bad_arg("lookahead", getattr(pool, method), s, -1, int_range=True)
    raises_bad_arg("lookahead", getattr(pool, method), s, "1")
    assert (pool.stats(), seq_snapshot(s)) == (before, snap)


@pytest.mark.parametrize(
    "method", ["allocate", "can_allocate", "can_append", "may_append", "cache", "deallocate"]
)
def test_r29_foreign_sequence_is_value_error(method):
    """A sequence holding blocks of another pool: ValueError, neither pool nor seq changes."""
    p1 = kvpool.BlockManagerPool(16, 4)
    p2 = kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(toks(10))
    assert p1.allocate(s)
    s.num_computed_tokens = 10
    s.append_token(1)
    snap = (p1.stats(), p2.stats(), seq_snapshot(s))
    with pytest.raises(ValueError):
        getattr(p2, method)(s)
    assert (p1.stats(), p2.stats(), seq_snapshot(s)) == snap


@pytest.mark.parametrize("method", ["block_tables", "slot_mapping"])
def test_r19_r29_exports_bad_args(pool_with_seq, method):
    pool, s = pool_with_seq
    fn = getattr(pool, method)
    raises_bad_arg("seqs", fn, None)
    raises_bad_arg("seqs", fn, [s, "x"])
    raises_bad_arg("seqs", fn, 5)
    raises_bad_arg("group", fn, [s], group=-1, int_range=True)
    raises_bad_arg("group", fn, [s], group="0")
    # group 1 does not exist on a pool without a composite manager (R25 is another issue)
    raises_bad_arg("group", fn, [s], group=1)


def test_r19_r29_exports_foreign_sequence(pool_with_seq):
    """Assumption beyond the contract: exporting a sequence of another pool is a ValueError."""
    pool, _ = pool_with_seq
    other = kvpool.BlockManagerPool(16, 4)
    t = kvpool.Sequence(toks(5))
    assert other.allocate(t)
    with pytest.raises(ValueError):
        pool.block_tables([t])
    with pytest.raises(ValueError):
        pool.slot_mapping([t])


def test_r29_empty_sequence_cannot_be_allocated():
    """len 0: num_tokens defaults to 0, outside 1..len (R14); or the constructor refuses it."""
    pool = kvpool.BlockManagerPool(16, 4)
    try:
        s = kvpool.Sequence([])
    except ValueError as e:
        assert "token_ids" in str(e)
        return
    before = pool.stats()
    with pytest.raises(ValueError):
        pool.allocate(s)
    with pytest.raises(ValueError):
        pool.can_allocate(s)
    assert pool.stats() == before
    assert s.dp_rank is None


def test_r29_errors_never_panic_across_ffi():
    """No pyo3 PanicException (a BaseException, not an Exception) for any bad call."""
    bm = kvpool.BlockManager(8, 4)
    pool = kvpool.BlockManagerPool(8, 4)
    calls = [
        lambda: bm.allocate(-(2**70)),
        lambda: bm.evict(2**70),
        lambda: bm.cache(toks(4), []),
        lambda: bm.cache([], bm.allocate(1)),
        lambda: kvpool.hash_blocks([], 1),
        lambda: kvpool.hash_blocks(toks(4), 2**70),
        lambda: pool.block_tables([]),
        lambda: pool.slot_mapping([]),
        lambda: pool.drain_events(),
        lambda: pool.allocate(kvpool.Sequence(toks(4)), 2**70),
        lambda: pool.may_append(kvpool.Sequence(toks(4)), 2**70),
    ]
    for c in calls:
        try:
            c()
        except Exception:
            pass
        # BaseException subclasses other than Exception (PanicException) propagate and fail
    bm.check()
    pool.check()
