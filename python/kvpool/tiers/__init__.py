"""The tiers below the device, the Python side (the core's are rust/kvpool/src/tiers).

The host tier is part of the core pool (``kvpool.HierarchyBlockManagerPool``, a
``kvpool.BlockManagerPool`` built with one); a remote tier is a Python object the pool asks
once per admission (``lookup``). The modules, each one job (docs/architecture.md):

- ``hierarchy``: ``HierarchyBlockManagerPool``, the core's host-tier pool with a remote tier;
- ``base``: ``RemoteTier``, the interface of a remote tier, and ``RemoteTierError``;
- ``memory``: ``MemoryRemoteTier``, a remote tier in this process's memory;
- ``redis``: ``RedisRemoteTier``, a remote tier on Redis / Valkey / Redis Cluster;
- ``payload``: what a store holds: block keys under a namespace, payloads that verify;
- ``lookup``: the remote lookup of one admission (budget, counters, a failure is a miss);
- ``remote_transfer``: fetches from the remote tier into host blocks, writes to it;
- ``host_transfer``: executors of the host tier's transfer plans (NumPy, CuPy), which drive
  ``remote_transfer`` when the pool has a remote tier.

This package imports what ``import kvpool`` needs and nothing more: ``payload``, ``redis`` and
``remote_transfer`` (xxhash, redis-py: ``kvpool[remote]``) load when imported themselves.
"""

from kvpool.tiers.base import RemoteTier, RemoteTierError
from kvpool.tiers.hierarchy import HierarchyBlockManagerPool
from kvpool.tiers.lookup import RemoteLookup, lookup_for
from kvpool.tiers.memory import MemoryRemoteTier

__all__ = [
    "HierarchyBlockManagerPool",
    "MemoryRemoteTier",
    "RemoteLookup",
    "RemoteTier",
    "RemoteTierError",
    "lookup_for",
]
