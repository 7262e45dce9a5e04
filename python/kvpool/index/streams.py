"""KV events on Redis Streams, and ``PrefixIndex``, a small router view built from them.

``RedisEventPublisher`` publishes a pool's KV events (R21, docs/events.md) to a stream, one
bounded ``XADD`` per batch; ``read_events`` replays a stream into a ``PrefixIndex`` and, if
given, a ``kvpool.KVIndex``. Events travel as JSON (``event_to_dict``: hashes as hex).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool._args import check_int

__all__ = ["PrefixIndex", "RedisEventPublisher", "event_from_dict", "event_to_dict", "read_events"]


def event_to_dict(event: Any) -> dict[str, Any]:
    """A JSON-able dict of a ``kvpool.KVEvent`` (R21, every field of docs/events.md): hashes as
    hex (``event_from_dict`` turns it back into the index's form)."""
    parent = event.parent_hash
    extra = event.extra_key
    return {
        "sequence": getattr(event, "sequence", None),
        "kind": str(event.kind),
        "medium": getattr(event, "medium", "device"),
        "group": getattr(event, "group", 0),
        "group_kind": getattr(event, "group_kind", "full_attention"),
        "sliding_window": getattr(event, "sliding_window", None),
        "block_hashes": [bytes(h).hex() for h in event.block_hashes],
        "parent_hash": None if parent is None else bytes(parent).hex(),
        "token_ids": list(event.token_ids),
        "block_size": int(event.block_size),
        "dp_rank": int(event.dp_rank),
        "extra_key": None if extra is None else bytes(extra).hex(),
    }


def event_from_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The ``KVIndex.apply`` form (docs/events.md) of an ``event_to_dict`` dict (hex to bytes)."""
    out = dict(d)
    out["block_hashes"] = [bytes.fromhex(h) for h in d.get("block_hashes", ())]
    for key in ("parent_hash", "extra_key"):
        out[key] = None if d.get(key) is None else bytes.fromhex(d[key])
    return out


class PrefixIndex:
    """Which (instance, dp rank) holds which block hash on its device: a small router view,
    rebuilt from events (``kvpool.KVIndex`` is the full one: every medium, group and rank).

    ``stored`` adds the hashes, ``removed`` drops them, ``cleared`` drops everything of that
    instance and rank, ``group`` registers a group holding nothing yet; events of the host and
    remote media are not the device's and are skipped.
    Each KV-cache group is kept apart: ``holders`` and ``snapshot`` are the full-attention group
    (0); ``best_holder`` credits a holder with the longest prefix every one of its groups admits
    (docs/events.md): full attention its leading run, a sliding window of ``w`` tokens the blocks
    holding the ``w - 1`` tokens before the boundary, a linear state a checkpoint under the hash
    of the boundary's last block.
    """

    def __init__(self) -> None:
        self.holders: dict[str, set[tuple[str, int]]] = {}
        self.by_holder: dict[tuple[str, int], set[str]] = {}
        # holder -> group (not 0) -> (group_kind, sliding_window, block_size, hashes)
        self.groups: dict[tuple[str, int], dict[int, tuple[str, int | None, int, set[str]]]] = {}

    def apply(self, instance: str, event: dict[str, Any]) -> None:
        """Applies one event (``event_to_dict`` form) of ``instance``."""
        if event.get("medium", "device") != "device":
            return
        holder = (instance, int(event["dp_rank"]))
        kind = event["kind"]
        if kind == "cleared":
            self._drop(holder, self.by_holder.get(holder, set()))
            self.by_holder.pop(holder, None)
            for state in self.groups.get(holder, {}).values():
                state[3].clear()
            return
        if kind not in ("stored", "removed", "group"):
            raise ValueError(f"event: unknown kind {kind!r}")
        group = int(event.get("group") or 0)
        if kind == "group":  # a group announced up front: it holds nothing yet
            if group != 0 and group not in self.groups.get(holder, {}):
                window = event.get("sliding_window")
                self.groups.setdefault(holder, {})[group] = (
                    event.get("group_kind") or "full_attention",
                    None if window is None else int(window),
                    int(event["block_size"]),
                    set(),
                )
            return
        if group != 0:
            known = self.groups.setdefault(holder, {})
            entry = known.get(group)
            if entry is None or kind == "stored":
                window = event.get("sliding_window")
                held = set() if entry is None else entry[3]
                entry = known[group] = (
                    event.get("group_kind") or "full_attention",
                    None if window is None else int(window),
                    int(event["block_size"]),
                    held,
                )
            if kind == "stored":
                entry[3].update(event["block_hashes"])
            else:
                entry[3].difference_update(event["block_hashes"])
            return
        held = self.by_holder.setdefault(holder, set())
        if kind == "stored":
            for h in event["block_hashes"]:
                held.add(h)
                self.holders.setdefault(h, set()).add(holder)
        else:
            self._drop(holder, [h for h in event["block_hashes"] if h in held])
            held.difference_update(event["block_hashes"])

    def _drop(self, holder: tuple[str, int], hashes: Any) -> None:
        for h in hashes:
            s = self.holders.get(h)
            if s is not None:
                s.discard(holder)
                if not s:
                    del self.holders[h]

    def admits(self, holder: tuple[str, int], hashes: Sequence[str], n: int) -> int:
        """The largest ``m <= n`` every group of ``holder`` besides full attention admits for the
        chain ``hashes`` (hex), whose leading ``n`` blocks its full-attention group holds."""
        groups = self.groups.get(holder, {})

        def admitted(m: int) -> bool:
            for kind, window, block_size, held in groups.values():
                if kind == "sliding_window" and window is not None:
                    first = max(0, m * block_size - (window - 1)) // block_size
                    if any(hashes[i] not in held for i in range(first, m)):
                        return False
                elif kind == "linear_state" and m > 0 and hashes[m - 1] not in held:
                    return False
                elif kind == "full_attention" and any(h not in held for h in hashes[:m]):
                    return False
            return True

        return next(m for m in range(n, -1, -1) if admitted(m))

    def snapshot(self) -> dict[tuple[str, int], frozenset[str]]:
        """Holder -> hashes it holds (holders with none left out)."""
        return {k: frozenset(v) for k, v in self.by_holder.items() if v}

    def best_holder(self, hashes: Sequence[bytes]) -> tuple[tuple[str, int] | None, int]:
        """The holder with the longest prefix of ``hashes`` (a request's chain) all its groups
        admit, and its length."""
        best: tuple[str, int] | None = None
        best_n = 0
        chain = [bytes(h).hex() for h in hashes]
        candidates = set(self.holders.get(chain[0], ())) if chain else set()
        for holder in sorted(candidates):
            held = self.by_holder[holder]
            n = 0
            for h in chain:
                if h not in held:
                    break
                n += 1
            n = self.admits(holder, chain, n)
            if n > best_n:
                best, best_n = holder, n
        return best, best_n


class RedisEventPublisher:
    """Publishes a pool's KV events (R21) to a Redis Stream: one bounded XADD per batch.

    Parameters
    ----------
    url : str
        ``redis://`` URL of the broker.
    instance_id : str
        Name of this serving instance in the index routers build.
    stream : str
        Stream key.
    maxlen : int
        Approximate bound of the stream length (``XADD ... MAXLEN ~ maxlen``).
    timeout_ms : float
        Socket timeout; a failed publish is counted in ``errors`` and dropped.
    """

    def __init__(
        self,
        url: str,
        instance_id: str,
        *,
        stream: str = "kvpool:events",
        maxlen: int = 100_000,
        timeout_ms: float = 1000.0,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not instance_id or not isinstance(instance_id, str):
            raise ValueError("instance_id: must be a non-empty str")
        check_int("maxlen", maxlen, low=1)
        t = timeout_ms / 1000.0
        self.client = redis.Redis.from_url(
            url, socket_timeout=t, socket_connect_timeout=t, retry=Retry(NoBackoff(), 0)
        )
        self.instance_id = instance_id
        self.stream = stream
        self.maxlen = maxlen
        self.published = 0
        self.errors = 0

    def publish(self, events: Iterable[Any]) -> bytes | str | None:
        """XADDs one entry holding ``events`` (``kvpool.KVEvent`` or dicts); returns its id."""
        batch = [e if isinstance(e, dict) else event_to_dict(e) for e in events]
        if not batch:
            return None
        try:
            entry_id = self.client.xadd(
                self.stream,
                {"instance": self.instance_id, "events": json.dumps(batch)},
                maxlen=self.maxlen,
                approximate=True,
            )
        except Exception:  # noqa: BLE001 - events are advisory; the router catches up later
            self.errors += 1
            return None
        self.published += len(batch)
        return entry_id

    def close(self) -> None:
        self.client.close()


def read_events(
    url: str,
    *,
    stream: str = "kvpool:events",
    index: PrefixIndex | None = None,
    last_id: bytes | str = "0",
    count: int = 1000,
    max_entries: int = 1_000_000,
    timeout_ms: float = 1000.0,
    kv_index: Any = None,
    instance_ids: dict[str, int] | None = None,
) -> tuple[PrefixIndex, bytes | str]:
    """Replays a stream into a ``PrefixIndex`` (new or ``index``) from after ``last_id``.

    Reads in pages of ``count`` entries (XRANGE) until the end or ``max_entries``; returns the
    index and the last id read (pass it back to continue later). With ``kv_index`` (a
    ``kvpool.KVIndex``) every entry's events are applied to it as well, the instance named by
    ``instance_ids`` (instance name -> int id; new names get the next free id, added to it).
    """
    check_int("count", count, low=1)
    check_int("max_entries", max_entries, low=0)
    ids = instance_ids if instance_ids is not None else {}
    import redis

    t = timeout_ms / 1000.0
    client = redis.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t)
    index = index if index is not None else PrefixIndex()
    seen = 0
    try:
        while seen < max_entries:
            start = (
                "-"
                if last_id in ("0", b"0")
                else b"(" + (last_id if isinstance(last_id, bytes) else last_id.encode())
            )
            page: Any = client.xrange(
                stream, min=start, max="+", count=min(count, max_entries - seen)
            )
            if not page:
                break
            for entry_id, fields in page:
                instance = fields[b"instance"].decode()
                batch = json.loads(fields[b"events"])
                for ev in batch:
                    index.apply(instance, ev)
                if kv_index is not None:
                    number = ids.setdefault(instance, max(ids.values(), default=-1) + 1)
                    kv_index.apply(number, [event_from_dict(ev) for ev in batch])
                last_id = entry_id
            seen += len(page)
    finally:
        client.close()
    return index, last_id
