"""kvpool.integrations.vllm.KVCacheManager against vLLM's own (0.33 or 0.34, whichever is
installed).

Skipped unless a supported vLLM is installed (``make test-vllm`` runs it under both). Every test
runs at block sizes 16 (0.33's default) and 64 (0.34's), the memory of the differentials the same
in tokens (``h.blocks``). ``vllm_harness.drive`` makes the
sync Scheduler's exact calls on many requests at once (admission, chunked prefill, decode with
lookahead, preemption, free, reset_prefix_cache) and checks that every hit block holds the KV of
its tokens and that tables only grow. Three managers run each seeded trace:

- ``kvpool``: kvpool's manager;
- ``vllm``: vLLM's own, publishing blocks when it allocates them;
- ``vllm-r17``: vLLM's own, publishing after the KV exists as kvpool does (R17).

The schedules, admissions and hits are identical except where the rules differ by design; each
difference is counted and printed, and the runs must agree up to the first one:

- same-step sharing: vLLM publishes at allocation, so a request admitted in the step that
  another schedules the same prefix shares it in ``vllm`` only;
- duplicates (R9, first writer wins, no dedup since vLLM's tables only grow): a request that
  recomputed blocks another published meanwhile publishes the rest of its chain when it is
  released, vLLM at once; a later request then hits less in ``kvpool``;
- eviction under memory pressure: prefix-closed LRU (R10) picks other victims than vLLM's free
  queue, so later hits differ.
"""

from __future__ import annotations

import pytest
import vllm_harness as h  # noqa: E402  (imports vLLM: 15-25 s, once per process)

SIZES = sorted({16, 64, h.BS})  # h.BS: the installed version's default


@pytest.fixture(
    scope="module", params=SIZES, ids=[f"bs{b}{'-default' if b == h.BS else ''}" for b in SIZES]
)
def bs(request):
    return request.param


@pytest.fixture(scope="module")
def hasher(bs):
    return h.block_hasher(bs)


def _cut(*steps):
    known = [s for s in steps if s is not None]
    return min(known) if known else None


def _admissions_before(log, cut):
    return {
        rid: [a for a in adm if cut is None or a[0] < cut] for rid, adm in log.admissions.items()
    }


def _differing(a, b):
    return sorted(
        rid
        for rid in set(a.admissions) | set(b.admissions)
        if a.admissions.get(rid) != b.admissions.get(rid)
    )


def _drive_three(trace, num_blocks, hasher, bs, **kw):
    logs = {}
    for kind in ("kvpool", "vllm-r17", "vllm"):
        manager = h.make_manager(kind, h.blocks(num_blocks, bs), bs, events=True)
        check = (lambda m: m.check()) if kind == "kvpool" else None
        logs[kind] = h.drive(
            manager, trace, hasher=None if kind == "kvpool" else hasher, check=check, **kw
        )
        # R12: with nothing running the reset succeeds, and a later lookup hits nothing
        assert manager.reset_prefix_cache()
        if kind == "kvpool":
            assert any(type(e).__name__ == "AllBlocksCleared" for e in manager.take_events())
    return logs


def _report(name, logs):
    k, r, v = logs["kvpool"], logs["vllm-r17"], logs["vllm"]
    print(
        f"\n{name}: hit tokens kvpool {k.hit_tokens}, vllm-r17 {r.hit_tokens}, vllm {v.hit_tokens}; "
        f"steps {len(k.steps)}/{len(r.steps)}/{len(v.steps)}; preemptions "
        f"{k.preemptions}/{r.preemptions}/{v.preemptions}"
    )
    print(
        f"  by design: same-step shares (vllm) {v.same_step_shares}; hits stopped at an "
        f"unpublished duplicate chain (kvpool, R9) {k.missed_running}; first eviction step "
        f"kvpool {k.first_eviction_step}, vllm-r17 {r.first_eviction_step}; requests admitted "
        f"differently: kvpool vs vllm-r17 {len(_differing(k, r))}, kvpool vs vllm {len(_differing(k, v))}"
    )


@pytest.mark.parametrize("seed,lookahead", [(0, 0), (1, 2), (3, 0)])
def test_differential_no_pressure(seed, lookahead, hasher, bs):
    trace = h.chat_trace(160, seed=seed)
    logs = _drive_three(trace, 4096, hasher, bs, lookahead=lookahead, reset_at=(6,))
    _report(f"seed {seed}, lookahead {lookahead}, {h.blocks(4096, bs)} blocks of {bs}", logs)
    k, r, v = logs["kvpool"], logs["vllm-r17"], logs["vllm"]
    assert k.first_eviction_step is None and r.first_eviction_step is None
    assert k.resets == r.resets == v.resets == [False]  # requests hold blocks at step 6
    assert r.missed_running == 0 and r.same_step_shares == 0 and k.same_step_shares == 0
    # kvpool == vLLM publishing after compute, up to the first R9 duplicate miss (all if none)
    cut = k.first_missed_step
    assert k.steps[:cut] == r.steps[:cut]
    assert _admissions_before(k, cut) == _admissions_before(r, cut)
    if cut is None:
        assert (k.hit_tokens, k.stats_hits, k.stats_queries) == (
            r.hit_tokens,
            r.stats_hits,
            r.stats_queries,
        )
    # vLLM's own == vLLM publishing after compute, up to the first same-step share
    cut_v = v.first_share_step
    assert v.steps[:cut_v] == r.steps[:cut_v]
    # and so kvpool == vLLM's own up to the first by-design difference
    cut_all = _cut(cut, cut_v)
    assert k.steps[:cut_all] == v.steps[:cut_all]
    assert k.hit_tokens > 0


@pytest.mark.parametrize("seed,num_blocks", [(0, 300), (2, 360)])
def test_differential_memory_pressure(seed, num_blocks, hasher, bs):
    trace = h.chat_trace(160, seed=seed)
    logs = _drive_three(trace, num_blocks, hasher, bs, arrival_scale=0.5)
    _report(f"seed {seed}, {h.blocks(num_blocks, bs)} blocks of {bs} (pressure)", logs)
    k, r, v = logs["kvpool"], logs["vllm-r17"], logs["vllm"]
    assert k.first_eviction_step is not None and r.first_eviction_step is not None
    assert k.preemptions > 0 and r.preemptions > 0  # the trace does exercise preemption
    assert k.events["BlockRemoved"] > 0
    cut = _cut(k.first_eviction_step, r.first_eviction_step, k.first_missed_step)
    assert k.steps[:cut] == r.steps[:cut]
    assert _admissions_before(k, cut) == _admissions_before(r, cut)
    cut_v = _cut(cut, v.first_share_step, v.first_eviction_step)
    assert k.steps[:cut_v] == v.steps[:cut_v]


def test_prefix_cache_stats_and_events_are_vllms_types(bs):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.metrics.stats import PrefixCacheStats

    # small enough to evict, big enough not to preempt (rounding to blocks of 64 costs more)
    num_blocks = {16: 64, 64: 20}[bs]
    manager = h.make_manager("kvpool", num_blocks, bs, events=True)
    trace = h.chat_trace(12, seed=5, system_prompt_len=200, user_mean=40, max_prompt_len=400)
    h.drive(manager, trace)
    stats = manager.make_prefix_cache_stats()
    assert isinstance(stats, PrefixCacheStats) and stats.requests == 0  # drained each step
    manager = h.make_manager("kvpool", num_blocks, bs, events=True)
    seen = h.record_events(manager)
    log = h.drive(manager, trace)
    assert log.stats_hits == log.hit_tokens > 0  # no preemption: every hit is counted
    stored = [e for e in seen if isinstance(e, BlockStored)]
    removed = [e for e in seen if isinstance(e, BlockRemoved)]
    assert stored and removed  # the trace evicts
    known: set[int] = set()
    for e in stored:
        assert e.medium == "GPU" and e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"
        assert e.block_size == bs and len(e.token_ids) == bs * len(e.block_hashes)
        assert all(isinstance(x, int) and 0 <= x < 2**64 for x in e.block_hashes)
        assert e.parent_block_hash is None or e.parent_block_hash in known
        known.update(e.block_hashes)
    assert all(x in known for e in removed for x in e.block_hashes)
    import msgspec  # vLLM's publisher encodes batches this way

    batch = KVEventBatch(ts=0.0, events=seen[:5])
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.Encoder().encode(batch), type=KVEventBatch) == batch
    )


def test_cache_salt_and_lora_root_the_chain(bs):
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    manager = h.make_manager("kvpool", 64, bs)
    sp = SamplingParams(max_tokens=1)
    prompt = list(range(100, 100 + 4 * bs))  # 4 blocks

    def admit_and_free(rid, skip_reading=False, **kw):
        r = Request(rid, prompt, sp, None, **kw)
        if skip_reading:
            h.skip_reading(r)  # what prompt-logprobs requests set
        blocks, hit, _ = manager.get_computed_blocks(r)
        assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        manager.free(r)
        return hit

    assert admit_and_free("a") == 0
    assert admit_and_free("b") == 3 * bs  # R8: the last block is left to compute
    assert admit_and_free("c", cache_salt="tenant-1") == 0
    assert admit_and_free("d", cache_salt="tenant-1") == 3 * bs
    assert admit_and_free("e", lora_request=LoRARequest("adapter", 1, "/nowhere")) == 0
    assert admit_and_free("f", skip_reading=True) == 0  # vLLM's rule: no lookup for it
    assert admit_and_free("g") == 3 * bs
    manager.check()


def test_get_computed_blocks_is_pure_and_allocation_all_or_nothing(bs):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    manager = h.make_manager("kvpool", 9, bs)  # 8 usable blocks
    sp = SamplingParams(max_tokens=4)
    big = Request("big", list(range(1, 12 * bs + 7)), sp, None)  # 13 blocks: never fits
    before = manager.pool.stats()
    for _ in range(3):  # the Scheduler asks again every step
        blocks, hit, boundary = manager.get_computed_blocks(big)
        assert (hit, boundary) == (0, 0)
        assert manager.allocate_slots(big, 4 * bs, hit, blocks, full_sequence_must_fit=True) is None
    assert (
        manager.pool.stats() == before
        and manager.get_blocks("big").get_block_ids(allow_none=True) is None
    )
    # without the whole-sequence gate the first chunk fits (4 blocks), then growth fails cleanly
    new = manager.allocate_slots(big, 4 * bs, hit, blocks)
    assert new is not None and len(new.get_block_ids()[0]) == 4 and 0 not in new.get_block_ids()[0]
    big.num_computed_tokens = 4 * bs
    assert manager.allocate_slots(big, 8 * bs) is None  # 8 more blocks: only 4 free
    assert manager.get_block_ids("big") == (new.get_block_ids()[0],)
    manager.free(big)
    manager.check()
    assert manager.block_pool.get_num_free_blocks() == 8 and manager.reset_prefix_cache()


def test_bad_input_and_unsupported_configs(bs):
    import torch
    from kvpool.integrations import vllm as kv_vllm
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.request import Request

    manager = h.make_manager("kvpool", 32, bs)
    r = Request("r", list(range(1, 40)), SamplingParams(max_tokens=2), None)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(r, 0)
    with pytest.raises(NotImplementedError, match="num_external_computed_tokens"):
        manager.allocate_slots(r, 8, num_external_computed_tokens=16)
    assert manager.pool.stats()["num_used_blocks"] == 0
    full = h.kv_cache_config(32, bs)
    mamba = MambaSpec(block_size=bs, shapes=((2, 4),), dtypes=(torch.float32,))
    kwargs = dict(max_model_len=1024, scheduler_block_size=bs, hash_block_size=bs)
    hybrid = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[
            full.kv_cache_groups[0],
            KVCacheGroupSpec(["model.layers.1.linear_attn"], mamba),
        ],
    )
    # (sliding-window, chunked and Mamba "align" groups are taken: test_vllm_hybrid.py)
    with pytest.raises(NotImplementedError, match="Mamba group 1 in mamba_cache_mode='none'"):
        kv_vllm.KVCacheManager(kv_cache_config=hybrid, **kwargs)
    with pytest.raises(NotImplementedError, match="use_eagle"):
        kv_vllm.KVCacheManager(kv_cache_config=full, use_eagle=True, **kwargs)
    with pytest.raises(ValueError, match="scheduler_block_size"):
        kv_vllm.KVCacheManager(
            kv_cache_config=full,
            max_model_len=1024,
            scheduler_block_size=2 * bs,
            hash_block_size=bs,
        )


def _scenario(kind, hasher, bs):
    """The two by-design differences on four requests sharing a 64-token prefix P:
    step 1 admits A = P+a and B = P+b (same step); step 2 admits C = P+b+c while A and B run;
    then B is freed and D = P+b+d is admitted. Returns the hits of B, C and D."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    manager = h.make_manager(kind, 64, bs)
    sp = SamplingParams(max_tokens=4)
    prefix, a, b, c, d = (
        list(range(s, s + n))
        for s, n in (
            (1000, 4 * bs),
            (2000 + bs, bs),
            (3000 + bs, bs),
            (4000 + bs, bs),
            (5000 + bs, bs),
        )
    )
    hashing = None if kind == "kvpool" else hasher

    def admit(rid, tokens):
        r = Request(rid, tokens, sp, None, block_hasher=hashing)
        blocks, hit, _ = manager.get_computed_blocks(r)
        assert manager.allocate_slots(
            r, r.num_tokens - hit, hit, blocks, full_sequence_must_fit=True
        )
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, hit
        return r, hit

    def forward(*requests):  # the step's forward pass: every scheduled token computed
        for r in requests:
            r.num_computed_tokens = r.num_tokens

    manager.new_step_starts()
    ra, _ = admit("A", prefix + a)
    rb, hit_b = admit("B", prefix + b)
    forward(ra, rb)
    manager.new_step_starts()
    rc, hit_c = admit("C", prefix + b + c)
    forward(rc)
    manager.free(rb)
    manager.new_step_starts()
    _, hit_d = admit("D", prefix + b + d)
    if kind == "kvpool":
        manager.check()
    return hit_b, hit_c, hit_d


def test_by_design_differences_on_a_crafted_trace(hasher, bs):
    # vLLM publishes A's blocks when it allocates them: B, admitted in the same step, hits P
    # before its KV exists; kvpool (R17) and vLLM publishing after compute do not.
    assert _scenario("vllm", hasher, bs)[0] == 4 * bs
    assert _scenario("vllm-r17", hasher, bs)[0] == _scenario("kvpool", hasher, bs)[0] == 0
    # B recomputed P, a duplicate of A's published P (R9: first writer wins, no dedup), so
    # kvpool publishes B's block b only when B is released: C (P+b+c) hits P alone while B runs,
    # vLLM publishing after compute also hits b; once B is freed, D hits P+b in both.
    assert _scenario("vllm-r17", hasher, bs)[1:] == (5 * bs, 5 * bs)
    assert _scenario("kvpool", hasher, bs)[1:] == (4 * bs, 5 * bs)


@pytest.mark.parametrize("events", [False, True])
def test_blocks_a_decode_fills_are_published_before_the_next_lookup(events, bs):
    """R17 as the manager publishes: a running request's filled block is published once its KV
    exists and before the next lookup, whether or not a lookup ran in the step that scheduled
    it (that lookup must neither see it nor forget it); with KV events, at the step's start."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    manager = h.make_manager("kvpool", 64, bs, events=events)
    sp = SamplingParams(max_tokens=8)
    prompt = list(range(100, 100 + 2 * bs - 2))  # block 1 fills at token 2 * bs
    running = Request("run", prompt, sp, None)
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(running)
    assert manager.allocate_slots(running, len(prompt), hit, blocks) is not None
    running.status, running.num_computed_tokens = RequestStatus.RUNNING, len(prompt)
    running.append_output_token_ids(7)  # the prefill's sampled token: 31 tokens
    manager.take_events()
    step = 0
    while (
        running.num_tokens < 2 * bs + 1
    ):  # decode steps; the one scheduling token 2 * bs fills block 1
        manager.new_step_starts()
        assert manager.allocate_slots(running, 1) is not None
        # a lookup in the step under way: the block's KV does not exist yet
        probe = Request(f"probe{step}", prompt + [7, 8, 9], sp, None)
        assert manager.get_computed_blocks(probe)[1] == bs
        manager.free(probe)
        running.num_computed_tokens += 1  # the forward pass returns
        running.append_output_token_ids(8 + step)
        step += 1
    manager.new_step_starts()
    stored = [e for e in manager.take_events() if type(e).__name__ == "BlockStored"]
    assert bool(stored) == events  # with events: published at the step's start, events out
    later = Request("later", prompt + [7, 8, 9], sp, None)
    assert manager.get_computed_blocks(later)[1] == 2 * bs  # both blocks: block 1's KV exists
    manager.check()
    manager.free(later)
    manager.free(running)
    manager.check()
