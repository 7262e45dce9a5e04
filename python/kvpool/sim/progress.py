"""Progress bars of ``kvpool simulate`` on stderr (rich): requests finished, the simulated clock,
queues and cache usage, elapsed time and an ETA.

One bar per run; a parallel sweep shows one bar per point, fed by its worker process through a
queue of ``(point, finished, fields)`` messages (:class:`Reporter`). Updates are throttled to 10
per second, so a bar costs the simulation nothing measurable.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Progress", "Reporter", "fields_of"]

_FIELDS = (
    "clock {task.fields[clock]:>9}  run {task.fields[run]:>4}  wait {task.fields[wait]:>5}  "
    "use {task.fields[use]:>4}"
)


def fields_of(sim: Any) -> dict[str, Any]:
    """The bar's fields for the simulator ``sim`` now."""
    last = sim.timeline[-1] if sim.timeline else None
    if sim.cfg.order == "request":
        clock = f"req {sim.step_no}"
    elif sim.seconds_clock or sim.cfg.gpu:
        clock = f"{sim.now_s:,.0f} s"
    else:
        clock = f"step {sim.step_no}"
    return {
        "clock": clock,
        "run": len(sim.running),
        "wait": len(sim.waiting),
        "use": f"{100 * last.usage:.0f}%" if last else "-",
    }


def _bar(console_stderr: bool = True) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress

    return RichProgress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(_FIELDS),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=Console(stderr=console_stderr),
        transient=False,
    )


class Progress:
    """A bar over finished requests, the simulator's ``on_step`` (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled = enabled
        self.total = total
        self.label = label
        self._last = 0.0
        self.progress: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self.progress = _bar()
            self.progress.__enter__()
            self.task = self.progress.add_task(
                self.label, total=self.total, clock="-", run=0, wait=0, use="-"
            )
        return self

    def __call__(self, sim: Any) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and not sim.done():
            return
        self._last = now
        self.progress.update(self.task, completed=len(sim.finished), **fields_of(sim))

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)


class Reporter:
    """``on_step`` of a sweep worker: sends ``(point, finished, fields)`` to the parent's queue."""

    def __init__(self, queue: Any, point: int) -> None:
        self.queue = queue
        self.point = point
        self._last = 0.0

    def __call__(self, sim: Any) -> None:
        now = time.perf_counter()
        if now - self._last < 0.2 and not sim.done():
            return
        self._last = now
        self.queue.put((self.point, len(sim.finished), fields_of(sim)))


def sweep_bars(labels: list[str], totals: list[int]) -> tuple[Any, list[Any]]:
    """A rich progress with one task per sweep point (entered by the caller)."""
    bar = _bar()
    tasks = [
        bar.add_task(lbl, total=n, clock="-", run=0, wait=0, use="-")
        for lbl, n in zip(labels, totals, strict=True)
    ]
    return bar, tasks
