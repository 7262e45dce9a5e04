"""``kvpool simulate``'s arguments made into a configuration and a workload, and one run.

``make_config`` turns the parsed arguments into a ``SimConfig`` (the cache size from
``--num-blocks``, ``--cache-tokens``, ``--gib`` or ``--gpu``, the model shape, elastic pages) and
the extra rows of the report's configuration; ``make_workload`` generates or reads the requests;
``run_one`` simulates one configuration. ``kvpool.sim.cli`` (one run, ``--sweep``),
``kvpool.sim.sweep`` (its worker processes) and ``kvpool.sim.fleet_cli`` (``--instances``) all
build on them; a bad combination of options raises :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from kvpool.sim.capacity import MODELS, ModelShape, blocks_for_budget, bytes_per_block
from kvpool.sim.config import SimConfig, SimError
from kvpool.sim.elastic import MIB, default_page_bytes, parse_limit_schedule, xtensor_option
from kvpool.sim.engine import Simulator
from kvpool.sim.request import Request
from kvpool.sim.summary import SimResult
from kvpool.sim.timing import GPUS
from kvpool.sim.workloads import generate, load_trace

__all__ = [
    "DEFAULT_NUM_BLOCKS",
    "DEFAULT_NUM_REQUESTS",
    "DEFAULT_STEP_MS",
    "GPU_MEMORY_UTILIZATION",
    "UsageError",
    "make_config",
    "make_workload",
    "parse_tokens",
    "run_one",
]

DEFAULT_NUM_REQUESTS = 5000
DEFAULT_NUM_BLOCKS = 6144
DEFAULT_STEP_MS = 20.0
# with --gpu and no cache size: KV memory = this share of the GPUs' memory, less the weights
GPU_MEMORY_UTILIZATION = 0.9


class UsageError(Exception):
    pass


_SUFFIX = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9}


def parse_tokens(text: str) -> float:
    """A token count: an integer, ``1e6``, ``3M``, ``500k``, or ``inf`` (room for the workload)."""
    t = str(text).strip()
    if t.lower() in ("inf", "infinite", "infinity"):
        return math.inf
    mult = 1.0
    if t and t[-1] in _SUFFIX:
        mult, t = _SUFFIX[t[-1]], t[:-1]
    try:
        v = float(t) * mult
    except ValueError:
        raise ValueError(
            f"expected a token count (1000000, 1e6, 3M or inf), got {text!r}"
        ) from None
    if not v >= 1 or math.isinf(v):
        raise ValueError(f"expected a token count >= 1, got {text!r}")
    return float(int(v))


def _model_shape(args: argparse.Namespace) -> ModelShape | None:
    explicit = [args.layers, args.kv_heads, args.head_dim]
    if (
        args.model is None
        and all(x is None for x in explicit)
        and args.dtype is None
        and args.heads is None
        and args.params is None
    ):
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


def _blocks_for_tokens(
    tokens: float, block_size: int, reqs: list[Request] | None, what: str
) -> int:
    if math.isinf(tokens):
        if reqs is None:  # checking the options before the workload is read
            return 2
        # every block of every request, each request starting a fresh block
        return sum(-(-(r.prompt_len + r.output_len) // block_size) for r in reqs) + 1
    return -(-int(tokens) // block_size) + 1


def make_config(
    args: argparse.Namespace, reqs: list[Request] | None = None
) -> tuple[SimConfig, dict[str, Any]]:
    """The SimConfig of ``args``, and extra config rows; ``reqs`` sizes ``--cache-tokens inf``."""
    shape = _model_shape(args)
    extra: dict[str, Any] = {}
    sizes = [
        k
        for k, v in (
            ("--num-blocks", args.num_blocks),
            ("--gib", args.gib),
            ("--cache-tokens", args.cache_tokens),
        )
        if v is not None
    ]
    if len(sizes) > 1:
        raise UsageError(f"give one of {', '.join(sizes)}, not both")
    if args.gib is not None:
        if shape is None:
            raise UsageError(
                "--gib needs a model shape: --model, or --layers/--kv-heads/--head-dim"
            )
        num_blocks = blocks_for_budget(shape, args.block_size, args.gib)
        if num_blocks < 2:
            raise UsageError(
                f"{args.gib} GiB holds {num_blocks} block(s) of "
                f"{bytes_per_block(shape, args.block_size):,} bytes: too small for a cache"
            )
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
            raise UsageError(
                f"the weights ({weights_gib:.0f} GiB) do not fit {args.tp} x {gpu.name}: raise --tp"
            )
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
        host_blocks = _blocks_for_tokens(
            args.host_cache_tokens, args.block_size, reqs, "--host-cache-tokens"
        )
    if shape is not None:
        bpb = bytes_per_block(shape, args.block_size)
        extra["model"] = {
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": shape.dtype,
            "heads": shape.heads,
            "params": shape.params,
            "bytes_per_block": bpb,
            "kv_gib_per_rank": num_blocks * bpb / (1 << 30),
        }
    if args.gpu is None and any(
        v != d for v, d in ((args.tp, 1), (args.mfu, 0.5), (args.mbu, 0.8))
    ):
        raise UsageError("--tp, --mfu and --mbu shape the roofline: they need --gpu")
    if args.gpu is not None and args.step_ms is not None:
        raise UsageError("give --gpu (the roofline) or --step-ms (a fixed step time), not both")
    xtensor, schedule = _xtensor_config(args, shape, extra)
    if args.eviction == "optimal":
        _check_optimal(args, host_blocks, xtensor)
    cfg = SimConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        dp_size=args.dp,
        enable_prefix_cache=args.prefix_cache,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_seqs,
        linear_state_slots=args.linear_state_slots,
        linear_state_blocks=args.linear_state_blocks,
        checkpoint_interval=args.checkpoint_interval,
        linear_state_match=args.linear_state_match,
        sliding_window=args.sliding_window,
        attention_chunk_size=args.attention_chunk_size,
        swa_num_blocks=args.swa_num_blocks,
        host_num_blocks=host_blocks,
        remote=args.remote,
        check=args.check,
        max_steps=args.max_steps,
        seed=args.seed,
        order=args.order,
        eviction=args.eviction,
        protected_percent=args.protected_percent,
        retain_ttl_s=args.retain_ttl,
        step_ms=args.step_ms or DEFAULT_STEP_MS,
        gpu=args.gpu,
        tp=args.tp,
        mfu=args.mfu,
        mbu=args.mbu,
        model_shape=shape,
        xtensor=xtensor,
        memory_limit_schedule=schedule,
    )
    try:
        cfg.step_timer()
    except SimError as e:
        raise UsageError(str(e)) from None
    return cfg, extra


def _check_optimal(args: argparse.Namespace, host_blocks: int, xtensor: Any) -> None:
    """``--eviction optimal`` is the offline bound of one full-attention device cache in request
    order (kvpool.sim.optimal): every option that leaves that model is a usage error naming it."""
    if args.order != "request":
        raise UsageError("--eviction optimal needs --order request (the future is then known)")
    for flag, given in (
        ("--sliding-window", args.sliding_window is not None),
        ("--attention-chunk-size", args.attention_chunk_size is not None),
        ("--linear-state-slots", bool(args.linear_state_slots)),
        ("--host-blocks/--host-cache-tokens", bool(host_blocks)),
        ("--remote", args.remote is not None),
        ("--xtensor", xtensor is not None),
        ("--dp", args.dp != 1),
        ("--no-prefix-cache", not args.prefix_cache),
    ):
        if given:
            raise UsageError(f"--eviction optimal bounds one full-attention cache: drop {flag}")


def _xtensor_config(
    args: argparse.Namespace, shape: ModelShape | None, extra: dict[str, Any]
) -> tuple[dict[str, Any] | None, tuple[tuple[float, float | None], ...]]:
    """The pool's ``xtensor=`` dict and the limit schedule of ``--xtensor`` and its options."""
    if not args.xtensor:
        given = [
            n
            for n, v in (
                ("--page-mib", args.page_mib),
                ("--memory-limit-gib", args.memory_limit_gib),
                ("--memory-limit-schedule", args.memory_limit_schedule),
            )
            if v is not None
        ]
        if given:
            raise UsageError(f"{', '.join(given)} go(es) with --xtensor")
        return None, ()
    if shape is None:
        raise UsageError(
            "--xtensor sizes pages in bytes: it needs a model shape (--model, or "
            "--layers/--kv-heads/--head-dim)"
        )
    if args.host_blocks or args.host_cache_tokens is not None:
        raise UsageError(
            "--xtensor does not combine with a host tier (--host-blocks / --host-cache-tokens)"
        )
    bpb = bytes_per_block(shape, args.block_size)
    page_bytes = (
        int(args.page_mib * MIB) if args.page_mib is not None else default_page_bytes(shape.layers)
    )
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


def make_workload(args: argparse.Namespace) -> tuple[list[Request], dict[str, Any]]:
    step_s = (args.step_ms or DEFAULT_STEP_MS) / 1000.0
    if args.trace:
        t0 = time.perf_counter()
        reqs = load_trace(
            args.trace,
            step_seconds=step_s,
            seed=args.seed,
            fmt=args.trace_format,
            trace_block_size=args.trace_block_size,
        )
        return reqs, {"trace": args.trace, "trace_read_s": time.perf_counter() - t0}
    if args.trace_format != "auto" or args.trace_block_size is not None:
        raise UsageError("--trace-format and --trace-block-size go with --trace")
    if args.rate < 0:
        raise UsageError("--rate must be >= 0")
    reqs = generate(
        args.workload,
        args.num_requests,
        seed=args.seed,
        rate=args.rate or None,
        output_len=args.output_len,
        max_output_len=args.max_output_len,
        max_prompt_len=args.max_prompt_len,
    )
    return reqs, {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "rate": args.rate,
        "seed": args.seed,
    }


def run_one(
    args: argparse.Namespace, reqs: list[Request], label: str, on_step: Any = None
) -> SimResult:
    """Simulate ``reqs`` as ``args`` configure it; ``on_step`` sees the simulator each step."""
    cfg, extra = make_config(args, reqs)
    executor = None
    if args.execute:
        from kvpool.sim.execute import Executor  # the data plane: kvpool.kernels

        executor = Executor(
            cfg,
            backend=args.backend,
            layers=args.exec_layers,
            heads=args.exec_heads,
            head_dim=args.exec_head_dim,
            check_every=args.check_every,
            seed=args.seed,
        )
    sim = Simulator(cfg, reqs, executor=executor, on_step=on_step)
    if executor is not None:
        executor.bind(sim)
    res = sim.run()
    res.config.update(extra)
    if executor is not None:
        res.execute = executor.report()
    return res
