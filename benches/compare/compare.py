"""Side-by-side benchmark: one seeded trace replayed through several block managers.

``python benches/compare.py`` (from the repository root, with kvpool installed). Managers (``--managers``):

* ``kvpool``: ``kvpool.BlockManagerPool`` (the Rust core);
* ``nano-vllm-ref``: pure-Python nano-vllm-style BlockManager (``nanovllm_reference.py``);
* ``vllm-v1-ref``: pure-Python vLLM-v1-style BlockPool + KVCacheManager, SHA-256 hashes
  (``vllm_reference.py``), and ``vllm-v1-ref-xxhash`` with xxh3-128;
* ``nano-vllm`` / ``vllm``: the real packages, run when importable (``auto`` tries them).

The replay (identical for every manager; the schedule does not depend on the manager):
requests enter the waiting queue at their arrival step and are admitted first-come first-served
while the batch has room (``--max-running``, a prefill token budget, and a block budget that
reserves each running request's whole prompt + output, so no allocation can fail and no request
is ever preempted). An admitted request is prefilled in its admission step (prefix match +
allocate, then mark the prompt computed, publish its full blocks and append the first sampled
token), then decodes one token per step (room for the last token, then computed, publish,
append), and is freed in the step that appends its last token. Only the managers' calls are
timed (``time.perf_counter_ns`` around each phase of a step, whose loop holds nothing else);
building the batch's block tables and slot mapping is timed apart ("export"). The cost of one
clock reading (calibrated at the start of each replay) is taken off every timed interval.

Cross-check: managers with the same hit semantics must report the same hit tokens for every
request admitted before either of them first evicted a cached block (eviction policies differ on
purpose: nano-vllm reuses the oldest freed block, vLLM keeps an LRU free queue with unhashed
blocks first, kvpool evicts least-recently-used leaves). All of them match whole blocks only and
leave at least one prompt token to compute (a block-aligned prompt whose blocks are all cached
recomputes its last block: vLLM's ``num_tokens - 1`` cap, nano-vllm's "never the last block",
kvpool's R8).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from adapters import ADAPTERS, ALIASES, Adapter, Unavailable, make_adapter

__all__ = ["TraceItem", "build_trace", "machine_description", "main", "replay"]

# "perf": wall clock (time.perf_counter_ns); "cpu": this thread's CPU time (time.thread_time_ns),
# which does not count time the thread spends descheduled on a busy machine (each reading costs
# more, ~1 us where it is a system call, so it adds a little to every phase)
CLOCKS = {"perf": time.perf_counter_ns, "cpu": time.thread_time_ns}
DEFAULT_MANAGERS = "auto"
AUTO_MANAGERS = ("kvpool", "nano-vllm-ref", "vllm-v1-ref", "nano-vllm", "vllm")
TARGETS = {"nano-vllm-ref": 100.0, "vllm-v1-ref": 20.0, "nano-vllm": 100.0, "vllm": 20.0}


@dataclass
class TraceItem:
    """One request, with its prompt in both forms the managers take (converted once, untimed):
    a list for the Python references (nano-vllm's Sequence and vLLM's Request hold lists) and an
    int32 array for kvpool (its ``Sequence`` reads a NumPy array without a per-token loop)."""

    rid: int
    arrival: float
    prompt: list[int]
    output: list[int]
    extra_key: bytes | None
    prompt_array: np.ndarray | None = None


def build_trace(
    kind: str, num_requests: int, *, seed: int = 0, options: dict[str, Any] | None = None
) -> list[TraceItem]:
    """The seeded workload of ``kvpool.sim.workloads``, as plain lists (converted once, untimed)."""
    from kvpool.sim import workloads

    reqs = workloads.generate(kind, num_requests, seed=seed, **(options or {}))
    items = []
    for r in reqs:
        prompt = np.asarray(r.prompt).tolist()
        if r.output is not None:
            output = np.asarray(r.output).tolist()[: r.output_len]
        else:  # tokens the engine "samples": drawn from the request id, the same for everyone
            rng = np.random.default_rng([seed & 0xFFFFFFFF, 0x0B7, int(r.request_id) & 0xFFFFFFFF])
            output = rng.integers(0, workloads.VOCAB_SIZE, size=r.output_len).tolist()
        extra_key = r.extra_key
        if isinstance(extra_key, str):
            extra_key = extra_key.encode()
        items.append(
            TraceItem(
                int(r.request_id),
                float(r.arrival),
                prompt,
                output,
                extra_key,
                np.ascontiguousarray(prompt, dtype=np.int32),
            )
        )
    return items


@dataclass
class ReplayResult:
    name: str
    description: str
    hash_name: str
    semantics: str
    publish_on_allocate: bool = False
    num_requests: int = 0
    num_steps: int = 0
    manager_ns: int = 0
    export_ns: int = 0
    phase_ns: dict[str, int] = field(default_factory=dict)
    step_ns: list[int] = field(default_factory=list)
    hit_tokens: dict[int, int] = field(default_factory=dict)  # rid -> hit tokens
    admit_step: dict[int, int] = field(default_factory=dict)  # rid -> step index
    first_eviction_step: int | None = None
    # requests that share a full first block with a request admitted earlier in the same step
    # (where "publish at allocation" and "publish after the forward step" give different hits)
    same_step_sharers: set[int] = field(default_factory=set)
    prompt_tokens: int = 0
    wall_s: float = 0.0
    clock_overhead_ns: int = 0

    @property
    def us_per_request(self) -> float:
        return self.manager_ns / 1e3 / max(self.num_requests, 1)

    @property
    def us_per_step(self) -> float:
        return self.manager_ns / 1e3 / max(self.num_steps, 1)

    @property
    def export_us_per_step(self) -> float:
        return self.export_ns / 1e3 / max(self.num_steps, 1)

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / max(self.prompt_tokens, 1)


def clock_overhead_ns(clock: Any, samples: int = 2001) -> int:
    """Median of two back-to-back readings of ``clock``: what an empty timed interval reads."""
    diffs = []
    for _ in range(samples):
        a = clock()
        b = clock()
        diffs.append(b - a)
    diffs.sort()
    return int(diffs[len(diffs) // 2])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay(
    adapter: Adapter,
    trace: list[TraceItem],
    *,
    max_running: int = 128,
    max_prefill_tokens: int = 16384,
    export: bool = True,
    clock: str = "perf",
) -> ReplayResult:
    """Drive ``adapter`` through ``trace`` with the manager-independent schedule above."""
    bs = adapter.block_size
    capacity = adapter.num_blocks - 1  # usable blocks (block 0 is padding for kvpool / vLLM)
    res = ReplayResult(
        adapter.name,
        adapter.description,
        adapter.hash_name,
        adapter.semantics,
        adapter.publish_on_allocate,
    )
    res.prompt_tokens = sum(len(it.prompt) for it in trace)
    for it in trace:
        if _cdiv(len(it.prompt) + len(it.output), bs) > capacity:
            raise ValueError(
                f"request {it.rid} needs {_cdiv(len(it.prompt) + len(it.output), bs)} blocks; "
                f"the pool has {capacity}: raise --num-blocks"
            )
    perf = CLOCKS[clock]
    ovh = clock_overhead_ns(perf)
    res.clock_overhead_ns = ovh
    waiting = deque(sorted(trace, key=lambda it: (it.arrival, it.rid)))
    # running: [seq, item, number of tokens appended so far, reserved blocks]
    running: list[list[Any]] = []
    reserved = 0
    step = 0  # engine step (arrival clock)
    steps = 0  # steps that did work
    phase = {"admit": 0, "decode_alloc": 0, "post": 0, "free": 0}
    step_ns = res.step_ns
    evicted = False
    wall0 = time.perf_counter()
    while waiting or running:
        if not running and waiting and waiting[0].arrival > step:
            step = int(np.ceil(waiting[0].arrival))  # idle: jump to the next arrival
        # --- schedule (untimed, manager independent)
        admits: list[TraceItem] = []
        prefill_tokens = 0
        while waiting and waiting[0].arrival <= step and len(running) + len(admits) < max_running:
            it = waiting[0]
            need = _cdiv(len(it.prompt) + len(it.output), bs)
            if reserved + need > capacity:
                break
            if admits and prefill_tokens + len(it.prompt) > max_prefill_tokens:
                break
            waiting.popleft()
            admits.append(it)
            reserved += need
            prefill_tokens += len(it.prompt)
        if len(admits) > 1:
            firsts: set[tuple[bytes | None, tuple[int, ...]]] = set()
            for it in admits:
                if len(it.prompt) >= bs:
                    key = (it.extra_key, tuple(it.prompt[:bs]))
                    if key in firsts:
                        res.same_step_sharers.add(it.rid)
                    firsts.add(key)
        decoding = running
        dec_seqs = [r[0] for r in decoding]
        dec_tokens = [r[1].output[r[2]] for r in decoding]
        first_tokens = [it.output[0] for it in admits]

        # --- timed: allocation
        t0 = perf()
        new_seqs, hits = adapter.admit(admits) if admits else ([], [])
        t1 = perf()
        if dec_seqs:
            adapter.decode_alloc(dec_seqs)
        t2 = perf()
        # --- timed apart: batch export for the forward pass
        batch = new_seqs + dec_seqs
        if export and batch:
            t3 = perf()
            adapter.export(batch)
            res.export_ns += max(perf() - t3 - ovh, 0)
        # --- timed: after the forward pass
        t4 = perf()
        adapter.post(new_seqs, first_tokens, dec_seqs, dec_tokens)
        t5 = perf()
        # bookkeeping (untimed)
        for it, seq, h in zip(admits, new_seqs, hits, strict=True):
            res.hit_tokens[it.rid] = int(h)
            res.admit_step[it.rid] = steps
            running.append([seq, it, 1, _cdiv(len(it.prompt) + len(it.output), bs)])
        for r in decoding[: len(dec_seqs)]:
            r[2] += 1
        finished = [r for r in running if r[2] >= len(r[1].output)]
        if finished:
            running = [r for r in running if r[2] < len(r[1].output)]
        fin_seqs = [r[0] for r in finished]
        # --- timed: release
        t6 = perf()
        if fin_seqs:
            adapter.free(fin_seqs)
        t7 = perf()
        for r in finished:
            reserved -= r[3]
        # each interval also holds about one clock reading: take it off (never below zero)
        d_admit = max(t1 - t0 - ovh, 0)
        d_decode = max(t2 - t1 - ovh, 0)
        d_post = max(t5 - t4 - ovh, 0)
        d_free = max(t7 - t6 - ovh, 0)
        phase["admit"] += d_admit
        phase["decode_alloc"] += d_decode
        phase["post"] += d_post
        phase["free"] += d_free
        step_ns.append(d_admit + d_decode + d_post + d_free)
        if not evicted and adapter.num_evictions() > 0:
            evicted = True
            res.first_eviction_step = steps
        steps += 1
        step += 1
    res.wall_s = time.perf_counter() - wall0
    res.num_requests = len(trace)
    res.num_steps = steps
    res.phase_ns = phase
    res.manager_ns = sum(step_ns)
    return res


def cross_check(results: list[ReplayResult]) -> list[dict[str, Any]]:
    """Compare hit tokens between the first manager and each other one of the same semantics,
    on the requests admitted before either first evicted a cached block."""
    checks: list[dict[str, Any]] = []
    if not results:
        return checks
    base = results[0]
    for other in results[1:]:
        if other.semantics != base.semantics:
            checks.append({"a": base.name, "b": other.name, "skipped": "different hit semantics"})
            continue
        limits = [r.first_eviction_step for r in (base, other) if r.first_eviction_step is not None]
        limit = min(limits) if limits else None
        # vLLM publishes a prompt's blocks when it allocates them (a request admitted later in
        # the same step hits them); kvpool and nano-vllm publish after the forward step
        excluded: set[int] = set()
        if base.publish_on_allocate != other.publish_on_allocate:
            excluded = base.same_step_sharers
        compared = 0
        mismatches: list[tuple[Any, ...]] = []
        for rid, step in base.admit_step.items():
            if limit is not None and step >= limit:
                continue
            if rid in excluded:
                continue
            if other.admit_step.get(rid) != step:
                mismatches.append((rid, "admitted at another step"))
                continue
            compared += 1
            if base.hit_tokens[rid] != other.hit_tokens[rid]:
                mismatches.append((rid, base.hit_tokens[rid], other.hit_tokens[rid]))
        hit_tokens = sum(
            base.hit_tokens[rid]
            for rid, s in base.admit_step.items()
            if (limit is None or s < limit) and rid not in excluded
        )
        n_excluded = sum(
            1
            for rid, s in base.admit_step.items()
            if (limit is None or s < limit) and rid in excluded
        )
        checks.append(
            {
                "a": base.name,
                "b": other.name,
                "compared_requests": compared,
                "excluded_same_step": n_excluded,
                "compared_hit_tokens": hit_tokens,
                "until_step": limit,
                "mismatches": mismatches[:10],
                "num_mismatches": len(mismatches),
            }
        )
    return checks


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu}, {ncpu} cores, {platform.system()} {platform.release()}, "
        f"CPython {platform.python_version()}, NumPy {np.__version__}"
    )


def _fmt_table(results: list[ReplayResult], baseline: ReplayResult | None) -> str:
    header = [
        "manager",
        "hash",
        "requests",
        "steps",
        "us/request",
        "us/step",
        "export us/step",
        "hit rate",
        "kvpool speed-up",
    ]
    rows = []
    for r in results:
        if baseline is None:
            speed = "-"
        elif r is baseline:
            speed = "1.0x"
        else:
            speed = f"{r.us_per_request / max(baseline.us_per_request, 1e-9):.1f}x"
        rows.append(
            [
                r.name,
                r.hash_name,
                str(r.num_requests),
                str(r.num_steps),
                f"{r.us_per_request:.1f}",
                f"{r.us_per_step:.1f}",
                f"{r.export_us_per_step:.1f}",
                f"{100 * r.hit_rate:.1f}%",
                speed,
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    right = {2, 3, 4, 5, 6, 7, 8}

    def line(cells: list[str]) -> str:
        out = []
        for i, c in enumerate(cells):
            out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _fmt_phases(results: list[ReplayResult]) -> str:
    """Where the time goes: microseconds per request in each phase, and per decode token."""
    lines = [
        "per request, by phase (us): admit = sequence + prefix match + allocate; "
        "decode = room for the next token; post = mark computed + publish + append token; "
        "free = release"
    ]
    for r in results:
        n = max(r.num_requests, 1)
        ph = {k: v / 1e3 / n for k, v in r.phase_ns.items()}
        lines.append(
            f"  {r.name:<20} admit {ph.get('admit', 0):9.1f}  decode {ph.get('decode_alloc', 0):9.1f}"
            f"  post {ph.get('post', 0):9.1f}  free {ph.get('free', 0):8.1f}"
        )
    return "\n".join(lines)


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise argparse.ArgumentTypeError(f"--workload-option needs KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benches/compare.py",
        description="Replay one seeded shared-prefix trace through kvpool and pure-Python "
        "reference block managers (nano-vllm-style, vLLM-v1-style); print us/request, us/step, "
        "hit rate and kvpool's speed-up.",
    )
    p.add_argument("--requests", type=int, default=1000, help="number of requests (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--workload",
        default="mixed",
        help="kvpool.sim.workloads kind: mixed (default), chat, system_prompt, few_shot, rag, random",
    )
    p.add_argument(
        "--workload-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra option for the workload generator (repeatable), e.g. rate=1.0",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=16384,
        help="blocks per manager, padding block included (default 16384)",
    )
    p.add_argument(
        "--managers",
        default=DEFAULT_MANAGERS,
        help="comma-separated: kvpool, nano-vllm-ref, vllm-v1-ref, vllm-v1-ref-xxhash, "
        "nano-vllm, vllm; 'auto' (default) = kvpool, both references, and the real "
        "packages when importable",
    )
    p.add_argument(
        "--max-running", type=int, default=128, help="max running requests (default 128)"
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="prefill token budget per step (default 16384)",
    )
    p.add_argument(
        "--no-export", action="store_true", help="skip the block table / slot mapping export"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' for stdout)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="replays per manager; the fastest is reported (default 1)",
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="perf",
        help="perf: wall clock (default); cpu: thread CPU time (steadier on a busy machine)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1:
        print("compare.py: --requests must be >= 1", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("compare.py: --repeat must be >= 1", file=sys.stderr)
        return 2
    if args.block_size < 2 or args.num_blocks < 2:
        print("compare.py: need --block-size >= 2 and --num-blocks >= 2", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.managers.split(",") if n.strip()]
    auto = names == ["auto"]
    if auto:
        names = list(AUTO_MANAGERS)
    names = [ALIASES.get(n, n) for n in names]
    bad = [n for n in names if n not in ADAPTERS]
    if bad:
        print(
            f"compare.py: unknown manager(s) {', '.join(bad)}; expected {', '.join(ADAPTERS)}",
            file=sys.stderr,
        )
        return 2
    try:
        options = _parse_options(args.workload_option)
        trace = build_trace(args.workload, args.requests, seed=args.seed, options=options)
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    n_prompt = sum(len(t.prompt) for t in trace)
    n_out = sum(len(t.output) for t in trace)
    say(
        f"trace: {args.workload}, {len(trace)} requests, seed {args.seed}, "
        f"{n_prompt / len(trace):.0f} prompt + {n_out / len(trace):.0f} output tokens per request "
        f"(prompts {min(len(t.prompt) for t in trace)}-{max(len(t.prompt) for t in trace)}); "
        f"block size {args.block_size}, {args.num_blocks} blocks"
    )

    # rounds interleave the managers, so that a busy machine slows them alike; the fastest
    # round of each manager is reported
    best: dict[str, ReplayResult] = {}
    skipped: dict[str, str] = {}
    for _ in range(args.repeat):
        for name in names:
            if name in skipped:
                continue
            try:
                adapter = make_adapter(name, args.num_blocks, args.block_size)
            except Unavailable as e:
                skipped[name] = str(e)
                if not (auto and name in ("nano-vllm", "vllm")):
                    say(f"  {name}: skipped ({e})")
                continue
            # as engines do after start-up (vLLM freezes its heap): the preallocated blocks
            # and the trace are left out of the garbage collector's scans
            gc.collect()
            gc.freeze()
            try:
                res = replay(
                    adapter,
                    trace,
                    max_running=args.max_running,
                    max_prefill_tokens=args.max_prefill_tokens,
                    export=not args.no_export,
                    clock=args.clock,
                )
            except ValueError as e:
                print(f"compare.py: {e}", file=sys.stderr)
                return 2
            finally:
                gc.unfreeze()
            del adapter
            say(f"  {name}: {res.wall_s:.1f} s wall, {res.us_per_request:.1f} us/request")
            if name not in best or res.manager_ns < best[name].manager_ns:
                best[name] = res
    results = [best[n] for n in names if n in best]
    if not results:
        print("compare.py: no manager could run", file=sys.stderr)
        return 1

    baseline = next((r for r in results if r.name == "kvpool"), None)
    say("")
    print(_fmt_table(results, baseline))
    say("")
    say(_fmt_phases(results))
    checks = cross_check(results)
    ok = all(c.get("num_mismatches", 0) == 0 for c in checks)
    say("")
    for c in checks:
        if "skipped" in c:
            say(f"hit cross-check {c['a']} vs {c['b']}: skipped ({c['skipped']})")
            continue
        until = (
            "whole trace"
            if c["until_step"] is None
            else f"steps < {c['until_step']} (first eviction)"
        )
        verdict = (
            "agree"
            if c["num_mismatches"] == 0
            else f"DISAGREE on {c['num_mismatches']} requests {c['mismatches']}"
        )
        excl = ""
        if c["excluded_same_step"]:
            excl = (
                f" ({c['excluded_same_step']} requests left out: they share a prefix with a "
                f"request admitted in the same step, which only {c['a'] if results[0].publish_on_allocate else c['b']} "
                f"can hit)"
            )
        say(
            f"hit cross-check {c['a']} vs {c['b']}: {c['compared_requests']} requests, "
            f"{c['compared_hit_tokens']} hit tokens, {until}: {verdict}{excl}"
        )
    target_lines = []
    if baseline is not None:
        for r in results:
            if r.name in TARGETS:
                ratio = r.us_per_request / max(baseline.us_per_request, 1e-9)
                tgt = TARGETS[r.name]
                target_lines.append(
                    f"target kvpool >= {tgt:.0f}x faster than {r.name} per request: "
                    f"{ratio:.1f}x {'PASS' if ratio >= tgt else 'MISS'}"
                )
    for t in target_lines:
        say(t)
    if skipped and not args.quiet:
        for k, v in skipped.items():
            if auto and k in ("nano-vllm", "vllm"):
                say(f"({k} not run: {v})")
    machine = machine_description()
    say(f"machine: {machine}")

    if args.json:
        payload = {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "args": vars(args),
            "trace": {
                "kind": args.workload,
                "requests": len(trace),
                "prompt_tokens": n_prompt,
                "output_tokens": n_out,
            },
            "results": [
                {
                    "manager": r.name,
                    "description": r.description,
                    "hash": r.hash_name,
                    "requests": r.num_requests,
                    "steps": r.num_steps,
                    "us_per_request": r.us_per_request,
                    "us_per_step": r.us_per_step,
                    "export_us_per_step": r.export_us_per_step,
                    "hit_rate": r.hit_rate,
                    "hit_tokens": sum(r.hit_tokens.values()),
                    "prompt_tokens": r.prompt_tokens,
                    "phase_us": {k: v / 1e3 for k, v in r.phase_ns.items()},
                    "first_eviction_step": r.first_eviction_step,
                    "clock_overhead_ns": r.clock_overhead_ns,
                    "wall_s": r.wall_s,
                    "speedup_vs_kvpool": (r.us_per_request / baseline.us_per_request)
                    if baseline
                    else None,
                }
                for r in results
            ],
            "cross_check": checks,
            "skipped": skipped,
        }
        text = json.dumps(payload, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
