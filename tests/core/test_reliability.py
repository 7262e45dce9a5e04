"""Reliability: the findings F1-F13 of an outside differential/fuzz campaign, each
as a regression test asserting what the contract requires (the reproducers of
``../shared/reliability/`` turned into assertions), plus the checks that would have caught them:

* F1-F9: one test per reproducer (R10, R11, R14-R16, R22-R25, R29);
* F10: one test per error message listed, asserting the argument's name is in it (R29), and
  the one rule for bools;
* F11-F13: the remote tier against a real redis-server (tests/tiers/redis_helpers.py) or a failing
  tier object: per-block fetch failures, BaseExceptions propagating, the optional keyed MAC;
* the huge-count sweep: every count argument of every public method with 2**31, 2**40, 2**62,
  2**63 and 2**64-1, in subprocesses (an abort would kill only them): nothing aborts, panics
  (pyo3's PanicException is a BaseException) or wraps; constructor caps, one test each;
* the choices of docs/contract.md (LRU meaning, dp rank across pools, cache() on a
  sequence holding nothing).

The R15/R16 property test over random workloads is in rust/kvpool/tests/reliability.rs.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import kvpool
import numpy as np
import pytest
from kvpool.tiers.base import RemoteTier
from kvpool.tiers.host_transfer import NumpyTransferExecutor
from kvpool.tiers.payload import block_spec, decode_payload, encode_payload, make_namespace
from kvpool.tiers.redis import RedisRemoteTier
from redis_helpers import RedisServer  # tests/tiers/, on the path through tests/conftest.py

HUGE = [2**31, 2**40, 2**62, 2**63, 2**64 - 1]


def h(tokens, bs=4):
    return kvpool.hash_blocks(tokens, bs)


def slots(pool, rank=0):
    lsc = pool.linear_state_cache(rank)
    return dict(
        free=lsc.num_free_slots,
        live=lsc.num_live_slots,
        committed=lsc.num_committed_checkpoints,
        pinned=lsc.num_pinned_checkpoints,
        pending=lsc.num_pending_checkpoints,
        lru=lsc.lru_order(),
    )


# ============================================================================ F1-F9 reproducers
F1_SCRIPT = textwrap.dedent("""
    import kvpool
    for cls in (kvpool.BlockManager, kvpool.ConcurrentBlockManager, kvpool.SingleBlockManager):
        m = cls(16) if cls is kvpool.SingleBlockManager else cls(16, 4)
        for n in (17, 2**40, 2**61, 2**62, 2**63, 2**64 - 1):
            try:
                m.allocate(n)
                raise SystemExit(f"{cls.__name__}.allocate({n}) accepted")
            except kvpool.OutOfBlocksError:
                pass
        m.check()
        assert m.num_free_blocks == 15, m.num_free_blocks
        blocks = m.allocate(3)
        m.deallocate(blocks)
        m.check()
    print("ok")
""")


def test_f1_huge_allocate_is_out_of_blocks_on_every_manager():
    """repro_panic.py: allocate(2**40) aborted the process, n >= 2**62 raised PanicException;
    now OutOfBlocksError (an Exception) on all three managers, nothing changed (R3, R29)."""
    r = subprocess.run(
        [sys.executable, "-c", F1_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_f2_promote_keeps_a_checkpoint_an_in_flight_copy_holds_pinned():
    """repro_promote.py: a committed checkpoint whose slot an earlier, taken-but-uncommitted
    promote copy still holds counted as evictable: can_allocate True, allocate False (R15), and
    the failed allocate evicted a checkpoint (R14). Now it is pinned until that copy is done."""
    p = kvpool.BlockManagerPool(
        32, 4, linear_state_slots=4, linear_state_save="promote", checkpoint_interval=4
    )
    a = kvpool.Sequence(list(range(1, 14)))
    assert p.allocate(a)
    a.num_computed_tokens = 4
    p.cache(a)
    plan1 = p.take_linear_state_plan()  # the worker is busy with it
    a.num_computed_tokens = 8
    p.cache(a)
    p.commit_linear_state_plan(p.take_linear_state_plan())
    p.check()
    before = slots(p)
    assert before["pinned"] == 2 and before["lru"] == []
    b = kvpool.Sequence([77] * 6)
    assert p.can_allocate(b) is False
    assert p.allocate(b) is False
    assert slots(p) == before, "R14: the failed allocate changed nothing"
    p.check()
    p.commit_linear_state_plan(plan1)
    assert slots(p)["pinned"] == 0
    assert p.can_allocate(b) and p.allocate(b)
    p.check()


def test_f3_the_pools_view_refuses_what_the_pools_plans_own():
    """repro_lsview.py: through pool.linear_state_cache(r), commit / cancel of a pending slot a
    pool plan owns made a checkpoint matchable before the worker wrote it, or freed a slot the
    plan then overwrote (another sequence's live state). Now a ValueError naming the hash."""
    # 1. promote() of a running sequence's live slot.
    p = kvpool.BlockManagerPool(16, 4, linear_state_slots=4)
    a = kvpool.Sequence(list(range(10)))
    assert p.allocate(a)
    with pytest.raises(ValueError, match="live_slot"):
        p.linear_state_cache(0).promote(a.linear_state_slot, h(list(range(8)))[1])
    p.check()
    # 2. commit / 3. cancel of a planned save.
    for method in ("commit_checkpoint", "cancel_checkpoint"):
        p = kvpool.BlockManagerPool(16, 4, linear_state_slots=3, checkpoint_interval=4)
        a = kvpool.Sequence(list(range(10)))
        assert p.allocate(a)
        a.num_computed_tokens = 8
        p.cache(a)
        view = p.linear_state_cache(0)
        hash8 = h(list(range(8)))[1]
        before = (slots(p), p.stats())
        with pytest.raises(ValueError, match="prefix_hash") as e:
            getattr(view, method)(hash8)
        assert hash8.hex() in str(e.value)
        assert (slots(p), p.stats()) == before, "nothing changed"
        assert not view.contains(hash8), "not matchable before the worker wrote it"
        c = kvpool.Sequence([5] * 5)
        assert not p.allocate(c), "the planned slot is not free for another sequence"
        plan = p.take_linear_state_plan()
        p.commit_linear_state_plan(plan)
        assert view.contains(hash8)
        p.deallocate(a)  # its live slot is needed for the next one
        b = kvpool.Sequence(list(range(8)) + [99, 98])
        assert p.allocate(b) and b.num_cached_tokens == 8
        assert b.linear_state_restore_slot == plan.save_dst[0]
        p.check()
    # A checkpoint reserved through the view itself stays the caller's to commit or cancel.
    own = kvpool.BlockManagerPool(16, 4, linear_state_slots=4).linear_state_cache(0)
    mine = h([1, 2, 3, 4])[0]
    assert own.reserve_checkpoint(mine) is not None
    own.commit_checkpoint(mine)
    assert own.contains(mine)
    own.check()


def test_f4_can_append_counts_the_kept_tail_the_slide_makes_evictable():
    """repro_swa_canappend.py: with sliding window + prefix cache, can_append said False and
    may_append then succeeded (R16); one growth computation serves both now."""
    p = kvpool.BlockManagerPool(37, 4, sliding_window=17, swa_num_blocks=12)
    toks = [35, 16, 30, 14, 33, 43, 14, 15, 16, 1, 18, 18, 24, 41, 47, 23, 44, 36, 14, 11, 14, 10]
    s = kvpool.Sequence(toks, extra_key=b"a")
    assert p.allocate(s)
    s.num_computed_tokens = 20
    s.append_tokens([34, 29, 31, 39, 40, 31, 38, 10])
    p.deallocate(s)  # keeps the window tail of this turn
    assert p.allocate(s)  # the next turn hits its own prefix
    t = kvpool.Sequence([35, 16, 30, 14, 33, 43, 14, 15, 16, 1, 18, 18, 11, 13, 1])
    s.append_token(43)
    assert p.allocate(t)
    s.num_computed_tokens = 31
    assert p.stats()["window"]["num_free_blocks"] == 0
    assert p.can_append(s, 5) is True
    assert p.may_append(s, 5) is True
    p.check()


def test_f4_can_allocate_predicts_the_growth_of_an_allocated_sequence():
    """repro_swa_cangrow.py: the same slide-accounting gap in can_allocate for chunked prefill
    growth (R15)."""
    p = kvpool.BlockManagerPool(
        19, 2, dp_size=2, enable_prefix_cache=True, sliding_window=11, swa_num_blocks=11
    )
    s = kvpool.Sequence([44, 6, 33, 40, 10, 27, 25, 2, 13, 5, 16, 5])
    assert p.allocate(s)
    s.append_tokens([32, 34, 40, 23, 40])
    s.num_computed_tokens = 12
    p.deallocate(s)
    assert p.allocate(s)
    assert p.may_append(s, 2)
    s.append_tokens([27, 27, 33, 37, 41, 23, 13, 16, 23, 21])
    s.num_computed_tokens = 20
    assert p.can_allocate(s) is True
    assert p.allocate(s) is True
    p.check()


def test_f4_a_failed_may_append_changes_nothing_not_even_the_slide():
    """R16 all-or-nothing with a window: a no leaves tables and counts exactly as they were."""
    p = kvpool.BlockManagerPool(64, 2, sliding_window=3, swa_num_blocks=6)
    s = kvpool.Sequence(list(range(8)))
    assert p.allocate(s)
    s.num_computed_tokens = 8
    before = (p.stats(), s.group_block_table(1).tolist(), s.block_table.tolist())
    assert p.can_append(s, 40) is False
    assert p.may_append(s, 40) is False
    assert (p.stats(), s.group_block_table(1).tolist(), s.block_table.tolist()) == before
    assert p.may_append(s, 0) is True and s.group_block_table(1).tolist()[0] == 0, "slid now"
    p.check()


@pytest.mark.parametrize(
    "make",
    [lambda: kvpool.BlockManagerPool(16, 4), lambda: kvpool.HierarchyBlockManagerPool(16, 16, 4)],
)
def test_f5_len_plus_lookahead_never_wraps(make):
    """repro_lookahead_wrap.py: lookahead=2**64-1 wrapped len + lookahead and answered yes in
    can_append, may_append, may_append_all and advance. Now a correct no (R16)."""
    p = make()
    s = kvpool.Sequence(list(range(9)))
    assert p.allocate(s)
    for la in (2**63, 2**64 - 9, 2**64 - 1):
        assert p.can_append(s, la) is False
        assert p.may_append(s, la) is False
        if hasattr(p, "may_append_all"):
            assert p.may_append_all([s], la) == [0]
    assert s.block_table.tolist() == [1, 2, 3], "nothing was taken"
    if hasattr(p, "advance"):
        s.num_computed_tokens = len(s)
        assert p.advance([s], [5], lookahead=2**64 - 1) == [0]
    p.check()


def test_f5_first_needed_block_is_exact_for_every_count():
    w = kvpool.SlidingWindowBlockManager(16, 4, 8)
    for n in [0, 6, 7, 8, 11, 12, *HUGE]:
        assert w.first_needed_block(n) == max(n + 1 - 8, 0) // 4, n


def test_f6_a_save_left_untaken_past_its_boundary_is_dropped():
    """repro_stale_save.py: advanced past a second boundary before the first boundary's plan was
    taken, both saves read the live slot, and the first checkpoint got the later state (a later
    hit restored it). The stale save is dropped now (docs/contract.md)."""
    p = kvpool.BlockManagerPool(32, 4, linear_state_slots=8, checkpoint_interval=4)
    toks = list(range(1, 14))
    a = kvpool.Sequence(toks)
    assert p.allocate(a)
    a.num_computed_tokens = 4
    p.cache(a)
    a.num_computed_tokens = 8
    p.cache(a)  # the step ran without the plan of boundary 4
    plan = p.take_linear_state_plan()
    assert plan.save_hashes == [h(toks)[1]], "only the boundary-8 save remains"
    assert p.stats()["num_pending_checkpoints"] == 1, "the stale save's slot was freed"
    p.commit_linear_state_plan(plan)
    b = kvpool.Sequence(toks[:4] + [99, 98, 97])
    assert p.allocate(b)
    assert b.linear_state_restore_slot is None and b.num_cached_tokens == 0
    c = kvpool.Sequence(toks[:8] + [99])
    assert p.allocate(c) and c.num_cached_tokens == 8, "the boundary-8 checkpoint is good"
    p.check()


def test_f7_a_failed_reservation_is_retried_at_the_same_boundary():
    """repro_ls_boundary.py: a boundary whose checkpoint reservation failed (every slot live) was
    never retried by a later cache() at the same boundary once a slot was free (R24)."""
    p = kvpool.BlockManagerPool(20, 4, linear_state_slots=4, checkpoint_interval=4)
    x, y = kvpool.Sequence([9] * 5), kvpool.Sequence([8] * 5)
    a = kvpool.Sequence([1, 2, 3, 4, 5, 6])
    for s in (x, y, a):
        assert p.allocate(s)
    a.num_computed_tokens = 4
    p.cache(a)
    assert p.stats()["num_pending_checkpoints"] == 0
    p.deallocate(x)
    p.cache(a)
    assert p.stats()["num_pending_checkpoints"] == 1
    p.cache(a)
    assert p.stats()["num_pending_checkpoints"] == 1, "never twice"
    p.check()


def test_f8_a_parent_made_a_leaf_competes_by_its_own_recency():
    """repro_evict_order.py: after the leaf A3 is evicted its parent A2 is an evictable leaf
    older than B0, so strict LRU evicts A2 next and keeps B0 (R10)."""
    bm = kvpool.BlockManager(16, 2)
    A, B = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9]
    ha, hb = kvpool.hash_blocks(A, 2), kvpool.hash_blocks(B, 2)
    a = bm.allocate(3)
    bm.cache(A[:6], a)
    bm.deallocate(a)
    hit = bm.allocate_shared(A[:6])
    a3 = bm.allocate(1)
    assert bm.cache(A, hit + a3) == 1
    bm.deallocate(hit)
    bm.deallocate(a3)
    b = bm.allocate(1)
    bm.cache(B, b)
    bm.deallocate(b)
    assert bm.evict(2) == 2
    pc = bm.prefix_cache
    assert [pc.contains(x) for x in ha] == [True, True, False, False]
    assert pc.contains(hb[0])
    bm.check()


def test_f9_a_dropped_sequence_takes_its_lru_place_when_dropped():
    """repro_drop_lru.py: blocks released by dropping a Sequence got their LRU place only at the
    next drain, merged by depth with the blocks released after them (released earlier, ranked
    newer). Now the drop's time is the place: C (dropped first) is older than A."""
    p = kvpool.BlockManagerPool(10, 4)  # 9 blocks
    C = [2, 0, 2, 2, 2, 0, 1, 1, 0, 1, 1, 0]  # 3 blocks
    A = list(range(100, 124))  # 6 blocks
    c, a = kvpool.Sequence(C), kvpool.Sequence(A)
    for s in (c, a):
        assert p.allocate(s)
        s.num_computed_tokens = len(s)
        p.cache(s)
    del c
    gc.collect()
    p.deallocate(a)
    x = kvpool.Sequence([7] * 8, extra_key=b"x")
    assert p.allocate(x)  # 2 evictions: C's tail (C2, C1), C being least recently used
    probe_c = kvpool.Sequence(C[:8] + [9, 9, 9])
    assert p.allocate(probe_c) and probe_c.num_cached_tokens == 4, "only C0 is left of C"
    p.deallocate(probe_c)  # its 2 new blocks were A's tail (A5, A4): A lost nothing else
    probe_a = kvpool.Sequence(A + [1])
    assert p.allocate(probe_a) and probe_a.num_cached_tokens == 16
    p.check()


# ============================================================================ F10 messages
def raises_naming(exc, name, fn, *args, **kwargs):
    with pytest.raises(exc) as e:
        fn(*args, **kwargs)
    assert name in str(e.value), str(e.value)
    return e.value


@pytest.mark.parametrize(
    "value, exc", [(-1, ValueError), (2**64, OverflowError), (1.5, TypeError), (True, TypeError)]
)
def test_f10_seq_id_errors_name_seq_id(value, exc):
    raises_naming(exc, "seq_id", kvpool.Sequence, [1, 2], seq_id=value)
    assert kvpool.Sequence([1], seq_id=2**64 - 1).seq_id == 2**64 - 1


@pytest.mark.parametrize(
    "make, option",
    [
        (lambda **kw: kvpool.BlockManager(8, 4, **kw), "enable_prefix_cache"),
        (lambda **kw: kvpool.ConcurrentBlockManager(8, 4, **kw), "enable_prefix_cache"),
        (lambda **kw: kvpool.BlockManagerPool(8, 4, **kw), "enable_prefix_cache"),
        (lambda **kw: kvpool.BlockManagerPool(8, 4, **kw), "concurrent"),
        (lambda **kw: kvpool.BlockManagerPool(8, 4, **kw), "enable_events"),
        (lambda **kw: kvpool.HierarchyBlockManagerPool(8, 8, 4, **kw), "enable_prefix_cache"),
        (lambda **kw: kvpool.HierarchyBlockManagerPool(8, 8, 4, **kw), "concurrent"),
        (lambda **kw: kvpool.HierarchyBlockManagerPool(8, 8, 4, **kw), "enable_events"),
    ],
)
def test_f10_bool_options_name_themselves(make, option):
    for bad in ("yes", 1, 0, 0.0, [True]):
        raises_naming(TypeError, option, make, **{option: bad})
    make(**{option: np.True_})
    make(**{option: False})


def test_f10_batch_exports_name_seqs():
    p, other = kvpool.BlockManagerPool(16, 4), kvpool.BlockManagerPool(16, 4)
    s = kvpool.Sequence(list(range(6)))
    assert other.allocate(s)
    raises_naming(ValueError, "seqs", p.block_tables, [s])
    raises_naming(ValueError, "seqs", p.slot_mapping, [s])
    raises_naming(ValueError, "seqs", p.may_append_all, [s])
    raises_naming(ValueError, "seqs", p.advance, [s], [1])
    h2 = kvpool.HierarchyBlockManagerPool(16, 16, 4)
    raises_naming(ValueError, "seqs", h2.block_tables, [s])


def test_f10_out_of_range_ints_are_not_type_errors():
    s = kvpool.Sequence([1, 2, 3])
    for bad in (2**32, 2**64, 2**100, -1):
        e = raises_naming(ValueError, "token", s.append_token, bad)
        assert str(bad) in str(e)
    assert len(s) == 3
    p = kvpool.BlockManagerPool(16, 4)
    assert p.allocate(s)

    def set_computed(v):
        s.num_computed_tokens = v

    raises_naming(OverflowError, "num_computed_tokens", set_computed, 2**64)
    raises_naming(ValueError, "num_computed_tokens", set_computed, -1)
    raises_naming(ValueError, "num_computed_tokens", set_computed, 4)
    raises_naming(TypeError, "num_computed_tokens", set_computed, 1.0)
    assert s.num_computed_tokens == 0


def test_f10_big_endian_token_arrays_are_token_arrays():
    for dtype in (">i2", ">i4", ">i8", ">u4", ">u8", "<i4"):
        assert kvpool.Sequence(np.array([1, 2, 300], dtype=dtype)).token_ids == [1, 2, 300]
    raises_naming(ValueError, "token_ids", kvpool.Sequence, np.array([-1], dtype=">i4"))
    raises_naming(TypeError, "token_ids", kvpool.Sequence, np.array([1.0], dtype=">f8"))


def test_f10_debug_hash_bits_message_names_the_value_given():
    for bad in (0, 129, 2**20 + 1, 2**40):
        e = raises_naming(
            ValueError, "debug_hash_bits", kvpool.BlockManager, 8, 4, debug_hash_bits=bad
        )
        assert str(bad) in str(e)
    raises_naming(
        OverflowError, "debug_hash_bits", kvpool.BlockManager, 8, 4, debug_hash_bits=2**64
    )


def test_f10_one_rule_for_bools_never_an_int():
    """A bool is rejected as a token, a count, an id and a seed alike (TypeError naming it)."""
    raises_naming(TypeError, "token_ids", kvpool.Sequence, [True, 2])
    raises_naming(TypeError, "token_ids", kvpool.Sequence, (1, False))
    s = kvpool.Sequence([1])
    raises_naming(TypeError, "token", s.append_token, True)
    raises_naming(TypeError, "token_ids", s.append_tokens, [True])
    raises_naming(TypeError, "n", kvpool.BlockManager(8, 4).allocate, True)
    raises_naming(TypeError, "num_blocks", kvpool.BlockManager, True, 4)
    raises_naming(TypeError, "seq_id", kvpool.Sequence, [1], seq_id=False)
    raises_naming(TypeError, "hash_seed", kvpool.BlockManager, 8, 4, hash_seed=True)
    p = kvpool.BlockManagerPool(16, 4)
    assert p.allocate(s)
    raises_naming(TypeError, "lookahead", p.can_append, s, True)
    raises_naming(TypeError, "index", kvpool.SequenceBatch([s]).__getitem__, True)


# ============================================================================ F11-F13 remote tier
BS = 4
LAYERS = 2
SHAPE = (BS, 2, 8)  # block_size, kv heads, head dim
NS = make_namespace(
    "reliability-model",
    dtype="float16",
    num_kv_heads=2,
    head_dim=8,
    block_size=BS,
    num_layers=LAYERS,
)
SECRET = bytes(range(32))


@pytest.fixture
def server():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


def kv_of(tokens, layer, kind):
    """Deterministic "KV" of a block's tokens (what any instance would compute)."""
    t = np.asarray(tokens, dtype=np.float32).reshape(BS, 1, 1)
    base = t * 0.25 + layer * 3 + kind * 7 + np.arange(8, dtype=np.float32).reshape(1, 1, 8) * 0.5
    return np.broadcast_to(base, SHAPE).astype(np.float16)


class Instance:
    """A hierarchy pool with NumPy caches and an executor: one serving instance."""

    def __init__(self, tier, num_blocks=48, host_blocks=48):
        self.pool = kvpool.HierarchyBlockManagerPool(
            num_blocks, host_blocks, BS, remote=tier, remote_budget_ms=500.0
        )
        self.dev = [np.zeros((num_blocks, *SHAPE), np.float16) for _ in range(2 * LAYERS)]
        self.host = [np.zeros((host_blocks, *SHAPE), np.float16) for _ in range(2 * LAYERS)]
        self.ex = NumpyTransferExecutor(self.dev, self.host)

    def admit(self, prompts):
        """Allocates every prompt first (their fetches share one plan), then one executor step;
        verifies every cached block's KV (never wrong KV) and returns the cached tokens."""
        seqs = [kvpool.Sequence(p) for p in prompts]
        for s in seqs:
            assert self.pool.allocate(s)
        self.ex.step(self.pool)
        for s in seqs:
            table, toks = [int(b) for b in s.block_table], list(s.token_ids)
            for i in range(s.num_cached_tokens // BS):
                for a, arr in enumerate(self.dev):
                    np.testing.assert_array_equal(
                        arr[table[i]], kv_of(toks[i * BS : (i + 1) * BS], a // 2, a % 2)
                    )
        return seqs, [s.num_cached_tokens for s in seqs]

    def serve(self, prompts):
        seqs, cached = self.admit(prompts)
        for s in seqs:
            table, toks = [int(b) for b in s.block_table], list(s.token_ids)
            for i in range(s.num_computed_tokens // BS, len(s) // BS):
                for a, arr in enumerate(self.dev):
                    arr[table[i]] = kv_of(toks[i * BS : (i + 1) * BS], a // 2, a % 2)
            s.num_computed_tokens = len(s)
            self.pool.deallocate(s)
        self.ex.step(self.pool)
        self.pool.check()
        return cached

    def release(self, seqs):
        for s in seqs:
            self.pool.deallocate(s)
        self.ex.step(self.pool)
        self.pool.check()


def prompt(seed, n_blocks):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, 50_000, n_blocks * BS)] + [1]


def test_f11_a_bad_payload_fails_its_own_block_not_the_plan(server):
    """One fetch plan carries the blocks of several sequences: a corrupt block stops only its
    own sequence's chain; a checksum-valid payload of the wrong size fails only its block."""
    tier = RedisRemoteTier(server.url, NS)
    writer = Instance(tier)
    p1, p2, p3 = prompt(1, 4), prompt(2, 4), prompt(3, 4)
    writer.serve([p1, p2, p3])
    c1, c2, c3 = (kvpool.hash_blocks(p, BS) for p in (p1, p2, p3))
    raw = tier.get_many([c1[1]])[0]
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0xFF
    tier.put_many([c1[1]], [bytes(bad)])  # p1's block 1: corrupt
    spec = block_spec(writer.host)
    body = bytes(decode_payload(c2[2], spec, tier.get_many([c2[2]])[0]))
    short = encode_payload(c2[2], spec, body[:-2])
    assert decode_payload(c2[2], spec, short) is not None, "its checksum is valid"
    tier.put_many([c2[2]], [short])  # p2's block 2: valid checksum, wrong size
    reader = Instance(RedisRemoteTier(server.url, NS))
    seqs, cached = reader.admit([p1, p2, p3])
    assert cached == [1 * BS, 2 * BS, 4 * BS], "each chain stops at its own bad block"
    st = reader.pool.stats()["remote"]
    assert st["fetched_blocks"] == 1 + 2 + 4 and st["failed_fetch_blocks"] == 3 + 2
    assert st["corrupt"] >= 2
    reader.release(seqs)
    for inst in (writer, reader):
        inst.pool.reset_prefix_cache()
        st = inst.pool.stats()
        assert st["num_free_blocks"] == st["num_total_blocks"]
        assert st["host"]["num_free_blocks"] == st["host"]["num_total_blocks"]


class FailingTier(RemoteTier):
    """A tier whose exists_many raises ``error``; nothing stored."""

    def __init__(self, error):
        super().__init__()
        self.error = error
        self.calls = 0

    def exists_many(self, keys, *, timeout=None):
        self.calls += 1
        raise self.error

    def get_many(self, keys, *, timeout=None):
        return [None] * len(keys)

    def put_many(self, keys, payloads, *, timeout=None):
        return None


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3), GeneratorExit()])
def test_f12_base_exceptions_from_the_tier_propagate_with_the_pool_unchanged(error):
    tier = FailingTier(error)
    pool = kvpool.HierarchyBlockManagerPool(32, 32, BS, remote=tier)
    seq = kvpool.Sequence(list(range(100, 117)))
    before = pool.stats()
    with pytest.raises(type(error)):
        pool.allocate(seq)
    assert tier.calls == 1
    assert pool.stats() == before, "nothing changed, not even the lookup counters"
    assert seq.block_table.tolist() == [] and seq.dp_rank is None
    pool.check()


def test_f12_an_exception_from_the_tier_is_a_counted_miss():
    tier = FailingTier(RuntimeError("down"))
    pool = kvpool.HierarchyBlockManagerPool(32, 32, BS, remote=tier)
    seq = kvpool.Sequence(list(range(17)))
    assert pool.allocate(seq) and seq.num_cached_tokens == 0
    assert pool.stats()["remote"]["lookup_failures"] == 1
    pool.check()


def test_f13_mac_round_trip_and_forgeries_are_misses():
    key = kvpool.hash_blocks(list(range(BS)), BS)[0]
    spec = "float16:4x2x8"
    body = bytes(range(64))
    tagged = encode_payload(key, spec, body, mac_key=SECRET)
    assert bytes(decode_payload(key, spec, tagged, 64, mac_key=SECRET)) == body
    assert bytes(decode_payload(key, spec, tagged)) == body, "keyless readers check the checksum"
    assert decode_payload(key, spec, tagged, mac_key=bytes(32)) is None, "another key"
    forged = encode_payload(key, spec, b"\x00" * 64)  # a valid checksum, written without the key
    assert decode_payload(key, spec, forged) is not None
    assert decode_payload(key, spec, forged, mac_key=SECRET) is None, "unauthenticated"
    # Forged body with a recomputed checksum under the old tag; flipped tag; tag moved to
    # another block key.
    forged_body = encode_payload(key, spec, b"\x01" * 64, mac_key=bytes(16))[:-32] + tagged[-32:]
    assert decode_payload(key, spec, forged_body, mac_key=SECRET) is None
    flipped = bytearray(tagged)
    flipped[-1] ^= 1
    assert decode_payload(key, spec, bytes(flipped), mac_key=SECRET) is None
    other = kvpool.hash_blocks(list(range(1, BS + 1)), BS)[0]
    assert decode_payload(other, spec, tagged, mac_key=SECRET) is None
    for bad in (b"short", "a str key" * 4, bytes(65)):
        with pytest.raises(ValueError, match="mac_key"):
            encode_payload(key, spec, body, mac_key=bad)


def test_f13_mac_through_redis_a_forger_without_the_key_is_never_loaded(server):
    writer = Instance(RedisRemoteTier(server.url, NS, mac_key=SECRET))
    p, q = prompt(10, 4), prompt(11, 4)
    writer.serve([p])
    reader = Instance(RedisRemoteTier(server.url, NS, mac_key=SECRET))
    assert reader.serve([p]) == [4 * BS], "the round trip through the tier"
    stranger = Instance(RedisRemoteTier(server.url, NS, mac_key=bytes(32)))
    assert stranger.serve([p]) == [0], "another key reads nothing"
    # A forger without the key stores q's blocks with wrong KV and valid checksums.
    forger = RedisRemoteTier(server.url, NS)
    spec = block_spec(writer.host)
    chain = kvpool.hash_blocks(q, BS)
    forger.put_many(
        chain[:4], [encode_payload(k, spec, b"\x07" * (64 * 2 * LAYERS * 2)) for k in chain[:4]]
    )
    assert reader.serve([q]) == [0], "forged payloads are misses, never wrong KV"
    assert reader.pool.stats()["remote"]["corrupt"] >= 1
    with pytest.raises(ValueError, match="mac_key"):
        RedisRemoteTier(server.url, NS, mac_key=b"too short")


# ============================================================================ the huge-count sweep
SWEEP = textwrap.dedent('''
    """Runs every case of one family with every huge value; prints one JSON line per case."""
    import json, sys
    import numpy as np
    import kvpool

    HUGE = [2**31, 2**40, 2**62, 2**63, 2**64 - 1]
    ALLOWED = (ValueError, TypeError, OverflowError, IndexError, kvpool.OutOfBlocksError)

    def seq(n=9):
        return kvpool.Sequence(list(range(n)))

    def pool(cls=kvpool.BlockManagerPool, **kw):
        p = cls(32, 16, 4, **kw) if cls is kvpool.HierarchyBlockManagerPool else cls(32, 4, **kw)
        s = seq()
        assert p.allocate(s)
        return p, s

    def cached_manager(cls):
        m = cls(16, 4)
        b = m.allocate(2)
        m.cache(list(range(8)), b)
        m.deallocate(b)
        return m

    def checked(obj, result):
        obj.check()
        return result

    def pool_call(method, cls=kvpool.BlockManagerPool, **kw):
        def run(v):
            p, s = pool(cls, **kw)
            before = p.stats(), s.block_table.tolist()
            try:
                return method(p, s, v)
            finally:
                p.check()
                if before != (p.stats(), s.block_table.tolist()):
                    raise AssertionError("a call with a huge count changed the pool")
        return run

    def managers(cls):
        ctor = (lambda v: cls(v)) if cls is kvpool.SingleBlockManager else (lambda v: cls(v, 4))
        cases = [(f"{cls.__name__}(num_blocks)", "num", ctor)]
        if cls is not kvpool.SingleBlockManager:
            cases += [
                (f"{cls.__name__}(block_size)", "block_size", lambda v: cls(16, v)),
                (f"{cls.__name__}(debug_hash_bits)", "debug_hash_bits",
                 lambda v: cls(16, 4, debug_hash_bits=v)),
                (f"{cls.__name__}(hash_seed)", "hash_seed", lambda v: cls(16, 4, hash_seed=v).block_size),
                (f"{cls.__name__}.evict(n)", "n", lambda v: (lambda m: checked(m, m.evict(v)))(cached_manager(cls))),
            ]
        new = (lambda: cls(16)) if cls is kvpool.SingleBlockManager else (lambda: cls(16, 4))
        cases += [(f"{cls.__name__}.allocate(n)", "n", lambda v: (lambda m: checked(m, m.allocate(v)))(new()))]
        return cases

    def sequence_cases():
        def set_computed(v):
            p, s = pool()
            s.num_computed_tokens = v
        def group_table(v):
            p, s = pool()
            return s.group_block_table(v)
        def batch_index(v):
            return kvpool.SequenceBatch([seq()])[v]
        def negative_index(v):
            return kvpool.SequenceBatch([seq()])[-v]
        return [
            ("Sequence(token_ids)", "token_ids", lambda v: kvpool.Sequence([1, v]).token_ids),
            ("Sequence(token_ids array)", "token_ids",
             lambda v: kvpool.Sequence(np.array([1, v], dtype=np.uint64)).token_ids),
            ("Sequence(seq_id)", "seq_id", lambda v: kvpool.Sequence([1], seq_id=v).seq_id),
            ("Sequence.append_token(token)", "token", lambda v: seq().append_token(v)),
            ("Sequence.append_tokens(token_ids)", "token_ids", lambda v: seq().append_tokens([v])),
            ("Sequence.num_computed_tokens", "num_computed_tokens", set_computed),
            ("Sequence.group_block_table(group)", "group", group_table),
            ("SequenceBatch[index]", "index", batch_index),
            ("SequenceBatch[-index]", "index", negative_index),
            ("hash_blocks(block_size)", "block_size", lambda v: kvpool.hash_blocks([1, 2], v)),
            ("hash_blocks(hash_seed)", "hash_seed", lambda v: len(kvpool.hash_blocks([1, 2], 2, hash_seed=v))),
            ("hash_blocks(token_ids)", "token_ids", lambda v: kvpool.hash_blocks([v, 2], 2)),
        ]

    def pool_cases(cls):
        name = cls.__name__
        ctor = ((lambda **kw: cls(32, 16, 4, **kw)) if cls is kvpool.HierarchyBlockManagerPool
                else (lambda **kw: cls(32, 4, **kw)))
        cases = [
            (f"{name}(num_blocks)", "num_blocks",
             (lambda v: cls(v, 16, 4)) if cls is kvpool.HierarchyBlockManagerPool else (lambda v: cls(v, 4))),
            (f"{name}(block_size)", "block_size",
             (lambda v: cls(32, 16, v)) if cls is kvpool.HierarchyBlockManagerPool else (lambda v: cls(32, v))),
            (f"{name}(dp_size)", "dp_size", lambda v: ctor(dp_size=v)),
            (f"{name}(num_single_blocks)", "num_single_blocks", lambda v: ctor(num_single_blocks=v)),
            (f"{name}(hash_seed)", "hash_seed", lambda v: ctor(hash_seed=v).block_size),
            (f"{name}(debug_hash_bits)", "debug_hash_bits", lambda v: ctor(debug_hash_bits=v)),
            (f"{name}.can_allocate(num_tokens)", "num_tokens", pool_call(lambda p, s, v: p.can_allocate(seq(), v), cls)),
            (f"{name}.allocate(num_tokens)", "num_tokens", pool_call(lambda p, s, v: p.allocate(seq(), v), cls)),
            (f"{name}.allocate(num_tokens) growth", "num_tokens", pool_call(lambda p, s, v: p.allocate(s, v), cls)),
            (f"{name}.can_append(lookahead)", "lookahead", pool_call(lambda p, s, v: p.can_append(s, v), cls)),
            (f"{name}.may_append(lookahead)", "lookahead", pool_call(lambda p, s, v: p.may_append(s, v), cls)),
            (f"{name}.block_tables(group)", "group", pool_call(lambda p, s, v: p.block_tables([s], v), cls)),
            (f"{name}.slot_mapping(group)", "group", pool_call(lambda p, s, v: p.slot_mapping([s], v), cls)),
        ]
        if cls is kvpool.HierarchyBlockManagerPool:
            cases += [("HierarchyBlockManagerPool(host_num_blocks)", "host_num_blocks", lambda v: cls(32, v, 4))]
        else:
            cases += [
                (f"{name}(linear_state_slots)", "linear_state_slots", lambda v: ctor(linear_state_slots=v)),
                (f"{name}(checkpoint_interval)", "checkpoint_interval",
                 lambda v: ctor(linear_state_slots=4, checkpoint_interval=v).num_blocks),
                (f"{name}(sliding_window)", "sliding_window", lambda v: ctor(sliding_window=v).num_groups),
                (f"{name}(swa_num_blocks)", "swa_num_blocks", lambda v: ctor(sliding_window=8, swa_num_blocks=v)),
                (f"{name}.may_append_all(lookahead)", "lookahead", pool_call(lambda p, s, v: p.may_append_all([s], v))),
                (f"{name}.advance(lookahead)", "lookahead", advance_case),
                (f"{name}.advance(token_ids)", "token_ids", advance_token_case),
                (f"{name}.linear_state_cache(dp_rank)", "dp_rank",
                 lambda v: ctor(linear_state_slots=4).linear_state_cache(v)),
                (f"{name}(sliding_window).can_append(lookahead)", "lookahead",
                 pool_call(lambda p, s, v: p.can_append(s, v), sliding_window=8)),
                (f"{name}(sliding_window).may_append(lookahead)", "lookahead",
                 pool_call(lambda p, s, v: p.may_append(s, v), sliding_window=8)),
            ]
        return cases

    def advance_case(v):
        p, s = pool()
        s.num_computed_tokens = len(s)
        out = p.advance([s], [5], lookahead=v)
        p.check()
        assert out == [0], out
        return out

    def advance_token_case(v):
        p, s = pool()
        before = p.stats(), len(s)
        try:
            return p.advance([s], [v])
        except ValueError:
            assert (p.stats(), len(s)) == before, "a rejected advance changed the pool"
            raise
        finally:
            p.check()

    def hybrid_cases():
        def lsc():
            return kvpool.LinearStatePrefixCache(8)
        def committed():
            c = lsc()
            c.reserve_checkpoint(kvpool.hash_blocks([1, 2], 2)[0])
            c.commit_checkpoint(kvpool.hash_blocks([1, 2], 2)[0])
            return c
        return [
            ("LinearStatePrefixCache(num_slots)", "num_slots", lambda v: kvpool.LinearStatePrefixCache(v)),
            ("LinearStatePrefixCache.release_live_slot(slot)", "slot", lambda v: lsc().release_live_slot(v)),
            ("LinearStatePrefixCache.promote(live_slot)", "live_slot",
             lambda v: lsc().promote(v, kvpool.hash_blocks([1, 2], 2)[0])),
            ("LinearStatePrefixCache.evict(n)", "n", lambda v: (lambda c: checked(c, c.evict(v)))(committed())),
            ("SlidingWindowBlockManager(num_blocks)", "num_blocks", lambda v: kvpool.SlidingWindowBlockManager(v, 4, 8)),
            ("SlidingWindowBlockManager(block_size)", "block_size", lambda v: kvpool.SlidingWindowBlockManager(16, v, 8)),
            ("SlidingWindowBlockManager(window)", "window",
             lambda v: kvpool.SlidingWindowBlockManager(16, 4, v).first_needed_block(v)),
            ("SlidingWindowBlockManager.first_needed_block(num_computed_tokens)", "num_computed_tokens",
             lambda v: kvpool.SlidingWindowBlockManager(16, 4, 8).first_needed_block(v)),
            ("SlidingWindowBlockManager.allocate(n)", "n",
             lambda v: (lambda m: checked(m, m.allocate(v)))(kvpool.SlidingWindowBlockManager(16, 4, 8))),
            ("CompositeBlockManager(num_blocks)", "groups", lambda v: kvpool.CompositeBlockManager([(v, 4, None)])),
            ("CompositeBlockManager(block_size)", "groups", lambda v: kvpool.CompositeBlockManager([(16, v, None)])),
            ("CompositeBlockManager(window)", "groups", lambda v: kvpool.CompositeBlockManager([(16, 4, v)]).num_groups),
            ("CompositeBlockManager.allocate(n)", "n",
             lambda v: (lambda m: checked(m, m.allocate(0, v)))(kvpool.CompositeBlockManager([(16, 4, None)]))),
            ("CompositeBlockManager.allocate(group)", "group",
             lambda v: kvpool.CompositeBlockManager([(16, 4, None)]).allocate(v, 1)),
            ("CompositeBlockManager.counts(group)", "group",
             lambda v: kvpool.CompositeBlockManager([(16, 4, None)]).counts(v)),
        ]

    FAMILIES = {
        "managers": lambda: managers(kvpool.BlockManager) + managers(kvpool.ConcurrentBlockManager)
        + managers(kvpool.SingleBlockManager),
        "sequence": sequence_cases,
        "pool": lambda: pool_cases(kvpool.BlockManagerPool),
        "hierarchy": lambda: pool_cases(kvpool.HierarchyBlockManagerPool),
        "hybrid": hybrid_cases,
    }

    for label, arg, call in FAMILIES[sys.argv[1]]():
        for v in HUGE:
            try:
                result = call(v)
                out = {"outcome": "ok", "result": repr(result)[:80]}
            except ALLOWED as e:
                out = {"outcome": type(e).__name__, "message": str(e)[:200]}
            except BaseException as e:  # PanicException, AssertionError, ...: a failure
                out = {"outcome": "FAIL " + type(e).__module__ + "." + type(e).__name__,
                       "message": str(e)[:200]}
            print(json.dumps({"case": label, "arg": arg, "value": v, **out}), flush=True)
''')


def run_sweep(family):
    r = subprocess.run(
        [sys.executable, "-c", SWEEP, family], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"the sweep aborted (rc {r.returncode}): {r.stderr[-2000:]}"
    return [json.loads(line) for line in r.stdout.splitlines()]


# Results the contract allows for a huge count that is not an error: the exact value.
EXACT = {
    "Sequence(token_ids)": {2**31: "[1, 2147483648]"},
    "Sequence(token_ids array)": {2**31: "[1, 2147483648]"},
    "Sequence(seq_id)": {v: repr(v) for v in HUGE},
    "Sequence.append_token(token)": {2**31: "None"},
    "Sequence.append_tokens(token_ids)": {2**31: "None"},
    "hash_blocks(token_ids)": {2**31: None},
    "SlidingWindowBlockManager.first_needed_block(num_computed_tokens)": {
        v: repr(max(v - 7, 0) // 4) for v in HUGE
    },
    "SlidingWindowBlockManager(window)": {v: "0" for v in HUGE},
    "hash_blocks(block_size)": {v: "[]" for v in HUGE},  # no full block of that size
    "BlockManagerPool.advance(token_ids)": {2**31: "None"},  # a valid token id
}
NO = {"can_append", "may_append", "can_allocate", "allocate", "may_append_all", "advance"}


@pytest.mark.parametrize("family", ["managers", "sequence", "pool", "hierarchy", "hybrid"])
def test_huge_count_sweep_nothing_aborts_panics_or_wraps(family):
    """Every count argument of every public method with 2**31, 2**40, 2**62, 2**63, 2**64-1
    (in a subprocess: an abort kills only it). Each call either raises a ValueError /
    TypeError / OverflowError / IndexError naming its argument or OutOfBlocksError, or answers
    a correct "no", or (where the value is valid) gives the exact result; the structure's
    check() passes afterwards and a rejected call changed nothing (R29, F1, F5)."""
    results = run_sweep(family)
    assert len(results) >= 5 * 8
    failures = [r for r in results if r["outcome"].startswith("FAIL")]
    assert not failures, failures[:5]
    for r in results:
        case, v = r["case"], r["value"]
        if r["outcome"] == "ok":
            method = case.split(".")[-1].split("(")[0]
            if case in EXACT and v in EXACT[case]:
                expected = EXACT[case][v]
                assert expected is None or r["result"] == expected, r
            elif "(" in case and case.split("(")[0] in NO or method in NO:
                assert r["result"] in ("False", "[0]"), r
            elif case.endswith(
                (
                    "(hash_seed)",
                    "(checkpoint_interval)",
                    "(sliding_window)",
                    "CompositeBlockManager(window)",
                )
            ):
                pass  # valid values: a seed, an interval, a window (no size, no cap)
            elif method == "evict":
                assert r["result"] in ("0", "1", "2"), r
            else:
                raise AssertionError(f"a huge count was accepted: {r}")
        elif r["outcome"] != "OutOfBlocksError":
            assert r["arg"] in r["message"], f"the error does not name its argument: {r}"


# ============================================================================ constructor caps
CAP_BLOCKS = 2**30  # kvpool::MAX_BLOCKS (docs/contract.md, "Choice: sizes and counts")


@pytest.mark.parametrize(
    "arg, make",
    [
        ("num_blocks", lambda n: kvpool.BlockManager(n, 1)),
        ("num_blocks", lambda n: kvpool.ConcurrentBlockManager(n, 1)),
        ("num_slots", lambda n: kvpool.SingleBlockManager(n)),
        ("num_slots", lambda n: kvpool.LinearStatePrefixCache(n)),
        ("num_blocks", lambda n: kvpool.SlidingWindowBlockManager(n, 1, 8)),
        ("groups", lambda n: kvpool.CompositeBlockManager([(16, 4, None), (n, 1, 8)])),
        ("num_blocks", lambda n: kvpool.BlockManagerPool(n, 1)),
        ("num_single_blocks", lambda n: kvpool.BlockManagerPool(16, 4, num_single_blocks=n)),
        ("linear_state_slots", lambda n: kvpool.BlockManagerPool(16, 4, linear_state_slots=n)),
        (
            "swa_num_blocks",
            lambda n: kvpool.BlockManagerPool(16, 4, sliding_window=8, swa_num_blocks=n),
        ),
        ("num_blocks", lambda n: kvpool.HierarchyBlockManagerPool(n, 16, 1)),
        ("host_num_blocks", lambda n: kvpool.HierarchyBlockManagerPool(16, n, 1)),
    ],
)
def test_block_and_slot_counts_are_capped_at_2_to_the_30(arg, make):
    """Above the cap: a ValueError naming the argument and the cap, never an attempt."""
    for n in (CAP_BLOCKS + 1, 2**31, 2**40):
        e = raises_naming(ValueError, arg, make, n)
        assert str(CAP_BLOCKS) in str(e), str(e)


@pytest.mark.parametrize(
    "make",
    [
        lambda bs: kvpool.BlockManager(16, bs),
        lambda bs: kvpool.ConcurrentBlockManager(16, bs),
        lambda bs: kvpool.SlidingWindowBlockManager(16, bs, 8),
        lambda bs: kvpool.BlockManagerPool(16, bs),
        lambda bs: kvpool.HierarchyBlockManagerPool(16, 16, bs),
    ],
)
def test_block_size_is_capped_at_2_to_the_16(make):
    for bs in (2**16 + 1, 2**31):
        e = raises_naming(ValueError, "block_size", make, bs)
        assert "65536" in str(e)
    make(2**16)


def test_tokens_per_manager_are_capped_below_2_to_the_40():
    raises_naming(ValueError, "num_blocks", kvpool.BlockManager, 2**25, 2**15)


@pytest.mark.parametrize(
    "make",
    [
        lambda n: kvpool.BlockManagerPool(16, 4, dp_size=n),
        lambda n: kvpool.HierarchyBlockManagerPool(16, 16, 4, dp_size=n),
    ],
)
def test_dp_size_is_capped_at_1024(make):
    raises_naming(ValueError, "dp_size", make, 1025)
    make(2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs RLIMIT_AS")
@pytest.mark.parametrize(
    "make",
    [
        "kvpool.BlockManager(2**30, 2**9)",
        "kvpool.BlockManagerPool(2**29, 16, dp_size=64)",
        "kvpool.HierarchyBlockManagerPool(16, 2**30, 2**9)",
        "kvpool.LinearStatePrefixCache(2**30)",
    ],
)
def test_within_the_caps_an_impossible_size_is_a_value_error_not_an_abort(make):
    """Sizes inside the caps that the machine cannot hold: the whole footprint is asked for in
    one request before any array is filled, so it is a ValueError, never an abort or the OOM
    killer. In a subprocess whose address space is limited to 6 GiB, so the test behaves the
    same on every machine and can never exhaust this one."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    script = textwrap.dedent(f"""
        import kvpool
        try:
            {make}
            print("allocated")
        except ValueError as e:
            assert "num_" in str(e), e
            print("refused")
    """)
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, preexec_fn=limit
    )
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stdout + r.stderr[-2000:]


# ============================================================================ contract choices
def test_lru_is_the_time_of_the_last_release_not_of_the_last_hit():
    """docs/contract.md (R10, R11 choice): a block hit long ago but released last is the newest."""
    bm = kvpool.BlockManager(8, 2)
    old, new = [1, 2], [3, 4]
    a = bm.allocate(1)
    bm.cache(old, a)
    b = bm.allocate(1)
    bm.cache(new, b)
    hit = bm.allocate_shared(old)  # hit "old" first, while it is still held
    bm.deallocate(a)
    bm.deallocate(b)  # "new" becomes cache-only now
    assert bm.eviction_order() == [b[0].id]
    bm.deallocate(hit)  # "old" becomes cache-only last: it is the most recently used
    assert bm.eviction_order() == [b[0].id, a[0].id]
    assert bm.evict(1) == 1
    assert bm.prefix_cache.contains(kvpool.hash_blocks(old, 2)[0])
    bm.check()


def test_a_table_is_released_tail_first():
    bm = kvpool.BlockManager(8, 2)
    blocks = bm.allocate(3)
    bm.cache(list(range(6)), blocks)
    bm.deallocate(blocks)
    assert bm.eviction_order() == [b.id for b in reversed(blocks)]


def test_dp_rank_is_kept_across_pools_when_the_other_pool_has_it():
    a = kvpool.BlockManagerPool(16, 4, dp_size=2)
    b = kvpool.BlockManagerPool(16, 4, dp_size=2)
    small = kvpool.BlockManagerPool(16, 4, dp_size=1)
    filler = kvpool.Sequence(list(range(20)))
    assert a.allocate(filler) and filler.dp_rank == 0
    s = kvpool.Sequence(list(range(100, 109)))
    assert a.allocate(s) and s.dp_rank == 1  # R13: the rank with more blocks available
    a.deallocate(s)
    other = kvpool.Sequence(list(range(200, 240)))
    assert b.allocate(other) and other.dp_rank == 0
    # In b, rank 0 is busier, but s keeps its rank... even when rank 1 would be the R13 choice
    # or not: it is the sequence's.
    assert b.allocate(s) and s.dp_rank == 1
    b.deallocate(s)
    assert small.allocate(s) and s.dp_rank == 0, "a rank the pool lacks is chosen afresh"
    small.deallocate(s)
    assert s.dp_rank == 0, "and kept from then on"
    for p in (a, b, small):
        p.check()


def test_cache_and_deallocate_of_a_sequence_holding_nothing_are_no_ops():
    p = kvpool.BlockManagerPool(
        16, 4, linear_state_slots=4, checkpoint_interval=4, enable_events=True
    )
    s = kvpool.Sequence(list(range(9)))
    before = p.stats()
    p.cache(s)
    p.deallocate(s)
    assert p.stats() == before and p.drain_events() == [] and not p.take_linear_state_plan()
    assert s.block_table.tolist() == [] and s.dp_rank is None
    other = kvpool.BlockManagerPool(16, 4)
    assert other.allocate(s)
    raises_naming(ValueError, "seq", p.cache, s)
    raises_naming(ValueError, "seq", p.deallocate, s)
