"""``kvpool simulate``: argument parsing and the run / sweep / report driver.

The options become a configuration and a workload in ``kvpool.sim.configure``; one run prints
``kvpool.sim.report``'s table (or JSON), ``--sweep`` runs its points through ``kvpool.sim.sweep``,
``--instances`` / ``--router`` hand over to ``kvpool.sim.fleet_cli``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from typing import Any

from rich.console import Console

import kvpool
from kvpool.sim import fleet_cli, report
from kvpool.sim.capacity import DTYPE_BYTES, MODELS
from kvpool.sim.config import EVICTIONS, SimError, check_fits
from kvpool.sim.configure import (
    DEFAULT_NUM_BLOCKS,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_STEP_MS,
    GPU_MEMORY_UTILIZATION,
    UsageError,
    make_config,
    make_workload,
    parse_tokens,
    run_one,
)
from kvpool.sim.progress import Progress
from kvpool.sim.request import Request, TraceError
from kvpool.sim.sweep import run_sweep
from kvpool.sim.timing import GPUS
from kvpool.sim.traces import FORMATS
from kvpool.sim.workloads import KINDS, save_trace

__all__ = ["build_parser", "main"]

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
    "linear_state_blocks": ("linear_state_blocks", int),
    "sliding_window": ("sliding_window", int),
    "attention_chunk_size": ("attention_chunk_size", int),
    "cache_tokens": ("cache_tokens", None),
    "host_cache_tokens": ("host_cache_tokens", None),
    "tp": ("tp", int),
    "mfu": ("mfu", float),
    "order": ("order", str),
    "eviction": ("eviction", str),
    "protected_percent": ("protected_percent", int),
    "retain_ttl": ("retain_ttl", float),
    "gpu": ("gpu", str),
    "xtensor": ("xtensor", None),
    "page_mib": ("page_mib", float),
    "memory_limit_gib": ("memory_limit_gib", float),
}
# sweep keys whose values are capacities: --plot draws the hit rate against them
CAPACITY_KEYS = ("cache_tokens", "num_blocks", "gib")


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
    src.add_argument(
        "--workload", "-w", choices=KINDS, default="mixed", help="synthetic workload kind"
    )
    src.add_argument(
        "--trace",
        "-t",
        metavar="PATH",
        help="JSONL trace to replay instead: kvpool's format, or a Mooncake / Qwen-Bailian "
        "production trace (docs/simulate.md)",
    )
    w.add_argument(
        "--trace-format",
        choices=FORMATS,
        default="auto",
        help="the trace's format (auto: detected from the first record's fields)",
    )
    w.add_argument(
        "--trace-block-size",
        type=_positive_int,
        default=None,
        help="tokens per hash id of a Mooncake / Qwen-Bailian trace (default 512 / 16)",
    )
    w.add_argument(
        "--num-requests",
        "-n",
        type=_positive_int,
        default=DEFAULT_NUM_REQUESTS,
        help="synthetic requests to generate",
    )
    w.add_argument(
        "--rate",
        type=float,
        default=0.5,
        help="mean arrivals per engine step (Poisson); 0 = all at step 0",
    )
    w.add_argument("--output-len", type=_positive_int, default=192, help="mean output tokens")
    w.add_argument("--max-output-len", type=_positive_int, default=1024)
    w.add_argument("--max-prompt-len", type=_positive_int, default=8192)
    w.add_argument("--seed", type=int, default=0, help="workload seed")
    w.add_argument(
        "--order",
        choices=("serving", "request"),
        default="serving",
        help="serving: continuous batching, arrivals on the trace's clock; request: one request "
        "at a time in arrival order, prompts only (the paper-style cache analysis)",
    )
    w.add_argument("--save-trace", metavar="PATH", help="also write the workload as a JSONL trace")

    c = p.add_argument_group("cache")
    c.add_argument(
        "--num-blocks",
        type=_positive_int,
        default=None,
        help=f"blocks per rank, padding block 0 included (default {DEFAULT_NUM_BLOCKS}, "
        "or derived from --gib and the model shape)",
    )
    c.add_argument(
        "--cache-tokens",
        type=_tokens_arg,
        default=None,
        metavar="N",
        help="device cache per rank in tokens (1e6, 3M, or inf: room for the whole workload); "
        "sets --num-blocks to ceil(N / block size) + 1",
    )
    c.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    c.add_argument(
        "--dp", type=_positive_int, default=1, help="data-parallel ranks (one pool each)"
    )
    c.add_argument(
        "--eviction",
        choices=EVICTIONS,
        default="lru",
        help="lru: the pool's default eviction; slru: segmented LRU (scan resistant, "
        "docs/eviction.md); ghost_slru: SLRU that also protects what is recomputed soon after "
        "its eviction; optimal: the offline bound in request order "
        "(farthest next use; needs --order request and one full-attention cache)",
    )
    c.add_argument(
        "--protected-percent",
        type=int,
        default=None,
        metavar="P",
        help="slru, ghost_slru: the share of the blocks (0-100) the protected segment may hold "
        "(default: the pool's, 20)",
    )
    c.add_argument(
        "--retain-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="session hints: retain every finished turn of a session (workloads with sessions: "
        "-w agentic, chat traces) for SECONDS or until its next turn is admitted "
        "(docs/sessions.md)",
    )
    c.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="disable prefix caching",
    )
    c.add_argument(
        "--gib",
        type=_pos_float,
        default=None,
        help="KV memory budget per rank in GiB: derive --num-blocks from the model shape",
    )
    c.add_argument(
        "--model", choices=sorted(MODELS), default=None, help="model shape preset (with --gib)"
    )
    c.add_argument(
        "--layers", type=_positive_int, default=None, help="attention layers (with --gib)"
    )
    c.add_argument("--kv-heads", type=_positive_int, default=None, help="KV heads (with --gib)")
    c.add_argument("--head-dim", type=_positive_int, default=None, help="head dim (with --gib)")
    c.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default=None, help="KV dtype (with --gib)"
    )
    c.add_argument(
        "--heads",
        type=_positive_int,
        default=None,
        help="query heads (the roofline, with --layers)",
    )
    c.add_argument(
        "--params",
        type=_pos_float,
        default=None,
        metavar="BILLIONS",
        help="parameters in billions (the roofline, with --layers)",
    )

    t = p.add_argument_group("time (steps to seconds)")
    t.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        default=None,
        help="roofline step time of the model (--model) on this GPU; without --num-blocks, "
        f"--gib or --cache-tokens the KV cache is {GPU_MEMORY_UTILIZATION:g} of the GPUs' memory "
        "less the weights",
    )
    t.add_argument(
        "--tp", type=_positive_int, default=1, help="GPUs per rank (ideal tensor parallelism)"
    )
    t.add_argument(
        "--mfu",
        type=_pos_float,
        default=0.5,
        help="fraction of the peak FLOP/s the roofline reaches",
    )
    t.add_argument(
        "--mbu",
        type=_pos_float,
        default=0.8,
        help="fraction of the memory bandwidth the roofline reaches",
    )
    t.add_argument(
        "--step-ms",
        type=_pos_float,
        default=None,
        help="fixed milliseconds per engine step when there is no --gpu "
        f"(default {DEFAULT_STEP_MS:g}); also turns kvpool-trace 'time' fields and idle gaps of "
        "synthetic workloads into steps",
    )
    c.add_argument(
        "--host-blocks",
        type=_nonneg_int,
        default=0,
        help="host-tier blocks per rank (HierarchyBlockManagerPool); 0 = no host tier",
    )
    c.add_argument(
        "--host-cache-tokens",
        type=_tokens_arg,
        default=None,
        metavar="N",
        help="host tier per rank in tokens (sets --host-blocks to ceil(N / block size) + 1)",
    )
    c.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="shared remote KV tier, e.g. redis://127.0.0.1:6379/0, or memory (in this process) "
        "(needs --host-blocks); simulators sharing one Redis reuse each other's prefixes; "
        "with --instances a comma list of none, memory and URLs, one table row each",
    )

    x = p.add_argument_group("elastic memory (XTensor pages, docs/xtensor.md)")
    x.add_argument(
        "--xtensor",
        action="store_true",
        help="every rank's KV blocks on virtual-memory pages mapped on use: the cache size is the "
        "virtual range, the memory is what the pages mapped hold (reported over time); needs a "
        "model shape (--model, or --layers/--kv-heads/--head-dim) to size pages in bytes",
    )
    x.add_argument(
        "--page-mib",
        type=_pos_float,
        default=None,
        metavar="M",
        help="bytes of one page, all layers' K and V, in MiB (default: 2 MiB per K and V tensor of "
        "every layer, 4 x layers MiB, CUDA's granularity)",
    )
    x.add_argument(
        "--memory-limit-gib",
        type=_pos_float,
        default=None,
        metavar="G",
        help="memory each rank may map, in GiB (default: the whole range)",
    )
    x.add_argument(
        "--memory-limit-schedule",
        default=None,
        metavar="T:GIB,...",
        help="change the limit per rank at simulated second T to GIB GiB (none: no limit), e.g. "
        "600:20,1800:8,3000:none; as a co-located second model would squeeze the instance",
    )

    h = p.add_argument_group("hybrid models")
    h.add_argument(
        "--linear-state-slots",
        type=_nonneg_int,
        default=0,
        help="recurrent-state slots per rank (GDN/Mamba layers); 0 = pure attention",
    )
    h.add_argument(
        "--checkpoint-interval",
        type=_positive_int,
        default=None,
        help="tokens between linear-state checkpoints (multiple of --block-size)",
    )
    h.add_argument(
        "--linear-state-blocks",
        type=_nonneg_int,
        default=0,
        help="blocks of the KV store one recurrent state takes: the states then share the "
        "store with the KV (docs/hybrid.md, 'Linear state in the one store'); 0 = slots of "
        "their own",
    )
    h.add_argument("--linear-state-match", choices=("deepest", "contiguous"), default="deepest")
    h.add_argument(
        "--sliding-window",
        type=_positive_int,
        default=None,
        help="window of the sliding-window attention group, in tokens",
    )
    h.add_argument(
        "--attention-chunk-size",
        type=_positive_int,
        default=None,
        help="chunk of a chunked local attention group (Llama 4), in tokens, in place of "
        "--sliding-window: a query reads from its chunk's start (docs/hybrid.md)",
    )
    h.add_argument(
        "--swa-num-blocks",
        type=_positive_int,
        default=None,
        help="blocks of the sliding-window group (default: as the pool decides)",
    )

    s = p.add_argument_group("scheduler")
    s.add_argument(
        "--max-batched-tokens",
        type=_positive_int,
        default=2048,
        help="token budget per step per rank (prefill chunks + decodes)",
    )
    s.add_argument("--max-seqs", type=_positive_int, default=256, help="running sequences per rank")
    s.add_argument(
        "--max-steps", type=_positive_int, default=None, help="stop after this many steps"
    )

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    o.add_argument(
        "--timeline", action="store_true", help="with --json: include the per-step timeline"
    )
    o.add_argument(
        "--plot",
        metavar="PNG",
        help="write a figure of usage, hit rate and queue lengths; with "
        "a --sweep of cache_tokens/num_blocks/gib: the hit rate against the capacity (log x)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--progress",
        action="store_true",
        help="show the progress bar even when stderr is not a terminal",
    )
    o.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="run every combination and print one comparison table; keys: "
        + ", ".join(sorted(k for k in SWEEP_KEYS if k == SWEEP_KEYS[k][0] or "_" in k)),
    )
    o.add_argument(
        "--jobs",
        "-j",
        type=_positive_int,
        default=None,
        help="--sweep: points run in parallel processes "
        "(default: one per CPU, at most one per point)",
    )
    o.add_argument(
        "--check",
        action="store_true",
        help="test mode: pool.check() and accounting asserts after every step (slow)",
    )

    fleet_cli.add_arguments(p)
    e = p.add_argument_group("data plane")
    e.add_argument(
        "--execute",
        action="store_true",
        help="also run a small random-weight attention stack through kvpool.kernels "
        "and check paged against dense attention",
    )
    e.add_argument(
        "--backend",
        choices=("auto", "cupy", "emulated", "numpy"),
        default="auto",
        help="kernel backend for --execute (auto: cupy with a GPU, else numpy)",
    )
    e.add_argument(
        "--check-every",
        type=_positive_int,
        default=16,
        help="--execute: compare with dense attention every this many steps",
    )
    e.add_argument("--exec-layers", type=_positive_int, default=2)
    e.add_argument("--exec-heads", default="4/2", help="query/KV heads of the stack, e.g. 4/2")
    e.add_argument(
        "--exec-head-dim",
        type=_positive_int,
        default=64,
        help="head dim of the stack (the CUDA kernels take 64, 128 or 256)",
    )
    return p


def _parse_sweep(specs: list[str]) -> list[tuple[str, str, list[Any]]]:
    """``(key, dest, values)`` of each ``--sweep KEY=V1,V2,...``."""
    out = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not vals.strip():
            raise UsageError(f"--sweep wants KEY=V1,V2,..., got {spec!r}")
        if key not in SWEEP_KEYS:
            raise UsageError(
                f"--sweep: unknown key {key!r}; known: {', '.join(sorted(SWEEP_KEYS))}"
            )
        dest, conv = SWEEP_KEYS[key]
        if conv is None:
            conv = parse_tokens if dest in ("cache_tokens", "host_cache_tokens") else _bool
        try:
            values = [conv(v.strip()) for v in vals.split(",") if v.strip()]
        except ValueError as e:
            raise UsageError(f"--sweep {key}: {e}") from None
        if any(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 and dest != "rate"
            for v in values
        ):
            raise UsageError(f"--sweep {key}: values must be > 0")
        if dest == "order" and any(v not in ("serving", "request") for v in values):
            raise UsageError("--sweep order: values are serving, request")
        unknown = [v for v in values if v not in EVICTIONS] if dest == "eviction" else []
        if unknown:
            raise UsageError(
                f"--sweep eviction: values are {', '.join(EVICTIONS)}, got {', '.join(unknown)}"
            )
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
    try:
        return _main(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        return _fail(str(e), 2)
    except (SimError, TraceError) as e:
        return _fail(str(e))
    except kvpool.KVPoolError as e:
        if os.environ.get("KVPOOL_DEBUG"):
            raise
        return _fail(f"the pool raised {type(e).__name__}: {e}")
    except OSError as e:
        return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _main(args: argparse.Namespace) -> int:
    if args.timeline and not args.json:
        raise UsageError("--timeline goes with --json")
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
        save_trace(reqs, args.save_trace)
    show = args.progress or (
        not args.no_progress and not os.environ.get("KVPOOL_NO_PROGRESS") and sys.stderr.isatty()
    )
    console = Console()
    if fleet:  # --instances / --router: N pools behind a router (kvpool.sim.fleet)
        return fleet_cli.run(args, reqs, wl, console, show)
    if args.plot and sweep and not any(k in CAPACITY_KEYS for k, _, _ in sweep):
        raise UsageError(
            f"--plot with --sweep draws the hit rate against a capacity: sweep one of "
            f"{', '.join(CAPACITY_KEYS)}"
        )
    if sweep:
        return _run_sweep(args, sweep, reqs, wl, console, show)
    return _run_single(args, reqs, wl, console, show)


def _run_single(
    args: argparse.Namespace, reqs: list[Request], wl: dict[str, Any], console: Console, show: bool
) -> int:
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
        return _fail(
            f"--execute: paged attention differs from dense attention by "
            f"{res.execute['max_abs_error']:.3e} (tolerance {res.execute['tolerance']:.0e})",
            3,
        )
    return 0


def _run_sweep(
    args: argparse.Namespace,
    sweep: list[tuple[str, str, list[Any]]],
    reqs: list[Request],
    wl: dict[str, Any],
    console: Console,
    show: bool,
) -> int:
    """The cartesian product of the swept values, one table (or JSON document)."""
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
        cfg, _ = make_config(
            a, reqs if same else None
        )  # validate every combination before running any
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
        report.plot_capacity(
            labels,
            results,
            args.plot,
            sweep_keys=[k for k, _, _ in sweep],
            title=os.path.basename(wl["trace"]) if "trace" in wl else _describe(wl),
        )
    if args.json:
        print(
            json.dumps(
                {
                    "sweep": [
                        {"label": lbl, **res.to_json(timeline=args.timeline)}
                        for lbl, res in zip(labels, results, strict=True)
                    ]
                },
                indent=2,
            )
        )
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
        return report.short(v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _describe(wl: dict[str, Any]) -> str:
    if "trace" in wl:
        return f"trace {wl['trace']}"
    return (
        f"{wl['workload']} workload, {wl['num_requests']} requests, rate {wl['rate']:g}/step, "
        f"seed {wl['seed']}"
    )
