"""Prefix-cache hit rates of hybrid models on Mooncake's traces: kvpool's pool beside vLLM 0.33.0.

Requests are taken in trace order, one at a time (no arrival clock, no concurrency, no output
tokens), as the Mooncake paper's Figure 9 does. Each hybrid has one full-attention group and one
sliding-window or linear-state group of equal layer count; a cache of C tokens is 2C/16
group-blocks of memory at block size 16 (C/16 for full attention only).

Tokens: token j of Mooncake hash id h is ``h * 512 + j``, so two prompts share exactly up to
their first differing id (and, at a shared last id, up to the shorter one). Hit rate = prompt
tokens served from the cache / prompt tokens.

Configs (``--configs``; a blank means the manager has no counterpart)::

    name         kvpool.BlockManagerPool               vLLM 0.33.0 (one pool shared by all groups)
    full         C/16 blocks                           FullAttentionSpec(16), C/16 blocks
    w1024, w128  2C/16 blocks, one store for both      FullAttentionSpec(16) + SlidingWindowSpec(16, w):
                 groups (sliding_window=w)             2C/16 blocks, prefix_cache_retention_interval 0
    w1024-dense  (none today)                          as w1024, retention None (every window block)
    c8192        2C/16 blocks, one store for both      FullAttentionSpec(16) +
                 groups (attention_chunk_size=8192)    ChunkedLocalAttentionSpec(16, 8192) (Llama 4):
                                                       2C/16 blocks
    ls512        2C/16 blocks, one store: a state takes FullAttentionSpec(544) + MambaSpec(544, "align"):
                 34 blocks (linear_state_blocks=34,    2C/544 blocks, retention 0
                 544 tokens' KV), at most 2C/544 slots,
                 checkpoint_interval=512 (preset
                 "linear-split": C/16 blocks + C/544
                 slots of their own)
    ls512-dense  (none today)                          as ls512, retention None (every state)
    ls2048       as ls512, checkpoint_interval=2048    (none)

kvpool, per request: ``Sequence(tokens)``, ``allocate`` (the whole prompt), hit =
``num_cached_tokens``; then ``num_computed_tokens`` = each chunk end and ``cache``; ``deallocate``.
With linear state the chunks end where ``pool.next_checkpoint_boundary(seq)`` says (R24: each
multiple of ``checkpoint_interval`` past the hit, the junction where the prompt left the cached
chains, the prompt's last full-block boundary; kvpool's simulator and its transformers engine
end their chunks there too), then at the prompt's end, each followed by
``take_linear_state_plan`` / ``commit_linear_state_plan``. Without linear state there is one
chunk (the whole prompt).

vLLM, per request, the calls its Scheduler and EngineCore make: ``Request(..., block_hasher)``
(EngineCore's hasher at the resolved hash block size, sha256), ``new_step_starts``,
``get_computed_blocks`` (its shared-prefix boundary stored on the request, as ``schedule()``
does), ``allocate_slots`` for the first chunk with the waiting loop's arguments
(``full_sequence_must_fit=scheduler_reserve_full_isl``, ``has_scheduled_reqs=False``), then
``new_step_starts`` + the running loop's ``allocate_slots(req, n, num_lookahead_tokens=0)`` per
further chunk, ``free``. Chunks: the whole rest of the prompt (the token budget is
``max_model_len``), cut by the Scheduler's own ``_mamba_block_aligned_split`` when the model has
Mamba layers in "align" mode. The manager is the one a real ``Scheduler`` builds (its constructor
runs); the KVCacheConfig comes from vLLM's own ``get_kv_cache_groups`` /
``get_kv_cache_config_from_groups`` (``num_gpu_blocks_override`` = the block count), scheduler and
hash block sizes from ``resolve_kv_cache_block_sizes``, as EngineCore resolves them.

Choices where vLLM leaves room (vLLM 0.33.0's code, read in .venv-vllm):

- Retention: ``CacheConfig.prefix_cache_retention_interval`` defaults to 0 ("only semantic
  checkpoints": the replay boundary ``num_prompt_tokens - 1`` and shared-prefix junctions); the
  engine copies it into ``KVCacheConfig`` (whose own dataclass default, None, would be dense).
  ``w1024-dense`` sets None, what ``CacheConfig`` documents as "retains checkpoints densely".
- Mamba: a Qwen3-Next-like model (Qwen3-Next-80B-A3B at TP 1: GDN state shapes from
  ``MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4)``, bf16,
  1,097,728 bytes; full attention 2 KV heads x 256, bf16, 2,048 bytes a token). The platform's
  rule (``Platform._align_hybrid_block_size``, kernel block 16) gives an attention block of
  ``16 * cdiv(1097728, 16 * 2048) = 544`` tokens; "align" mode sets ``mamba_block_size`` to it and
  pads the Mamba page to the attention page (1,114,112 bytes), so both groups share one pool of
  2C/544 equal pages. ``resolve_kv_cache_block_sizes`` then gives scheduler and hash block sizes
  544/544 (the gcd of the groups: no finer ``prefix_match_unit`` by default, hence no partial
  hits). The MambaSpec is the base layer's (``MambaBase.get_kv_cache_spec``): no internal
  prefill checkpoints, which GDN only exports with the FlashInfer prefill backend (not on CPU),
  so the Scheduler splits the prefill instead.
- Model config: a Llama-shaped config.json (no weights) with ``max_model_len`` 262,144 carries the
  CacheConfig; vLLM's hybrid behaviour comes from the KVCacheConfig and CacheConfig
  (``mamba_cache_mode="align"``, the mode ``MambaModelConfig`` picks with prefix caching on).
- One request at a time, ``has_scheduled_reqs=False`` and ``num_in_flight_tokens`` 0 between steps
  (the sync Scheduler after ``update_from_output``).

Timing: manager time per request in microseconds, token-list building excluded; vLLM's counts its
``Request`` construction (the block hashing its manager needs, as in benches/vllm_bench.py) and
shows it separately; kvpool's counts ``Sequence`` construction (kvpool hashes in its own calls).

kvpool options: ``--kvpool-options JSON`` (and ``--kvpool-preset NAME``, applied first) are
keyword arguments merged into every config's ``BlockManagerPool`` arguments. A top-level key that
names a config kind (``full``, ``window``, ``chunked``, ``linear``) or a config (``w128``) with an object value
scopes its options to those configs. A string value starting with ``=`` is an integer expression
of ``C`` (cache tokens), ``BS`` (16), ``W`` (the window, or 0), ``CI`` (the checkpoint interval, or
0) and ``PAGE`` (544); ``null`` drops the key. ``num_blocks`` is the first positional argument.
A config with no kvpool counterpart today (``w1024-dense``) runs kvpool only when the options
name it. Example: ``--kvpool-options '{"window": {"num_blocks": "=2*C//BS", "swa_num_blocks":
null}}'``.

Usage (``make build``, ``make .venv-vllm/.vllm-stamp``, then kvpool into that venv as
``make test-vllm`` does)::

    .venv-vllm/bin/python benches/hybrid_bench.py --trace conversation --sizes 1M,4M,16M --jobs 2
    .venv/bin/python benches/hybrid_bench.py --managers kvpool --kvpool-preset contiguous --check
    .venv-vllm/bin/python benches/hybrid_bench.py --trace conversation,synthetic --jobs 2 --json > t.json
    .venv/bin/python benches/hybrid_bench.py --render t.json     # the tables of a saved run

A run of one (config, size, manager) takes from seconds (kvpool) to minutes (vLLM, whose import
alone is 15-80 s); ``--jobs N`` runs them in N processes (the whole table: ``--jobs 2``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import datetime
import gc
import json
import operator
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np

BS = 16  # the block size of every full-attention and window group
PAGE = 544  # the linear-state page in tokens (Qwen3-Next's attention block at equal bytes)
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id
MAX_MODEL_LEN = 262_144
TRACE_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "mooncake"
)
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
MANAGERS = ("kvpool", "vllm", "drop-in")


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    kind: str  # "full", "window", "chunked" or "linear"
    window: int | None = None
    checkpoint_interval: int | None = None
    dense: bool = False  # vLLM keeps every window block (retention None)
    kvpool: bool = True  # kvpool has a counterpart today
    vllm: bool = True


CONFIGS = {
    c.name: c
    for c in (
        Config("full", "full attention only", "full"),
        Config("w1024", "+ window 1024", "window", window=1024),
        Config("w128", "+ window 128", "window", window=128),
        Config("c8192", "+ chunked local attention 8192 (Llama 4)", "chunked", window=8192),
        Config(
            "w1024-dense",
            "+ window 1024, vLLM keeping every window block",
            "window",
            window=1024,
            dense=True,
            kvpool=False,
        ),
        Config(
            "ls512",
            '+ linear state, checkpoint every 512 (kvpool) / vLLM "align" at 544',
            "linear",
            checkpoint_interval=512,
        ),
        Config(
            "ls512-dense",
            '+ linear state: vLLM "align" at 544 keeping every state (retention None)',
            "linear",
            checkpoint_interval=512,
            dense=True,
            kvpool=False,
        ),
        Config(
            "ls2048",
            "+ linear state, checkpoint every 2048",
            "linear",
            checkpoint_interval=2048,
            vllm=False,
        ),
    )
}

# Named kvpool option sets (the format of --kvpool-options). "today" is kvpool's API as it is;
# add a preset here for each new pool option worth a standing comparison.
PRESETS: dict[str, dict] = {
    "today": {},
    # the window group's own store beside the full-attention one, C/16 blocks each
    "split": {"window": {"num_blocks": "=C//BS", "swa_num_blocks": "=C//BS"}},
    # the linear-state slots as a store of their own beside C/16 blocks (before the one store)
    "linear-split": {
        "linear": {
            "num_blocks": "=C//BS",
            "linear_state_slots": "=C//PAGE",
            "linear_state_blocks": None,
        }
    },
    "contiguous": {"linear": {"linear_state_match": "contiguous"}},
    "promote": {"linear": {"linear_state_save": "promote"}},
}


# ----------------------------------------------------------------------------- arguments
def parse_size(text: str) -> int:
    """``1M`` -> 1,000,000 tokens (decimal, as ``kvpool simulate`` reads sizes)."""
    text = text.strip()
    mult = {"k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}.get(text[-1:])
    value = float(text[:-1]) * mult if mult else float(text)
    if value < BS or value != int(value):
        raise argparse.ArgumentTypeError(f"size {text!r}: a whole number of tokens, at least {BS}")
    return int(value)


def size_label(tokens: int) -> str:
    for unit, v in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= v and tokens % (v // 1000) == 0:
            return f"{tokens / v:g}{unit}"
    return str(tokens)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
}


def eval_expr(text: str, names: dict[str, int]) -> int:
    """An integer expression of ``names`` (``+ - * / // %``, parentheses), for ``=...`` options."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(
            f"option expression {text!r}: only numbers, {sorted(names)} and + - * / // %"
        )

    return int(ev(ast.parse(text, mode="eval")))


def scoped_options(options: dict, cfg: Config) -> tuple[dict, bool]:
    """The options that apply to ``cfg`` (global keys, then its kind's, then its own name's), and
    whether any scope named the config itself."""
    scopes = {"full", "window", "chunked", "linear", *CONFIGS}
    out = {k: v for k, v in options.items() if not (k in scopes and isinstance(v, dict))}
    for key in (cfg.kind, cfg.name):
        if isinstance(options.get(key), dict):
            out.update(options[key])
    return out, isinstance(options.get(cfg.name), dict)


def kvpool_kwargs(cfg: Config, tokens: int, options: dict) -> dict:
    """``BlockManagerPool`` arguments for ``cfg`` at a cache of ``tokens`` tokens (``num_blocks``
    included), after the options."""
    kw: dict = {"num_blocks": tokens // BS}
    if cfg.kind == "window":
        # one block store of 2C/16 for both groups, as vLLM's one pool (preset "split": C/16 each)
        kw.update(num_blocks=2 * tokens // BS, sliding_window=cfg.window)
    elif cfg.kind == "chunked":
        kw.update(num_blocks=2 * tokens // BS, attention_chunk_size=cfg.window)
    elif cfg.kind == "linear":
        # one store of 2C/16 blocks, a state taking a 544-token page of it, as vLLM's one pool
        # (preset "linear-split": C/16 blocks beside C/544 slots of their own)
        kw.update(
            num_blocks=2 * tokens // BS,
            linear_state_slots=2 * tokens // PAGE,
            linear_state_blocks=PAGE // BS,
            checkpoint_interval=cfg.checkpoint_interval,
        )
    names = {
        "C": tokens,
        "BS": BS,
        "W": cfg.window or 0,
        "CI": cfg.checkpoint_interval or 0,
        "PAGE": PAGE,
    }
    for key, value in scoped_options(options, cfg)[0].items():
        if value is None:
            kw.pop(key, None)
        elif isinstance(value, str) and value.startswith("="):
            kw[key] = eval_expr(value[1:], names)
        else:
            kw[key] = value
    return kw


def runs_on(cfg: Config, manager: str, options: dict) -> bool:
    if manager in ("vllm", "drop-in"):  # kvpool's vLLM manager takes the configs vLLM builds
        return cfg.vllm
    return cfg.kvpool or scoped_options(options, cfg)[1]


# --------------------------------------------------------------------------------- trace
def trace_path(name: str) -> str:
    return os.path.normpath(os.path.join(TRACE_DIR, TRACES[name])) if name in TRACES else name


def read_trace(path: str, n: int) -> list[tuple[np.ndarray, int]]:
    """The first ``n`` requests: (hash ids, prompt length)."""
    out = []
    with open(path) as f:
        for line in f:
            if len(out) >= n:
                break
            if line.strip():
                r = json.loads(line)
                out.append((np.asarray(r["hash_ids"], dtype=np.int64), int(r["input_length"])))
    return out


_OFFSETS = np.arange(MOONCAKE_BLOCK, dtype=np.int64)


def prompt_tokens(ids: np.ndarray, length: int) -> np.ndarray:
    """Token j of hash id h is ``h * 512 + j``."""
    return (ids[:, None] * MOONCAKE_BLOCK + _OFFSETS).ravel()[:length]


class PrefixOracle:
    """The longest prefix a request shares with any earlier one (an upper bound on any hit).

    A trie over hash ids; each node keeps the longest prompt that passed through it: a request
    matching ``k`` ids of an earlier one shares ``min(len, len_earlier, 512 * k)`` tokens."""

    def __init__(self) -> None:
        self.child: dict[tuple[int, int], int] = {}
        self.longest: list[int] = [0]

    def bound_and_add(self, ids: np.ndarray, length: int) -> int:
        node, bound, walking = 0, 0, True
        for k, h in enumerate(ids.tolist()):
            key = (node, h)
            nxt = self.child.get(key)
            if nxt is None:
                walking = False
                nxt = self.child[key] = len(self.longest)
                self.longest.append(0)
            elif walking:
                bound = min(length, MOONCAKE_BLOCK * (k + 1), self.longest[nxt])
            self.longest[nxt] = max(self.longest[nxt], length)
            node = nxt
        return bound


# ------------------------------------------------------------------------------- kvpool
def run_kvpool(cfg: Config, tokens: int, trace, options: dict, check_every: int) -> dict:
    import kvpool

    kw = kvpool_kwargs(cfg, tokens, options)
    shown = dict(kw)
    pool = kvpool.BlockManagerPool(kw.pop("num_blocks"), BS, **kw)
    ci = kw.get("checkpoint_interval") if kw.get("linear_state_slots") else None
    oracle = PrefixOracle() if check_every else None
    hits = total = 0
    ns = 0
    checks = 0
    gc.collect()
    gc.disable()
    try:
        for i, (ids, length) in enumerate(trace):
            toks = prompt_tokens(ids, length).astype(np.uint32)
            t0 = time.perf_counter_ns()
            seq = kvpool.Sequence(toks)
            if not pool.allocate(seq):
                raise RuntimeError(
                    f"kvpool {cfg.name} at {size_label(tokens)}: request {i} "
                    f"({length} tokens) does not fit"
                )
            hit = seq.num_cached_tokens
            if ci is not None:
                pool.commit_linear_state_plan(pool.take_linear_state_plan())  # the restore
                while (end := pool.next_checkpoint_boundary(seq)) is not None and end < length:
                    seq.num_computed_tokens = end
                    pool.cache(seq)
                    pool.commit_linear_state_plan(pool.take_linear_state_plan())
            seq.num_computed_tokens = length
            pool.cache(seq)
            if ci is not None:
                pool.commit_linear_state_plan(pool.take_linear_state_plan())
            pool.deallocate(seq)
            ns += time.perf_counter_ns() - t0
            hits += hit
            total += length
            if oracle is not None:
                bound = oracle.bound_and_add(ids, length)
                if not 0 <= hit <= min(bound, length - 1):
                    raise AssertionError(
                        f"kvpool request {i}: hit {hit} beyond the shared prefix {bound}"
                    )
                # in the one store, the checkpoints' states hold blocks (and nothing else does)
                held = pool.num_used_blocks - pool.stats()["num_linear_state_blocks"]
                if held:
                    raise AssertionError(f"kvpool request {i}: {held} blocks held after deallocate")
                if (i + 1) % check_every == 0 or i + 1 == len(trace):
                    pool.check()
                    checks += 1
    finally:
        gc.enable()
    st = pool.stats()
    extra = {
        "evictions": st.get("num_evictions", 0),
        "pool_hit_tokens": st.get("prefix_hit_tokens"),
    }
    if ci is not None:
        extra["linear_state_hits"] = st.get("linear_state_hits")
        extra["checkpoint_evictions"] = st.get("num_checkpoint_evictions")
    return {
        "hit_tokens": hits,
        "prompt_tokens": total,
        "us_per_request": ns / len(trace) / 1e3,
        "hash_us_per_request": None,
        "kvpool_kwargs": shown,
        "checks": checks,
        **extra,
    }


# --------------------------------------------------------------------------------- vLLM
def _model_dir() -> str:
    """The vLLM tests' Llama-shaped config (tests/vllm/vllm_harness.py, no weights, no hub),
    long enough for Mooncake's longest prompts."""
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "vllm")
    )
    import vllm_harness

    return vllm_harness.model_dir(MAX_MODEL_LEN)


def qwen3_next_specs():
    """Full attention and GDN state specs of a Qwen3-Next-80B-A3B-like model at TP 1, with the
    attention block size vLLM's platform picks so both pages are equal (module doc)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.utils.math_utils import cdiv
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4, 0)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "auto")
    mamba_page = MambaSpec(block_size=-1, shapes=shapes, dtypes=dtypes).page_size_bytes
    attn_1 = FullAttentionSpec(
        block_size=1, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
    ).page_size_bytes
    block = BS * cdiv(mamba_page, BS * attn_1)  # Platform._align_hybrid_block_size, kernel block 16
    assert block == PAGE, f"attention block {block}, expected {PAGE}"
    attn = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=256, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=block,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    return attn, mamba


def build_vllm(cfg: Config, tokens: int, manager: str = "vllm"):
    """vLLM's real Scheduler on the hybrid KVCacheConfig of ``cfg`` (module doc); returns it with
    its hash block size and block count. ``manager`` "drop-in": the Scheduler is kvpool's
    (``--scheduler-cls kvpool.integrations.vllm.Scheduler``), on kvpool's manager."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    if cfg.kind == "linear":
        attn, other = qwen3_next_specs()
        block, num_blocks = PAGE, 2 * tokens // PAGE
    else:
        attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=256, dtype=torch.bfloat16)
        common = dict(block_size=BS, num_kv_heads=2, head_size=256, dtype=torch.bfloat16)
        other = {
            "full": lambda: None,
            "window": lambda: SlidingWindowSpec(sliding_window=cfg.window, **common),
            "chunked": lambda: ChunkedLocalAttentionSpec(attention_chunk_size=cfg.window, **common),
        }[cfg.kind]()
        block, num_blocks = BS, (1 if cfg.kind == "full" else 2) * tokens // BS
    cache = CacheConfig(
        block_size=block,
        enable_prefix_caching=True,
        num_gpu_blocks_override=num_blocks,
        prefix_cache_retention_interval=None if cfg.dense else 0,
        mamba_cache_mode="align" if cfg.kind == "linear" else "none",
    )
    if cfg.kind == "linear":
        cache.mamba_block_size = block
    cache.kv_cache_layout = "NHD"  # tensors only; the manager never reads it
    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    sched = SchedulerConfig(
        max_num_batched_tokens=MAX_MODEL_LEN,
        max_num_seqs=16,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
    )
    config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)
    specs = {"model.layers.0.self_attn.attn": attn}
    if other is not None:
        layer = "linear_attn" if cfg.kind == "linear" else "self_attn.attn"
        specs[f"model.layers.1.{layer}"] = other
    groups = get_kv_cache_groups(config, specs)
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, available_memory=1 << 62)
    assert kv_cache_config.num_blocks == num_blocks, (kv_cache_config.num_blocks, num_blocks)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, config)
    kv_cache_config.hash_block_size = hash_block
    config.cache_config.num_gpu_blocks = num_blocks
    cls = Scheduler
    if manager == "drop-in":
        from kvpool.integrations import vllm as kv_vllm

        config.scheduler_config.scheduler_cls = kv_vllm.Scheduler
        cls = config.scheduler_config.get_scheduler_cls()
    scheduler = cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
        include_finished_set=False,
        log_stats=True,
    )
    return scheduler, hash_block, num_blocks, scheduler_block


def run_vllm(cfg: Config, tokens: int, trace, check_every: int, manager: str = "vllm") -> dict:
    """``manager`` "vllm": vLLM's own manager; "drop-in": kvpool's (``build_vllm``), driven by
    the same calls, its Requests without vLLM's block hasher (kvpool hashes in its own calls, as
    under kvpool's Scheduler, whose engine core hashes nothing for vLLM)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    scheduler, hash_block, num_blocks, scheduler_block = build_vllm(cfg, tokens, manager)
    name = "vLLM" if manager == "vllm" else "kvpool's vLLM manager"
    manager = scheduler.kv_cache_manager
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_block, hash_fn) if name == "vLLM" else None
    split = scheduler.need_mamba_block_aligned_split
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    oracle = PrefixOracle() if check_every else None
    hits = total = 0
    ns = hash_ns = 0
    chunks = 0
    gc.collect()
    gc.disable()
    try:
        for i, (ids, length) in enumerate(trace):
            toks = prompt_tokens(ids, length).tolist()
            t0 = time.perf_counter_ns()
            req = Request(str(i), toks, params, None, block_hasher=hasher)
            t1 = time.perf_counter_ns()
            manager.new_step_starts()
            blocks, hit, junction = manager.get_computed_blocks(req)
            req.shared_prefix_boundary = junction
            n = length - hit
            if split:
                n = scheduler._mamba_block_aligned_split(req, n, hit, 0)
            new = manager.allocate_slots(
                req,
                n,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                num_lookahead_tokens=0,
                num_external_computed_tokens=0,
                delay_cache_blocks=False,
                skip_zeroing_group_ids=(),
                num_encoder_tokens=0,
                full_sequence_must_fit=scheduler.scheduler_reserve_full_isl,
                reserved_blocks=0,
                has_scheduled_reqs=False,
            )
            if new is None:
                raise RuntimeError(
                    f"{name} {cfg.name} at {size_label(tokens)}: request {i} ({length} tokens) "
                    "does not fit"
                )
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit + n
            chunks += 1
            while req.num_computed_tokens < length:
                manager.new_step_starts()
                n = length - req.num_computed_tokens
                if split:
                    n = scheduler._mamba_block_aligned_split(req, n)
                if manager.allocate_slots(req, n, num_lookahead_tokens=0) is None:
                    raise RuntimeError(
                        f"{name} {cfg.name}: request {i} ran out of blocks mid-prefill"
                    )
                req.num_computed_tokens += n
                chunks += 1
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            manager.free(req)
            t2 = time.perf_counter_ns()
            ns += t2 - t0
            hash_ns += t1 - t0
            hits += hit
            total += length
            if oracle is not None:
                bound = oracle.bound_and_add(ids, length)
                if not 0 <= hit <= min(bound, length - 1):
                    raise AssertionError(
                        f"{name} request {i}: hit {hit} beyond the shared prefix {bound}"
                    )
                if manager.block_pool.get_num_free_blocks() != num_blocks - 1:
                    raise AssertionError(f"{name} request {i}: blocks held after free")
    finally:
        gc.enable()
    if check_every and not manager.reset_prefix_cache():
        raise AssertionError(f"{name}: reset_prefix_cache failed with nothing running")
    return {
        "hit_tokens": hits,
        "prompt_tokens": total,
        "us_per_request": ns / len(trace) / 1e3,
        "hash_us_per_request": hash_ns / len(trace) / 1e3,
        "chunks_per_request": chunks / len(trace),
        "vllm_num_blocks": num_blocks,
        "vllm_block_size": scheduler_block,
        "vllm_hash_block_size": hash_block,
        "vllm_retention_interval": None if cfg.dense else 0,
    }


# ------------------------------------------------------------------------------ running
def run_job(job: dict) -> dict:
    """One (trace, config, size, manager); in a worker process with ``--jobs``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cfg = CONFIGS[job["config"]]
    t0 = time.perf_counter()
    trace = read_trace(job["path"], job["requests"])
    if job["manager"] == "kvpool":
        res = run_kvpool(cfg, job["tokens"], trace, job["options"], job["check_every"])
    else:
        res = run_vllm(cfg, job["tokens"], trace, job["check_every"], job["manager"])
    res.update(
        trace=job["trace"],
        config=cfg.name,
        size=size_label(job["tokens"]),
        tokens=job["tokens"],
        manager=job["manager"],
        requests=len(trace),
        hit_rate=res["hit_tokens"] / res["prompt_tokens"],
        wall_s=time.perf_counter() - t0,
    )
    return res


def versions(managers) -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("kvpool", *(["vllm", "torch"] if {"vllm", "drop-in"} & set(managers) else [])):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import subprocess

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out["kvpool_commit"] = (
            subprocess.run(
                ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            or None
        )
    except OSError:
        out["kvpool_commit"] = None
    return out


def machine(load_at_start: float) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs, load {load_at_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end"
    )


def pct(res: dict | None) -> str:
    return "" if res is None else f"{100 * res['hit_rate']:.1f}"


def render(doc: dict) -> str:
    rows = {(r["trace"], r["config"], r["size"], r["manager"]): r for r in doc["results"]}
    a = doc["args"]
    sizes = [size_label(t) for t in a["sizes"]]
    lines = [
        f"# hybrid prefix-cache hit rates, {a['requests']:,} requests in order, block size {BS}",
        f"# {doc['date']}, {doc['machine']}; "
        + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()),
        f"# kvpool options: {json.dumps(a['kvpool_options'])}"
        + (f" (preset {a['kvpool_preset']})" if a["kvpool_preset"] else ""),
        "",
    ]
    traces = a["traces"]
    # the layout: hit rate at each size, joined
    head = ["config"] + [f"{m}, {t}" for t in traces for m in a["managers"]]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---" * len(head) + "|")
    for name in a["configs"]:
        cells = [CONFIGS[name].label]
        for t in traces:
            for m in a["managers"]:
                got = [rows.get((t, name, s, m)) for s in sizes]
                cells.append(
                    ""
                    if all(g is None for g in got)
                    else " / ".join(pct(g) or "-" for g in got) + "%"
                )
        lines.append("| " + " | ".join(cells) + " |")
    for t in traces:
        for s in sizes:
            lines += [
                "",
                f"## {t}, cache {s} tokens",
                "| config | kvpool hit % | vLLM hit % | drop-in hit % | kvpool us/req "
                "| vLLM us/req (hashing) | drop-in us/req |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for name in a["configs"]:
                k, v, d = (rows.get((t, name, s, m)) for m in ("kvpool", "vllm", "drop-in"))
                if k is None and v is None and d is None:
                    continue
                kus, dus = ("" if r is None else f"{r['us_per_request']:.0f}" for r in (k, d))
                vus = (
                    ""
                    if v is None
                    else f"{v['us_per_request']:.0f} ({v['hash_us_per_request']:.0f})"
                )
                lines.append(f"| {name} | {pct(k)} | {pct(v)} | {pct(d)} | {kus} | {vus} | {dus} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--trace",
        default="conversation",
        help="conversation, synthetic, a comma list of them, or a path to a Mooncake JSONL trace",
    )
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--sizes", default="1M,4M,16M", help="cache sizes in tokens (k/M/G decimal)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--managers", default=",".join(MANAGERS))
    p.add_argument(
        "--kvpool-options",
        default="{}",
        help="JSON: BlockManagerPool keyword arguments (module doc)",
    )
    p.add_argument(
        "--kvpool-preset",
        default=None,
        choices=sorted(PRESETS),
        help="named kvpool options, applied before --kvpool-options",
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="worker processes, one run each (the machine: 2 cores)"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check every hit against the shared prefix, nothing held after each request, "
        "kvpool's check() every --check-every requests, vLLM's reset at the end",
    )
    p.add_argument("--check-every", type=int, default=250)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--render", metavar="JSON", help="print the tables of a saved --json output and exit"
    )
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            print(render(json.load(f)))
        return 0

    traces = [t for t in a.trace.split(",") if t]
    paths = {t: trace_path(t) for t in traces}
    for t, path in paths.items():
        if not os.path.exists(path):
            p.error(f"--trace {t}: no file {path}")
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    configs = [c for c in a.configs.split(",") if c]
    managers = [m for m in a.managers.split(",") if m]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown {c!r} (of {', '.join(CONFIGS)})")
    for m in managers:
        if m not in MANAGERS:
            p.error(f"--managers: unknown {m!r} (of {', '.join(MANAGERS)})")
    try:
        user = json.loads(a.kvpool_options)
    except json.JSONDecodeError as e:
        p.error(f"--kvpool-options: not JSON ({e})")
    if not isinstance(user, dict):
        p.error("--kvpool-options: a JSON object of BlockManagerPool keyword arguments")
    options = copy.deepcopy(PRESETS[a.kvpool_preset]) if a.kvpool_preset else {}
    for key, value in user.items():  # scoped objects merge into the preset's, others replace
        if isinstance(value, dict) and isinstance(options.get(key), dict):
            options[key].update(value)
        else:
            options[key] = value
    if a.jobs < 1 or a.requests < 1 or a.check_every < 1:
        p.error("--jobs, --requests and --check-every must be positive")

    jobs = [
        {
            "trace": t,
            "path": paths[t],
            "config": c,
            "tokens": s,
            "manager": m,
            "requests": a.requests,
            "options": options,
            "check_every": a.check_every if a.check else 0,
        }
        for t in traces
        for c in configs
        for s in sizes
        for m in managers
        if runs_on(CONFIGS[c], m, options)
    ]
    checked = set()
    for job in jobs:  # option errors before any run: each kvpool config's pool at the smallest size
        if job["manager"] == "kvpool" and job["config"] not in checked:
            checked.add(job["config"])
            import kvpool

            kw = kvpool_kwargs(CONFIGS[job["config"]], min(sizes), options)
            try:
                kvpool.BlockManagerPool(kw.pop("num_blocks"), BS, **kw).check()
            except (TypeError, ValueError) as e:
                p.error(f"--kvpool-options for {job['config']}: {e}")
    jobs.sort(key=lambda j: (j["manager"] != "vllm", -j["tokens"]))  # the long runs first
    started, load = time.perf_counter(), os.getloadavg()[0]

    def note(res: dict) -> None:
        print(
            f"[{time.perf_counter() - started:6.0f} s] {res['trace']} {res['config']} {res['size']} "
            f"{res['manager']}: hit {100 * res['hit_rate']:.2f}%, {res['us_per_request']:.0f} us/req, "
            f"{res['wall_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    results = []
    if a.jobs == 1:
        for job in jobs:
            results.append(run_job(job))
            note(results[-1])
    else:
        with ProcessPoolExecutor(max_workers=a.jobs, mp_context=get_context("spawn")) as ex:
            for fut in as_completed([ex.submit(run_job, job) for job in jobs]):
                results.append(fut.result())
                note(results[-1])
    doc = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(load),
        "versions": versions(managers),
        "args": {
            "traces": traces,
            "requests": a.requests,
            "sizes": sizes,
            "configs": configs,
            "managers": managers,
            "kvpool_options": options,
            "kvpool_preset": a.kvpool_preset,
            "check": a.check,
        },
        "results": sorted(
            results,
            key=lambda r: (
                traces.index(r["trace"]),
                configs.index(r["config"]),
                r["tokens"],
                r["manager"],
            ),
        ),
    }
    print(json.dumps(doc, indent=1) if a.json else render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
