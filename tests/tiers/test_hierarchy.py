"""kvpool.HierarchyBlockManagerPool and kvpool.tiers.host_transfer: the host tier of R26.

Covers: KV bytes round-tripping device -> host -> device bit-identical through the NumPy
executor; a host hit after device eviction; plans never naming a block that was freed before
completion; no device leak when an offload is confirmed after the sequence was reallocated;
seeded random workloads (both policies, 1 and 2 dp ranks) with check() after every step, a
"ghost KV" check of every loaded block, and every id free on both tiers after cleanup; bad input
naming its argument (R29); the GPU executor (skipped without a GPU).
"""

from __future__ import annotations

import random

import kvpool
import numpy as np
import pytest
from kvpool.tiers.host_transfer import NumpyTransferExecutor

BS = 4


def table(seq) -> list[int]:
    return [int(x) for x in seq.block_table]


def finish(pool, seq) -> None:
    """The engine computed every token of seq, then the request ended."""
    seq.num_computed_tokens = len(seq)
    pool.deallocate(seq)


def fill_device(pool, rank=0) -> None:
    """Evict every cached device block of `rank` (allocate all, compute nothing, release)."""
    n = (
        pool.stats()["ranks"][rank]["num_free_blocks"]
        + pool.stats()["ranks"][rank]["num_cached_blocks"]
    )
    big = kvpool.Sequence(list(range(10_000, 10_000 + n * BS)))
    assert pool.allocate(big)
    pool.deallocate(big)
    assert pool.stats()["ranks"][rank]["num_cached_blocks"] == 0


def caches(num_blocks, host_num_blocks, layers=2, heads=2, dim=8, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    dev = [
        rng.standard_normal((num_blocks, BS, heads, dim)).astype(dtype) for _ in range(2 * layers)
    ]
    host = [np.zeros((host_num_blocks, BS, heads, dim), dtype) for _ in range(2 * layers)]
    return dev, host


# ---------------------------------------------------------------------------------------------
# R26 scenarios
# ---------------------------------------------------------------------------------------------


def test_round_trip_kv_bytes_device_host_device_bit_identical():
    pool = kvpool.HierarchyBlockManagerPool(16, 16, BS)
    dev, host = caches(16, 16)
    ex = NumpyTransferExecutor(dev, host)
    a = kvpool.Sequence(list(range(13)))
    assert pool.allocate(a)
    written = [c[table(a)[:3]].copy() for c in dev]  # the KV the engine wrote for a's 3 full blocks
    finish(pool, a)
    assert ex.run_offloads(pool.take_offload_plans(), pool) == 3
    fill_device(pool)
    for c in dev:  # the device copies are gone: scribble over the whole device cache
        c[...] = np.float16(-7.0)
    b = kvpool.Sequence(list(range(13)))
    assert pool.allocate(b)
    assert b.num_cached_tokens == 0
    assert ex.run_loads(pool.take_load_plans(), pool) == 3
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    for c, w in zip(dev, written, strict=True):
        assert c[table(b)[:3]].tobytes() == w.tobytes()
    pool.check()


def test_host_hit_after_device_eviction():
    pool = kvpool.HierarchyBlockManagerPool(16, 16, BS, enable_events=True)
    a = kvpool.Sequence(list(range(17)))
    assert pool.allocate(a)
    finish(pool, a)
    pool.complete_offloads(pool.take_offload_plans())
    fill_device(pool)
    pool.drain_events()
    b = kvpool.Sequence(list(range(17)) + [99])
    assert pool.can_allocate(b)
    assert pool.allocate(b)
    plans = pool.take_load_plans()
    assert len(plans) == 1 and plans[0].direction == "load" and plans[0].dp_rank == 0
    assert plans[0].src.dtype == np.int32 and plans[0].dst.dtype == np.int32
    assert [int(x) for x in plans[0].dst] == table(b)[:4]
    host = pool.stats()["host"]
    assert host["prefix_hit_tokens"] == 16 and host["num_pending_load_blocks"] == 4
    assert b.num_cached_tokens == 0, "R26: cached only after complete_loads"
    assert pool.drain_events() == [], "R26: loaded blocks are published only after complete_loads"
    pool.complete_loads(plans)
    assert b.num_cached_tokens == 16 and b.num_computed_tokens == 16
    assert [e.kind for e in pool.drain_events()] == ["stored"]
    assert len(pool.slot_mapping([b])) == 2, "loaded tokens are not computed again"
    # the loaded chain is now matchable on the device
    c = kvpool.Sequence(list(range(17)))
    assert pool.allocate(c)
    assert c.num_cached_tokens == 16 and pool.take_load_plans() == []
    st = pool.stats()
    assert st["host"]["num_loaded_blocks"] == 4 and st["ranks"][0]["host"]["num_loaded_blocks"] == 4
    pool.check()


def test_plans_never_reference_a_block_freed_before_completion():
    pool = kvpool.HierarchyBlockManagerPool(12, 8, BS)
    a = kvpool.Sequence(list(range(13)))
    assert pool.allocate(a)
    finish(pool, a)
    pool.complete_offloads(pool.take_offload_plans())
    fill_device(pool)
    b = kvpool.Sequence(list(range(13)))  # pending load into 3 device blocks
    assert pool.allocate(b)
    loads = pool.take_load_plans()
    c = kvpool.Sequence(list(range(500, 513)))  # pending offload of 3 device blocks
    assert pool.allocate(c)
    finish(pool, c)
    offloads = pool.take_offload_plans()
    pool.deallocate(b)  # released before its load completed
    named_dev = {int(x) for x in loads[0].dst} | {int(x) for x in offloads[0].src}
    named_host = {int(x) for x in loads[0].src} | {int(x) for x in offloads[0].dst}
    # take every other device block and fill the host with other chains: none of them is named
    others = []
    while True:
        s = kvpool.Sequence(list(range(1000 + 10 * len(others), 1000 + 10 * len(others) + 5)))
        if not pool.allocate(s):
            break
        others.append(s)
        assert not set(table(s)) & named_dev
    for s in others:
        finish(pool, s)
    off2 = pool.take_offload_plans()
    assert off2 and not {int(x) for x in off2[0].dst} & named_host
    pool.check()
    pool.complete_offloads(off2 + offloads)
    pool.complete_loads(loads)
    pool.check()


def test_no_device_leak_when_offload_confirmed_after_reallocation():
    pool = kvpool.HierarchyBlockManagerPool(16, 16, BS)
    a = kvpool.Sequence(list(range(13)))
    assert pool.allocate(a)
    finish(pool, a)
    plans = pool.take_offload_plans()
    assert pool.stats()["num_used_blocks"] == 3, "R26: offloaded device blocks stay held"
    assert pool.allocate(a)  # reallocated before the offload is confirmed: hits its own blocks
    assert a.num_cached_tokens == 12
    pool.complete_offloads(plans)
    assert pool.stats()["num_used_blocks"] == 4
    finish(pool, a)
    assert pool.take_offload_plans() == [], "never offloaded twice"
    pool.reset_prefix_cache()
    st = pool.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["host"]["num_free_blocks"] == st["host"]["num_total_blocks"]
    pool.check()


def test_short_host_offloads_longest_prefix_and_policy_on_evict():
    pool = kvpool.HierarchyBlockManagerPool(16, 3, BS)
    a = kvpool.Sequence(list(range(17)))
    assert pool.allocate(a)
    finish(pool, a)
    plans = pool.take_offload_plans()
    assert len(plans[0]) == 2, "2 host blocks: the first 2 of 4 blocks"
    pool.complete_offloads(plans)

    ev = kvpool.HierarchyBlockManagerPool(16, 16, BS, offload_policy="on_evict")
    assert ev.offload_policy == "on_evict"
    x = kvpool.Sequence(list(range(13)))
    y = kvpool.Sequence(list(range(13)))
    assert ev.allocate(x)
    x.num_computed_tokens = 13
    ev.cache(x)
    assert ev.allocate(y) and y.num_cached_tokens == 12
    finish(ev, x)
    assert ev.take_offload_plans() == [], "y still holds the blocks: nothing becomes evictable"
    finish(ev, y)
    assert len(ev.take_offload_plans()[0]) == 3
    ev.check()


def test_complete_twice_foreign_or_wrong_direction_is_value_error():
    pool = kvpool.HierarchyBlockManagerPool(16, 16, BS)
    other = kvpool.HierarchyBlockManagerPool(16, 16, BS)
    a = kvpool.Sequence(list(range(9)))
    assert pool.allocate(a)
    finish(pool, a)
    plans = pool.take_offload_plans()
    with pytest.raises(ValueError, match="plans"):
        other.complete_offloads(plans)
    with pytest.raises(ValueError, match="plans"):
        pool.complete_loads(plans)
    with pytest.raises(ValueError, match="twice"):
        pool.complete_offloads(plans + plans)
    pool.complete_offloads(plans)
    with pytest.raises(ValueError, match="already completed"):
        pool.complete_offloads(plans)
    pool.check()


def test_stats_shape():
    pool = kvpool.HierarchyBlockManagerPool(8, 6, BS, dp_size=2)
    st = pool.stats()
    keys = {
        "num_total_blocks",
        "num_free_blocks",
        "num_cached_blocks",
        "num_used_blocks",
        "usage",
        "prefix_query_tokens",
        "prefix_hit_tokens",
        "num_evictions",
        "num_loaded_blocks",
        "num_offloaded_blocks",
        "num_pending_load_blocks",
        "num_pending_offload_blocks",
    }
    assert set(st["host"]) == keys
    assert st["host"]["num_total_blocks"] == 10 and st["num_total_blocks"] == 14
    assert [r["host"]["num_total_blocks"] for r in st["ranks"]] == [5, 5]
    assert "HierarchyBlockManagerPool(" in repr(pool)


# ---------------------------------------------------------------------------------------------
# Random workloads (R2, R14, R15, R26): check() every step, ghost KV, all free at the end
# ---------------------------------------------------------------------------------------------


def _kv_value(tokens, pos) -> float:
    """The KV a token at `pos` gets: a function of its whole prefix (as attention's is)."""
    return float(hash(tuple(tokens[: pos + 1])) % (1 << 50))


@pytest.mark.parametrize("policy", ["on_deallocate", "on_evict"])
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload(policy, dp, seed):
    rng = random.Random(seed)
    nb, hnb = 9, 16
    pool = kvpool.HierarchyBlockManagerPool(nb, hnb, BS, dp_size=dp, offload_policy=policy)
    dev = [[np.zeros((nb, BS, 1), np.float64)] for _ in range(dp)]
    host = [[np.zeros((hnb, BS, 1), np.float64)] for _ in range(dp)]
    ex = NumpyTransferExecutor(dev, host)
    running: list = []
    loads: list = []
    offloads: list = []
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(6)]

    def write(seq, start, end):
        toks, r, tb = list(seq.token_ids), seq.dp_rank, table(seq)
        for pos in range(start, end):
            dev[r][0][tb[pos // BS], pos % BS, 0] = _kv_value(toks, pos)

    def verify(seq):
        toks, r, tb = list(seq.token_ids), seq.dp_rank, table(seq)
        for pos in range(seq.num_computed_tokens):
            assert dev[r][0][tb[pos // BS], pos % BS, 0] == _kv_value(toks, pos), (seq, pos)

    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            toks = rng.choice(prefixes)[: rng.randrange(1, 17)] + [
                rng.randrange(50) for _ in range(rng.randrange(0, 4))
            ]
            s = kvpool.Sequence(toks)
            before = pool.stats()
            can = pool.can_allocate(s)
            assert pool.stats() == before, "R15"
            ok = pool.allocate(s)
            assert ok == can
            if ok:
                running.append(s)
            else:
                assert pool.stats() == before, "R14"
        elif op < 0.55 and running:
            s = rng.choice(running)
            c = s.num_computed_tokens
            n = min(len(s), c + rng.randrange(1, 16), len(s.block_table) * BS)
            write(s, c, n)  # the forward step (recomputes a pending load's blocks if any)
            s.num_computed_tokens = n
            pool.cache(s)
            if n == len(s):  # decode: the sampled token's KV is written by the next step
                s.append_token(rng.randrange(50))
                pool.may_append(s)
        elif op < 0.7 and running:
            s = running.pop(rng.randrange(len(running)))
            pool.deallocate(s)
            assert len(s.block_table) == 0 and s.num_cached_tokens == 0
        elif op < 0.8:
            offloads += pool.take_offload_plans()
            loads += pool.take_load_plans()
        elif op < 0.98:
            if loads and rng.random() < 0.5:
                ex.run_loads(loads, pool)
                loads = []
                for s in running:
                    verify(s)
            if offloads:
                ex.run_offloads(offloads, pool)
                offloads = []
        else:
            pool.reset_prefix_cache()
        pool.check()
    for s in running:
        pool.deallocate(s)
    ex.run_loads(loads + pool.take_load_plans(), pool)
    ex.run_offloads(offloads + pool.take_offload_plans(), pool)
    pool.check()
    st = pool.stats()
    assert st["host"]["num_pending_load_blocks"] == st["host"]["num_pending_offload_blocks"] == 0
    assert st["host"]["num_loaded_blocks"] > 0 and st["host"]["num_offloaded_blocks"] > 0, (
        "the workload exercised both directions"
    )
    pool.reset_prefix_cache()
    st = pool.stats()
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["host"]["num_free_blocks"] == st["host"]["num_total_blocks"]


def test_random_workload_exercises_loads():
    # the loop above must actually load: same driver, counted
    loaded = 0
    for seed in range(3):
        pool = kvpool.HierarchyBlockManagerPool(8, 16, BS)
        rng = random.Random(seed)
        for _ in range(60):
            s = kvpool.Sequence(list(range(rng.randrange(4, 20))) + [rng.randrange(1000)])
            if pool.allocate(s):
                pool.complete_loads(pool.take_load_plans())
                finish(pool, s)
                pool.complete_offloads(pool.take_offload_plans())
                fill_device(pool) if rng.random() < 0.3 else None
        pool.check()
        loaded += pool.stats()["host"]["num_loaded_blocks"]
    assert loaded > 10


def test_simulator_with_host_tier_and_data_plane():
    from kvpool.sim.engine import SimConfig, Simulator
    from kvpool.sim.execute import Executor
    from kvpool.sim.workloads import generate

    reqs = generate(
        "system_prompt", 12, seed=3, max_prompt_len=120, output_len=4, max_output_len=6, rate=0.5
    )
    cfg = SimConfig(num_blocks=24, block_size=16, host_num_blocks=32, check=True)
    ex = Executor(cfg, backend="numpy", check_every=1)
    sim = Simulator(cfg, reqs, executor=ex)
    ex.bind(sim)
    res = sim.run()
    assert ex.report()["ok"]
    assert res.summary["host_offloads"] > 0
    sim.pool.check()


# ---------------------------------------------------------------------------------------------
# Bad input (R29)
# ---------------------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="host_num_blocks"):
        kvpool.HierarchyBlockManagerPool(16, 1, BS)
    with pytest.raises(TypeError, match="host_num_blocks"):
        kvpool.HierarchyBlockManagerPool(16, "8", BS)
    with pytest.raises(ValueError, match="offload_policy"):
        kvpool.HierarchyBlockManagerPool(16, 8, BS, offload_policy="sometimes")
    with pytest.raises(TypeError, match="offload_policy"):
        kvpool.HierarchyBlockManagerPool(16, 8, BS, offload_policy=1)
    # Linear state composes with the host tier; a bad slot count is still named.
    with pytest.raises(ValueError, match="linear_state_slots"):
        kvpool.HierarchyBlockManagerPool(16, 8, BS, linear_state_slots=1)
    pool = kvpool.HierarchyBlockManagerPool(16, 8, BS)
    with pytest.raises(TypeError, match="plans"):
        pool.complete_loads(5)
    with pytest.raises(TypeError, match="plans"):
        pool.complete_offloads([object()])
    with pytest.raises(TypeError, match="seq"):
        pool.allocate([1, 2, 3])
    with pytest.raises(ValueError, match="num_tokens"):
        pool.allocate(kvpool.Sequence([1, 2]), 3)
    with pytest.raises(ValueError, match="seq"):
        pool.deallocate(_foreign())
    dev, host = caches(16, 8)
    with pytest.raises(ValueError, match="host_caches"):
        NumpyTransferExecutor(dev, host[:-1])
    with pytest.raises(ValueError, match="host_caches"):
        NumpyTransferExecutor(dev, [h.astype(np.float32) for h in host])
    with pytest.raises(TypeError, match="device_caches"):
        NumpyTransferExecutor(3, host)


def _foreign():
    s = kvpool.Sequence(list(range(5)))
    assert kvpool.BlockManagerPool(8, BS).allocate(s)
    return s


# ---------------------------------------------------------------------------------------------
# GPU data plane
# ---------------------------------------------------------------------------------------------


def _gpu():
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


@pytest.mark.skipif(_gpu() is None, reason="needs cupy and a GPU")
def test_round_trip_on_gpu_with_pinned_host_memory():
    cp = _gpu()
    from kvpool.tiers.host_transfer import CupyTransferExecutor

    pool = kvpool.HierarchyBlockManagerPool(16, 16, 16)
    shape = (16, 16, 8, 128)
    dev = [cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(2)]
    host = [CupyTransferExecutor.pinned_like(shape, np.float16) for _ in range(2)]
    ex = CupyTransferExecutor(dev, host)
    a = kvpool.Sequence(list(range(49)))
    assert pool.allocate(a)
    written = [cp.asnumpy(d[cp.asarray(table(a)[:3])]) for d in dev]
    a.num_computed_tokens = 49
    pool.deallocate(a)
    assert ex.run_offloads(pool.take_offload_plans(), pool) == 3
    big = kvpool.Sequence(list(range(5000, 5000 + 15 * 16)))
    assert pool.allocate(big)
    pool.deallocate(big)
    for d in dev:
        d[...] = 0
    b = kvpool.Sequence(list(range(49)))
    assert pool.allocate(b)
    assert ex.run_loads(pool.take_load_plans(), pool) == 3
    for d, w in zip(dev, written, strict=True):
        assert cp.asnumpy(d[cp.asarray(table(b)[:3])]).tobytes() == w.tobytes()
    pool.check()
