"""Compatibility shim: ``kvpool.transfer`` moved to ``kvpool.tiers.host_transfer``
(docs/architecture.md)."""

from kvpool.tiers.host_transfer import *  # noqa: F403
from kvpool.tiers.host_transfer import __all__  # noqa: F401
