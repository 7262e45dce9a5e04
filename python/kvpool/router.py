"""Compatibility shim: ``kvpool.router`` moved to ``kvpool.index.router`` (docs/architecture.md)."""

from kvpool.index.router import *  # noqa: F403
from kvpool.index.router import __all__  # noqa: F401
