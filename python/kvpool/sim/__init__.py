"""kvpool.sim: a continuous-batching serving simulator and KV-cache capacity planner.

``request`` holds the types every part shares (``Request``, ``TraceError``, trace prompts);
``workloads`` (synthetic generators, kvpool JSONL traces) and ``traces`` (the Mooncake and
Qwen-Bailian production traces) make workloads; ``timing`` is the step-time model (fixed, or a
roofline on A100/H100/H200); the simulator (``engine``, configured by ``config``) runs on the
compiled pool, its report needs ``rich`` (a dependency) and ``--plot`` matplotlib (optional).
docs/architecture.md maps the modules; docs/simulate.md is the user's guide.
"""

from kvpool.sim.request import HashedPrompt, Request, Session, TraceError
from kvpool.sim.traces import read_production_trace
from kvpool.sim.workloads import KINDS, generate, load_trace, save_trace

__all__ = [
    "KINDS",
    "HashedPrompt",
    "Request",
    "Session",
    "TraceError",
    "generate",
    "load_trace",
    "read_production_trace",
    "save_trace",
]
