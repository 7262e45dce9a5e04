"""Compatibility shim: ``kvpool.tiers.remote`` moved to ``kvpool.tiers.lookup``
(docs/architecture.md)."""

from kvpool.tiers.lookup import *  # noqa: F403
from kvpool.tiers.lookup import __all__  # noqa: F401
