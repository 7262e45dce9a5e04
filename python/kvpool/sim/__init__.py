"""kvpool.sim: a continuous-batching serving simulator and KV-cache capacity planner.

``workloads`` (synthetic generators, JSONL traces) has no dependency besides NumPy; the
simulator itself needs the compiled pool and, for its output, ``rich`` (and ``matplotlib``
for ``--plot``). See docs/simulate.md.
"""

from kvpool.sim.workloads import KINDS, Request, TraceError, generate, load_trace, save_trace

__all__ = ["KINDS", "Request", "TraceError", "generate", "load_trace", "save_trace"]
