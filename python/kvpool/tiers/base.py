"""The interface of a remote tier (``RemoteTier``) and its error.

A third tier behind ``kvpool.HierarchyBlockManagerPool(..., remote=tier)``: device, then host,
then a store shared by many serving instances (docs/remote_tier.md). ``kvpool.tiers.redis``
and ``kvpool.tiers.memory`` implement it.

**Failures degrade to misses.** ``RemoteTier`` methods raise ``RemoteTierError`` on I/O failure
(counted: errors, timeouts); the pool's lookup (``kvpool.tiers.lookup``) and
``kvpool.tiers.remote_transfer.RemoteTransfer`` catch every ``Exception`` and treat it as a miss
(the request recomputes); a ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt,
SystemExit) propagates.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["RemoteTier", "RemoteTierError"]


class RemoteTierError(Exception):
    """A remote-tier call failed (connection, timeout, server error); callers treat it as a miss."""


class RemoteTier:
    """The interface of a remote tier (subclass it), with I/O counters.

    ``keys`` are 16-byte chain hashes (R6); the tier namespaces them. Every method takes
    ``timeout`` (seconds or None: the tier's default) and raises ``RemoteTierError`` on failure.
    ``mac_key`` (None, or 16 to 64 bytes of a per-deployment secret) authenticates payloads:
    ``RemoteTransfer`` tags what it writes and accepts only tagged payloads when it is set.
    """

    mac_key: bytes | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {
            "errors": 0,
            "timeouts": 0,
            "skipped": 0,
            "corrupt": 0,
            "exists_calls": 0,
            "get_calls": 0,
            "put_calls": 0,
            "gets": 0,
            "get_hits": 0,
            "puts": 0,
            "bytes_in": 0,
            "bytes_out": 0,
        }

    def note(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to counter ``name`` (thread-safe)."""
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def stats(self) -> dict[str, int]:
        """A copy of the counters (merged into the pool's ``stats()["remote"]``)."""
        with self._lock:
            return dict(self._counters)

    def exists_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Whether each key is stored (one round trip)."""
        raise NotImplementedError

    def get_many(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bytes | None]:
        """The payload of each key, None where missing (one round trip)."""
        raise NotImplementedError

    def put_many(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], *, timeout: float | None = None
    ) -> None:
        """Stores ``payloads[i]`` under ``keys[i]`` (one round trip)."""
        raise NotImplementedError

    def delete_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Deletes the keys; returns how many existed."""
        raise NotImplementedError
