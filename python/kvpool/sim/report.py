"""Rendering of simulation results: rich tables, JSON, matplotlib figures.

matplotlib is optional (``--plot`` only): :func:`require_matplotlib` turns its absence into one
line telling how to install it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvpool.sim.config import SimError

__all__ = ["comparison_table", "plot", "plot_capacity", "require_matplotlib", "summary_table"]


def require_matplotlib() -> None:
    """Raise SimError with a one-line install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SimError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'kvpool[sim]')"
        ) from None


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _int(x: float) -> str:
    return f"{int(x):,}"


def _secs(x: float) -> str:
    return f"{x:.3g} s" if x < 100 else f"{x:,.0f} s"


def _time_rows(s: dict[str, Any], c: dict[str, Any]) -> list[tuple[str, str, str] | None]:
    return [
        None,
        ("step time", c.get("step_time", "-"), "how a step's seconds are counted"),
        (
            "simulated time",
            _secs(s["sim_time_s"]),
            f"the clock at the end ({c.get('clock', 'steps')}); {_secs(s['busy_s'])} of steps",
        ),
        (
            "TTFT",
            _secs(s["ttft_s_mean"]),
            f"mean arrival -> first token; p50 {_secs(s['ttft_s_p50'])}, "
            f"p99 {_secs(s['ttft_s_p99'])}; {s['ttft_steps_mean']:.1f} steps "
            f"(p99 {s['ttft_steps_p99']:.0f})",
        ),
        (
            "time between tokens",
            f"{s['tbt_ms_mean']:.1f} ms",
            f"mean over decoded tokens, p99 {s['tbt_ms_p99']:.1f} ms; "
            f"per request {s['tpot_ms_mean']:.1f} ms",
        ),
        (
            "end-to-end",
            _secs(s["e2e_s_mean"]),
            f"mean arrival -> last token; {s['e2e_steps_mean']:.1f} steps",
        ),
        (
            "throughput",
            f"{s['output_tokens_per_s']:,.0f} tok/s",
            "output tokens per simulated second; "
            f"{s['computed_tokens_per_s']:,.0f} computed tok/s while busy",
        ),
    ]


def _xtensor_rows(s: dict[str, Any], c: dict[str, Any]) -> list[tuple[str, str, str] | None]:
    """Mapped memory of elastic pages (--xtensor)."""
    if not c.get("xtensor"):
        return []
    x = c["xtensor"]
    limit = x.get("memory_limit")
    changes = s.get("limit_changes", [])
    rows: list[tuple[str, str, str] | None] = [
        None,
        (
            "mapped memory",
            f"{s['mapped_gib_mean']:.2f} GiB",
            f"mean over simulated time, all ranks; peak {s['mapped_gib_peak']:.2f}, at the end "
            f"{s['mapped_gib_final']:.2f} GiB, of {s['reserved_gib']:.2f} GiB of virtual range",
        ),
        (
            "pages",
            f"{x['page_bytes'] / (1 << 20):g} MiB",
            f"{x['blocks_per_page']} blocks each; {s['page_maps']:,} maps, "
            f"{s['page_unmaps']:,} unmaps"
            + (f", {s['map_failures']:,} refused" if s.get("map_failures") else ""),
        ),
        (
            "memory limit",
            "none" if limit is None else f"{limit / (1 << 30):g} GiB",
            "per rank at the start"
            + (
                f"; {len(changes)} change(s), held above the limit at most "
                f"{s['limit_excess_gib_peak']:.2f} GiB"
                if changes
                else ""
            ),
        ),
    ]
    return rows


def _group_memory_rows(s: dict[str, Any]) -> list[tuple[str, str, str] | None]:
    """The store's blocks per group at the end of the run (hybrid models only)."""
    memory = s.get("group_memory")
    if not memory:
        return []
    rows: list[tuple[str, str, str] | None] = []
    for name, label in (
        ("full", "full attention"),
        ("window", "chunked attention" if memory.get("chunked") else "sliding window"),
        ("linear", "linear state"),
    ):
        used, cached = memory.get(f"{name}_used_blocks"), memory.get(f"{name}_cached_blocks")
        if used is None:
            continue
        meaning = f"blocks of the store at the end: {cached:,} cached, {used:,} used"
        if name == "linear":
            meaning += f", {memory.get('linear_state_slots_in_use', 0):,} slots in use"
        rows.append((f"memory: {label}", _int(used + cached), meaning))
    if "linear_state_slots_in_use" in memory and "linear_used_blocks" not in memory:
        rows.append(
            (
                "memory: linear state",
                _int(memory["linear_state_slots_in_use"]),
                "slots in use at the end (a store of their own)",
            )
        )
    rows.append(
        ("memory: free", _int(memory["free_blocks"]), "free blocks of the store at the end")
    )
    return rows


def _session_rows(s: dict[str, Any]) -> list[tuple[str, str, str] | None]:
    if "sessions" not in s:
        return []
    return [
        None,
        (
            "sessions",
            _int(s["sessions"]),
            f"first turns (parent_chat_id -1); {s['follow_up_turns']:,} "
            f"follow-up turns, up to turn {s['max_turn']}",
        ),
        (
            "hit rate by turn",
            f"{_pct(s['first_turn_hit_rate'])} / {_pct(s['follow_up_hit_rate'])}",
            "prompt tokens from cache at first admission: first turns / follow-ups",
        ),
    ]


def _request_order_rows(res: Any) -> list[tuple[str, str, str] | None]:
    s = res.summary
    c = res.config
    rows: list[tuple[str, str, str] | None] = [
        (
            "requests",
            f"{s['finished']:,} / {s['requests']:,}",
            "one at a time, in arrival order (no batching)",
        ),
        ("prompt tokens", _int(s["prompt_tokens"]), "sum of prompt lengths"),
        None,
        (
            "cache",
            f"{s['num_total_blocks']:,} blocks x {c['block_size']}",
            f"{c['capacity_tokens_per_rank']:,} tokens per rank, {c['dp_size']} rank(s)",
        ),
        (
            "prompt tokens from cache",
            _pct(s["cached_token_fraction"]),
            f"{s['admitted_cached_tokens']:,} of {s['admitted_tokens']:,} prompt tokens found in "
            f"the cache; mean per request {_pct(s['mean_request_cached_fraction'])}",
        ),
        (
            "prefix hit rate",
            _pct(s["prefix_hit_rate"]),
            "hit / looked-up tokens of full blocks (pool stats)",
        ),
        ("evictions", _int(s["evictions"]), "cached blocks reclaimed for new allocations"),
        (
            "prefill tokens computed",
            _int(s["prefill_tokens_computed"]),
            "prompt tokens not found in the cache",
        ),
    ]
    if c.get("host_num_blocks"):
        rows += [
            (
                "host loads",
                _int(s["host_loads"]),
                "blocks copied host -> device (host prefix hits)",
            ),
            ("host offloads", _int(s["host_offloads"]), "blocks copied device -> host on release"),
        ]
    rows += _group_memory_rows(s)
    rows += _session_rows(s)
    rows += _xtensor_rows(s, c)
    rows += [
        None,
        ("step time", c.get("step_time", "-"), "how a prefill's seconds are counted"),
        (
            "prefill time",
            _secs(s["prefill_s_mean"]),
            f"mean per request; {_secs(s['busy_s'])} in all",
        ),
        ("wall time", f"{s['wall_s']:.2f} s", "simulation, this machine"),
    ]
    if "trace_read_s" in s:
        rows.append(("trace read in", f"{s['trace_read_s']:.2f} s", "parsing the trace file"))
    return rows


def summary_rows(res: Any) -> list[tuple[str, str, str] | None]:
    """(metric, value, meaning) rows; None separates sections."""
    s = res.summary
    c = res.config
    if c.get("order") == "request":
        return _request_order_rows(res)
    rows: list[tuple[str, str, str] | None] = [
        ("requests", f"{s['finished']:,} / {s['requests']:,}", "finished / total"),
        ("prompt tokens", _int(s["prompt_tokens"]), "sum of prompt lengths"),
        ("output tokens", _int(s["output_tokens"]), "tokens sampled"),
        ("engine steps", _int(s["steps"]), "forward passes (per rank, in lockstep)"),
        (
            "tokens per step",
            f"{s['mean_batched_tokens']:.0f}",
            f"mean; budget {c['max_num_batched_tokens']} per rank",
        ),
        ("running per step", f"{s['mean_running']:.1f}", "mean sequences holding blocks"),
        None,
        (
            "cache",
            f"{s['num_total_blocks']:,} blocks x {c['block_size']}",
            f"{c['capacity_tokens_per_rank']:,} tokens per rank, {c['dp_size']} rank(s)",
        ),
        (
            "prefix hit rate",
            _pct(s["prefix_hit_rate"]),
            "hit / looked-up tokens of full blocks in the device cache (pool stats; host and "
            "remote hits count in 'prompt tokens from cache')",
        ),
        (
            "prompt tokens from cache",
            _pct(s["cached_token_fraction"]),
            f"{s['admitted_cached_tokens']:,} of {s['admitted_tokens']:,} admitted tokens "
            "not recomputed",
        ),
        (
            "... at first admission",
            _pct(s["first_admission_cached_fraction"]),
            "without preemption re-hits; mean per request "
            f"{_pct(s['mean_request_cached_fraction'])}",
        ),
        (
            "peak usage",
            _pct(s["peak_usage"]),
            f"{s['peak_used_blocks']:,} blocks held by sequences at peak",
        ),
        ("mean usage", _pct(s["mean_usage"]), "used / total, mean over steps"),
        ("evictions", _int(s["evictions"]), "cached blocks reclaimed for new allocations"),
        None,
        (
            "preemptions",
            _int(s["preemptions"]),
            f"recompute preemptions ({s['preempted_requests']} requests hit)",
        ),
        (
            "recomputed tokens",
            _int(s["recomputed_tokens"]),
            "work lost to preemption and done again",
        ),
        (
            "prefill tokens computed",
            _int(s["prefill_tokens_computed"]),
            "prompt tokens that ran through the model",
        ),
    ]
    if c.get("host_num_blocks"):
        rows += [
            (
                "host loads",
                _int(s["host_loads"]),
                "blocks copied host -> device (host prefix hits)",
            ),
            ("host offloads", _int(s["host_offloads"]), "blocks copied device -> host on release"),
        ]
    if "remote_hit_blocks" in s:
        rows += [
            ("remote hits", _int(s["remote_hit_blocks"]), "blocks found on the shared remote tier"),
            (
                "remote fetched",
                _int(s["remote_fetched_blocks"]),
                "blocks fetched remote -> host, verified",
            ),
            ("remote writes", _int(s["remote_puts"]), "blocks written to the remote tier"),
            ("remote errors", _int(s["remote_errors"]), "failed remote calls (degraded to misses)"),
        ]
    if c.get("linear_state_slots"):
        rows += [
            (
                "checkpoint hits",
                _int(s["checkpoint_hits"]),
                "admissions that restored a linear-state checkpoint",
            ),
            ("checkpoint saves", _int(s["checkpoint_saves"]), "linear-state checkpoints written"),
        ]
    rows += _group_memory_rows(s)
    rows += _session_rows(s)
    rows += _xtensor_rows(s, c)
    rows += _time_rows(s, c)
    rows += [
        None,
        (
            "scheduler overhead",
            f"{s['sched_us_per_step_mean']:.1f} us/step",
            f"p50 {s['sched_us_per_step_p50']:.1f}, p99 {s['sched_us_per_step_p99']:.1f} us; "
            f"{s['sched_us_per_request']:.1f} us per request",
        ),
        ("wall time", f"{s['wall_s']:.2f} s", "simulation, this machine"),
    ]
    if "trace_read_s" in s:
        rows.append(("trace read in", f"{s['trace_read_s']:.2f} s", "parsing the trace file"))
    if res.execute:
        e = res.execute
        rows += [
            None,
            (
                "data plane",
                f"max err {e['max_abs_error']:.2e}",
                f"{e['backend']} backend, {e['checked_steps']} steps checked, "
                f"{'OK' if e['ok'] else 'FAILED'} (tol {e['tolerance']:.0e})",
            ),
        ]
    return rows


def summary_table(res: Any, title: str = "kvpool simulate") -> Any:
    from rich.table import Table

    t = Table(title=title, show_lines=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_column("meaning", style="dim")
    for row in summary_rows(res):
        if row is None:
            t.add_section()
        else:
            t.add_row(*row)
    return t


COMPARE_COLUMNS = [
    ("hit rate", lambda s: _pct(s["prefix_hit_rate"])),
    ("first hit", lambda s: _pct(s["first_admission_cached_fraction"])),
    ("peak use", lambda s: _pct(s["peak_usage"])),
    ("preempt", lambda s: _int(s["preemptions"])),
    ("evict", lambda s: _int(s["evictions"])),
    ("steps", lambda s: _int(s["steps"])),
    ("TTFT s", lambda s: f"{s['ttft_s_mean']:.3g}"),
    ("TBT ms", lambda s: f"{s['tbt_ms_mean']:.3g}"),
    ("sched us", lambda s: f"{s['sched_us_per_step_mean']:.1f}"),
    ("wall s", lambda s: f"{s['wall_s']:.1f}"),
]
# --order request: no steps, no decode
REQUEST_ORDER_COLUMNS = [
    ("from cache", lambda s: _pct(s["cached_token_fraction"])),
    ("hit rate", lambda s: _pct(s["prefix_hit_rate"])),
    ("evict", lambda s: _int(s["evictions"])),
    ("prefill tokens", lambda s: _int(s["prefill_tokens_computed"])),
    ("prefill s", lambda s: f"{s['prefill_s_mean']:.3g}"),
    ("wall s", lambda s: f"{s['wall_s']:.1f}"),
]


# --xtensor (any point of the sweep): mapped memory, all ranks
XTENSOR_COLUMNS = [
    ("mapped GiB mean", lambda s: f"{s['mapped_gib_mean']:.2f}" if "mapped_gib_mean" in s else "-"),
    ("peak", lambda s: f"{s['mapped_gib_peak']:.2f}" if "mapped_gib_peak" in s else "-"),
]


def comparison_table(labels: Sequence[str], results: Sequence[Any]) -> Any:
    from rich.table import Table

    request_order = all(r.config.get("order") == "request" for r in results)
    columns = REQUEST_ORDER_COLUMNS if request_order else COMPARE_COLUMNS
    if any(r.config.get("xtensor") for r in results):
        columns = columns[:-1] + XTENSOR_COLUMNS + columns[-1:]
    t = Table(
        title="kvpool simulate --sweep" + (" (request order)" if request_order else ""),
        title_justify="left",
    )
    t.add_column("config", style="bold", no_wrap=True)
    t.add_column("tokens/rank", justify="right", no_wrap=True)
    for name, _ in columns:
        t.add_column(name, justify="right")
    for label, r in zip(labels, results, strict=False):
        s = r.summary
        t.add_row(label, short(r.config["capacity_tokens_per_rank"]), *(f(s) for _, f in columns))
    return t


def short(n: float) -> str:
    for unit, v in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= v:
            return f"{n / v:.3g}{unit}"
    return f"{int(n)}"


def plot_capacity(
    labels: Sequence[str],
    results: Sequence[Any],
    path: str,
    *,
    sweep_keys: Sequence[str],
    title: str = "",
) -> None:
    """The prefix hit rate against the cache capacity in tokens (log x), like Mooncake's Figure 9.

    One line per combination of the other swept keys; y is the share of prompt tokens found in
    the cache at each request's first admission (``first_admission_cached_fraction``: preempted
    requests re-hitting their own prefix do not count). The largest capacity's rate is marked as
    the curve's ceiling when its run never evicted (an "infinite" cache).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cap_keys = [k for k in sweep_keys if k in ("cache_tokens", "num_blocks", "gib")]
    lines: dict[str, list[tuple[float, float, Any]]] = {}
    for label, r in zip(labels, results, strict=True):
        rest = " ".join(p for p in label.split() if p.split("=", 1)[0] not in cap_keys)
        lines.setdefault(rest, []).append(
            (
                float(r.config["capacity_tokens_per_rank"]),
                float(r.summary["first_admission_cached_fraction"]),
                r,
            )
        )
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, pts in lines.items():
        pts.sort(key=lambda p: p[0])
        xs = [p[0] for p in pts]
        ys = [100 * p[1] for p in pts]
        (line,) = ax.plot(xs, ys, marker="o", lw=1.5, label=name or "hit rate")
        top = pts[-1]
        if top[2].summary["evictions"] == 0:
            ax.axhline(100 * top[1], color=line.get_color(), ls=":", lw=1)
            ax.annotate(
                f"no eviction: {100 * top[1]:.1f}%",
                (xs[-1], ys[-1]),
                textcoords="offset points",
                xytext=(-8, 6),
                ha="right",
                fontsize=8,
            )
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(
                f"{y:.1f}",
                (x, y),
                textcoords="offset points",
                xytext=(0, -12),
                ha="center",
                fontsize=7,
            )
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity per rank (tokens)")
    ax.set_ylabel("prompt tokens from the cache (%)")
    ymax = max((100 * p[1] for pts in lines.values() for p in pts), default=1.0)
    ax.set_ylim(0, max(5.0, math.ceil(ymax / 10 + 0.5) * 10))
    mode = results[0].config.get("order", "serving") if results else "serving"
    ax.set_title(
        (title + ": " if title else "") + f"hit rate against capacity ({mode} order)", fontsize=10
    )
    ax.grid(alpha=0.3, which="both")
    if len(lines) > 1 or next(iter(lines)):
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: Any, path: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = res.timeline
    x = [r.step for r in tl]
    elastic = bool(res.config.get("xtensor"))
    fig, axes = plt.subplots(
        4 if elastic else 3, 1, figsize=(9, 10 if elastic else 7.5), sharex=True
    )
    ax = axes[0]
    total = max(res.summary["num_total_blocks"], 1)
    ax.plot(x, [100 * r.usage for r in tl], lw=1, label="used (held by sequences)")
    ax.plot(
        x,
        [100 * (r.used_blocks + r.cached_blocks) / total for r in tl],
        lw=1,
        label="used + cached",
    )
    ax.set_ylabel("KV blocks %")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(
        f"{res.config['num_blocks'] - 1} blocks x {res.config['block_size']} tokens, "
        f"{res.summary['requests']} requests"
    )
    ax = axes[1]
    ax.plot(x, [100 * r.hit_rate for r in tl], lw=1, color="tab:green")
    ax.set_ylabel("prefix hit rate %\n(cumulative)")
    ax.set_ylim(0, 100)
    ax = axes[2]
    ax.plot(x, [r.running for r in tl], lw=1, label="running")
    ax.plot(x, [r.waiting for r in tl], lw=1, label="waiting")
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)
    if elastic:
        ax = axes[3]
        s = res.summary
        ax.plot(
            x,
            [r.mapped_gib for r in tl],
            lw=1,
            color="tab:purple",
            label=f"mapped (mean {s['mapped_gib_mean']:.1f}, peak {s['mapped_gib_peak']:.1f} GiB)",
        )
        ax.plot(x, [r.limit_gib for r in tl], lw=1, ls="--", color="tab:red", label="memory limit")
        ax.set_ylabel("KV memory GiB\n(all ranks)")
        ax.set_ylim(0, max([r.limit_gib for r in tl] + [s["mapped_gib_peak"], 1e-3]) * 1.05)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("engine step")
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
