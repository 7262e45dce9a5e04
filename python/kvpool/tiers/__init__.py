"""Tiers below the device, the Python side: the remote tier's lookup policy (``remote``).

The host tier is part of the core pool (``kvpool.HierarchyBlockManagerPool``, a
``kvpool.BlockManagerPool`` built with one); ``kvpool.transfer`` runs its plans and
``kvpool.remote`` holds the remote tier itself (Redis) and its executor.
"""

from kvpool.tiers.remote import RemoteLookup, lookup_for

__all__ = ["RemoteLookup", "lookup_for"]
