"""The remote side of a hierarchy pool's transfer plans: fetches into host blocks, writes out.

``RemoteTransfer`` runs it over a ``HostBlockIO`` (the executors of
``kvpool.tiers.host_transfer`` implement it); the tier is the pool's ``remote``
(``kvpool.tiers.base.RemoteTier``), the payloads ``kvpool.tiers.payload``'s.

Invariants
----------
- **Failures degrade to misses.** Every ``Exception`` of the tier or of host block access is a
  miss (the request recomputes); a ``BaseException`` that is not an ``Exception``
  (KeyboardInterrupt, SystemExit) propagates. A fetch fails block by block: a bad payload costs
  its own block (and the rest of its sequence's chain, which the pool cuts at the first missing
  block), never the other sequences' blocks of the plan.
- Fetched blocks land in host *staging* blocks; the pool counts them only after
  ``complete_fetches`` reports which arrived (the leading run of each sequence's chain).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvpool.tiers.payload import decode_payload, encode_payload, spec_nbytes

__all__ = ["HostBlockIO", "RemoteTransfer"]


class HostBlockIO(Protocol):
    """Reads and writes whole host blocks of one rank as bytes (all cache arrays of a block)."""

    def host_block_spec(self, rank: int) -> str: ...

    # Optional: ``def host_block_nbytes(self, rank: int) -> int`` (else derived from the spec).

    def read_host_blocks(self, rank: int, ids: Sequence[int]) -> list[bytes]: ...

    def write_host_blocks(
        self, rank: int, ids: Sequence[int], bodies: Sequence[memoryview]
    ) -> None: ...


class RemoteTransfer:
    """Runs the remote side of a hierarchy pool's plans: fetches and writes to the remote tier.

    ``pool.remote`` is the tier, ``pool.remote_policy`` the write policy:

    - ``"write_through"``: after ``complete_offloads``, the offloaded host blocks are sent
      (``exists_many`` first, so blocks already stored are not sent again);
    - ``"on_host_evict"``: offloaded blocks are remembered per host id and sent just before a
      plan overwrites that host block (host eviction), and by ``flush()``.

    Every failure is a miss: fetches that fail are reported with ``complete_fetches`` /
    ``fail_fetches`` (the sequence recomputes), writes that fail are dropped (counted by the tier).

    Parameters
    ----------
    pool : kvpool.HierarchyBlockManagerPool
    io : HostBlockIO
        Host block access (``kvpool.tiers.host_transfer`` executors implement it).
    """

    def __init__(self, pool: Any, io: HostBlockIO) -> None:
        tier = getattr(pool, "remote", None)
        if tier is None:
            raise ValueError(
                "pool: has no remote tier (HierarchyBlockManagerPool(..., remote=...))"
            )
        self.pool = pool
        self.tier = tier
        self.io = io
        self.policy = pool.remote_policy
        self._unsent: dict[int, dict[int, bytes]] = {}  # rank -> host id -> key (on_host_evict)

    # -- writes
    def _send(
        self, rank: int, ids: Sequence[int], keys: Sequence[bytes], skip_existing: bool
    ) -> int:
        if not ids:
            return 0
        try:
            if skip_existing:
                there = self.tier.exists_many(keys)
                pick = [i for i, t in enumerate(there) if not t]
                ids = [ids[i] for i in pick]
                keys = [keys[i] for i in pick]
                if not ids:
                    return 0
            spec = self.io.host_block_spec(rank)
            bodies = self.io.read_host_blocks(rank, ids)
            mac_key = getattr(self.tier, "mac_key", None)
            self.tier.put_many(
                keys,
                [
                    encode_payload(k, spec, b, mac_key=mac_key)
                    for k, b in zip(keys, bodies, strict=True)
                ],
            )
            self.pool.record_remote_events(
                rank, "stored", list(keys)
            )  # medium "remote" (docs/events.md)
            return len(ids)
        except Exception:  # noqa: BLE001 - a failed write is a lost cache entry, never an error
            return 0

    def before_host_writes(self, plans: Iterable[Any]) -> int:
        """``on_host_evict``: sends the unsent blocks that the plans' host writes overwrite."""
        if self.policy != "on_host_evict":
            return 0
        sent = 0
        for p in plans:
            unsent = self._unsent.get(int(p.dp_rank))
            if not unsent:
                continue
            victims = [(int(i), unsent.pop(int(i))) for i in p.dst if int(i) in unsent]
            if victims:
                sent += self._send(
                    int(p.dp_rank), [i for i, _ in victims], [k for _, k in victims], True
                )
        return sent

    def after_offloads(self, plans: Iterable[Any]) -> int:
        """After ``complete_offloads``: write through, or keep the blocks for ``on_host_evict``."""
        sent = 0
        for p in plans:
            rank, ids, keys = int(p.dp_rank), [int(i) for i in p.dst], list(p.keys)
            if self.policy == "on_host_evict":
                self._unsent.setdefault(rank, {}).update(zip(ids, keys, strict=True))
            else:
                sent += self._send(rank, ids, keys, True)
        return sent

    def flush(self) -> int:
        """``on_host_evict``: sends every block still unsent (e.g. at shutdown)."""
        sent = 0
        for rank, unsent in self._unsent.items():
            items = list(unsent.items())
            unsent.clear()
            sent += self._send(rank, [i for i, _ in items], [k for _, k in items], True)
        return sent

    # -- fetches
    def run_fetches(self, plans: Iterable[Any]) -> int:
        """Gets, verifies and writes the fetched blocks into host staging blocks, then reports
        what arrived to the pool (``complete_fetches``). Returns the blocks that arrived.

        Per block (F11): a plan holds the fetched blocks of several sequences, so a missing,
        corrupt, forged or wrong-sized payload fails only its own block; ``complete_fetches``
        then keeps each sequence's leading run of arrived blocks (its chain stops at the first
        failure) and the other sequences keep their hits. Only a failed ``get_many`` fails the
        whole plan.
        """
        plans = list(plans)
        if not plans:
            return 0
        self.before_host_writes(plans)
        arrived = [
            self._fetch(int(p.dp_rank), [int(i) for i in p.dst], list(p.keys)) for p in plans
        ]
        self.pool.complete_fetches(plans, arrived)
        return sum(sum(a) for a in arrived)

    def _block_nbytes(self, rank: int, spec: str) -> int | None:
        size = getattr(self.io, "host_block_nbytes", None)
        return int(size(rank)) if size is not None else spec_nbytes(spec)

    def _fetch(self, rank: int, ids: list[int], keys: list[bytes]) -> list[bool]:
        """Fetches one plan's blocks into host ids ``ids``; which arrived intact."""
        ok = [False] * len(ids)
        try:
            payloads = list(self.tier.get_many(keys))
            spec = self.io.host_block_spec(rank)
            nbytes = self._block_nbytes(rank, spec)
        except Exception:  # noqa: BLE001 - a failed fetch is a miss
            return ok
        if len(payloads) != len(keys):
            self.tier.note("corrupt")
            return ok
        mac_key = getattr(self.tier, "mac_key", None)
        good: list[tuple[int, memoryview]] = []
        gone: list[bytes] = []
        for j, (k, payload) in enumerate(zip(keys, payloads, strict=True)):
            body = decode_payload(k, spec, payload, nbytes, mac_key=mac_key)
            if body is None:
                if payload is not None:
                    self.tier.note("corrupt")
                else:
                    gone.append(k)
                continue  # this block fails; the pool cuts its sequence's chain here
            good.append((j, body))
        if (
            gone
        ):  # the tier no longer holds them (evicted, expired): "removed" events (docs/events.md)
            self.pool.record_remote_events(rank, "removed", gone)
        if not good:
            return ok
        try:
            self.io.write_host_blocks(rank, [ids[j] for j, _ in good], [b for _, b in good])
            for j, _ in good:
                ok[j] = True
        except Exception:  # noqa: BLE001 - retry block by block: only the bad ones fail
            for j, body in good:
                try:
                    self.io.write_host_blocks(rank, [ids[j]], [body])
                    ok[j] = True
                except Exception:  # noqa: BLE001 - a block that cannot be written is a miss
                    self.tier.note("corrupt")
        return ok
