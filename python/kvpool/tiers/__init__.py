"""Tiers below the device, the Python side: the remote tier's lookup policy (``remote``).

The host tier is part of the core pool (``kvpool.HierarchyBlockManagerPool``, a
``kvpool.BlockManagerPool`` built with one); ``kvpool.transfer`` runs its plans and
``kvpool.remote`` holds the remote tier itself (Redis) and its executor;
``kvpool.tiers.memory.MemoryRemoteTier`` is one in this process's memory.
"""

from kvpool.tiers.remote import RemoteLookup, lookup_for

__all__ = ["MemoryRemoteTier", "RemoteLookup", "lookup_for"]


def __getattr__(name: str) -> object:
    # kvpool.remote imports kvpool.tiers.remote: load the memory tier (a RemoteTier) lazily
    if name == "MemoryRemoteTier":
        from kvpool.tiers.memory import MemoryRemoteTier

        return MemoryRemoteTier
    raise AttributeError(name)
