"""Shared by tests/vllm and benches/vllm_bench.py: vLLM 0.33 or 0.34 on CPU, both managers, traces.

Importing this module imports vLLM (15-25 s); without a supported vLLM it skips the importing
test module instead (``vllm_available()`` asks first). It sets
``VLLM_TARGET_DEVICE=cpu`` and ``HF_HUB_OFFLINE=1`` (no hub, no GPU).

- ``chat_trace``: a seeded multi-turn chat trace (shared system prompts, growing histories).
- ``make_manager``: vLLM's own ``KVCacheManager`` or kvpool's, from the same arguments.
- ``drive``: the calls vLLM's sync Scheduler makes on its manager (``schedule()``:
  ``new_step_starts``, the running loop's ``allocate_slots`` with lookahead and preemption from
  the tail, the waiting loop's ``get_computed_blocks`` / ``allocate_slots(full_sequence_must_fit)``
  / ``record_prefix_cache_stats`` / ``get_blocks``, the three ``take_*``; ``update_from_output``:
  sampled tokens, ``free`` on finish, ``take_events``, ``make_prefix_cache_stats``, ``usage``),
  on many requests at once, with a fake KV store that checks every hit block holds the KV of the
  tokens it stands for and that tables only grow. Returns a log to compare.
- ``build_scheduler`` / ``run_scheduler``: vLLM's real Scheduler on a written config.json.
- ``BS``: the block size the installed version's defaults pick (16 in 0.33, 64 in 0.34);
  ``blocks(n)``: ``n`` blocks of 16 tokens as blocks of another size (the same memory);
  ``skip_reading(request)``: mark a request as one that must not read the cache (each version's
  attribute).
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def installed_version() -> tuple[int, int] | None:
    """The installed vLLM's ``(major, minor)``, or None (without importing it)."""
    from kvpool.integrations._vllm_versions import version_of

    try:
        return version_of(importlib.metadata.version("vllm"))
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_available() -> bool:
    """Whether a vLLM that kvpool's drop-in supports (0.33.x, 0.34.x) is installed (without
    importing it)."""
    from kvpool.integrations._vllm_versions import SUPPORTED_MINORS

    return installed_version() in SUPPORTED_MINORS


if not vllm_available():  # the test modules importing this one are skipped: make test-vllm
    import pytest
    from kvpool.integrations._vllm_versions import SUPPORTED

    pytest.skip(
        f"needs vLLM{SUPPORTED} (found {installed_version()}): make test-vllm",
        allow_module_level=True,
    )

import kvpool  # noqa: E402
import torch  # noqa: E402
import vllm.v1.core.sched.scheduler as sched_module  # noqa: E402
from kvpool.integrations import vllm as kv_vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

VOCAB = 32000
VERSION = installed_version()
VLLM_034 = VERSION == (0, 34)
if VLLM_034:
    # 0.34's CPU platform refuses to build a config on x86 without triton-cpu (0.33 warned);
    # PyPI's wheel brings CUDA's triton, which has no CPU driver. Nothing here runs a kernel
    # (configs, Schedulers and managers only), so the check is told Triton is there.
    import vllm.triton_utils as _triton_utils

    _triton_utils.HAS_TRITON = True


def default_block_size() -> int:
    """The block size vLLM's config resolves when none is given (the version's default), for
    the full-attention model of ``model_dir``."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir(), skip_tokenizer_init=True, max_model_len=8192),
        cache_config=CacheConfig(enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512,
            max_num_seqs=32,
            max_model_len=8192,
            is_encoder_decoder=False,
        ),
    )
    return config.cache_config.block_size


def blocks(n16: int, block_size: int) -> int:
    """``n16`` blocks of 16 tokens as blocks of ``block_size`` tokens (the same memory)."""
    return n16 * 16 // block_size


def skip_reading(request: Request) -> Request:
    """Mark ``request`` as one that must not read the prefix cache (what prompt-logprobs
    requests set): 0.33's ``skip_reading_prefix_cache``, 0.34's ``prefix_cache_hit_limit`` 0."""
    if VLLM_034:
        request.prefix_cache_hit_limit = 0
    else:
        request.skip_reading_prefix_cache = True
    return request


# ---------------------------------------------------------------------------------- traces
@dataclass
class Item:
    rid: int
    arrival: float
    prompt: list[int]
    output: list[int]


def chat_trace(
    num_requests: int,
    seed: int = 0,
    *,
    num_system_prompts: int = 4,
    system_prompt_len: int = 700,
    user_mean: float = 90.0,
    output_len: int = 12,
    max_turns: int = 6,
    max_prompt_len: int = 3000,
) -> list[Item]:
    """Sessions on a few shared system prompts; each turn's prompt is the whole history plus a
    new user message; answers are fixed tokens (the fake model samples exactly them)."""
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(3, VOCAB, system_prompt_len).tolist() for _ in range(num_system_prompts)
    ]
    items: list[Item] = []
    t_session = 0.0
    while len(items) < num_requests:
        history = list(systems[int(rng.integers(num_system_prompts))])
        t = t_session
        for _ in range(int(rng.integers(1, max_turns + 1))):
            user = int(np.clip(rng.lognormal(np.log(user_mean), 0.6), 4, 600))
            prompt = history + rng.integers(3, VOCAB, user).tolist()
            if len(prompt) > max_prompt_len or len(items) >= num_requests:
                break
            answer = rng.integers(3, VOCAB, output_len).tolist()
            items.append(Item(len(items), t, prompt, answer))
            history = prompt + answer
            t += 8.0 + float(rng.exponential(12.0))
        t_session += float(rng.exponential(3.0))
    items.sort(key=lambda it: (it.arrival, it.rid))
    for i, it in enumerate(items):
        it.rid = i
    return items


# -------------------------------------------------------------------------------- managers
@dataclass(frozen=True)
class Hybrid:
    """A hybrid model's KV cache groups as vLLM builds them: ``window_groups`` sliding-window
    groups of ``window`` tokens beside one full-attention group; ``window_first``: vLLM's group 0
    is a window group (gpt-oss's first layer is a window layer). ``retention``: the config's
    ``prefix_cache_retention_interval`` (vLLM's default 0: sparse window retention; None: vLLM
    keeps every window block). ``chunked``: the window groups are chunked local attention
    groups of chunk ``window`` (Llama 4). ``mamba``: they are Mamba groups in "align" mode
    (Qwen3-Next's GDN layers; ``window`` unused), the Scheduler splitting prefills at block
    boundaries."""

    window: int
    window_groups: int = 1
    window_first: bool = False
    retention: int | None = 0
    chunked: bool = False
    mamba: bool = False


GPT_OSS = Hybrid(window=128, window_groups=1, window_first=True)  # alternating 128 / full
# 5 window layers (512) per full one: five window groups here; vLLM's planner splits Gemma 3's
# layers into six (test_vllm_hybrid.py's test_the_configs_vllms_planner_builds)
GEMMA3 = Hybrid(window=512, window_groups=5)
# Llama 4: 3 chunked local attention layers (chunk 8,192) per full one, three chunked groups; a
# chunk of 512 here, so the chat trace's prompts (about 3.2k tokens) cross chunk boundaries
LLAMA4 = Hybrid(window=512, window_groups=3, chunked=True)
# Qwen3-Next: GDN (Mamba "align") layers 3:1 beside full attention, three Mamba groups
QWEN3_NEXT = Hybrid(window=0, window_groups=3, mamba=True)


def kv_cache_config(
    num_blocks: int, block_size: int = 16, num_layers: int = 2, hybrid: Hybrid | None = None
) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    if hybrid is None:
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
    common = dict(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    if hybrid.mamba:
        window: Any = MambaSpec(
            block_size=block_size,
            shapes=((2, 8), (4, 16)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        )
    elif hybrid.chunked:
        window = ChunkedLocalAttentionSpec(attention_chunk_size=hybrid.window, **common)
    else:
        window = SlidingWindowSpec(sliding_window=hybrid.window, **common)
    n = 1 + hybrid.window_groups  # one layer per group: layer i in group i
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], window if i else spec)
        for i in range(n)
    ]
    if hybrid.window_first:  # window layers first: vLLM's group 0 is a window group
        groups = groups[1:] + groups[:1]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=hybrid.retention,
    )


def vllm_grouped_config(
    num_blocks: int, block_size: int, layer_windows: list[int | None]
) -> KVCacheConfig:
    """The KV cache config vLLM's own planner groups for a model whose layer i has window
    ``layer_windows[i]`` (None: full attention): ``get_kv_cache_groups`` of the installed
    version (gpt-oss: alternating 128 / None; Gemma 3: five windows per full layer)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir(), skip_tokenizer_init=True, max_model_len=8192),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512,
            max_num_seqs=32,
            max_model_len=8192,
            is_encoder_decoder=False,
        ),
    )
    config.cache_config.kv_cache_layout = "LBHNC"  # (the engine core resolves it: any will do)
    common = dict(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    specs = {
        f"model.layers.{i}.self_attn.attn": (
            FullAttentionSpec(**common)
            if w is None
            else SlidingWindowSpec(sliding_window=w, **common)
        )
        for i, w in enumerate(layer_windows)
    }
    groups = get_kv_cache_groups(config, specs)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=config.cache_config.prefix_cache_retention_interval,
    )


def group_windows(config: KVCacheConfig) -> list[int | None]:
    """Each group's window in tokens (a chunked local attention group's chunk; None: full
    attention), in vLLM's order."""
    return [
        getattr(g.kv_cache_spec, "sliding_window", None)
        or getattr(g.kv_cache_spec, "attention_chunk_size", None)
        for g in config.kv_cache_groups
    ]


def group_states(config: KVCacheConfig) -> list[bool]:
    """Whether each group is a Mamba group (a state per block), in vLLM's order."""
    return [isinstance(g.kv_cache_spec, MambaSpec) for g in config.kv_cache_groups]


def group_chunked(config: KVCacheConfig) -> list[bool]:
    """Whether each group is a chunked local attention group, in vLLM's order."""
    return [isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec) for g in config.kv_cache_groups]


def first_needed(window: int | None, computed: int, block_size: int) -> int:
    """The first block a table must hold for a query at position ``computed`` (a sliding
    window's ``get_num_skipped_tokens`` in blocks; 0 for full attention): entries before it are
    null. A chunked group's chunk counts as its window here (kvpool keeps that much)."""
    if window is None:
        return 0
    return max(0, computed - window + 1) // block_size


def first_read(window: int | None, chunked: bool, computed: int, block_size: int) -> int:
    """The first block a query at position ``computed`` reads: ``first_needed``, or for a
    chunked local attention group its chunk's start (vLLM's ``get_num_skipped_tokens``)."""
    if chunked and window:
        return computed // window * window // block_size
    return first_needed(window, computed, block_size)


class PublishAfterCompute(VllmKVCacheManager):
    """vLLM's own manager publishing the way kvpool does (R17), the reference of the exact
    comparisons: ``allocate_slots`` with ``delay_cache_blocks=True``, then ``cache_blocks`` of
    the tokens whose KV exists at the next ``new_step_starts`` and before ``free``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.live: dict[str, Request] = {}

    def new_step_starts(self) -> None:
        for r in self.live.values():
            self.cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
        super().new_step_starts()

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        kwargs["delay_cache_blocks"] = True
        blocks = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if blocks is not None:
            self.live[request.request_id] = request
        return blocks

    def free(self, request) -> None:
        if self.live.pop(request.request_id, None) is not None:
            self.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)
        super().free(request)


MANAGERS = {"vllm": VllmKVCacheManager, "vllm-r17": PublishAfterCompute}


def make_manager(
    kind: str,
    num_blocks: int,
    block_size: int = 16,
    *,
    max_model_len: int = 8192,
    events: bool = False,
    caching: bool = True,
    hybrid: Hybrid | None = None,
    config: KVCacheConfig | None = None,
):
    """``kind`` "vllm" (vLLM's own), "vllm-r17" (``PublishAfterCompute``) or "kvpool", built
    with the Scheduler's keyword arguments; ``hybrid``: window groups beside full attention;
    ``config``: this KV cache config instead (``num_blocks`` and ``hybrid`` unused)."""
    cls = MANAGERS.get(kind, kv_vllm.KVCacheManager)
    return cls(
        kv_cache_config=config or kv_cache_config(num_blocks, block_size, hybrid=hybrid),
        max_model_len=max_model_len,
        max_in_flight_tokens=2048,
        enable_caching=caching,
        use_eagle=False,
        num_hash_lookahead_tokens=0,
        num_prefill_lookahead=0,
        log_stats=True,
        enable_kv_cache_events=events,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        metrics_collector=None,
        watermark=0.0,
        enable_mamba_shared_prefix_checkpoint=False,
    )


def block_hasher(block_size: int, algo: str = "sha256"):
    """vLLM's request block hasher (what EngineCore builds when prefix caching is on)."""
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


# ----------------------------------------------------------------------------- the driver
@dataclass
class Log:
    """What a drive decided, step by step, and its totals."""

    steps: list[tuple] = field(default_factory=list)  # one tuple per step: what was scheduled
    admissions: dict[int, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # rid -> [(step, hit)]
    same_step_shares: int = 0  # admissions whose hit includes blocks scheduled, not computed
    share_tokens: int = 0  # the hit tokens from the first such block on (vLLM only)
    first_share_step: int | None = None
    missed_running: int = 0  # hits stopping at a block a running request computed, unpublished
    first_missed_step: int | None = None
    first_eviction_step: int | None = None
    hit_tokens: int = 0
    preemptions: int = 0
    events: collections.Counter = field(default_factory=collections.Counter)
    stats_hits: int = 0
    stats_queries: int = 0
    resets: list[bool] = field(default_factory=list)


def drive(
    manager,
    trace: list[Item],
    *,
    budget: int = 512,
    max_seqs: int = 16,
    lookahead: int = 0,
    arrival_scale: float = 1.0,
    hasher=None,
    reset_at: tuple[int, ...] = (),
    check=None,
) -> Log:
    """Run ``trace`` through ``manager`` with the sync Scheduler's calls (module doc).

    ``hasher``: vLLM's block hasher (vLLM's manager reads ``request.block_hashes``; kvpool's
    hashes the tokens itself). ``reset_at``: steps at which ``reset_prefix_cache`` is called
    (its result is logged). ``check``: called with the manager after every step.
    """
    bs = manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    windows = group_windows(manager.kv_cache_config)  # None: full attention
    chunked = group_chunked(manager.kv_cache_config)
    full = windows.index(None)
    params = {}
    pending = collections.deque(trace)
    waiting: collections.deque = collections.deque()
    running: list = []
    reqs: dict[str, Request] = {}
    chains: dict[str, list[bytes]] = {}  # the content each full block of a request stands for
    tables: dict[str, list[list[int]]] = {}  # the worker's view per group: NewRequestData, appends
    answers = {str(it.rid): it.output for it in trace}
    # block id -> (group, content) whose KV it holds (full blocks; one id space for all groups)
    kv_store: dict[int, tuple[int, bytes]] = {}
    log = Log()
    step = 0

    def release(r: Request) -> None:
        manager.free(r)

    while pending or waiting or running:
        while pending and pending[0].arrival * arrival_scale <= step:
            it = pending.popleft()
            sp = params.get(len(it.output)) or params.setdefault(
                len(it.output), SamplingParams(max_tokens=len(it.output), ignore_eos=True)
            )
            r = Request(
                str(it.rid), it.prompt, sp, None, arrival_time=float(step), block_hasher=hasher
            )
            reqs[r.request_id] = r
            chains[r.request_id] = kvpool.hash_blocks(it.prompt + it.output, bs)
            waiting.append(r)
        if step in reset_at:
            log.resets.append(manager.reset_prefix_cache())
        # ------------------------------------------------------------------ schedule()
        manager.new_step_starts()
        token_budget = budget
        scheduled: dict[str, int] = {}
        in_flight: set[bytes] = set()
        preempted: list[str] = []
        i = 0
        while i < len(running) and token_budget > 0:
            r = running[i]
            n = min(r.num_tokens_with_spec - r.num_computed_tokens, token_budget)
            while True:
                new = manager.allocate_slots(r, n, num_lookahead_tokens=lookahead)
                if new is not None:
                    break
                victim = running.pop()  # preempt from the tail (FCFS)
                release(victim)
                victim.status = RequestStatus.PREEMPTED
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                tables.pop(victim.request_id, None)
                waiting.appendleft(victim)
                preempted.append(victim.request_id)
                log.preemptions += 1
                if victim is r:
                    break
            if new is None:
                break
            ids = new.get_block_ids(allow_none=True)
            if ids is not None:
                for table, more in zip(tables[r.request_id], ids, strict=True):
                    table.extend(more)
            scheduled[r.request_id] = n
            token_budget -= n
            for j in range(r.num_computed_tokens // bs, (r.num_computed_tokens + n) // bs):
                in_flight.add(chains[r.request_id][j])
            i += 1
        while waiting and not preempted and token_budget > 0 and len(running) < max_seqs:
            r = waiting[0]
            blocks, hit, _ = manager.get_computed_blocks(r)
            n = min(r.num_tokens - hit, token_budget)
            new = manager.allocate_slots(
                r,
                n,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=0,
                delay_cache_blocks=False,
                skip_zeroing_group_ids=(),
                num_encoder_tokens=0,
                full_sequence_must_fit=True,
                reserved_blocks=0,
                has_scheduled_reqs=bool(running),
            )
            if new is None:
                break
            waiting.popleft()
            manager.record_prefix_cache_stats(r, hit)
            groups = manager.get_blocks(r.request_id).get_block_ids()
            table = groups[full]
            chain = chains[r.request_id]
            shared = False
            for g, window in enumerate(windows):
                start = first_needed(window, hit, bs)  # a window's table: null entries before
                assert not any(groups[g][:start]), (
                    f"request {r.request_id}: group {g} holds blocks behind its window"
                )
                start = first_read(window, chunked[g], hit, bs)
                for j in range(start, hit // bs):  # every hit block read holds its tokens' KV ...
                    if chain[j] in in_flight:  # ... or is being computed this step (vLLM only)
                        shared = True
                    else:
                        assert kv_store.get(groups[g][j]) == (g, chain[j]), (
                            f"request {r.request_id}: hit block {j} of group {g} holds other KV"
                        )
            log.same_step_shares += shared
            if shared:
                first = next(j for j in range(hit // bs) if chain[j] in in_flight)
                log.share_tokens += hit - first * bs
            if shared and log.first_share_step is None:
                log.first_share_step = step
            j = hit // bs  # the first block missed: computed by a running request, unpublished?
            if (
                j < len(chain)
                and (j + 1) * bs < r.num_tokens
                and any(
                    q.num_computed_tokens >= (j + 1) * bs and chains[q.request_id][j] == chain[j]
                    for q in running
                )
            ):
                log.missed_running += 1
                if log.first_missed_step is None:
                    log.first_missed_step = step
            tables[r.request_id] = [list(ids) for ids in groups]
            log.admissions.setdefault(int(r.request_id), []).append((step, hit))
            log.hit_tokens += hit
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = hit
            running.append(r)
            scheduled[r.request_id] = n
            token_budget -= n
            for j in range(hit // bs, (hit + n) // bs):
                in_flight.add(chain[j])
        manager.take_boundary_state_offloads()
        manager.take_kv_cache_block_copies()
        manager.take_new_block_ids()
        log.steps.append((step, tuple(scheduled.items()), tuple(preempted)))
        # --------------------------------------------------- the forward pass, then update
        for rid in scheduled:
            r = reqs[rid]
            worker, now = tables[rid], manager.get_block_ids(rid)
            assert worker[full] == now[full], f"request {rid}: table changed under the worker"
            computed = r.num_computed_tokens
            for g, window in enumerate(windows):
                if window is None:
                    continue
                # a window table: entries the worker holds, or null once behind the window
                assert len(worker[g]) == len(now[g]) and all(
                    b in (a, 0) for a, b in zip(worker[g], now[g], strict=True)
                ), f"request {rid}: group {g}'s table changed under the worker"
                # every block a query of this step reads holds its tokens' KV
                for j in range(first_read(window, chunked[g], computed, bs), computed // bs):
                    if chains[rid][j] not in in_flight:
                        assert kv_store.get(worker[g][j]) == (g, chains[rid][j]), (
                            f"request {rid}: block {j} of group {g} holds other KV at step {step}"
                        )
        for rid, n in scheduled.items():
            r = reqs[rid]
            worker = tables[rid]
            for g in range(len(windows)):
                for j in range(r.num_computed_tokens // bs, (r.num_computed_tokens + n) // bs):
                    assert worker[g][j], f"request {rid}: writes block {j} of group {g} to null"
                    kv_store[worker[g][j]] = (g, chains[rid][j])  # the fake KV, once full
            r.num_computed_tokens += n
        finished = []
        for rid in scheduled:
            r = reqs[rid]
            if r.num_computed_tokens >= r.num_tokens:
                r.append_output_token_ids(answers[rid][r.num_output_tokens])
                if r.num_output_tokens >= r.max_tokens:
                    finished.append(r)
        for r in finished:
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
            running.remove(r)
            release(r)
            tables.pop(r.request_id)
        for e in manager.take_events():
            log.events[type(e).__name__] += 1
            if type(e).__name__ == "BlockRemoved" and log.first_eviction_step is None:
                log.first_eviction_step = step
        stats = manager.make_prefix_cache_stats()
        log.stats_hits += stats.hits
        log.stats_queries += stats.queries
        assert 0.0 <= manager.usage <= 1.0
        if check is not None:
            check(manager)
        step += 1
    assert manager.block_pool.get_num_free_blocks() == manager.kv_cache_config.num_blocks - 1, (
        "blocks leaked"
    )
    return log


# ------------------------------------------------------------------- the real Scheduler
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 16384,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
_MODEL_DIRS: dict[int, str] = {}


def model_dir(max_position_embeddings: int = 16384) -> str:
    """A folder with a Llama-shaped config.json (no weights, no tokenizer, no hub), one per
    ``max_position_embeddings`` (benches/hybrid_bench.py takes Mooncake's longest prompts)."""
    if max_position_embeddings not in _MODEL_DIRS:
        path = tempfile.mkdtemp(prefix="kvpool-vllm-model-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**LLAMA_CONFIG, "max_position_embeddings": max_position_embeddings}, f)
        _MODEL_DIRS[max_position_embeddings] = path
    return _MODEL_DIRS[max_position_embeddings]


BS = default_block_size()  # 16 under vLLM 0.33, 64 under 0.34


def build_scheduler(
    manager: str,
    num_blocks: int,
    *,
    block_size: int = 16,
    budget: int = 512,
    max_seqs: int = 32,
    max_model_len: int = 8192,
    async_: bool = False,
    events: bool = False,
    hash_algo: str = "sha256",
    scheduler_options: dict | None = None,
    hybrid: Hybrid | None = None,
):
    """vLLM's real Scheduler (or AsyncScheduler); ``manager`` "vllm" or "kvpool" (kvpool's
    installed through ``scheduler_cls``, the route ``--scheduler-cls`` takes).
    ``scheduler_options``: more ``SchedulerConfig`` fields (0.34's
    ``cache_aware_admission_window``, ...)."""
    from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401 (cls below)
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, max_model_len=max_model_len)
    cache = CacheConfig(
        block_size=block_size, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo
    )
    if hybrid is not None and hybrid.mamba:  # the Scheduler splits prefills at block boundaries
        cache.mamba_cache_mode = "align"
        cache.mamba_block_size = block_size
    sched = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        **(scheduler_options or {}),
    )
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
    config = VllmConfig(
        model_config=model, cache_config=cache, scheduler_config=sched, kv_events_config=kv_events
    )
    config.cache_config.num_gpu_blocks = num_blocks
    config.scheduler_config.async_scheduling = async_
    if manager == "kvpool":
        config.scheduler_config.scheduler_cls = (
            kv_vllm.AsyncScheduler if async_ else kv_vllm.Scheduler
        )
        cls = config.scheduler_config.get_scheduler_cls()
    else:
        cls = AsyncScheduler if async_ else Scheduler
    saved = sched_module.KVCacheManager
    if manager == "vllm-r17":
        sched_module.KVCacheManager = PublishAfterCompute
    try:
        scheduler = cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config(num_blocks, block_size, hybrid=hybrid),
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=block_size,
            include_finished_set=False,
            log_stats=True,
        )
    finally:
        sched_module.KVCacheManager = saved
    return scheduler, config


class FakeKV:
    """A worker's block tables and a fake KV store under vLLM's real Scheduler, every group in
    one id space: each ``SchedulerOutput`` is executed as the device would, in order, when it is
    scheduled. Its reads are checked first: a new request's hit blocks of every group (full
    attention: all of them; a window: those its first query reads, null entries before), and
    every step, each window block a scheduled query reads, must hold the KV of exactly the
    tokens they stand for; then its writes are recorded (a block's KV once it is full). A
    Mamba group runs vLLM's "align" protocol (``mamba_utils.preprocess_mamba``): each step
    copies the state from the block of the previous step's last token (a new or resumed
    request: of its hit's last token) to the block of this step's, checking that it is the
    state of exactly the request's prefix there, then writes the state after the step.
    ``reads``: blocks (a Mamba group: states) checked, per group."""

    def __init__(self, config: KVCacheConfig, trace: list[Item]) -> None:
        self.bs = config.kv_cache_groups[0].kv_cache_spec.block_size
        self.windows = group_windows(config)
        self.chunked = group_chunked(config)
        self.states = group_states(config)
        self.tokens = {str(it.rid): it.prompt + it.output for it in trace}
        self.chains = {rid: kvpool.hash_blocks(t, self.bs) for rid, t in self.tokens.items()}
        self.state_idx: dict[str, int] = {}  # the worker's mamba_state_idx
        self.tables: dict[str, list[list[int]]] = {}
        self.store: dict[int, tuple[int, Any]] = {}
        self.reads = [0] * len(self.windows)

    def _read(self, rid: str, g: int, j: int, step: int) -> None:
        got = self.store.get(self.tables[rid][g][j])
        assert got == (g, self.chains[rid][j]), (
            f"step {step}: request {rid} reads block {j} of group {g} "
            f"(id {self.tables[rid][g][j]}), which holds other KV"
        )
        self.reads[g] += 1

    def _state(self, rid: str, p: int) -> tuple:
        """The state after ``p`` tokens of request ``rid``'s sequence (its prefix's identity)."""
        full = p // self.bs
        head = self.chains[rid][full - 1] if full else b""
        return (head, tuple(self.tokens[rid][full * self.bs : p]))

    def _run_states(self, rid: str, c: int, n: int, step: int) -> None:
        """vLLM's Mamba step: copy the state to the step's block, then write the new one."""
        bs, table_of = self.bs, self.tables[rid]
        prev = self.state_idx.get(rid, (c - 1) // bs)
        curr = -(-(c + n) // bs) - 1
        for g, state in enumerate(self.states):
            if not state:
                continue
            table = table_of[g]
            assert table[curr], f"step {step}: request {rid} has no state block {curr} (group {g})"
            if prev >= 0:
                assert table[prev], f"step {step}: request {rid}'s state block {prev} is null"
                got = self.store.get(table[prev])
                assert got == (g, self._state(rid, c)), (
                    f"step {step}: request {rid} copies the state of block {prev} of group {g} "
                    f"(id {table[prev]}), which holds another state"
                )
                self.reads[g] += 1
            self.store[table[curr]] = (g, self._state(rid, c + n))
        self.state_idx[rid] = curr

    def execute(self, so, step: int) -> None:
        """Check the reads of scheduler output ``so``, then record its writes."""
        bs = self.bs
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.state_idx.pop(rid, None)
        for rid in so.preempted_req_ids or ():
            self.tables.pop(rid, None)
            self.state_idx.pop(rid, None)
        computed: dict[str, int] = {}
        for r in so.scheduled_new_reqs:
            self.tables[r.req_id] = [list(ids) for ids in r.block_ids]
            c = computed[r.req_id] = r.num_computed_tokens
            self.state_idx.pop(r.req_id, None)
            for g, window in enumerate(self.windows):
                if self.states[g]:
                    continue  # its hit's state is read by the step's copy
                start = first_needed(window, c, bs)
                assert not any(self.tables[r.req_id][g][:start]), (
                    f"request {r.req_id}: group {g} holds blocks behind its window"
                )
                # the hit, as the first query reads it
                for j in range(first_read(window, self.chunked[g], c, bs), c // bs):
                    self._read(r.req_id, g, j, step)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for rid, new_ids, c in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            if rid in resumed:
                self.tables[rid] = [list(ids) for ids in new_ids]
                self.state_idx.pop(rid, None)
            elif new_ids is not None:
                for table, more in zip(self.tables[rid], new_ids, strict=True):
                    table.extend(more)
            computed[rid] = c
            for g, window in enumerate(self.windows):
                if window is not None:  # every block the step's first query reads
                    for j in range(first_read(window, self.chunked[g], c, bs), c // bs):
                        self._read(rid, g, j, step)
        for rid, n in so.num_scheduled_tokens.items():
            c = computed[rid]
            self._run_states(rid, c, n, step)
            for g, table in enumerate(self.tables[rid]):
                if self.states[g]:
                    continue
                for j in range(c // bs, (c + n) // bs):
                    assert table[j], (
                        f"step {step}: request {rid} writes block {j} of group {g} to null"
                    )
                    self.store[table[j]] = (g, self.chains[rid][j])


@dataclass
class Run:
    """A Scheduler run: one record per ``schedule()``, and totals."""

    records: list[tuple] = field(default_factory=list)
    finished: int = 0
    preemptions: int = 0
    hits: int = 0
    queries: int = 0
    schedule_ns: list[int] = field(default_factory=list)
    update_ns: list[int] = field(default_factory=list)
    hash_ns: int = 0


def first_difference(a: Run, b: Run) -> tuple | None:
    """The first pair of records in which two Scheduler runs differ (None: a prefix of one
    another)."""
    for x, y in zip(a.records, b.records, strict=False):
        if x != y:
            return x, y
    return None


def first_differing_step(a: Run, b: Run) -> int | None:
    """The step at which two runs are first scheduled differently, or None."""
    diff = first_difference(a, b)
    return None if diff is None else diff[0][0]


def assert_same_or_hit_first(a: Run, b: Run) -> None:
    """Identical schedules, or the first differing step admits a request with another hit."""
    diff = first_difference(a, b)
    if diff is None:
        assert len(a.records) == len(b.records)
        return
    (step, new_a, cached_a, *_), (_, new_b, cached_b, *_) = diff
    assert cached_a == cached_b, f"step {step}: running requests scheduled differently"
    hits_a = {rid: computed for rid, computed, _ in new_a}
    hits_b = {rid: computed for rid, computed, _ in new_b}
    assert any(hits_a[x] != hits_b[x] for x in hits_a.keys() & hits_b.keys()), (
        f"step {step}: the schedules part without a hit difference: {diff}"
    )


def record_events(manager) -> list:
    """Every KV event ``manager.take_events`` hands out from now on, in order (the list grows
    as the Scheduler takes them)."""
    seen: list = []
    original = manager.take_events

    def take():
        events = original()
        seen.extend(events)
        return events

    manager.take_events = take
    return seen


def run_scheduler(
    scheduler,
    config,
    trace: list[Item],
    *,
    arrival_scale: float = 1.0,
    hasher=None,
    timed: bool = False,
    kv: FakeKV | None = None,
) -> Run:
    """Feed ``trace`` to the Scheduler as EngineCore does (``step`` for sync,
    ``step_with_batch_queue`` for async: a queue of ``max_concurrent_batches``), with a fake
    model that samples the trace's answers; ends with ``reset_prefix_cache()`` (must succeed).
    ``kv``: a ``FakeKV`` that executes and checks every scheduled step."""
    from vllm.v1.outputs import ModelRunnerOutput

    answers = {str(it.rid): it.output for it in trace}
    sampled: collections.Counter[str] = collections.Counter()
    pending = collections.deque(trace)
    params: dict[int, SamplingParams] = {}
    queue: collections.deque = collections.deque()
    queue_size = config.max_concurrent_batches if config.scheduler_config.async_scheduling else 1
    run = Run()
    clock = time.perf_counter_ns
    step = 0
    idle = 0  # steps in a row that scheduled nothing with requests waiting
    while pending or scheduler.has_requests() or queue:
        while pending and pending[0].arrival * arrival_scale <= step:
            it = pending.popleft()
            sp = params.get(len(it.output)) or params.setdefault(
                len(it.output), SamplingParams(max_tokens=len(it.output), ignore_eos=True)
            )
            t0 = clock()
            r = Request(
                str(it.rid), it.prompt, sp, None, arrival_time=float(step), block_hasher=hasher
            )
            run.hash_ns += clock() - t0
            scheduler.add_request(r)
        if not scheduler.has_requests() and not queue:
            step += 1
            continue
        if scheduler.has_requests():
            t0 = clock()
            so = scheduler.schedule()
            if timed:
                run.schedule_ns.append(clock() - t0)
            if kv is not None:
                kv.execute(so, step)
            ids, tokens = list(so.num_scheduled_tokens), []
            for rid in ids:
                req = scheduler.requests.get(rid)
                if req is None or req.is_prefill_chunk:
                    tokens.append([])
                    continue
                i = sampled[rid]
                sampled[rid] += 1
                tokens.append([answers[rid][i] if i < len(answers[rid]) else 0])
            rows = {} if VLLM_034 else {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
            mro = ModelRunnerOutput(
                req_ids=ids, sampled_token_ids=tokens, **rows
            )  # (0.34: no index)
            cached = so.scheduled_cached_reqs
            run.records.append(
                (  # block counts, not ids: which free block comes is the allocator's
                    step,
                    tuple(
                        (r.req_id, r.num_computed_tokens, len(r.block_ids[0]))
                        for r in so.scheduled_new_reqs
                    ),
                    tuple(
                        zip(
                            cached.req_ids,
                            cached.num_computed_tokens,
                            [0 if b is None else len(b[0]) for b in cached.new_block_ids],
                            strict=True,
                        )
                    ),
                    tuple(so.num_scheduled_tokens.items()),
                    tuple(sorted(so.preempted_req_ids or ())),
                )
            )
            run.preemptions += len(so.preempted_req_ids or ())
            idle = 0 if so.total_num_scheduled_tokens else idle + 1
            assert idle < 1000, (
                "no progress in 1,000 steps: a request that can never fit the KV cache?"
            )
            queue.appendleft((so, mro))
            if len(queue) < queue_size and (
                so.total_num_scheduled_tokens > 0 or scheduler.has_requests()
            ):
                step += 1
                continue
        if queue:
            so, mro = queue.pop()
            t0 = clock()
            outs = scheduler.update_from_output(so, mro)
            if timed:
                run.update_ns.append(clock() - t0)
            for eco in outs.values():
                run.finished += sum(o.finish_reason is not None for o in eco.outputs)
                if eco.scheduler_stats is not None:
                    run.hits += eco.scheduler_stats.prefix_cache_stats.hits
                    run.queries += eco.scheduler_stats.prefix_cache_stats.queries
        step += 1
    manager = scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.kv_cache_config.num_blocks - 1, (
        "blocks leaked"
    )
    assert scheduler.reset_prefix_cache(), "reset_prefix_cache failed with nothing running"
    return run
