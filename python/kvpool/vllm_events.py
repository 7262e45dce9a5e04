"""Compatibility shim: ``kvpool.vllm_events`` moved to ``kvpool.index.vllm_events``
(docs/architecture.md)."""

from kvpool.index.vllm_events import *  # noqa: F403
from kvpool.index.vllm_events import __all__  # noqa: F401
