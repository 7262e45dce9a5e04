"""What differs between vLLM 0.33 and 0.34 under kvpool's drop-in, under the installed version.

Skipped unless a supported vLLM is installed (``make test-vllm`` runs it under both):

- the import: any version but 0.33.x and 0.34.x is one ImportError naming the supported range;
- 0.34's probe ``get_num_cached_tokens`` (kvpool's manager has it under both): it changes
  nothing (no allocation, publication, LRU touch, stats, events, entries), it equals the hit the
  next lookup reports, as vLLM's own manager publishing after compute does; under 0.34's real
  Scheduler with cache-aware admission, the schedules equal that reference's;
- the options both versions have, refused or honoured by name: ``prefix_match_unit`` (hits inside
  a block) refused, ``prefix_cache_retention_interval`` 0 or None honoured, positive refused;
- reading the cache: 0.33's ``skip_reading_prefix_cache`` and 0.34's ``prefix_cache_hit_limit``
  (a bounded request gets no hit, its lookup counted);
- ``get_num_common_prefix_blocks``: vLLM's manager has it in 0.33 only, kvpool's under both.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import pytest
import vllm_harness as h  # noqa: E402  (imports vLLM: 15-25 s, once per process)
from kvpool.integrations._vllm_versions import SUPPORTED, version_of
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

SIZES = sorted({16, 64, h.BS})
SP = SamplingParams(max_tokens=4)
only_034 = pytest.mark.skipif(not h.VLLM_034, reason="new in vLLM 0.34")


@pytest.fixture(
    scope="module", params=SIZES, ids=[f"bs{b}{'-default' if b == h.BS else ''}" for b in SIZES]
)
def bs(request):
    return request.param


def _admit(manager, rid, tokens, hasher=None, computed=True, **kw):
    """The waiting loop's calls for one request; ``computed``: its forward pass has returned."""
    r = Request(rid, tokens, SP, None, block_hasher=hasher, **kw)
    blocks, hit, _ = manager.get_computed_blocks(r)
    assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, r.num_tokens if computed else hit
    return r


# ------------------------------------------------------------------------------ the import
@pytest.mark.parametrize("version", ["0.32.1", "0.35.0", "1.0.0"])
def test_any_other_version_is_one_import_error_naming_the_range(monkeypatch, version):
    import vllm

    module = sys.modules["kvpool.integrations.vllm"]
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delitem(sys.modules, "kvpool.integrations.vllm")
    with pytest.raises(ImportError, match=rf"vllm>=0\.33,<0\.35 .*found vllm {version} "):
        importlib.import_module("kvpool.integrations.vllm")
    monkeypatch.setitem(sys.modules, "kvpool.integrations.vllm", module)


def test_the_installed_version_is_the_one_the_module_serves():
    import vllm
    from kvpool.integrations import vllm as kv_vllm

    assert kv_vllm.VLLM_VERSION == h.VERSION == version_of(vllm.__version__)
    assert kv_vllm.REQUIRED_VLLM == SUPPORTED
    # the default block size each version's config picks (the tests run at both)
    assert h.BS == (64 if h.VLLM_034 else 16)


# ------------------------------------------------------------------------------- the probe
def _state(manager):
    """Everything the probe must leave as it was."""
    entries = {
        rid: (e.length, e.capacity, e.computed, list(e.ids), e.seq.token_ids)
        for rid, e in manager._seqs.items()
    }
    stats = manager.prefix_cache_stats
    return (
        manager.pool.stats(),
        manager.usage,
        manager.block_pool.get_num_free_blocks(),
        entries,
        dict(manager._unpublished),
        dict(manager._chain_keys),
        manager._stats_recorded,
        (stats.requests, stats.queries, stats.hits),
    )


@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
def test_the_probe_changes_nothing(events, bs):
    manager = h.make_manager("kvpool", 64, bs, events=events)
    prefix = list(range(1000, 1000 + 3 * bs))
    done = _admit(manager, "done", prefix + [1, 2, 3])
    manager.free(done)  # its 3 full blocks cached, free to evict
    waiting = Request("waiting", prefix + [4] * bs, SP, None, cache_salt="tenant")
    assert manager.get_computed_blocks(waiting)[1] == 0  # an entry, no blocks (salted chain)
    running = _admit(manager, "running", list(range(5000, 5000 + 3 * bs + 2)))  # unpublished
    manager.take_events()
    manager.make_prefix_cache_stats()
    before = _state(manager)
    probes = {
        "new": Request("new", prefix + [9] * 5, SP, None),
        "new-salted": Request("new-salted", prefix + [9] * 5, SP, None, cache_salt="other"),
        "waiting": waiting,
        "running": running,
        "skips": h.skip_reading(Request("skips", prefix + [9] * 5, SP, None)),
    }
    got = {name: manager.get_num_cached_tokens(r) for name, r in probes.items()}
    assert got == {"new": 3 * bs, "new-salted": 0, "waiting": 0, "running": 0, "skips": 0}
    assert _state(manager) == before
    assert manager.take_events() == []
    assert manager.make_prefix_cache_stats().requests == 0
    assert "new" not in manager._seqs and "skips" not in manager._seqs
    manager.check()
    # what it reported is the hit of the next lookup
    assert manager.get_computed_blocks(probes["new"])[1] == 3 * bs


def test_the_probe_touches_no_lru_order(bs):
    def run(touch):
        manager = h.make_manager("kvpool", 9, bs)  # 8 usable blocks
        x, y = list(range(1000, 1001 + 2 * bs)), list(range(5000, 5001 + 2 * bs))
        for rid, tokens in (("x", x), ("y", y)):  # 2 full blocks cached each, x's the older
            manager.free(_admit(manager, rid, tokens))
        for i in range(3):
            if touch:  # a real use of x: pinned by an admission, released again
                manager.free(_admit(manager, f"x{i}", x + [7], computed=False))
            else:
                assert manager.get_num_cached_tokens(Request(f"px{i}", x + [7], SP, None)) == 2 * bs
        big = _admit(manager, "big", list(range(9000, 9000 + 6 * bs - 1)))  # evicts 2 blocks
        manager.free(big)
        manager.check()
        return tuple(
            manager.get_num_cached_tokens(Request(f"after-{rid}", t + [7], SP, None))
            for rid, t in (("x", x), ("y", y))
        )

    assert run(touch=False) == (0, 2 * bs)  # x, the least recently used, was evicted
    assert run(touch=True) == (2 * bs, 0)  # (a real use of x would have made y the victim)


def test_the_probe_sees_what_the_next_lookup_sees(bs):
    """A block whose KV exists is unpublished until kvpool's next lookup: the probe does not
    publish it, and from its first call on the manager publishes at each step's start, so the
    probe equals the next lookup's hit from the next step on, as vLLM's own manager publishing
    after compute (``vllm-r17``); vLLM's stock manager published at allocation."""
    hasher = h.block_hasher(bs)
    kinds = ["kvpool", "vllm-r17", "vllm"] if h.VLLM_034 else ["kvpool"]
    prompt = list(range(100, 100 + 3 * bs + 2))
    seen = {}
    for kind in kinds:
        manager = h.make_manager(kind, 64, bs)
        hashing = None if kind == "kvpool" else hasher
        manager.new_step_starts()
        running = _admit(manager, "running", prompt, hashing)  # its forward pass returns
        running.append_output_token_ids(7)
        probe = Request("probe", prompt[: 3 * bs] + [8] * 5, SP, None, block_hasher=hashing)
        first = manager.get_num_cached_tokens(probe)
        manager.new_step_starts()
        second = manager.get_num_cached_tokens(probe)
        assert second == manager.get_computed_blocks(probe)[1]
        seen[kind] = (first, second)
    assert seen["kvpool"] == (0, 3 * bs)
    if h.VLLM_034:
        assert seen["vllm-r17"] == seen["kvpool"] and seen["vllm"] == (3 * bs, 3 * bs)


@only_034
def test_cache_aware_admission_under_the_real_scheduler():
    """0.34's Scheduler reorders its waiting window by the probe: kvpool's schedule equals vLLM's
    own publishing after compute, step for step (light load, no R9 duplicate in this trace)."""
    options = {"cache_aware_admission_window": 8, "cache_aware_admission_threshold": 0.0}
    trace = h.chat_trace(120, seed=2)
    hasher = h.block_hasher(h.BS)
    runs, probes = {}, {}
    for kind in ("kvpool", "vllm-r17"):
        for window in (options, None):
            scheduler, config = h.build_scheduler(
                kind, h.blocks(4096, h.BS), block_size=h.BS, scheduler_options=window
            )
            manager = scheduler.kv_cache_manager
            calls = [0]
            probe = manager.get_num_cached_tokens

            def counted(request, probe=probe, calls=calls):
                calls[0] += 1
                return probe(request)

            manager.get_num_cached_tokens = counted
            run = h.run_scheduler(
                scheduler, config, trace, hasher=None if kind == "kvpool" else hasher
            )
            assert run.finished == len(trace)
            runs[kind, window is not None], probes[kind, window is not None] = run, calls[0]
    assert probes["kvpool", True] > 0 and probes["kvpool", False] == 0
    assert runs["kvpool", True].records == runs["vllm-r17", True].records
    assert runs["kvpool", True].hits == runs["vllm-r17", True].hits > 0
    print(
        f"\ncache-aware admission (window 8): {probes['kvpool', True]} probes; schedules "
        f"reordered in {sum(a != b for a, b in zip(runs['kvpool', True].records, runs['kvpool', False].records, strict=False))} "
        f"steps; hits {runs['kvpool', True].hits} (without: {runs['kvpool', False].hits})"
    )


# ----------------------------------------------------------------- options, refused or honoured
def test_prefix_match_unit_finer_than_the_block_is_refused_by_name(bs):
    from kvpool.integrations import vllm as kv_vllm

    config = h.kv_cache_config(32, bs)
    with pytest.raises(NotImplementedError, match=r"prefix_match_unit \(hash_block_size\) 8"):
        kv_vllm.KVCacheManager(
            kv_cache_config=config, max_model_len=1024, scheduler_block_size=bs, hash_block_size=8
        )
    # prefix caching off: no hash is read, any unit goes (as vLLM)
    kv_vllm.KVCacheManager(
        kv_cache_config=config,
        max_model_len=1024,
        scheduler_block_size=bs,
        hash_block_size=8,
        enable_caching=False,
    )
    # vLLM's engine core refuses it first for one group (resolve_kv_cache_block_sizes)
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=h.model_dir(), skip_tokenizer_init=True, max_model_len=1024),
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True, prefix_match_unit=8),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024, is_encoder_decoder=False
        ),
    )
    with pytest.raises(ValueError, match="prefix_match_unit"):
        resolve_kv_cache_block_sizes(config, vllm_config)


def test_retention_interval_0_or_none_honoured_positive_refused_by_name(bs):
    from kvpool.integrations import vllm as kv_vllm
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    kwargs = dict(max_model_len=1024, scheduler_block_size=bs, hash_block_size=bs)
    prompt = list(range(100, 100 + 3 * bs + 1))
    for interval in (None, 0):  # both mean: every full block kept (full attention is dense)
        config = h.kv_cache_config(32, bs)
        config.prefix_cache_retention_interval = interval
        manager = kv_vllm.KVCacheManager(kv_cache_config=config, **kwargs)
        manager.free(_admit(manager, "a", prompt))
        assert manager.get_num_cached_tokens(Request("b", prompt, SP, None)) == 3 * bs
    config = h.kv_cache_config(32, bs)
    config.prefix_cache_retention_interval = 4 * bs
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        kv_vllm.KVCacheManager(kv_cache_config=config, **kwargs)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        VllmKVCacheManager(kv_cache_config=config, **kwargs)  # vLLM's own refuses it too


# ------------------------------------------------------------------------ reading the cache
def test_a_request_that_skips_the_cache_gets_no_hit_and_no_stats(bs):
    manager = h.make_manager("kvpool", 64, bs)
    prompt = list(range(100, 100 + 3 * bs + 1))
    manager.free(_admit(manager, "a", prompt))
    r = h.skip_reading(Request("b", prompt, SP, None))
    assert not manager.prefix_cache_lookup_enabled(r)
    assert manager.get_num_cached_tokens(r) == manager.get_computed_blocks(r)[1] == 0
    manager.record_prefix_cache_stats(r, 0)
    assert manager.make_prefix_cache_stats().requests == 0  # no lookup, not counted (as vLLM)


@only_034
def test_a_hit_limit_is_served_no_hit_below_it(bs):
    """0.34's ``prefix_cache_hit_limit`` k > 0 (prompt logprobs from row k): vLLM serves a hit of
    at most k tokens; kvpool serves none (a chain of its own), its lookup still counted. (vLLM's
    own probe ignores the limit: it reports the unbounded hit; kvpool's reports what the lookup
    will.)"""
    prompt = list(range(100, 100 + 4 * bs + 1))
    hits = {}
    for kind in ("kvpool", "vllm"):
        manager = h.make_manager(kind, 64, bs)
        hasher = None if kind == "kvpool" else h.block_hasher(bs)
        manager.free(_admit(manager, "a", prompt, hasher))
        r = Request("b", prompt, SP, None, block_hasher=hasher)
        r.prefix_cache_hit_limit = 2 * bs + 3
        assert manager.prefix_cache_lookup_enabled(r)
        hits[kind] = (manager.get_num_cached_tokens(r), manager.get_computed_blocks(r)[1])
        manager.record_prefix_cache_stats(r, hits[kind][1])
        assert manager.make_prefix_cache_stats().requests == 1
    assert hits == {"kvpool": (0, 0), "vllm": (4 * bs, 2 * bs)}


def test_get_num_common_prefix_blocks_kept_harmlessly():
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager

    manager = h.make_manager("kvpool", 32, h.BS)
    assert manager.get_num_common_prefix_blocks("anything") == [0]
    assert hasattr(VllmKVCacheManager, "get_num_common_prefix_blocks") == (not h.VLLM_034)
    assert hasattr(VllmKVCacheManager, "get_num_cached_tokens") == h.VLLM_034


def test_token_buffers_reach_the_pool_unchanged(bs):
    """0.34 keeps a request's tokens in an int32 ``TokenBuffer``, 0.33 in a list: the manager's
    sequence holds the same tokens after each sync, and vLLM can still append in place."""
    manager = h.make_manager("kvpool", 64, bs)
    r = _admit(manager, "r", list(range(100, 100 + bs + 3)))
    assert type(r._all_token_ids).__name__ == ("TokenBuffer" if h.VLLM_034 else "list")
    for token in range(2 * bs):
        r.append_output_token_ids(50_000 + token)
        assert manager.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        if token % 7 == 0:  # publishing syncs the sequence with the request first
            manager.cache_blocks(r, r.num_computed_tokens)
            assert manager._seqs["r"].seq.token_ids == list(r.all_token_ids)
    manager.check()
    later = Request("later", list(r.all_token_ids)[: 2 * bs] + [1, 2], SP, None)
    manager.cache_blocks(r, r.num_computed_tokens)
    assert manager.get_num_cached_tokens(later) == manager.get_computed_blocks(later)[1] == 2 * bs
    manager.free(r)
    manager.check()
