"""Rendering of simulation results: rich tables, JSON, matplotlib figure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["comparison_table", "plot", "summary_table"]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _int(x: float) -> str:
    return f"{int(x):,}"


def summary_rows(res: Any) -> list[tuple[str, str, str] | None]:
    """(metric, value, meaning) rows; None separates sections."""
    s = res.summary
    c = res.config
    rows: list[tuple[str, str, str] | None] = [
        ("requests", f"{s['finished']:,} / {s['requests']:,}", "finished / total"),
        ("prompt tokens", _int(s["prompt_tokens"]), "sum of prompt lengths"),
        ("output tokens", _int(s["output_tokens"]), "tokens sampled"),
        ("engine steps", _int(s["steps"]), "forward passes (per rank, in lockstep)"),
        ("tokens per step", f"{s['mean_batched_tokens']:.0f}", f"mean; budget {c['max_num_batched_tokens']} per rank"),
        ("running per step", f"{s['mean_running']:.1f}", "mean sequences holding blocks"),
        None,
        ("cache", f"{s['num_total_blocks']:,} blocks x {c['block_size']}",
         f"{c['capacity_tokens_per_rank']:,} tokens per rank, {c['dp_size']} rank(s)"),
        ("prefix hit rate", _pct(s["prefix_hit_rate"]),
         "hit / looked-up tokens of full blocks in the device cache (pool stats; host and remote "
         "hits count in 'prompt tokens from cache')"),
        ("prompt tokens from cache", _pct(s["cached_token_fraction"]),
         f"{s['admitted_cached_tokens']:,} of {s['admitted_tokens']:,} admitted tokens not recomputed"),
        ("peak usage", _pct(s["peak_usage"]), f"{s['peak_used_blocks']:,} blocks held by sequences at peak"),
        ("mean usage", _pct(s["mean_usage"]), "used / total, mean over steps"),
        ("evictions", _int(s["evictions"]), "cached blocks reclaimed for new allocations"),
        None,
        ("preemptions", _int(s["preemptions"]), f"recompute preemptions ({s['preempted_requests']} requests hit)"),
        ("recomputed tokens", _int(s["recomputed_tokens"]), "work lost to preemption and done again"),
        ("prefill tokens computed", _int(s["prefill_tokens_computed"]), "prompt tokens that ran through the model"),
    ]
    if c.get("host_num_blocks"):
        rows += [("host loads", _int(s["host_loads"]), "blocks copied host -> device (host prefix hits)"),
                 ("host offloads", _int(s["host_offloads"]), "blocks copied device -> host on release")]
    if "remote_hit_blocks" in s:
        rows += [("remote hits", _int(s["remote_hit_blocks"]), "blocks found on the shared remote tier"),
                 ("remote fetched", _int(s["remote_fetched_blocks"]), "blocks fetched remote -> host, verified"),
                 ("remote writes", _int(s["remote_puts"]), "blocks written to the remote tier"),
                 ("remote errors", _int(s["remote_errors"]), "failed remote calls (degraded to misses)")]
    if c.get("linear_state_slots"):
        rows += [("checkpoint hits", _int(s["checkpoint_hits"]), "admissions that restored a linear-state checkpoint"),
                 ("checkpoint saves", _int(s["checkpoint_saves"]), "linear-state checkpoints written")]
    rows += [
        None,
        ("TTFT", f"{s['ttft_steps_mean']:.1f} steps", f"mean arrival -> first token; p99 {s['ttft_steps_p99']:.0f}"),
        ("end-to-end", f"{s['e2e_steps_mean']:.1f} steps", "mean arrival -> last token"),
        ("scheduler overhead", f"{s['sched_us_per_step_mean']:.1f} us/step",
         f"p50 {s['sched_us_per_step_p50']:.1f}, p99 {s['sched_us_per_step_p99']:.1f} us; "
         f"{s['sched_us_per_request']:.1f} us per request"),
        ("wall time", f"{s['wall_s']:.2f} s", "simulation, this machine"),
    ]
    if res.execute:
        e = res.execute
        rows += [None, ("data plane", f"max err {e['max_abs_error']:.2e}",
                        f"{e['backend']} backend, {e['checked_steps']} steps checked, "
                        f"{'OK' if e['ok'] else 'FAILED'} (tol {e['tolerance']:.0e})")]
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
    ("peak use", lambda s: _pct(s["peak_usage"])),
    ("mean use", lambda s: _pct(s["mean_usage"])),
    ("preempt", lambda s: _int(s["preemptions"])),
    ("recomp tok", lambda s: _int(s["recomputed_tokens"])),
    ("evict", lambda s: _int(s["evictions"])),
    ("steps", lambda s: _int(s["steps"])),
    ("TTFT", lambda s: f"{s['ttft_steps_mean']:.1f}"),
    ("sched us/step", lambda s: f"{s['sched_us_per_step_mean']:.1f}"),
]


def comparison_table(labels: Sequence[str], results: Sequence[Any]) -> Any:
    from rich.table import Table

    t = Table(title="kvpool simulate --sweep", title_justify="left")
    t.add_column("config", style="bold", no_wrap=True)
    t.add_column("blocks x size", justify="right")
    for name, _ in COMPARE_COLUMNS:
        t.add_column(name, justify="right")
    for label, r in zip(labels, results, strict=False):
        s = r.summary
        t.add_row(label, f"{s['num_total_blocks']:,} x {r.config['block_size']}",
                  *(f(s) for _, f in COMPARE_COLUMNS))
    return t


def plot(res: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = res.timeline
    x = [r.step for r in tl]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    ax = axes[0]
    total = max(res.summary["num_total_blocks"], 1)
    ax.plot(x, [100 * r.usage for r in tl], lw=1, label="used (held by sequences)")
    ax.plot(x, [100 * (r.used_blocks + r.cached_blocks) / total for r in tl], lw=1,
            label="used + cached")
    ax.set_ylabel("KV blocks %")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{res.config['num_blocks'] - 1} blocks x {res.config['block_size']} tokens, "
                 f"{res.summary['requests']} requests")
    ax = axes[1]
    ax.plot(x, [100 * r.hit_rate for r in tl], lw=1, color="tab:green")
    ax.set_ylabel("prefix hit rate %\n(cumulative)")
    ax.set_ylim(0, 100)
    ax = axes[2]
    ax.plot(x, [r.running for r in tl], lw=1, label="running")
    ax.plot(x, [r.waiting for r in tl], lw=1, label="waiting")
    ax.set_ylabel("requests")
    ax.set_xlabel("engine step")
    ax.legend(loc="upper right", fontsize=8)
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
