"""``kvpool simulate`` on the whole Mooncake conversation trace: wall time of the command.

Runs each command ``--repeat`` times (default 3) as a subprocess and prints, per command, the
median, min and max of its wall time, the CPU time of its processes (user + system: the machine
is shared, CPU time says what the work costs), and the summary's own ``trace_read_s`` (the time
to parse the trace). The commands (serving mode, arrivals on the trace's clock, a roofline of
Llama-3-8B on 4 x H200 per rank):

- ``single``: the whole trace, 12,031 requests, about 145M prompt tokens;
- ``sweep``: a 6-point capacity sweep (``--sweep cache_tokens=...``), points in parallel processes;
- ``request``: the paper-style 6-point sweep in request order (one request at a time).

Usage: ``python benches/trace_bench.py [--trace PATH] [--repeat 3] [--only single,sweep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

TRACE = "/work/shared/data/mooncake/conversation_trace.jsonl"
SERVING = ["--model", "llama3-8b", "--gpu", "h200", "--tp", "4", "--max-batched-tokens", "8192"]
POINTS = "cache_tokens=250k,500k,1M,2M,4M,inf"
COMMANDS = {
    "single": SERVING,
    "sweep": [*SERVING, "--sweep", POINTS],
    "request": ["--order", "request", "--sweep", "cache_tokens=200k,1M,3M,10M,30M,inf"],
}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(trace: str, args: list[str]) -> tuple[float, float, list[float], dict]:
    cmd = [
        sys.executable,
        "-m",
        "kvpool",
        "simulate",
        "--trace",
        trace,
        *args,
        "--json",
        "--no-progress",
    ]
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1")
    )
    wall = time.perf_counter() - t0
    cpu = _children_cpu() - cpu0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    doc = json.loads(p.stdout)
    runs = doc["sweep"] if "sweep" in doc else [doc]
    return wall, cpu, [r["summary"]["trace_read_s"] for r in runs], runs[-1]["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default=",".join(COMMANDS))
    a = ap.parse_args()
    print(
        f"# {a.trace}, {a.repeat} runs each, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| command | wall s median (min-max) | CPU s median | trace read in s (median) | last point |"
    )
    print("|---|---:|---:|---:|---|")
    for name in a.only.split(","):
        walls, cpus, reads, last = [], [], [], {}
        for _ in range(a.repeat):
            w, c, r, last = run_once(a.trace, COMMANDS[name])
            walls.append(w)
            cpus.append(c)
            reads.extend(r)
        info = (
            f"{last['steps']:,} steps, from cache {100 * last['first_admission_cached_fraction']:.1f}%, "
            f"TTFT {last['ttft_s_mean']:.2f} s"
        )
        print(
            f"| {name} | {statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) | "
            f"{statistics.median(cpus):.1f} | {statistics.median(reads):.2f} | {info} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
