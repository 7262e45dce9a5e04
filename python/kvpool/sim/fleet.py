"""``kvpool simulate --instances N --router POLICY``: a fleet of serving instances in one process.

N :class:`~kvpool.sim.engine.Simulator` instances (one pool each, KV events on) share one
simulated clock, in seconds. A request is routed when the clock reaches its arrival: a
:class:`kvpool.index.router.Router` (``round_robin``, ``least_loaded`` or ``kv_aware``) picks the
instance, asking one :class:`kvpool.KVIndex` that every instance's event stream feeds. The
driver is a discrete-event loop:

- the next thing to happen is either the next arrival or the step of the busy instance whose
  clock is furthest behind; an arrival no later than that clock is routed first (so every busy
  instance's clock is at or past an arrival when it is routed, and an idle instance's clock
  jumps to it);
- after each step, the instance's drained events are applied to the index (its instance id is
  its position), and the requests it finished leave the router's load.

So the index sees exactly what the pools published, when they published it, and a request
routed at time t sees the events of every step that ended by about t (an instance's step can
end slightly past t: the events of that one step are early by less than a step).

Remote tier: ``remote="memory"`` gives every instance's hierarchy pool the same in-process
:class:`~kvpool.tiers.memory.MemoryRemoteTier` (the paper's global cache, Mooncake's Figure
10); a ``redis://`` URL shares a Redis server the same way; None keeps the caches local.

Invariants: every request is routed exactly once and finished by the instance it was routed
to; the router's load is the prompt tokens routed and not yet finished; the index's sources
are the instances' (pool, dp rank) streams, gap-free (asserted with ``check``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvpool
from kvpool.index.router import POLICIES, Router
from kvpool.sim.config import SimConfig, SimError, check_fits
from kvpool.sim.engine import Simulator, arrival_seconds
from kvpool.sim.request import Request
from kvpool.tiers.memory import MemoryRemoteTier

__all__ = ["FleetResult", "run_fleet"]


@dataclass
class FleetResult:
    """One fleet run: the per-instance summaries and the fleet's totals."""

    policy: str
    remote: str | None
    instances: int
    fleet: dict[str, Any]
    per_instance: list[dict[str, Any]] = field(default_factory=list)
    # the instances and the index at the end of the run (tests inspect them; not in the JSON)
    simulators: list[Simulator] = field(default_factory=list, repr=False)
    index: Any = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.policy} / {'remote:' + self.remote if self.remote else 'local caches'}"

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "remote": self.remote,
            "instances": self.instances,
            "fleet": self.fleet,
            "per_instance": self.per_instance,
        }


def _seconds_clock(requests: Sequence[Request], step_ms: float) -> list[Request]:
    """The requests with an arrival in seconds (step arrivals times the step time), sorted."""
    out = [
        r
        if r.arrival_s is not None
        else dataclasses.replace(r, arrival_s=r.arrival * step_ms / 1000.0)
        for r in requests
    ]
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def run_fleet(
    cfg: SimConfig,
    requests: Sequence[Request],
    instances: int,
    policy: str,
    *,
    remote: str | None = None,
    load_weight: float = 1.0,
    speculative_ttl: float | None = 2.0,
    medium_weights: dict[str, float] | None = None,
    on_progress: Any = None,
) -> FleetResult:
    """Simulates ``requests`` on ``instances`` pools of ``cfg`` routed by ``policy``.

    Parameters
    ----------
    cfg : SimConfig
        One instance's configuration (``cfg.remote`` is replaced by ``remote``).
    requests : sequence of Request
        The workload; step arrivals are turned into seconds (``cfg.step_ms`` per step).
    instances : int
        Number of instances (>= 1).
    policy : str
        A policy of :mod:`kvpool.index.router`.
    remote : str or None
        None (local caches), ``"memory"`` (one in-process remote tier shared by the fleet) or a
        ``redis://`` URL; a remote tier needs the host tier (``cfg.host_num_blocks``).
    load_weight, speculative_ttl, medium_weights
        The router's options (:class:`kvpool.index.router.Router`).
    on_progress : callable, optional
        Called with the number of requests routed so far.
    """
    if instances < 1:
        raise SimError(f"--instances must be >= 1, got {instances}")
    if policy not in POLICIES:
        raise SimError(
            f"--router: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}"
        )
    if cfg.order != "serving":
        raise SimError(
            "--instances simulates serving (continuous batching on the trace's clock): "
            "--order request is not available with it"
        )
    if remote is not None and not cfg.host_num_blocks:
        raise SimError(
            "a remote tier needs the host tier (--host-blocks N): remote hits land in host blocks"
        )
    shared = None
    if remote == "memory":
        shared = MemoryRemoteTier()
    icfg = dataclasses.replace(cfg, remote=remote, enable_events=True)
    reqs = _seconds_clock(requests, cfg.step_ms)
    if reqs:
        check_fits(icfg, reqs)
    sims = []
    for _ in range(instances):
        sim = Simulator(icfg, [], remote_tier=shared)
        sim.seconds_clock = True
        sims.append(sim)
    index = kvpool.KVIndex(hash_seed=cfg.hash_seed)
    router = Router(
        instances,
        policy,
        index=index,
        block_size=cfg.block_size,
        load_weight=load_weight,
        medium_weights=medium_weights,
        shared_remote=remote is not None,
        speculative_ttl=speculative_ttl,
    )
    routed = [0] * instances
    routed_tokens = [0] * instances
    predicted = np.zeros(3)  # prompt tokens the router saw cached on the chosen instance
    done_seen = [0] * instances
    gaps = 0
    t0 = time.perf_counter()
    i = 0
    max_steps = cfg.max_steps
    while True:
        busy = [k for k, s in enumerate(sims) if s.pending or s.waiting or s.running]
        k_busy = min(busy, key=lambda k: (sims[k].now_s, k)) if busy else -1
        t_busy = sims[k_busy].now_s if busy else math.inf
        t_arrival = arrival_seconds(reqs[i]) if i < len(reqs) else math.inf
        if t_arrival == math.inf and t_busy == math.inf:
            break
        if t_arrival <= t_busy:
            r = reqs[i]
            i += 1
            decision = router.route(
                r.prompt_tokens(), extra_key=r.extra_key, now=t_arrival, request_id=r.request_id
            )
            k = decision.instance
            sim = sims[k]
            if not (sim.pending or sim.waiting or sim.running):
                sim.now_s = max(sim.now_s, t_arrival)
            sim.pending.append(r)
            sim.requests.append(r)
            routed[k] += 1
            routed_tokens[k] += r.prompt_len
            if decision.cached_tokens:
                predicted += [decision.cached_tokens[m] for m in ("device", "host", "remote")]
            if on_progress is not None:
                on_progress(i)
            continue
        sim = sims[k_busy]
        if max_steps is not None and sim.step_no >= max_steps:
            raise SimError(
                f"instance {k_busy} reached --max-steps {max_steps} before the workload ended"
            )
        sim.step()
        events = sim.pool.drain_events()
        if events:
            gaps += len(index.apply(k_busy, events)["gaps"])
        for lv in sim.finished[done_seen[k_busy] :]:
            router.finish(lv.req.request_id)
        done_seen[k_busy] = len(sim.finished)
        if cfg.check:
            index.check()
    wall = time.perf_counter() - t0
    if gaps:
        raise SimError(
            f"the index saw {gaps} gap(s) in the instances' event streams"
        )  # pragma: no cover
    per = []
    for k, sim in enumerate(sims):
        s = sim.summary(wall)
        s.update(instance=k, routed_requests=routed[k], routed_prompt_tokens=routed_tokens[k])
        per.append(s)
    fleet = _fleet_summary(sims, per, wall, index, predicted)
    if shared is not None:
        fleet["remote_stored_blocks"] = len(shared)
    return FleetResult(policy, remote, instances, fleet, per, sims, index)


def _fleet_summary(
    sims: list[Simulator], per: list[dict[str, Any]], wall: float, index: Any, predicted: np.ndarray
) -> dict[str, Any]:
    fin = [lv for sim in sims for lv in sim.finished]
    ttft = np.array([lv.first_token_s - lv.arrival_s for lv in fin], dtype=np.float64)
    prompt = sum(lv.prompt_len for lv in fin)
    cached = sum(max(lv.first_cached, 0) for lv in fin)
    busy = np.array([sim.busy_s for sim in sims], dtype=np.float64)
    count = np.array([p["routed_requests"] for p in per], dtype=np.float64)
    tokens = np.array([p["routed_prompt_tokens"] for p in per], dtype=np.float64)
    arrivals = [lv.arrival_s for lv in fin]
    span = max((sim.now_s for sim in sims), default=0.0) - (min(arrivals) if arrivals else 0.0)
    out_tokens = sum(lv.generated for lv in fin)

    def pct(a: np.ndarray, p: float) -> float:
        return float(np.percentile(a, p)) if len(a) else 0.0

    def imbalance(a: np.ndarray) -> float:
        """max / mean (1.0: perfectly balanced)."""
        return float(a.max() / a.mean()) if len(a) and a.mean() > 0 else 1.0

    stats = index.stats()
    return {
        "requests": sum(len(sim.requests) for sim in sims),
        "finished": len(fin),
        "prompt_tokens": prompt,
        "output_tokens": out_tokens,
        # prompt tokens from any tier at each request's first admission (device, host, remote)
        "hit_rate": cached / prompt if prompt else 0.0,
        "prefix_hit_rate": (
            sum(p["prefix_hit_tokens"] for p in per) / q
            if (q := sum(p["prefix_query_tokens"] for p in per))
            else 0.0
        ),
        "host_loads": sum(p["host_loads"] for p in per),
        "remote_hit_blocks": sum(p.get("remote_hit_blocks", 0) for p in per),
        "recomputed_tokens": sum(p["recomputed_tokens"] for p in per),
        "preemptions": sum(p["preemptions"] for p in per),
        "ttft_s_mean": float(ttft.mean()) if len(ttft) else 0.0,
        "ttft_s_p50": pct(ttft, 50),
        "ttft_s_p90": pct(ttft, 90),
        "ttft_s_p99": pct(ttft, 99),
        "sim_time_s": float(span),
        "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "busy_imbalance": imbalance(busy),
        "request_imbalance": imbalance(count),
        "prompt_token_imbalance": imbalance(tokens),
        "min_requests": int(count.min()) if len(count) else 0,
        "max_requests": int(count.max()) if len(count) else 0,
        "router_predicted_device_tokens": int(predicted[0]),
        "router_predicted_any_tokens": int(predicted[2]),
        "index_entries": int(stats["entries"]),
        "index_events": int(stats["events_applied"]),
        "wall_s": wall,
    }
