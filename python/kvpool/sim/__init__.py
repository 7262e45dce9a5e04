"""kvpool.sim: a continuous-batching serving simulator and KV-cache capacity planner.

``workloads`` (synthetic generators, kvpool JSONL traces) and ``traces`` (the Mooncake and
Qwen-Bailian production traces) need only NumPy; ``timing`` is the step-time model (fixed, or a
roofline on A100/H100/H200); the simulator (``engine``) needs the compiled pool, its report
``rich`` (a dependency) and ``--plot`` matplotlib (optional). See docs/simulate.md.
"""

from kvpool.sim.traces import HashedPrompt, Session, read_production_trace
from kvpool.sim.workloads import KINDS, Request, TraceError, generate, load_trace, save_trace

__all__ = ["KINDS", "HashedPrompt", "Request", "Session", "TraceError", "generate", "load_trace",
           "read_production_trace", "save_trace"]
