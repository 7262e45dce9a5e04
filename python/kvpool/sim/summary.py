"""What a simulation reports: the per-step ``StepRecord``, the ``SimResult`` and its summary.

``summarize`` reads a finished simulator (``kvpool.sim.engine.Simulator``) and the pool's
statistics into the flat ``summary`` dict of ``kvpool simulate --json`` (docs/simulate.md lists
the keys); ``kvpool.sim.report`` renders it. Every value is a function of the run but for the
wall-clock ones (``wall_s``, ``trace_read_s``, ``sched_us_*``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["SimResult", "StepRecord", "remote_summary", "summarize"]


@dataclass(slots=True)
class StepRecord:
    step: int
    usage: float
    used_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    batched_tokens: int
    hit_rate: float
    sched_us: float
    time_s: float = 0.0  # the simulated clock at the end of the step
    step_s: float = 0.0  # the step's duration (step-time model)
    mapped_gib: float = 0.0  # --xtensor: memory mapped at the end of the step, all ranks
    limit_gib: float = 0.0  # --xtensor: what the limits allow, all ranks


@dataclass
class SimResult:
    config: dict[str, Any]
    summary: dict[str, Any]
    timeline: list[StepRecord] = field(default_factory=list)
    execute: dict[str, Any] | None = None

    def to_json(self, *, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "config": self.config,
            "summary": self.summary,
            "execute": self.execute,
        }
        if timeline:
            d["timeline"] = [asdict(r) for r in self.timeline]
        return d


def summarize(sim: Any, wall: float) -> dict[str, Any]:
    """The summary of a run (``SimResult.summary``): ``sim`` is the simulator at its end, ``wall``
    the run's wall time in seconds."""
    st = sim.pool.stats()
    fin = sim.finished
    request_order = sim.cfg.order == "request"
    ns = np.asarray(sim.sched_ns, dtype=np.float64) / 1e3
    arr_step = np.array(
        [lv.arrive_step if sim.seconds_clock else lv.req.arrival for lv in fin], dtype=np.float64
    )
    ttft = np.array([lv.first_token_step for lv in fin], dtype=np.float64) - arr_step
    e2e = np.array([lv.finish_step for lv in fin], dtype=np.float64) - arr_step + 1
    arr_s = np.array([lv.arrival_s for lv in fin], dtype=np.float64)
    ttft_s = np.array([lv.first_token_s for lv in fin], dtype=np.float64) - arr_s
    e2e_s = np.array([lv.finish_s for lv in fin], dtype=np.float64) - arr_s
    multi = [lv for lv in fin if lv.generated > 1]
    tpot = np.array(
        [(lv.finish_s - lv.first_token_s) / (lv.generated - 1) for lv in multi], dtype=np.float64
    )
    # time between tokens over every decoded token: each step's duration, once per decode in it
    step_s = np.asarray(sim.step_s, dtype=np.float64)
    dec_w = np.asarray(sim.step_decodes, dtype=np.float64)
    q = int(st.get("prefix_query_tokens", 0))
    h = int(st.get("prefix_hit_tokens", 0))
    steps = len(sim.timeline)
    tl_tokens = sum(r.batched_tokens for r in sim.timeline)
    span = sim.now_s - (min(arr_s) if len(arr_s) else 0.0)
    out_tokens = int(sum(lv.generated for lv in fin))
    # prompt tokens from the cache at each request's first admission (no preemption re-hits)
    first = np.array([max(lv.first_cached, 0) for lv in fin], dtype=np.float64)
    plen = np.array([lv.prompt_len for lv in fin], dtype=np.float64)
    computed = sim.prefill_tokens + sim.decode_tokens + sim.recompute_tokens

    def pct(a: np.ndarray, p: float) -> float:
        return float(np.percentile(a, p)) if len(a) else 0.0

    def mean(a: np.ndarray) -> float:
        return float(a.mean()) if len(a) else 0.0

    out: dict[str, Any] = {
        "requests": len(sim.requests),
        "finished": len(fin),
        "prompt_tokens": int(sum(r.prompt_len for r in sim.requests)),
        "output_tokens": out_tokens,
        "steps": steps if not request_order else len(fin),
        "prefill_tokens_computed": sim.prefill_tokens,
        "decode_tokens": sim.decode_tokens,
        "recomputed_tokens": sim.recompute_tokens,
        "mean_batched_tokens": tl_tokens / steps if steps else 0.0,
        "mean_running": float(np.mean([r.running for r in sim.timeline])) if steps else 0.0,
        "prefix_query_tokens": q,
        "prefix_hit_tokens": h,
        "prefix_hit_rate": h / q if q else 0.0,
        "admitted_tokens": sim.admit_tokens,
        "admitted_cached_tokens": sim.admit_cached,
        "cached_token_fraction": sim.admit_cached / sim.admit_tokens if sim.admit_tokens else 0.0,
        "first_admission_cached_fraction": float(first.sum() / plen.sum()) if len(fin) else 0.0,
        "mean_request_cached_fraction": float((first / plen).mean()) if len(fin) else 0.0,
        "peak_usage": sim.peak_usage,
        "mean_usage": sim.usage_sum / max(steps if not request_order else len(fin), 1),
        "peak_used_blocks": sim.peak_used_blocks,
        "num_total_blocks": int(st["num_total_blocks"]),
        "preemptions": sim.preemptions,
        "preempted_requests": sum(1 for lv in fin if lv.preemptions)
        + sum(1 for lv in list(sim.running) + list(sim.waiting) if lv.preemptions),
        "evictions": int(st.get("num_evictions", 0)),
        "host_loads": sim.host_loads,
        "host_offloads": sim.host_offloads,
        **remote_summary(sim),
        "checkpoint_hits": sim.ckpt_restores,
        "checkpoint_saves": sim.ckpt_saves,
        "ttft_steps_mean": mean(ttft),
        "ttft_steps_p99": pct(ttft, 99),
        "e2e_steps_mean": mean(e2e),
        # time in seconds (the step-time model)
        "sim_time_s": float(sim.now_s),
        "busy_s": float(sim.busy_s),
        "ttft_s_mean": mean(ttft_s),
        "ttft_s_p50": pct(ttft_s, 50),
        "ttft_s_p99": pct(ttft_s, 99),
        "tpot_ms_mean": 1e3 * mean(tpot),
        "tbt_ms_mean": 1e3 * float((step_s * dec_w).sum() / dec_w.sum()) if dec_w.sum() else 0.0,
        "tbt_ms_p99": 1e3 * _weighted_percentile(step_s, dec_w, 99),
        "e2e_s_mean": mean(e2e_s),
        "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "computed_tokens_per_s": computed / sim.busy_s if sim.busy_s > 0 else 0.0,
        "prefill_s_mean": float(step_s.mean()) if request_order and len(step_s) else 0.0,
        "sched_us_per_step_mean": mean(ns),
        "sched_us_per_step_p50": pct(ns, 50),
        "sched_us_per_step_p99": pct(ns, 99),
        "sched_us_per_request": float(ns.sum() / len(fin)) if fin else 0.0,
        "wall_s": wall,
    }
    if sim.trace_read_s is not None:
        out["trace_read_s"] = sim.trace_read_s
    if sim.cfg.has_window_groups or sim.cfg.linear_state_slots:
        out["group_memory"] = group_memory(sim.pool)
        out["group_memory"]["chunked"] = int(sim.cfg.attention_chunk_size is not None)
    if sim.mapped is not None:
        out.update(sim.mapped.summary(st, sim.now_s))
    if sim.cfg.retain_ttl_s is not None:
        out["retained_turns"] = sim.retained
        out["retain_refused"] = sim.retain_refused
    sessions = [lv for lv in fin if lv.req.session is not None]
    if sessions:
        first_turns = [lv for lv in sessions if lv.req.session.parent_chat_id < 0]
        follow = [lv for lv in sessions if lv.req.session.parent_chat_id >= 0]

        def hit(group: list[Any]) -> float:
            n = sum(lv.prompt_len for lv in group)
            return sum(max(lv.first_cached, 0) for lv in group) / n if n else 0.0

        out.update(
            {
                "sessions": len(first_turns),
                "follow_up_turns": len(follow),
                "max_turn": max(lv.req.session.turn for lv in sessions),
                "first_turn_hit_rate": hit(first_turns),
                "follow_up_hit_rate": hit(follow),
            }
        )
    return out


def group_memory(pool: Any) -> dict[str, int]:
    """The store's blocks per group at the end of the run, over the ranks (``pool.memory()``):
    ``full_*`` and ``window_*`` cached and used blocks (a window with its own store counts its
    own), free blocks of the shared store, the linear-state slots in use and, with linear state
    in the one store, the blocks the states hold (``linear_*``)."""
    out = {"free_blocks": 0}
    for rank in pool.memory():
        out["free_blocks"] += rank["free_blocks"]
        linear = rank["linear_state"]
        for g in rank["shared"]:
            if g["group"] == 0:
                name = "full"
            elif linear is not None and g["group"] == linear["group"]:
                name = "linear"
            else:
                name = "window"
            for kind in ("cached", "used"):
                key = f"{name}_{kind}_blocks"
                out[key] = out.get(key, 0) + g[f"{kind}_blocks"]
        own = rank["own_window"]
        if own is not None:
            for kind in ("cached", "used"):
                key = f"window_{kind}_blocks"
                out[key] = out.get(key, 0) + own[f"num_{kind}_blocks"]
        linear = rank["linear_state"]
        if linear is not None:
            out["linear_state_slots_in_use"] = (
                out.get("linear_state_slots_in_use", 0) + linear["slots_in_use"]
            )
    return out


def remote_summary(sim: Any) -> dict[str, Any]:
    """The remote tier's rows of the summary (none without a remote tier)."""
    if sim.remote is None:
        return {}
    r = sim.pool.stats()["remote"]
    return {
        "remote_hit_blocks": int(r["hit_blocks"]),
        "remote_fetched_blocks": int(r["fetched_blocks"]),
        "remote_failed_blocks": int(r["failed_fetch_blocks"]),
        "remote_puts": int(r.get("puts", 0)),
        "remote_errors": int(r.get("errors", 0)) + int(r.get("timeouts", 0)),
    }


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, p: float) -> float:
    """The ``p``-th percentile of ``values`` each counted ``weights`` times (0 if none)."""
    if not len(values) or not weights.sum():
        return 0.0
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    i = int(np.searchsorted(cum, p / 100.0 * cum[-1], side="left"))
    return float(values[order][min(i, len(values) - 1)])
