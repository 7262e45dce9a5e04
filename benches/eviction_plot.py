"""The eviction policies against LRU and the offline bound on Mooncake's two traces, as one
figure (docs/eviction_policies.png, issue 34; the table is benches/RESULTS.md's "Eviction
policies").

    .venv/bin/python benches/eviction_plot.py [--traces DIR] [--sizes 500k,1M,...] [--jobs N] \
        [--json-out DATA.json] [--out docs/eviction_policies.png]
    .venv/bin/python benches/eviction_plot.py --json-in DATA.json     # redraw, no simulation

Per trace (conversation_trace.jsonl, synthetic_trace.jsonl in ``--traces``) one run of

    kvpool simulate -t TRACE --order request --sweep cache_tokens=SIZES \
        --sweep eviction=lru,slru,ghost_slru,optimal --json [--jobs N]

(request order: one request at a time, prompts only, block size 16; ``optimal`` is the bound,
farthest next use). One panel per trace: the share of prompt tokens found in the cache
(``cached_token_fraction``) against the cache size in tokens (log x), one line per policy, the
bound dashed, the LRU -> bound gap shaded. The legend gives each policy's mean "gap closed",
(policy - LRU) / (bound - LRU), over the sizes where that gap is at least 1 point.
``--json-out`` keeps the two runs' JSON documents ({trace: simulate's --json}) for ``--json-in``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
POLICIES = ["lru", "slru", "ghost_slru", "optimal"]
STYLE = {
    "lru": dict(color="tab:gray", marker="o"),
    "slru": dict(color="tab:blue", marker="s"),
    "ghost_slru": dict(color="tab:orange", marker="^"),
    "optimal": dict(color="black", marker="x", ls="--"),
}


def simulate(trace: Path, sizes: str, jobs: int | None) -> dict:
    cmd = [sys.executable, "-m", "kvpool", "simulate", "-t", str(trace), "--order", "request"]
    cmd += ["--sweep", f"cache_tokens={sizes}", "--sweep", "eviction=" + ",".join(POLICIES)]
    cmd += ["--json", "--no-progress"] + (["--jobs", str(jobs)] if jobs else [])
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    print(f"{trace.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return json.loads(out)


def curves(doc: dict) -> dict[str, list[tuple[float, float]]]:
    """{policy: [(cache tokens, hit rate in %)]}, sorted by size."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for point in doc["sweep"]:
        cfg, s = point["config"], point["summary"]
        lines.setdefault(cfg["eviction"], []).append(
            (float(cfg["capacity_tokens_per_rank"]), 100 * s["cached_token_fraction"])
        )
    return {p: sorted(v) for p, v in lines.items()}


def gap_closed(lines: dict, policy: str) -> float | None:
    shares = [
        (y - lru) / (bound - lru)
        for (_, y), (_, lru), (_, bound) in zip(
            lines[policy], lines["lru"], lines["optimal"], strict=True
        )
        if bound - lru >= 1.0
    ]
    return 100 * sum(shares) / len(shares) if shares else None


def plot(data: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4.6), squeeze=False)
    for ax, (name, doc) in zip(axes[0], data.items(), strict=True):
        lines = curves(doc)
        xs = [x for x, _ in lines["lru"]]
        lru, bound = [y for _, y in lines["lru"]], [y for _, y in lines["optimal"]]
        ax.fill_between(xs, lru, bound, color="black", alpha=0.06, lw=0)
        for policy in POLICIES:
            label = "bound (offline, farthest next use)" if policy == "optimal" else policy
            gap = gap_closed(lines, policy) if policy in ("slru", "ghost_slru") else None
            if gap is not None:
                label += f" (gap closed: {gap:+.1f}%)"
            pts = lines[policy]
            ax.plot(*zip(*pts, strict=True), lw=1.5, ms=5, label=label, **STYLE[policy])
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x / 1e6:g}M" for x in xs])
        ax.minorticks_off()
        ax.set_ylim(0, None)
        ax.set_xlabel("cache size (tokens)")
        ax.set_ylabel("prompt tokens from the cache (%)")
        ax.set_title(f"Mooncake {name} trace", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Eviction policies against LRU and the offline bound (request order, block 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--traces", type=Path, default=Path("../shared/data/mooncake"))
    p.add_argument("--sizes", default="500k,1M,2M,4M,8M,16M,32M", help="cache_tokens values")
    p.add_argument("--jobs", type=int, default=None, help="simulate --jobs (default: its own)")
    p.add_argument("--json-in", help="draw from this saved data instead of simulating")
    p.add_argument("--json-out", help="save the runs' JSON here")
    p.add_argument("--out", default="docs/eviction_policies.png")
    args = p.parse_args()
    if args.json_in:
        data = json.loads(Path(args.json_in).read_text())
    else:
        data = {
            name: simulate(args.traces / f, args.sizes, args.jobs) for name, f in TRACES.items()
        }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=1))
    for name, doc in data.items():  # the numbers, one line per size
        lines = curves(doc)
        print(f"{name}: cache | " + " | ".join(POLICIES))
        for i, (x, _) in enumerate(lines["lru"]):
            print(f"  {x / 1e6:g}M | " + " | ".join(f"{lines[q][i][1]:.2f}%" for q in POLICIES))
    plot(data, args.out)
    print(f"figure written to {args.out}")


if __name__ == "__main__":
    main()
