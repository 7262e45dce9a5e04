"""``kvpool simulate --order request``: the paper-style cache analysis, one request at a time.

Requests are replayed in arrival order, each prompt alone: allocated whole (the prefix match),
marked computed, released (its full blocks published); no batching, no decode. The hit rate is
then a property of the trace and the cache size only, as in the Mooncake paper's capacity curve
(its Figure 9; docs/simulate.md). ``kvpool.sim.engine.Simulator.run`` calls
:func:`run_request_order` for it.

With ``--eviction optimal`` the pool is replaced by the offline bound of
:mod:`kvpool.sim.optimal` (farthest next use): the same requests, the same accounting, the hits
any eviction policy could at most get.

A sliding window publishes and slides at the release. With linear state the prompt is computed
in chunks that end at each checkpoint boundary (``BlockManagerPool.next_checkpoint_boundary``:
the multiples of ``checkpoint_interval`` and the prompt's last full block), each followed by
``cache`` and the step's linear-state plan (R24), as an engine's prefill would.
"""

from __future__ import annotations

import time
from typing import Any

import kvpool
from kvpool.sim.config import SimError
from kvpool.sim.live import DONE, Live
from kvpool.sim.optimal import OptimalRun, request_order_bound
from kvpool.sim.summary import SimResult
from kvpool.sim.timing import chunk_work

__all__ = ["run_request_order"]


def run_request_order(sim: Any) -> SimResult:
    """The paper-style analysis: each request's prompt alone, in arrival order.

    Per request: ``allocate`` the whole prompt (the prefix match), mark it computed,
    ``deallocate`` (publishes its full blocks, releases the rest). The step-time model gives
    the prefill time of the tokens not found in the cache; nothing is decoded.
    """
    t0 = time.perf_counter()
    pool = sim.pool
    timer = sim.timer
    max_steps = sim.cfg.max_steps
    bound = _bound(sim) if sim.cfg.eviction == "optimal" else None
    for i, req in enumerate(sim.requests):
        if max_steps is not None and i >= max_steps:
            break
        sim.pending.popleft()
        lv = Live(req, float(req.arrival_s) if req.arrival_s is not None else 0.0, i)
        sim.now_s = max(sim.now_s, lv.arrival_s)
        if bound is not None:
            cached = bound.hit_tokens[i]
            _account(sim, lv, req.prompt_len, cached)
            dt = timer.seconds(chunk_work(cached, req.prompt_len))
            sim.busy_s += dt
            sim.step_s.append(dt)
            _finish(sim, lv, i, dt)
            continue
        if sim.mapped is not None:
            sim.mapped.apply_due(sim.now_s)
        seq = sim.make_seq(lv)
        if not pool.allocate(seq):
            limit = " under the memory limit" if sim.mapped is not None else ""
            raise SimError(
                f"request {req.request_id} ({len(seq)} tokens) does not fit the cache{limit}"
            )
        if sim.hier:
            sim.sync_loads()
        L = len(seq)
        cached = seq.num_cached_tokens
        _account(sim, lv, L, cached)
        if sim.cfg.linear_state_slots:
            sim.ckpt_restores += seq.linear_state_restore_slot is not None
            sim._linear_state_plan()  # the restore (or zeroing) of the admission
            while (end := pool.next_checkpoint_boundary(seq)) is not None:
                seq.num_computed_tokens = end
                pool.cache(seq)
                sim._linear_state_plan()
        seq.num_computed_tokens = L
        dt = timer.seconds(chunk_work(cached, L))
        sim.busy_s += dt
        sim.step_s.append(dt)
        st = pool.stats()
        used = int(st["num_used_blocks"])
        sim.peak_used_blocks = max(sim.peak_used_blocks, used)
        usage = float(st["usage"])
        sim.peak_usage = max(sim.peak_usage, usage)
        sim.usage_sum += usage
        sim.release(lv)
        if sim.mapped is not None:
            sim.mapped.record(pool.stats(), lv.arrival_s + dt)
        _finish(sim, lv, i, dt)
    sim.now_s = max((lv.finish_s for lv in sim.finished), default=sim.now_s)
    wall = time.perf_counter() - t0
    if sim.cfg.check:
        st = pool.stats()
        # the linear-state group's blocks of the one store are all a finished run holds
        held = st["num_used_blocks"] - st["num_linear_state_blocks"]
        assert held == 0, f"blocks leaked after the run: {st}"
        pool.check()
    summary = sim.summary(wall)
    if bound is not None:  # the pool's counters did not run: the bound's own
        summary["prefix_query_tokens"] = bound.query_tokens
        summary["prefix_hit_tokens"] = hit = sum(bound.hit_tokens[: len(sim.finished)])
        summary["prefix_hit_rate"] = hit / bound.query_tokens if bound.query_tokens else 0.0
        summary["evictions"] = bound.evictions
        summary["peak_used_blocks"] = bound.peak_blocks
    return SimResult(sim.config_dict(), summary, sim.timeline)


def _account(sim: Any, lv: Live, length: int, cached: int) -> None:
    """An admission of ``length`` prompt tokens, ``cached`` of them from the cache."""
    sim.admissions += 1
    sim.admit_tokens += length
    sim.admit_cached += cached
    sim.prefill_tokens += length - cached
    lv.first_cached = cached


def _finish(sim: Any, lv: Live, i: int, dt: float) -> None:
    """Request ``i`` done after ``dt`` seconds of prefill."""
    lv.seq = None
    lv.state = DONE
    lv.first_token_step = lv.finish_step = i
    lv.first_token_s = lv.finish_s = lv.arrival_s + dt
    sim.finished.append(lv)
    sim.step_no = i + 1
    if sim.on_step is not None:
        sim.on_step(sim)


def _bound(sim: Any) -> OptimalRun:
    """The offline bound over the requests the run replays, on the pool's memory (one rank)."""
    cfg = sim.cfg
    bs = cfg.block_size
    requests = sim.requests[: cfg.max_steps] if cfg.max_steps is not None else sim.requests
    chains = [
        kvpool.hash_blocks(r.prompt_tokens(), bs, extra_key=r.extra_key, hash_seed=cfg.hash_seed)
        for r in requests
    ]
    try:
        return request_order_bound(chains, [r.prompt_len for r in requests], cfg.num_blocks - 1, bs)
    except ValueError as e:
        raise SimError(f"--eviction optimal: {e}") from None
