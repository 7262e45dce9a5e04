"""``MemoryRemoteTier``: a remote tier held in this process's memory (docs/remote_tier.md).

The stand-in for a shared store (Redis, Mooncake's global pool) where no server is wanted: the
fleet simulation (``kvpool simulate --instances N --remote memory``) gives one to every
instance's pool, and tests use it. It keeps payloads in a dict under their 16-byte chain-hash
keys, in least-recently-used order when ``capacity`` (blocks) bounds it: a ``put`` beyond the
capacity evicts the least-recently put or read keys. Thread-safe (one lock). Never fails: a
missing key is a miss, as in any tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpool.tiers.base import RemoteTier

__all__ = ["MemoryRemoteTier"]


class MemoryRemoteTier(RemoteTier):
    """A remote tier in a dict, optionally bounded to ``capacity`` blocks (LRU).

    Parameters
    ----------
    capacity : int or None
        Most keys held; None: unbounded.
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)):
            raise TypeError(
                f"capacity: must be an int or None, got {type(capacity).__name__}"
            )  # R29
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity: must be >= 1 or None, got {capacity!r}")
        self.capacity = capacity
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def stats(self) -> dict[str, int]:
        out = super().stats()
        with self._lock:
            out["stored_blocks"] = len(self._data)
            out["evictions"] = self.evictions
        return out

    def exists_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        with self._lock:
            self._counters["exists_calls"] += 1
            return [bytes(k) in self._data for k in keys]

    def get_many(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            self._counters["get_calls"] += 1
            for k in keys:
                k = bytes(k)
                payload = self._data.get(k)
                if payload is not None:
                    self._data.move_to_end(k)
                    self._counters["get_hits"] += 1
                    self._counters["bytes_in"] += len(payload)
                out.append(payload)
            self._counters["gets"] += len(keys)
        return out

    def put_many(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], *, timeout: float | None = None
    ) -> None:
        if len(keys) != len(payloads):
            raise ValueError(f"payloads: {len(payloads)} for {len(keys)} keys")
        with self._lock:
            self._counters["put_calls"] += 1
            for k, p in zip(keys, payloads, strict=True):
                k = bytes(k)
                self._data[k] = bytes(p)
                self._data.move_to_end(k)
                self._counters["puts"] += 1
                self._counters["bytes_out"] += len(p)
            while self.capacity is not None and len(self._data) > self.capacity:
                self._data.popitem(last=False)
                self.evictions += 1

    def delete_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        with self._lock:
            return sum(self._data.pop(bytes(k), None) is not None for k in keys)
