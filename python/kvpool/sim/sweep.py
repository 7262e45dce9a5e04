"""``kvpool simulate --sweep``: every point of the cartesian product, in parallel processes.

Each point is one independent simulation (its own pool, its own copy of the workload); the
points run in a pool of ``jobs`` worker processes (``spawn``: nothing of the parent's state is
shared but what is passed) and come back in the order they were given, whatever order they
finish in. A worker rebuilds the workload from the point's arguments, which gives the same
requests as the parent's (the generators are seeded, traces are files). With one job, or one
point, the points run in this process. An error in a point stops the sweep: the other workers
are terminated.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as queue_mod
import time
from typing import Any

from kvpool.sim.configure import make_workload, run_one
from kvpool.sim.progress import Progress, Reporter, sweep_bars
from kvpool.sim.request import Request
from kvpool.sim.summary import SimResult

__all__ = ["run_sweep"]

_QUEUE: Any = None


def _init_worker(q: Any) -> None:
    global _QUEUE
    _QUEUE = q
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _run_point(args: argparse.Namespace, label: str, point: int, keep_timeline: bool) -> SimResult:
    reqs, wl = make_workload(args)
    on_step = Reporter(_QUEUE, point) if _QUEUE is not None else None
    res = run_one(args, reqs, label, on_step)
    if "trace_read_s" in wl:
        res.summary["trace_read_s"] = wl["trace_read_s"]
    if not keep_timeline:
        res.timeline = []
    if _QUEUE is not None:
        _QUEUE.put((point, res.summary["finished"], None))
    return res


def run_sweep(
    plans: list[tuple[argparse.Namespace, str, bool]],
    reqs: list[Request],
    *,
    jobs: int | None,
    show: bool,
    keep_timeline: bool,
) -> list[SimResult]:
    """Run ``plans`` (``(args, label, same_workload)``) and return their results in order."""
    n = len(plans)
    jobs = min(n, jobs if jobs is not None else (os.cpu_count() or 1))
    if jobs <= 1:
        done = []
        for a, label, same in plans:
            r = reqs if same else make_workload(a)[0]
            with Progress(show, len(r), label) as prog:
                done.append(run_one(a, r, label, prog if show else None))
        return done
    ctx = mp.get_context("spawn")
    q = ctx.Queue() if show else None
    totals = [len(reqs) if same else a.num_requests for a, _, same in plans]
    pool = ctx.Pool(processes=jobs, initializer=_init_worker, initargs=(q,))
    bar = tasks = None
    try:
        handles = [
            pool.apply_async(_run_point, (a, label, i, keep_timeline))
            for i, (a, label, _) in enumerate(plans)
        ]
        if show:
            bar, tasks = sweep_bars([lbl for _, lbl, _ in plans], totals)
            bar.__enter__()
        results: list[Any] = [None] * n
        left = set(range(n))
        while left:
            for i in list(left):
                if handles[i].ready():
                    results[i] = handles[i].get()  # a worker's error is raised here
                    left.discard(i)
            if q is not None:
                _drain(q, bar, tasks)
            if left:
                time.sleep(0.05)
        if q is not None:
            _drain(q, bar, tasks)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
        pool.join()
    return results


def _drain(q: Any, bar: Any, tasks: Any) -> None:
    while True:
        try:
            point, finished, fields = q.get_nowait()
        except queue_mod.Empty:
            return
        bar.update(tasks[point], completed=finished, **(fields or {}))
