"""The fleet simulation on the Mooncake traces: every routing policy, with local caches
and with one shared remote tier, as the markdown table of docs/simulate.md and RESULTS.md.

    .venv/bin/python benches/fleet_bench.py /work/shared/data/mooncake/conversation_trace.jsonl \
        --instances 4 [--json out.json]

One configuration per instance (the defaults below: Llama-3-70B on 4 H100s, the roofline step
time, block size 512 as the trace's ids, a 1M-token device cache and a 4M-token host tier per
instance); the shared remote tier is an unbounded in-process store (``--remote memory``).
Equivalent to ``kvpool simulate --trace T --instances N --router round_robin,least_loaded,kv_aware
--remote none,memory`` with the same cache options, plus the markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from kvpool.sim.capacity import MODELS
from kvpool.sim.engine import SimConfig
from kvpool.sim.fleet import run_fleet
from kvpool.sim.workloads import load_trace


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("trace")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--cache-tokens", type=float, default=1e6, help="device cache per instance")
    p.add_argument("--host-tokens", type=float, default=4e6, help="host tier per instance")
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--policies", default="round_robin,least_loaded,kv_aware")
    p.add_argument("--remotes", default="none,memory")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    t0 = time.perf_counter()
    reqs = load_trace(a.trace)
    read_s = time.perf_counter() - t0
    bs = a.block_size
    cfg = SimConfig(
        num_blocks=math.ceil(a.cache_tokens / bs) + 1,
        block_size=bs,
        host_num_blocks=math.ceil(a.host_tokens / bs) + 1,
        gpu=a.gpu,
        tp=a.tp,
        model_shape=MODELS[a.model],
        max_num_batched_tokens=8192,
    )
    rows = []
    for remote in (None if r == "none" else r for r in a.remotes.split(",")):
        for policy in a.policies.split(","):
            res = run_fleet(cfg, reqs, a.instances, policy, remote=remote)
            f = res.fleet
            rows.append(res.to_json())
            print(
                f"| {policy} | {'shared remote' if remote else 'local'} | {100 * f['hit_rate']:.1f}% | "
                f"{f['ttft_s_mean']:.2f} | {f['ttft_s_p50']:.2f} | {f['ttft_s_p90']:.2f} | {f['ttft_s_p99']:.2f} | "
                f"{f['busy_imbalance']:.2f} | {f['min_requests']:,}-{f['max_requests']:,} | "
                f"{f['remote_hit_blocks']:,} | {f['wall_s']:.0f} s |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {
                    "trace": a.trace,
                    "trace_read_s": read_s,
                    "instances": a.instances,
                    "config": {k: str(v) for k, v in vars(cfg).items()},
                    "runs": rows,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
