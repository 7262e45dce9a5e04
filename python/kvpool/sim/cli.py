"""``kvpool simulate``: argument parsing and the run / sweep / report driver."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from typing import Any

from kvpool.sim.capacity import DTYPE_BYTES, MODELS, ModelShape, blocks_for_budget, bytes_per_block
from kvpool.sim.timing import GPUS
from kvpool.sim.traces import FORMATS
from kvpool.sim.workloads import KINDS, TraceError, generate, load_trace

__all__ = ["build_parser", "main"]

DEFAULT_NUM_REQUESTS = 5000
DEFAULT_NUM_BLOCKS = 6144
DEFAULT_STEP_MS = 20.0
# with --gpu and no cache size: KV memory = this share of the GPUs' memory, less the weights
GPU_MEMORY_UTILIZATION = 0.9

# --sweep keys -> argparse dest and value parser
SWEEP_KEYS: dict[str, tuple[str, Any]] = {
    "num_blocks": ("num_blocks", int),
    "block_size": ("block_size", int),
    "gib": ("gib", float),
    "dp": ("dp", int),
    "dp_size": ("dp", int),
    "max_batched_tokens": ("max_batched_tokens", int),
    "max_num_batched_tokens": ("max_batched_tokens", int),
    "max_seqs": ("max_seqs", int),
    "max_num_seqs": ("max_seqs", int),
    "host_blocks": ("host_blocks", int),
    "prefix_cache": ("prefix_cache", None),
    "rate": ("rate", float),
    "num_requests": ("num_requests", int),
    "linear_state_slots": ("linear_state_slots", int),
    "checkpoint_interval": ("checkpoint_interval", int),
    "sliding_window": ("sliding_window", int),
    "cache_tokens": ("cache_tokens", None),
    "host_cache_tokens": ("host_cache_tokens", None),
    "tp": ("tp", int),
    "mfu": ("mfu", float),
    "order": ("order", str),
    "gpu": ("gpu", str),
    "xtensor": ("xtensor", None),
    "page_mib": ("page_mib", float),
    "memory_limit_gib": ("memory_limit_gib", float),
}
# sweep keys whose values are capacities: --plot draws the hit rate against them
CAPACITY_KEYS = ("cache_tokens", "num_blocks", "gib")


class UsageError(Exception):
    pass


def _bounded(cast: type, low: float, strict: bool):
    """An argparse type: `cast` of the text, at least `low` (above it when `strict`)."""
    what = "an integer" if cast is int else "a number"
    bound = f"{'>' if strict else '>='} {low}"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (strict and value == low) or value != value:
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text}")
        return value

    return parse


_positive_int = _bounded(int, 1, strict=False)
_nonneg_int = _bounded(int, 0, strict=False)
_pos_float = _bounded(float, 0, strict=True)
_SUFFIX = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9}


def parse_tokens(text: str) -> float:
    """A token count: an integer, ``1e6``, ``3M``, ``500k``, or ``inf`` (room for the whole workload)."""
    t = str(text).strip()
    if t.lower() in ("inf", "infinite", "infinity"):
        return math.inf
    mult = 1.0
    if t and t[-1] in _SUFFIX:
        mult, t = _SUFFIX[t[-1]], t[:-1]
    try:
        v = float(t) * mult
    except ValueError:
        raise ValueError(f"expected a token count (1000000, 1e6, 3M or inf), got {text!r}") from None
    if not v >= 1 or math.isinf(v):
        raise ValueError(f"expected a token count >= 1, got {text!r}")
    return float(int(v))


def _tokens_arg(text: str) -> float:
    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bool(s: str) -> bool:
    t = s.strip().lower()
    if t in ("1", "on", "true", "yes"):
        return True
    if t in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"expected on/off, got {s!r}")


def build_parser(prog: str = "kvpool simulate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replay a serving workload through a continuous-batching scheduler built on "
        "kvpool.BlockManagerPool and report KV-cache usage, prefix hits, preemptions and scheduler "
        "overhead. Without arguments: a mixed synthetic workload on a default cache. "
        "See docs/simulate.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--workload", "-w", choices=KINDS, default="mixed", help="synthetic workload kind")
    src.add_argument("--trace", "-t", metavar="PATH",
                     help="JSONL trace to replay instead: kvpool's format, or a Mooncake / Qwen-Bailian "
                     "production trace (docs/simulate.md)")
    w.add_argument("--trace-format", choices=FORMATS, default="auto",
                   help="the trace's format (auto: detected from the first record's fields)")
    w.add_argument("--trace-block-size", type=_positive_int, default=None,
                   help="tokens per hash id of a Mooncake / Qwen-Bailian trace (default 512 / 16)")
    w.add_argument("--num-requests", "-n", type=_positive_int, default=DEFAULT_NUM_REQUESTS,
                   help="synthetic requests to generate")
    w.add_argument("--rate", type=float, default=0.5,
                   help="mean arrivals per engine step (Poisson); 0 = all at step 0")
    w.add_argument("--output-len", type=_positive_int, default=192, help="mean output tokens")
    w.add_argument("--max-output-len", type=_positive_int, default=1024)
    w.add_argument("--max-prompt-len", type=_positive_int, default=8192)
    w.add_argument("--seed", type=int, default=0, help="workload seed")
    w.add_argument("--order", choices=("serving", "request"), default="serving",
                   help="serving: continuous batching, arrivals on the trace's clock; request: one request "
                   "at a time in arrival order, prompts only (the paper-style cache analysis)")
    w.add_argument("--save-trace", metavar="PATH", help="also write the workload as a JSONL trace")

    c = p.add_argument_group("cache")
    c.add_argument("--num-blocks", type=_positive_int, default=None,
                   help=f"blocks per rank, padding block 0 included (default {DEFAULT_NUM_BLOCKS}, "
                   "or derived from --gib and the model shape)")
    c.add_argument("--cache-tokens", type=_tokens_arg, default=None, metavar="N",
                   help="device cache per rank in tokens (1e6, 3M, or inf: room for the whole workload); "
                   "sets --num-blocks to ceil(N / block size) + 1")
    c.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    c.add_argument("--dp", type=_positive_int, default=1, help="data-parallel ranks (one pool each)")
    c.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="disable prefix caching")
    c.add_argument("--gib", type=_pos_float, default=None,
                   help="KV memory budget per rank in GiB: derive --num-blocks from the model shape")
    c.add_argument("--model", choices=sorted(MODELS), default=None, help="model shape preset (with --gib)")
    c.add_argument("--layers", type=_positive_int, default=None, help="attention layers (with --gib)")
    c.add_argument("--kv-heads", type=_positive_int, default=None, help="KV heads (with --gib)")
    c.add_argument("--head-dim", type=_positive_int, default=None, help="head dim (with --gib)")
    c.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None, help="KV dtype (with --gib)")
    c.add_argument("--heads", type=_positive_int, default=None, help="query heads (the roofline, with --layers)")
    c.add_argument("--params", type=_pos_float, default=None, metavar="BILLIONS",
                   help="parameters in billions (the roofline, with --layers)")

    t = p.add_argument_group("time (steps to seconds)")
    t.add_argument("--gpu", choices=sorted(GPUS), default=None,
                   help="roofline step time of the model (--model) on this GPU; without --num-blocks, "
                   f"--gib or --cache-tokens the KV cache is {GPU_MEMORY_UTILIZATION:g} of the GPUs' memory less "
                   "the weights")
    t.add_argument("--tp", type=_positive_int, default=1, help="GPUs per rank (ideal tensor parallelism)")
    t.add_argument("--mfu", type=_pos_float, default=0.5, help="fraction of the peak FLOP/s the roofline reaches")
    t.add_argument("--mbu", type=_pos_float, default=0.8,
                   help="fraction of the memory bandwidth the roofline reaches")
    t.add_argument("--step-ms", type=_pos_float, default=None,
                   help=f"fixed milliseconds per engine step when there is no --gpu (default {DEFAULT_STEP_MS:g}); "
                   "also turns kvpool-trace 'time' fields and idle gaps of synthetic workloads into steps")
    c.add_argument("--host-blocks", type=_nonneg_int, default=0,
                   help="host-tier blocks per rank (HierarchyBlockManagerPool); 0 = no host tier")
    c.add_argument("--host-cache-tokens", type=_tokens_arg, default=None, metavar="N",
                   help="host tier per rank in tokens (sets --host-blocks to ceil(N / block size) + 1)")
    c.add_argument("--remote", default=None, metavar="URL",
                   help="shared remote KV tier, e.g. redis://127.0.0.1:6379/0, or memory (in this process) "
                        "(needs --host-blocks); simulators sharing one Redis reuse each other's prefixes; "
                        "with --instances a comma list of none, memory and URLs, one table row each")

    x = p.add_argument_group("elastic memory (XTensor pages, docs/xtensor.md)")
    x.add_argument("--xtensor", action="store_true",
                   help="every rank's KV blocks on virtual-memory pages mapped on use: the cache size is the "
                   "virtual range, the memory is what the pages mapped hold (reported over time); needs a model "
                   "shape (--model, or --layers/--kv-heads/--head-dim) to size pages in bytes")
    x.add_argument("--page-mib", type=_pos_float, default=None, metavar="M",
                   help="bytes of one page, all layers' K and V, in MiB (default: 2 MiB per K and V tensor of "
                   "every layer, 4 x layers MiB, CUDA's granularity)")
    x.add_argument("--memory-limit-gib", type=_pos_float, default=None, metavar="G",
                   help="memory each rank may map, in GiB (default: the whole range)")
    x.add_argument("--memory-limit-schedule", default=None, metavar="T:GIB,...",
                   help="change the limit per rank at simulated second T to GIB GiB (none: no limit), e.g. "
                   "600:20,1800:8,3000:none; as a co-located second model would squeeze the instance")

    h = p.add_argument_group("hybrid models")
    h.add_argument("--linear-state-slots", type=_nonneg_int, default=0,
                   help="recurrent-state slots per rank (GDN/Mamba layers); 0 = pure attention")
    h.add_argument("--checkpoint-interval", type=_positive_int, default=None,
                   help="tokens between linear-state checkpoints (multiple of --block-size)")
    h.add_argument("--linear-state-match", choices=("deepest", "contiguous"), default="deepest")
    h.add_argument("--sliding-window", type=_positive_int, default=None,
                   help="window of the sliding-window attention group, in tokens")
    h.add_argument("--swa-num-blocks", type=_positive_int, default=None,
                   help="blocks of the sliding-window group (default: as the pool decides)")

    s = p.add_argument_group("scheduler")
    s.add_argument("--max-batched-tokens", type=_positive_int, default=2048,
                   help="token budget per step per rank (prefill chunks + decodes)")
    s.add_argument("--max-seqs", type=_positive_int, default=256, help="running sequences per rank")
    s.add_argument("--max-steps", type=_positive_int, default=None, help="stop after this many steps")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    o.add_argument("--timeline", action="store_true", help="with --json: include the per-step timeline")
    o.add_argument("--plot", metavar="PNG", help="write a figure of usage, hit rate and queue lengths; with "
                   "a --sweep of cache_tokens/num_blocks/gib: the hit rate against the capacity (log x)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--progress", action="store_true",
                   help="show the progress bar even when stderr is not a terminal")
    o.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="run every combination and print one comparison table; keys: "
                   + ", ".join(sorted(k for k in SWEEP_KEYS if k == SWEEP_KEYS[k][0] or "_" in k)))
    o.add_argument("--jobs", "-j", type=_positive_int, default=None,
                   help="--sweep: points run in parallel processes (default: one per CPU, at most one per point)")
    o.add_argument("--check", action="store_true",
                   help="test mode: pool.check() and accounting asserts after every step (slow)")

    from kvpool.sim import fleet_cli

    fleet_cli.add_arguments(p)
    e = p.add_argument_group("data plane")
    e.add_argument("--execute", action="store_true",
                   help="also run a small random-weight attention stack through kvpool.kernels "
                   "and check paged against dense attention")
    e.add_argument("--backend", choices=("auto", "cupy", "emulated", "numpy"), default="auto",
                   help="kernel backend for --execute (auto: cupy with a GPU, else numpy)")
    e.add_argument("--check-every", type=_positive_int, default=16,
                   help="--execute: compare with dense attention every this many steps")
    e.add_argument("--exec-layers", type=_positive_int, default=2)
    e.add_argument("--exec-heads", default="4/2", help="query/KV heads of the stack, e.g. 4/2")
    e.add_argument("--exec-head-dim", type=_positive_int, default=64,
                   help="head dim of the stack (the CUDA kernels take 64, 128 or 256)")
    return p


def _model_shape(args: argparse.Namespace) -> ModelShape | None:
    explicit = [args.layers, args.kv_heads, args.head_dim]
    if (args.model is None and all(x is None for x in explicit) and args.dtype is None
            and args.heads is None and args.params is None):
        return None
    base = MODELS[args.model] if args.model else None
    if base is None and any(x is None for x in explicit):
        raise UsageError("a model shape needs --model or all of --layers, --kv-heads, --head-dim")
    params = args.params * 1e9 if args.params is not None else (base.params if base else None)
    return ModelShape(
        layers=args.layers or base.layers,  # type: ignore[union-attr]
        kv_heads=args.kv_heads or base.kv_heads,  # type: ignore[union-attr]
        head_dim=args.head_dim or base.head_dim,  # type: ignore[union-attr]
        dtype=args.dtype or (base.dtype if base else "bf16"),
        heads=args.heads or (base.heads if base else None),
        params=params,
    )


def workload_tokens(reqs: list[Any]) -> int:
    """KV tokens that hold every request of the workload at once (``--cache-tokens inf``)."""
    return sum(r.prompt_len + r.output_len for r in reqs)


def _blocks_for_tokens(tokens: float, block_size: int, reqs: list[Any] | None, what: str) -> int:
    if math.isinf(tokens):
        if reqs is None:  # checking the options before the workload is read
            return 2
        # every block of every request, each request starting a fresh block
        return sum(-(-(r.prompt_len + r.output_len) // block_size) for r in reqs) + 1
    return -(-int(tokens) // block_size) + 1


def make_config(args: argparse.Namespace, reqs: list[Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """The SimConfig of ``args`` (and the extra config rows); ``reqs`` sizes ``--cache-tokens inf``."""
    from kvpool.sim.engine import SimConfig, SimError

    shape = _model_shape(args)
    extra: dict[str, Any] = {}
    sizes = [k for k, v in (("--num-blocks", args.num_blocks), ("--gib", args.gib),
                            ("--cache-tokens", args.cache_tokens)) if v is not None]
    if len(sizes) > 1:
        raise UsageError(f"give one of {', '.join(sizes)}, not both")
    if args.gib is not None:
        if shape is None:
            raise UsageError("--gib needs a model shape: --model, or --layers/--kv-heads/--head-dim")
        num_blocks = blocks_for_budget(shape, args.block_size, args.gib)
        if num_blocks < 2:
            raise UsageError(
                f"{args.gib} GiB holds {num_blocks} block(s) of {bytes_per_block(shape, args.block_size):,} bytes: "
                "too small for a cache")
    elif args.cache_tokens is not None:
        num_blocks = _blocks_for_tokens(args.cache_tokens, args.block_size, reqs, "--cache-tokens")
    elif args.num_blocks is not None:
        num_blocks = args.num_blocks
    elif args.gpu is not None and shape is not None:
        gpu = GPUS[args.gpu]
        if shape.params is None:
            raise UsageError("--gpu needs the model's parameter count: --model, or --params")
        weights_gib = 2 * shape.params / (1 << 30)
        gib = args.tp * gpu.memory_gib * GPU_MEMORY_UTILIZATION - weights_gib
        if gib <= 0:
            raise UsageError(f"the weights ({weights_gib:.0f} GiB) do not fit {args.tp} x {gpu.name}: raise --tp")
        num_blocks = blocks_for_budget(shape, args.block_size, gib)
        extra["kv_gib_from_gpu"] = gib
    else:
        if shape is not None and args.gpu is None:
            raise UsageError("a model shape sizes the cache only with --gib (or --gpu)")
        num_blocks = DEFAULT_NUM_BLOCKS
    host_blocks = args.host_blocks
    if args.host_cache_tokens is not None:
        if args.host_blocks:
            raise UsageError("give --host-blocks or --host-cache-tokens, not both")
        host_blocks = _blocks_for_tokens(args.host_cache_tokens, args.block_size, reqs, "--host-cache-tokens")
    if shape is not None:
        bpb = bytes_per_block(shape, args.block_size)
        extra["model"] = {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                          "dtype": shape.dtype, "heads": shape.heads, "params": shape.params,
                          "bytes_per_block": bpb, "kv_gib_per_rank": num_blocks * bpb / (1 << 30)}
    if args.gpu is None and any(v != d for v, d in ((args.tp, 1), (args.mfu, 0.5), (args.mbu, 0.8))):
        raise UsageError("--tp, --mfu and --mbu shape the roofline: they need --gpu")
    if args.gpu is not None and args.step_ms is not None:
        raise UsageError("give --gpu (the roofline) or --step-ms (a fixed step time), not both")
    xtensor, schedule = _xtensor_config(args, shape, extra)
    cfg = SimConfig(
        num_blocks=num_blocks, block_size=args.block_size, dp_size=args.dp,
        enable_prefix_cache=args.prefix_cache, max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_seqs, linear_state_slots=args.linear_state_slots,
        checkpoint_interval=args.checkpoint_interval, linear_state_match=args.linear_state_match,
        sliding_window=args.sliding_window, swa_num_blocks=args.swa_num_blocks,
        host_num_blocks=host_blocks, remote=args.remote, check=args.check, max_steps=args.max_steps,
        seed=args.seed, order=args.order, step_ms=args.step_ms or DEFAULT_STEP_MS, gpu=args.gpu, tp=args.tp,
        mfu=args.mfu, mbu=args.mbu, model_shape=shape, xtensor=xtensor, memory_limit_schedule=schedule)
    try:
        cfg.step_timer()
    except SimError as e:
        raise UsageError(str(e)) from None
    return cfg, extra


def _xtensor_config(args: argparse.Namespace, shape: ModelShape | None,
                    extra: dict[str, Any]) -> tuple[dict[str, Any] | None, tuple[tuple[float, float | None], ...]]:
    """The pool's ``xtensor=`` dict and the limit schedule of ``--xtensor`` and its options."""
    from kvpool.sim.elastic import MIB, default_page_bytes, parse_limit_schedule, xtensor_option

    if not args.xtensor:
        given = [n for n, v in (("--page-mib", args.page_mib), ("--memory-limit-gib", args.memory_limit_gib),
                                ("--memory-limit-schedule", args.memory_limit_schedule)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} go(es) with --xtensor")
        return None, ()
    if shape is None:
        raise UsageError("--xtensor sizes pages in bytes: it needs a model shape (--model, or "
                         "--layers/--kv-heads/--head-dim)")
    if args.host_blocks or args.host_cache_tokens is not None:
        raise UsageError("--xtensor does not combine with a host tier (--host-blocks / --host-cache-tokens)")
    bpb = bytes_per_block(shape, args.block_size)
    page_bytes = int(args.page_mib * MIB) if args.page_mib is not None else default_page_bytes(shape.layers)
    try:
        option = xtensor_option(bpb, page_bytes, args.memory_limit_gib)
    except ValueError as e:
        raise UsageError(f"--page-mib: {e}") from None
    schedule: tuple[tuple[float, float | None], ...] = ()
    if args.memory_limit_schedule is not None:
        try:
            schedule = parse_limit_schedule(args.memory_limit_schedule)
        except ValueError as e:
            raise UsageError(f"--memory-limit-schedule: {e}") from None
    extra["xtensor_page_mib"] = page_bytes / MIB
    return option, schedule


def make_workload(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    step_s = (args.step_ms or DEFAULT_STEP_MS) / 1000.0
    if args.trace:
        t0 = time.perf_counter()
        reqs = load_trace(args.trace, step_seconds=step_s, seed=args.seed, fmt=args.trace_format,
                          trace_block_size=args.trace_block_size)
        return reqs, {"trace": args.trace, "trace_read_s": time.perf_counter() - t0}
    if args.trace_format != "auto" or args.trace_block_size is not None:
        raise UsageError("--trace-format and --trace-block-size go with --trace")
    if args.rate < 0:
        raise UsageError("--rate must be >= 0")
    reqs = generate(args.workload, args.num_requests, seed=args.seed, rate=args.rate or None,
                    output_len=args.output_len, max_output_len=args.max_output_len,
                    max_prompt_len=args.max_prompt_len)
    return reqs, {"workload": args.workload, "num_requests": args.num_requests, "rate": args.rate,
                  "seed": args.seed}


def run_one(args: argparse.Namespace, reqs: list[Any], label: str, on_step: Any = None) -> Any:
    """Simulate ``reqs`` with the configuration of ``args``; ``on_step`` sees the simulator each step."""
    from kvpool.sim.engine import Simulator

    cfg, extra = make_config(args, reqs)
    executor = None
    if args.execute:
        from kvpool.sim.execute import Executor

        executor = Executor(cfg, backend=args.backend, layers=args.exec_layers, heads=args.exec_heads,
                            head_dim=args.exec_head_dim, check_every=args.check_every, seed=args.seed)
    sim = Simulator(cfg, reqs, executor=executor, on_step=on_step)
    if executor is not None:
        executor.bind(sim)
    res = sim.run()
    res.config.update(extra)
    if executor is not None:
        res.execute = executor.report()
    return res


def _parse_sweep(specs: list[str]) -> list[tuple[str, str, list[Any]]]:
    """``(key, dest, values)`` of each ``--sweep KEY=V1,V2,...``."""
    out = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not vals.strip():
            raise UsageError(f"--sweep wants KEY=V1,V2,..., got {spec!r}")
        if key not in SWEEP_KEYS:
            raise UsageError(f"--sweep: unknown key {key!r}; known: {', '.join(sorted(SWEEP_KEYS))}")
        dest, conv = SWEEP_KEYS[key]
        if conv is None:
            conv = parse_tokens if dest in ("cache_tokens", "host_cache_tokens") else _bool
        try:
            values = [conv(v.strip()) for v in vals.split(",") if v.strip()]
        except ValueError as e:
            raise UsageError(f"--sweep {key}: {e}") from None
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 and dest != "rate" for v in values):
            raise UsageError(f"--sweep {key}: values must be > 0")
        if dest == "order" and any(v not in ("serving", "request") for v in values):
            raise UsageError("--sweep order: values are serving, request")
        if dest == "gpu" and any(v not in GPUS for v in values):
            raise UsageError(f"--sweep gpu: values are {', '.join(sorted(GPUS))}")
        out.append((key, dest, values))
    return out


def _fail(msg: str, code: int = 1) -> int:
    print(f"kvpool simulate: error: {msg}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None, prog: str = "kvpool simulate") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)  # unknown options: argparse prints usage and exits 2
    from kvpool.sim.engine import SimError

    try:
        import kvpool

        pool_error: tuple[type[BaseException], ...] = (getattr(kvpool, "KVPoolError", SimError),)
    except ImportError as e:  # pragma: no cover
        return _fail(f"cannot import kvpool: {e}")
    try:
        return _main(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        return _fail(str(e), 2)
    except (SimError, TraceError) as e:
        return _fail(str(e))
    except pool_error as e:
        if os.environ.get("KVPOOL_DEBUG"):
            raise
        return _fail(f"the pool raised {type(e).__name__}: {e}")
    except OSError as e:
        return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvpool.sim import report
    from kvpool.sim.progress import Progress

    if args.timeline and not args.json:
        raise UsageError("--timeline goes with --json")
    from kvpool.sim import fleet_cli

    fleet = fleet_cli.fleet_requested(args)
    sweep = _parse_sweep(args.sweep)
    if not sweep and not fleet:
        make_config(args)  # configuration errors before reading the workload
    if args.plot:
        report.require_matplotlib()
    try:
        reqs, wl = make_workload(args)
    except (TraceError, UsageError):
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.save_trace:
        from kvpool.sim.workloads import save_trace

        save_trace(reqs, args.save_trace)
    show = args.progress or (not args.no_progress and not os.environ.get("KVPOOL_NO_PROGRESS")
                             and sys.stderr.isatty())
    console = Console()
    if fleet:  # --instances / --router: N pools behind a router (kvpool.sim.fleet)
        return fleet_cli.run(args, reqs, wl, console, show)
    if args.plot and sweep and not any(k in CAPACITY_KEYS for k, _, _ in sweep):
        raise UsageError(f"--plot with --sweep draws the hit rate against a capacity: sweep one of "
                         f"{', '.join(CAPACITY_KEYS)}")
    if not sweep:
        make_config(args, reqs)  # usage errors before the progress bar
        with Progress(show, len(reqs), "simulate") as prog:
            res = run_one(args, reqs, "simulate", prog if show else None)
        res.config.update(wl)
        if "trace_read_s" in wl:
            res.summary["trace_read_s"] = wl["trace_read_s"]
        if args.plot:
            report.plot(res, args.plot)
        if args.json:
            print(json.dumps(res.to_json(timeline=args.timeline), indent=2))
        else:
            console.print(report.summary_table(res, title=f"kvpool simulate: {_describe(wl)}"))
            if args.plot:
                console.print(f"figure written to {args.plot}")
        if res.execute is not None and not res.execute["ok"]:
            return _fail(f"--execute: paged attention differs from dense attention by "
                         f"{res.execute['max_abs_error']:.3e} (tolerance {res.execute['tolerance']:.0e})", 3)
        return 0
    # sweep: the cartesian product of the given values
    from kvpool.sim.engine import check_fits
    from kvpool.sim.sweep import run_sweep

    plans = []
    for combo in itertools.product(*(v for _, _, v in sweep)):
        a = argparse.Namespace(**vars(args))
        for (_, dest, _), v in zip(sweep, combo, strict=True):
            setattr(a, dest, v)
        dests = {dest for _, dest, _ in sweep}
        if dests & {"gib", "cache_tokens", "num_blocks"}:  # the swept size replaces the others
            for d in ("gib", "cache_tokens", "num_blocks"):
                if d not in dests:
                    setattr(a, d, None)
        if "host_cache_tokens" in dests:
            a.host_blocks = 0
        label = " ".join(f"{k}={_fmt(v)}" for (k, _, _), v in zip(sweep, combo, strict=True))
        same = a.num_requests == args.num_requests and a.rate == args.rate
        cfg, _ = make_config(a, reqs if same else None)  # validate every combination before running any
        if same:
            check_fits(cfg, reqs)
        plans.append((a, label, same))
    results = run_sweep(plans, reqs, jobs=args.jobs, show=show, keep_timeline=args.timeline)
    for res in results:
        res.config.update(wl)
        if "trace_read_s" in wl and "trace_read_s" not in res.summary:
            res.summary["trace_read_s"] = wl["trace_read_s"]
    labels = [lbl for _, lbl, _ in plans]
    for res, lbl in zip(results, labels, strict=True):
        res.config["sweep_label"] = lbl
    if args.plot:
        report.plot_capacity(labels, results, args.plot, sweep_keys=[k for k, _, _ in sweep],
                             title=os.path.basename(wl["trace"]) if "trace" in wl else _describe(wl))
    if args.json:
        print(json.dumps({"sweep": [{"label": lbl, **res.to_json(timeline=args.timeline)}
                                    for lbl, res in zip(labels, results, strict=True)]}, indent=2))
    else:
        console.print(report.comparison_table(labels, results))
        if args.plot:
            console.print(f"figure written to {args.plot}")
    return 0


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, float) and v == int(v) and v >= 1e4:
        from kvpool.sim.report import _short

        return _short(v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _describe(wl: dict[str, Any]) -> str:
    if "trace" in wl:
        return f"trace {wl['trace']}"
    return f"{wl['workload']} workload, {wl['num_requests']} requests, rate {wl['rate']:g}/step, seed {wl['seed']}"
