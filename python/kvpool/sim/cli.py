"""``kvpool simulate``: argument parsing and the run / sweep / report driver."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

from kvpool.sim.capacity import DTYPE_BYTES, MODELS, ModelShape, blocks_for_budget, bytes_per_block
from kvpool.sim.workloads import KINDS, TraceError, generate, load_trace

__all__ = ["build_parser", "main"]

DEFAULT_NUM_REQUESTS = 5000
DEFAULT_NUM_BLOCKS = 6144

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
}


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
    src.add_argument("--trace", "-t", metavar="PATH", help="JSONL trace to replay instead (docs/simulate.md)")
    w.add_argument("--num-requests", "-n", type=_positive_int, default=DEFAULT_NUM_REQUESTS,
                   help="synthetic requests to generate")
    w.add_argument("--rate", type=float, default=0.5,
                   help="mean arrivals per engine step (Poisson); 0 = all at step 0")
    w.add_argument("--output-len", type=_positive_int, default=192, help="mean output tokens")
    w.add_argument("--max-output-len", type=_positive_int, default=1024)
    w.add_argument("--max-prompt-len", type=_positive_int, default=8192)
    w.add_argument("--seed", type=int, default=0, help="workload seed")
    w.add_argument("--step-ms", type=_pos_float, default=20.0,
                   help="milliseconds per engine step, to read trace 'time' fields (seconds)")
    w.add_argument("--save-trace", metavar="PATH", help="also write the workload as a JSONL trace")

    c = p.add_argument_group("cache")
    c.add_argument("--num-blocks", type=_positive_int, default=None,
                   help=f"blocks per rank, padding block 0 included (default {DEFAULT_NUM_BLOCKS}, "
                   "or derived from --gib and the model shape)")
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
    c.add_argument("--host-blocks", type=_nonneg_int, default=0,
                   help="host-tier blocks per rank (HierarchyBlockManagerPool); 0 = no host tier")
    c.add_argument("--remote", default=None, metavar="URL",
                   help="shared remote KV tier, e.g. redis://127.0.0.1:6379/0 (needs --host-blocks); "
                        "simulators sharing one Redis reuse each other's prefixes")

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
    o.add_argument("--plot", metavar="PNG", help="write a figure of usage, hit rate and queue lengths")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--progress", action="store_true",
                   help="show the progress bar even when stderr is not a terminal")
    o.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="run every combination and print one comparison table; keys: "
                   + ", ".join(sorted(k for k in SWEEP_KEYS if k == SWEEP_KEYS[k][0] or "_" in k)))
    o.add_argument("--check", action="store_true",
                   help="test mode: pool.check() and accounting asserts after every step (slow)")

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
    if args.model is None and all(x is None for x in explicit) and args.dtype is None:
        return None
    base = MODELS[args.model] if args.model else None
    if base is None and any(x is None for x in explicit):
        raise UsageError("a model shape needs --model or all of --layers, --kv-heads, --head-dim")
    return ModelShape(
        layers=args.layers or base.layers,  # type: ignore[union-attr]
        kv_heads=args.kv_heads or base.kv_heads,  # type: ignore[union-attr]
        head_dim=args.head_dim or base.head_dim,  # type: ignore[union-attr]
        dtype=args.dtype or (base.dtype if base else "bf16"),
    )


def make_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from kvpool.sim.engine import SimConfig

    shape = _model_shape(args)
    extra: dict[str, Any] = {}
    if args.gib is not None:
        if args.num_blocks is not None:
            raise UsageError("give --num-blocks or --gib, not both")
        if shape is None:
            raise UsageError("--gib needs a model shape: --model, or --layers/--kv-heads/--head-dim")
        num_blocks = blocks_for_budget(shape, args.block_size, args.gib)
        if num_blocks < 2:
            raise UsageError(
                f"{args.gib} GiB holds {num_blocks} block(s) of {bytes_per_block(shape, args.block_size):,} bytes: "
                "too small for a cache")
    else:
        if shape is not None and args.num_blocks is None:
            raise UsageError("a model shape sizes the cache only with --gib")
        num_blocks = args.num_blocks if args.num_blocks is not None else DEFAULT_NUM_BLOCKS
    if shape is not None:
        bpb = bytes_per_block(shape, args.block_size)
        extra["model"] = {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                          "dtype": shape.dtype, "bytes_per_block": bpb,
                          "kv_gib_per_rank": num_blocks * bpb / (1 << 30)}
    cfg = SimConfig(
        num_blocks=num_blocks, block_size=args.block_size, dp_size=args.dp,
        enable_prefix_cache=args.prefix_cache, max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_seqs, linear_state_slots=args.linear_state_slots,
        checkpoint_interval=args.checkpoint_interval, linear_state_match=args.linear_state_match,
        sliding_window=args.sliding_window, swa_num_blocks=args.swa_num_blocks,
        host_num_blocks=args.host_blocks, remote=args.remote, check=args.check, max_steps=args.max_steps, seed=args.seed)
    return cfg, extra


def make_workload(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    if args.trace:
        reqs = load_trace(args.trace, step_seconds=args.step_ms / 1000.0, seed=args.seed)
        return reqs, {"trace": args.trace}
    if args.rate < 0:
        raise UsageError("--rate must be >= 0")
    reqs = generate(args.workload, args.num_requests, seed=args.seed, rate=args.rate or None,
                    output_len=args.output_len, max_output_len=args.max_output_len,
                    max_prompt_len=args.max_prompt_len)
    return reqs, {"workload": args.workload, "num_requests": args.num_requests, "rate": args.rate,
                  "seed": args.seed}


class _Progress:
    """A rich progress bar over finished requests, refreshed at most 10 times a second."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled = enabled
        self.total = total
        self.label = label
        self._last = 0.0
        self.progress: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(
                SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("step {task.fields[step]:>6}  run {task.fields[run]:>4}  wait {task.fields[wait]:>4}  "
                           "use {task.fields[use]:>5}"),
                TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self.progress.__enter__()
            self.task = self.progress.add_task(self.label, total=self.total, step=0, run=0, wait=0, use="0%")
        return self

    def __call__(self, sim: Any) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and not sim.done():
            return
        self._last = now
        last = sim.timeline[-1] if sim.timeline else None
        self.progress.update(self.task, completed=len(sim.finished), step=sim.step_no,
                             run=len(sim.running), wait=len(sim.waiting),
                             use=f"{100 * last.usage:.0f}%" if last else "0%")

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


def run_one(args: argparse.Namespace, reqs: list[Any], label: str, show_progress: bool) -> Any:
    from kvpool.sim.engine import Simulator

    cfg, extra = make_config(args)
    executor = None
    if args.execute:
        from kvpool.sim.execute import Executor

        executor = Executor(cfg, backend=args.backend, layers=args.exec_layers, heads=args.exec_heads,
                            head_dim=args.exec_head_dim, check_every=args.check_every, seed=args.seed)
    with _Progress(show_progress, len(reqs), label) as prog:
        sim = Simulator(cfg, reqs, executor=executor, on_step=prog if show_progress else None)
        if executor is not None:
            executor.bind(sim)
        res = sim.run()
    res.config.update(extra)
    if executor is not None:
        res.execute = executor.report()
    return res


def _parse_sweep(specs: list[str]) -> list[tuple[str, list[Any]]]:
    out = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not vals.strip():
            raise UsageError(f"--sweep wants KEY=V1,V2,..., got {spec!r}")
        if key not in SWEEP_KEYS:
            raise UsageError(f"--sweep: unknown key {key!r}; known: {', '.join(sorted(SWEEP_KEYS))}")
        dest, conv = SWEEP_KEYS[key]
        conv = conv or _bool
        try:
            values = [conv(v.strip()) for v in vals.split(",") if v.strip()]
        except ValueError as e:
            raise UsageError(f"--sweep {key}: {e}") from None
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 and dest != "rate" for v in values):
            raise UsageError(f"--sweep {key}: values must be > 0")
        out.append((dest, values))
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

    if args.timeline and not args.json:
        raise UsageError("--timeline goes with --json")
    if not args.sweep:
        make_config(args)  # configuration errors before generating the workload
    try:
        reqs, wl = make_workload(args)
    except TraceError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.save_trace:
        from kvpool.sim.workloads import save_trace

        save_trace(reqs, args.save_trace)
    show = args.progress or (not args.no_progress and not os.environ.get("KVPOOL_NO_PROGRESS")
                             and sys.stderr.isatty())
    console = Console()
    sweep = _parse_sweep(args.sweep)
    if args.plot and sweep:
        raise UsageError("--plot draws one run; drop --sweep")
    if not sweep:
        make_config(args)  # usage errors before the progress bar
        res = run_one(args, reqs, "simulate", show)
        res.config.update(wl)
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
    dests = [d for d, _ in sweep]
    combos = list(itertools.product(*(v for _, v in sweep)))
    plans = []
    for combo in combos:
        a = argparse.Namespace(**vars(args))
        for d, v in zip(dests, combo, strict=False):
            setattr(a, d, v)
        if "gib" in dests:
            a.num_blocks = None
        label = " ".join(f"{k}={_fmt(v)}" for k, v in zip([k for k, _ in sweep], combo, strict=False))
        make_config(a)  # validate every combination before running any
        plans.append((a, label))
    results = []
    for a, label in plans:
        r = reqs
        if a.num_requests != args.num_requests or a.rate != args.rate:
            r, _ = make_workload(a)
        res = run_one(a, r, label, show)
        res.config.update(wl)
        res.config["sweep_label"] = label
        results.append(res)
    if args.json:
        print(json.dumps({"sweep": [{"label": lbl, **res.to_json(timeline=args.timeline)}
                                    for (_, lbl), res in zip(plans, results, strict=False)]}, indent=2))
    else:
        console.print(report.comparison_table([lbl for _, lbl in plans], results))
    return 0


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _describe(wl: dict[str, Any]) -> str:
    if "trace" in wl:
        return f"trace {wl['trace']}"
    return f"{wl['workload']} workload, {wl['num_requests']} requests, rate {wl['rate']:g}/step, seed {wl['seed']}"
