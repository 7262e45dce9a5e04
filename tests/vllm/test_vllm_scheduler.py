"""vLLM's real Scheduler and AsyncScheduler (0.33 or 0.34, whichever is installed) on kvpool's
manager, on CPU.

Skipped unless a supported vLLM is installed (``make test-vllm`` runs it under both). The runs
use the block size the installed version's defaults pick (``h.BS``: 16 in 0.33, 64 in 0.34);
the schedule comparisons run at the other size too, the memory the same in tokens. The Scheduler is built from a
written config.json (no hub, no weights) and fed fake ``ModelRunnerOutput``s
(``vllm_harness.run_scheduler``); kvpool's manager goes in through ``scheduler_cls``, the route
of ``--scheduler-cls kvpool.integrations.vllm.Scheduler``. Every run ends with no leaked block and
a successful ``reset_prefix_cache()``. Schedules are compared per step (requests, computed
tokens, block counts, scheduled tokens, preemptions) with vLLM's own manager (``vllm``) and with
vLLM's own publishing after the KV exists as kvpool does (``vllm-r17``). Where they differ, the
first difference must be a prefix hit (the by-design differences of test_vllm_manager.py's doc),
and the differences are counted and printed.
"""

from __future__ import annotations

import pytest
import vllm_harness as h  # noqa: E402  (imports vLLM: 15-25 s, once per process)

BS = h.BS
SIZES = sorted({16, 64, BS})
SIZE_IDS = [f"bs{b}{'-default' if b == BS else ''}" for b in SIZES]
_HASHERS: dict[int, object] = {}


def hasher_for(bs):
    if bs not in _HASHERS:
        _HASHERS[bs] = h.block_hasher(bs)
    return _HASHERS[bs]


@pytest.fixture(scope="module")
def hasher():
    return hasher_for(BS)


def _three(trace, hasher, num_blocks, bs=BS, **kw):
    """The three managers under the real Scheduler; ``num_blocks`` in blocks of 16 tokens."""
    runs, managers = {}, {}
    scale = kw.pop("arrival_scale", 1.0)
    for kind in ("kvpool", "vllm-r17", "vllm"):
        scheduler, config = h.build_scheduler(kind, h.blocks(num_blocks, bs), block_size=bs, **kw)
        managers[kind] = type(scheduler.kv_cache_manager).__module__
        runs[kind] = h.run_scheduler(
            scheduler,
            config,
            trace,
            arrival_scale=scale,
            hasher=None if kind == "kvpool" else hasher,
        )
        assert runs[kind].finished == len(trace)
    assert managers["kvpool"] == "kvpool.integrations._vllm_manager"
    return runs


def _report(name, runs):
    k, r, v = runs["kvpool"], runs["vllm-r17"], runs["vllm"]

    def differing(a, b):
        return sum(x != y for x, y in zip(a.records, b.records, strict=False)) + abs(
            len(a.records) - len(b.records)
        )

    print(
        f"\n{name}: steps {len(k.records)}/{len(r.records)}/{len(v.records)} (kvpool/vllm-r17/vllm); "
        f"prefix hits {k.hits}/{r.hits}/{v.hits} of {k.queries}; preemptions "
        f"{k.preemptions}/{r.preemptions}/{v.preemptions}; steps scheduled differently: "
        f"kvpool vs vllm-r17 {differing(k, r)}, kvpool vs vllm {differing(k, v)}"
    )


@pytest.mark.parametrize("bs", SIZES, ids=SIZE_IDS)
def test_scheduler_light_load_identical(bs):
    # no memory pressure, and (seeded, deterministic) no R9 duplicate: nothing by design differs
    trace = h.chat_trace(120, seed=2)
    runs = _three(trace, hasher_for(bs), 4096, bs)
    _report(f"sync Scheduler, {h.blocks(4096, bs)} blocks of {bs}", runs)
    assert runs["kvpool"].records == runs["vllm-r17"].records
    assert runs["kvpool"].hits == runs["vllm-r17"].hits > 0
    h.assert_same_or_hit_first(runs["kvpool"], runs["vllm"])


def test_scheduler_denser_trace_parts_at_a_hit(hasher):
    runs = _three(h.chat_trace(160, seed=2), hasher, 4096)
    _report(f"sync Scheduler, {h.blocks(4096, BS)} blocks of {BS}, 160 requests", runs)
    h.assert_same_or_hit_first(runs["kvpool"], runs["vllm-r17"])
    h.assert_same_or_hit_first(runs["kvpool"], runs["vllm"])


@pytest.mark.parametrize("bs", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_scheduler_dense_pressure_and_async(async_, bs):
    trace = h.chat_trace(200, seed=4)
    runs = _three(trace, hasher_for(bs), 400, bs, arrival_scale=0.3, async_=async_)
    name = "AsyncScheduler" if async_ else "Scheduler"
    _report(f"{name}, {h.blocks(400, bs)} blocks of {bs}, dense arrivals", runs)
    assert runs["kvpool"].preemptions > 0
    h.assert_same_or_hit_first(runs["kvpool"], runs["vllm-r17"])
    h.assert_same_or_hit_first(runs["vllm-r17"], runs["vllm"])


def test_scheduler_publishes_vllm_kv_events(hasher):
    trace = h.chat_trace(30, seed=6)
    scheduler, config = h.build_scheduler("kvpool", h.blocks(200, BS), block_size=BS, events=True)
    kinds: dict[str, int] = {}

    def publish(batch):
        for e in batch.events:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1

    scheduler.kv_event_publisher.publish = publish
    h.run_scheduler(scheduler, config, trace, arrival_scale=0.3)
    publish(type("Batch", (), {"events": scheduler.kv_cache_manager.take_events()})())
    assert kinds.get("BlockStored", 0) > 0 and kinds.get("BlockRemoved", 0) > 0
    assert kinds.get("AllBlocksCleared") == 1  # run_scheduler's closing reset_prefix_cache()


def test_install_puts_kvpool_under_every_scheduler_built_after(monkeypatch):
    import vllm.v1.core.sched.scheduler as sched_module
    from kvpool.integrations import vllm as kv_vllm

    monkeypatch.setattr(sched_module, "KVCacheManager", sched_module.KVCacheManager)  # undone after
    kv_vllm.install()  # the documented one line
    scheduler, config = h.build_scheduler("vllm", h.blocks(256, BS), block_size=BS)  # vLLM's own
    assert isinstance(scheduler.kv_cache_manager, kv_vllm.KVCacheManager)
    trace = h.chat_trace(20, seed=7)
    assert h.run_scheduler(scheduler, config, trace, arrival_scale=0.5).finished == len(trace)


def test_kvpool_scheduler_spares_the_engine_core_vllms_unused_hashing(hasher):
    """kvpool's Scheduler turns off vLLM's block hashing in the engine core that builds it
    (nothing reads ``request.block_hashes`` under kvpool's manager without a KV connector);
    an engine core on vLLM's own Scheduler, and any other caller, still get vLLM's hasher."""
    import vllm.v1.engine.core as engine_core
    from kvpool.integrations import vllm as kv_vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import Request

    class EngineCore:  # EngineCore.__init__'s order: the Scheduler, then the hasher
        def __init__(self, kind):
            self.scheduler, self.config = h.build_scheduler(kind, h.blocks(1024, BS), block_size=BS)
            self.request_block_hasher = engine_core.get_request_block_hasher(
                BS, get_hash_fn_by_name("sha256"), 0
            )

    prompt = list(range(100, 100 + 4 * BS))  # 4 full blocks
    params = SamplingParams(max_tokens=4)
    ours, theirs = EngineCore("kvpool"), EngineCore("vllm")  # kvpool's first: the switch is on
    assert engine_core.get_request_block_hasher is kv_vllm._request_block_hasher
    assert (
        Request("a", prompt, params, None, block_hasher=ours.request_block_hasher).block_hashes
        == []
    )
    theirs_hashes = Request(
        "b", prompt, params, None, block_hasher=theirs.request_block_hasher
    ).block_hashes
    assert theirs_hashes == Request("c", prompt, params, None, block_hasher=hasher).block_hashes
    assert len(theirs_hashes) == 4
    # not called from an engine core: vLLM's own factory
    plain = engine_core.get_request_block_hasher(BS, get_hash_fn_by_name("sha256"), 0)
    assert len(Request("d", prompt, params, None, block_hasher=plain).block_hashes) == 4
    # kvpool's Scheduler still schedules and hits with requests that carry no vLLM hashes
    trace = h.chat_trace(12, seed=3)
    run = h.run_scheduler(
        ours.scheduler, ours.config, trace, arrival_scale=0.5, hasher=ours.request_block_hasher
    )
    assert run.finished == len(trace) and run.hits > 0
