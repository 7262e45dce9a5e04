"""The shared remote KV tier (Redis / Valkey / Redis Cluster) and KV events on Redis Streams.

A third tier behind ``kvpool.HierarchyBlockManagerPool(..., remote=tier)``: device, then host,
then a store shared by many serving instances. See docs/remote_tier.md.

Invariants
----------
- **Keys** are the block's chained hash (R6, 16 bytes, as ``kvpool.hash_blocks`` returns)
  under a namespace digest of a user-supplied model/layout identifier (``make_namespace``):
  KV of another model, dtype, head layout, block size or rank layout never shares a key.
  Keys are not hash-tagged, so on Redis Cluster the blocks of one request spread over slots.
- **Payloads** are one block across all layers (K and V) with a header: magic, format version,
  the block spec (dtype and shape of every cache array) and an XXH3-64 checksum over key, spec
  and body. ``decode_payload`` returns None for anything that does not verify against the key
  and the spec the reader expects: a corrupt, truncated, foreign or mis-filed payload is a
  miss, never wrong KV. The checksum catches accidents, not forgeries: anyone who can write
  to the store can compute it. With a per-deployment secret (``mac_key``) payloads carry a
  keyed BLAKE2b tag as well, and a reader holding the key accepts only payloads tagged with
  it (format version 2; docs/remote_tier.md, "What the checksum protects").
- **Failures degrade to misses.** ``RemoteTier`` methods raise ``RemoteTierError`` on I/O
  failure (counted: errors, timeouts); the pool's lookup and ``RemoteTransfer`` catch every
  ``Exception`` and treat it as a miss (the request recomputes); a ``BaseException`` that is
  not an ``Exception`` (KeyboardInterrupt, SystemExit) propagates. A fetch fails block by
  block: a bad payload costs its own block (and the rest of its sequence's chain, which the
  pool cuts at the first missing block), never the other sequences' blocks of the plan. After a connection failure a
  ``RedisRemoteTier`` refuses calls for ``retry_interval_ms`` (counted: skipped), so a dead
  server costs the scheduler nothing; each call is bounded by its ``timeout``.
- **One round trip per request** for lookups (a single server: one ``EVALSHA`` of a read-only
  script running ``EXISTS`` per key; Redis Cluster: one pipelined ``EXISTS`` batch, which
  redis-py splits per node), one per plan for fetches (``MGET``) and writes (pipelined
  ``SET``); no ``KEYS`` / ``SCAN`` anywhere.
- Fetched blocks land in host *staging* blocks; the pool counts them only after
  ``complete_fetches`` reports which arrived (the leading run of each sequence's chain).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import xxhash

__all__ = [
    "HostBlockIO",
    "PrefixIndex",
    "RedisEventPublisher",
    "RedisRemoteTier",
    "RemoteTier",
    "RemoteTierError",
    "RemoteTransfer",
    "block_spec",
    "check_mac_key",
    "decode_payload",
    "event_from_dict",
    "encode_payload",
    "event_to_dict",
    "make_namespace",
    "read_events",
    "spec_nbytes",
]

MAGIC = b"KVPB"
FORMAT_VERSION = 1  # checksum only
FORMAT_VERSION_MAC = 2  # checksum, then a keyed BLAKE2b tag after the body
MAC_SIZE = 32
_HEADER = struct.Struct("<4sHHQQ")  # magic, version, spec length, body length, checksum
# Batched existence in one command on a single server (read-only; EVALSHA after the first call).
_EXISTS_LUA = ("local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end "
               "return table.concat(r)")  # one bulk string of '0'/'1': cheap to send and parse


class RemoteTierError(Exception):
    """A remote-tier call failed (connection, timeout, server error); callers treat it as a miss."""


# ---------------------------------------------------------------------------------- namespace
def make_namespace(model: str, *, dtype: str, num_kv_heads: int, head_dim: int, block_size: int,
                   num_layers: int, layout: str = "tp1:rank0", hash_seed: int | None = None) -> str:
    """The namespace identifier of a KV layout: blocks are shared only within one.

    Parameters
    ----------
    model : str
        Model name (and revision, if weights differ).
    dtype : str
        KV cache dtype, e.g. ``"float16"``.
    num_kv_heads, head_dim, block_size, num_layers : int
        Cache geometry of this rank.
    layout : str
        Rank layout, e.g. ``"tp2:rank1"`` (tensor-parallel shards hold different heads).
    hash_seed : int or None
        The pool's hash seed (different seeds never share anyway; included for clarity).

    Returns
    -------
    str
    """
    if not isinstance(model, str) or not model:
        raise ValueError("model: must be a non-empty str")
    for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("block_size", block_size), ("num_layers", num_layers)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}: must be an int > 0, got {v!r}")
    return (f"{model}|{dtype}|kvh{num_kv_heads}|hd{head_dim}|bs{block_size}|L{num_layers}|"
            f"{layout}|seed{hash_seed}")


def _key_prefix(namespace: str) -> bytes:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("namespace: must be a non-empty str (see make_namespace)")
    return b"kvpool:v1:" + xxhash.xxh3_64_hexdigest(namespace.encode()).encode() + b":"


# ---------------------------------------------------------------------------------- payloads
def block_spec(arrays: Sequence[Any]) -> str:
    """The spec string of one block of ``arrays`` (block axis first): dtype and block shape each."""
    return ";".join(f"{a.dtype}:{'x'.join(str(d) for d in a.shape[1:])}" for a in arrays)


def _checksum(key: bytes, spec: bytes, body: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(key)
    h.update(spec)
    h.update(body)
    return h.intdigest()


def check_mac_key(mac_key: bytes | None) -> bytes | None:
    """``mac_key`` validated: None, or 16 to 64 bytes of a per-deployment secret."""
    if mac_key is None:
        return None
    if not isinstance(mac_key, bytes | bytearray) or not 16 <= len(mac_key) <= 64:
        raise ValueError("mac_key: must be None or 16 to 64 bytes (a per-deployment secret)")
    return bytes(mac_key)


def _mac(mac_key: bytes, key: bytes, signed: bytes | memoryview) -> bytes:
    """Keyed BLAKE2b-256 of the block key and everything before the tag (header, spec, body)."""
    h = hashlib.blake2b(digest_size=MAC_SIZE, key=mac_key, person=b"kvpool-block")
    h.update(key)
    h.update(signed)
    return h.digest()


def encode_payload(key: bytes, spec: str, body: bytes | memoryview, *, mac_key: bytes | None = None) -> bytes:
    """Header plus ``body`` (one block of every cache array, concatenated) for ``key``.

    With ``mac_key`` (16 to 64 bytes, a per-deployment secret) the payload is format version 2:
    a keyed BLAKE2b tag over the key, header, spec and body follows the body.
    """
    mac_key = check_mac_key(mac_key)
    s = spec.encode()
    version = FORMAT_VERSION if mac_key is None else FORMAT_VERSION_MAC
    out = _HEADER.pack(MAGIC, version, len(s), len(body), _checksum(key, s, body)) + s + bytes(body)
    return out if mac_key is None else out + _mac(mac_key, key, out)


def decode_payload(key: bytes, spec: str, payload: bytes | None, body_len: int | None = None, *,
                   mac_key: bytes | None = None) -> memoryview | None:
    """The body of ``payload`` if it verifies for ``key`` and ``spec`` (and ``body_len``), else None.

    A reader with ``mac_key`` accepts only payloads tagged with that key (version 2): a payload
    someone without the key wrote (version 1, or a forged tag) is a miss. A reader without a key
    checks the checksum only, of either version.
    """
    if payload is None or len(payload) < _HEADER.size:
        return None
    magic, version, spec_len, blen, checksum = _HEADER.unpack_from(payload)
    s = spec.encode()
    if magic != MAGIC or version not in (FORMAT_VERSION, FORMAT_VERSION_MAC) or spec_len != len(s):
        return None
    if mac_key is not None and version != FORMAT_VERSION_MAC:
        return None
    tag = MAC_SIZE if version == FORMAT_VERSION_MAC else 0
    end = _HEADER.size + spec_len + blen
    if (body_len is not None and blen != body_len) or len(payload) != end + tag:
        return None
    view = memoryview(payload)
    if bytes(view[_HEADER.size:_HEADER.size + spec_len]) != s:
        return None
    body = view[_HEADER.size + spec_len:end]
    if _checksum(key, s, body) != checksum:
        return None
    if mac_key is not None and not hmac.compare_digest(_mac(mac_key, key, view[:end]), view[end:]):
        return None
    return body


def spec_nbytes(spec: str) -> int | None:
    """Bytes of one block body of ``spec`` (``block_spec``'s string), or None if a dtype is unknown."""
    import numpy as np

    total = 0
    for part in spec.split(";"):
        dtype, _, shape = part.rpartition(":")
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            return None
        for d in shape.split("x") if shape else ():
            size *= int(d)
        total += size
    return total


# ---------------------------------------------------------------------------------- tiers
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
            "errors": 0, "timeouts": 0, "skipped": 0, "corrupt": 0, "exists_calls": 0,
            "get_calls": 0, "put_calls": 0, "gets": 0, "get_hits": 0, "puts": 0,
            "bytes_in": 0, "bytes_out": 0}

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

    def get_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bytes | None]:
        """The payload of each key, None where missing (one round trip)."""
        raise NotImplementedError

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[bytes], *,
                 timeout: float | None = None) -> None:
        """Stores ``payloads[i]`` under ``keys[i]`` (one round trip)."""
        raise NotImplementedError

    def delete_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """Deletes the keys; returns how many existed."""
        raise NotImplementedError


class RedisRemoteTier(RemoteTier):
    """A remote tier on Redis / Valkey (one server) or Redis Cluster, through redis-py.

    Parameters
    ----------
    url : str
        ``redis://host:port/db`` (cluster: any node's ``redis://host:port``).
    namespace : str
        Model/layout identifier (``make_namespace``); keys of other namespaces are never read.
    cluster : bool
        Use ``redis.cluster.RedisCluster`` (multi-key calls are split per slot by redis-py).
    timeout_ms : float
        Default socket and connect timeout of a call.
    retry_interval_ms : float
        After a connection failure or timeout, calls fail fast (``skipped``) for this long.
    ttl_s : int or None
        Expiry of stored blocks (None: none; let ``maxmemory-policy allkeys-lru`` evict).
    mac_key : bytes or None
        Per-deployment secret (16 to 64 bytes) of a shared store: payloads are written with a
        keyed BLAKE2b tag and only payloads tagged with this key are read (others are misses).
    """

    def __init__(self, url: str, namespace: str, *, cluster: bool = False, timeout_ms: float = 1000.0,
                 retry_interval_ms: float = 1000.0, ttl_s: int | None = None,
                 mac_key: bytes | None = None) -> None:
        super().__init__()
        self.mac_key = check_mac_key(mac_key)
        try:
            import redis  # noqa: F401
        except ImportError as e:  # pragma: no cover - redis is a dependency of the extra
            raise ImportError("kvpool.remote needs redis-py: pip install 'kvpool[remote]'") from e
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url: must be a redis:// URL, got {url!r}")
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms: must be > 0, got {timeout_ms!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ValueError(f"ttl_s: must be an int > 0 or None, got {ttl_s!r}")
        self.url = url
        self.namespace = namespace
        self.prefix = _key_prefix(namespace)
        self.cluster = bool(cluster)
        self.timeout_s = timeout_ms / 1000.0
        self.retry_interval_s = retry_interval_ms / 1000.0
        self.ttl_s = ttl_s
        self._clients: dict[float, Any] = {}
        self._down_until = 0.0

    def __repr__(self) -> str:
        return f"RedisRemoteTier({self.url!r}, namespace={self.namespace!r}, cluster={self.cluster})"

    # -- plumbing
    def _client(self, timeout: float | None) -> Any:
        t = self.timeout_s if timeout is None else float(timeout)
        with self._lock:
            client = self._clients.get(t)
            if client is None:
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                opts: dict[str, Any] = {"socket_timeout": t, "socket_connect_timeout": t,
                                        "retry": Retry(NoBackoff(), 0)}
                if self.cluster:
                    from redis.cluster import RedisCluster

                    client = RedisCluster.from_url(self.url, **opts)
                else:
                    import redis

                    client = redis.Redis.from_url(self.url, retry_on_timeout=False, **opts)
                self._clients[t] = client
            return client

    def _call(self, what: str, fn: Any, timeout: float | None) -> Any:
        import redis

        if time.monotonic() < self._down_until:
            self.note("skipped")
            raise RemoteTierError(f"{what}: remote tier marked down after a failure")
        try:
            return fn(self._client(timeout))
        except redis.exceptions.TimeoutError as e:
            self.note("timeouts")
            self._down_until = time.monotonic() + self.retry_interval_s
            raise RemoteTierError(f"{what}: timed out ({e})") from e
        except (redis.exceptions.ConnectionError, OSError) as e:
            self.note("errors")
            self._down_until = time.monotonic() + self.retry_interval_s
            with self._lock:  # drop pooled sockets of the dead server
                clients, self._clients = self._clients, {}
            for c in clients.values():
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing a dead client
                    pass
            raise RemoteTierError(f"{what}: connection failed ({e})") from e
        except redis.exceptions.RedisError as e:
            self.note("errors")
            raise RemoteTierError(f"{what}: {e}") from e

    def _exists_script(self, client: Any) -> Any:
        script = getattr(client, "_kvpool_exists", None)
        if script is None:
            script = client.register_script(_EXISTS_LUA)
            client._kvpool_exists = script
        return script

    def _keys(self, keys: Iterable[bytes]) -> list[bytes]:
        out = []
        for i, k in enumerate(keys):
            if not isinstance(k, bytes | bytearray) or len(k) != 16:
                raise ValueError(f"keys[{i}]: must be 16 bytes (a kvpool.hash_blocks hash)")
            out.append(self.prefix + bytes(k))
        return out

    # -- interface
    def exists_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        full = self._keys(keys)
        if not full:
            return []
        self.note("exists_calls")

        def run(c: Any) -> list[bool]:
            if not self.cluster:  # one command, one array reply (a pipeline costs per key)
                reply = self._exists_script(c)(keys=full)
                if isinstance(reply, str):  # a client made with decode_responses=True
                    reply = reply.encode()
                return [flag == 49 for flag in reply]  # b"1" per stored key
            pipe = c.pipeline(transaction=False)
            for k in full:
                pipe.exists(k)
            return [bool(x) for x in pipe.execute()]

        return self._call("exists_many", run, timeout)

    def get_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bytes | None]:
        full = self._keys(keys)
        if not full:
            return []
        self.note("get_calls")

        def run(c: Any) -> list[bytes | None]:
            return list(c.mget_nonatomic(full) if self.cluster else c.mget(full))

        out = self._call("get_many", run, timeout)
        got = [p for p in out if p is not None]
        self.note("gets", len(full))
        self.note("get_hits", len(got))
        self.note("bytes_in", sum(len(p) for p in got))
        return out

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[bytes], *,
                 timeout: float | None = None) -> None:
        full = self._keys(keys)
        if len(full) != len(payloads):
            raise ValueError(f"payloads: {len(payloads)} payloads for {len(full)} keys")
        if not full:
            return
        self.note("put_calls")

        def run(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for k, p in zip(full, payloads, strict=True):
                pipe.set(k, p, ex=self.ttl_s)
            pipe.execute()

        self._call("put_many", run, timeout)
        self.note("puts", len(full))
        self.note("bytes_out", sum(len(p) for p in payloads))

    def delete_many(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        full = self._keys(keys)
        if not full:
            return 0

        def run(c: Any) -> int:
            pipe = c.pipeline(transaction=False)
            for k in full:
                pipe.delete(k)
            return int(sum(pipe.execute()))

        return self._call("delete_many", run, timeout)

    def close(self) -> None:
        """Closes the connections."""
        with self._lock:
            clients, self._clients = self._clients, {}
        for c in clients.values():
            c.close()


# ---------------------------------------------------------------------------------- transfers
class HostBlockIO(Protocol):
    """Reads and writes whole host blocks of one rank as bytes (all cache arrays of a block)."""

    def host_block_spec(self, rank: int) -> str: ...

    # Optional: ``def host_block_nbytes(self, rank: int) -> int`` (else derived from the spec).

    def read_host_blocks(self, rank: int, ids: Sequence[int]) -> list[bytes]: ...

    def write_host_blocks(self, rank: int, ids: Sequence[int], bodies: Sequence[memoryview]) -> None: ...


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
        Host block access (``kvpool.transfer`` executors implement it).
    """

    def __init__(self, pool: Any, io: HostBlockIO) -> None:
        tier = getattr(pool, "remote", None)
        if tier is None:
            raise ValueError("pool: has no remote tier (HierarchyBlockManagerPool(..., remote=...))")
        self.pool = pool
        self.tier = tier
        self.io = io
        self.policy = pool.remote_policy
        self._unsent: dict[int, dict[int, bytes]] = {}  # rank -> host id -> key (on_host_evict)

    # -- writes
    def _send(self, rank: int, ids: Sequence[int], keys: Sequence[bytes], skip_existing: bool) -> int:
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
            self.tier.put_many(keys, [encode_payload(k, spec, b, mac_key=mac_key)
                                      for k, b in zip(keys, bodies, strict=True)])
            self.pool.record_remote_events(rank, "stored", list(keys))  # issue 21: medium "remote"
            return len(ids)
        except Exception:  # noqa: BLE001 - a failed write is a lost cache entry, never an error
            return 0

    def before_host_writes(self, plans: Iterable[Any]) -> int:
        """``on_host_evict``: sends the unsent blocks the plans' host destinations will overwrite."""
        if self.policy != "on_host_evict":
            return 0
        sent = 0
        for p in plans:
            unsent = self._unsent.get(int(p.dp_rank))
            if not unsent:
                continue
            victims = [(int(i), unsent.pop(int(i))) for i in p.dst if int(i) in unsent]
            if victims:
                sent += self._send(int(p.dp_rank), [i for i, _ in victims], [k for _, k in victims], True)
        return sent

    def after_offloads(self, plans: Iterable[Any]) -> int:
        """After ``complete_offloads``: write-through, or remember the blocks (``on_host_evict``)."""
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
        arrived = [self._fetch(int(p.dp_rank), [int(i) for i in p.dst], list(p.keys)) for p in plans]
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
        if gone:  # issue 21: the tier no longer holds them (evicted, expired): "removed" events
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


# ---------------------------------------------------------------------------------- KV events
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
    """The ``KVIndex.apply`` form (docs/events.md) of an ``event_to_dict`` dict: hex back to bytes."""
    out = dict(d)
    out["block_hashes"] = [bytes.fromhex(h) for h in d.get("block_hashes", ())]
    for key in ("parent_hash", "extra_key"):
        out[key] = None if d.get(key) is None else bytes.fromhex(d[key])
    return out


class PrefixIndex:
    """Which (instance, dp rank) holds which block hash on its device: a small router view,
    rebuilt from events (``kvpool.KVIndex`` is the full one: every medium, group and rank).

    ``stored`` adds the hashes, ``removed`` drops them, ``cleared`` drops everything of that
    instance and rank; events of the host and remote media are not the device's and are skipped.
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
            for group in self.groups.get(holder, {}).values():
                group[3].clear()
            return
        if kind not in ("stored", "removed"):
            raise ValueError(f"event: unknown kind {kind!r}")
        group = int(event.get("group") or 0)
        if group != 0:
            known = self.groups.setdefault(holder, {})
            entry = known.get(group)
            if entry is None or kind == "stored":
                window = event.get("sliding_window")
                held = set() if entry is None else entry[3]
                entry = known[group] = (event.get("group_kind") or "full_attention",
                                        None if window is None else int(window), int(event["block_size"]), held)
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
        """The holder with the longest prefix of ``hashes`` (a request's chain) all its groups admit, and its length."""
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

    def __init__(self, url: str, instance_id: str, *, stream: str = "kvpool:events",
                 maxlen: int = 100_000, timeout_ms: float = 1000.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not instance_id or not isinstance(instance_id, str):
            raise ValueError("instance_id: must be a non-empty str")
        if not isinstance(maxlen, int) or maxlen <= 0:
            raise ValueError(f"maxlen: must be an int > 0, got {maxlen!r}")
        t = timeout_ms / 1000.0
        self.client = redis.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t,
                                           retry=Retry(NoBackoff(), 0))
        self.instance_id = instance_id
        self.stream = stream
        self.maxlen = maxlen
        self.published = 0
        self.errors = 0

    def publish(self, events: Iterable[Any]) -> bytes | None:
        """XADDs one entry holding ``events`` (``kvpool.KVEvent`` or dicts); returns its id."""
        batch = [e if isinstance(e, dict) else event_to_dict(e) for e in events]
        if not batch:
            return None
        try:
            entry_id = self.client.xadd(
                self.stream, {"instance": self.instance_id, "events": json.dumps(batch)},
                maxlen=self.maxlen, approximate=True)
        except Exception:  # noqa: BLE001 - events are advisory; the router catches up later
            self.errors += 1
            return None
        self.published += len(batch)
        return entry_id

    def close(self) -> None:
        self.client.close()


def read_events(url: str, *, stream: str = "kvpool:events", index: PrefixIndex | None = None,
                last_id: bytes | str = "0", count: int = 1000, max_entries: int = 1_000_000,
                timeout_ms: float = 1000.0, kv_index: Any = None,
                instance_ids: dict[str, int] | None = None) -> tuple[PrefixIndex, bytes | str]:
    """Replays a stream into a ``PrefixIndex`` (new or ``index``) from after ``last_id``.

    Reads in pages of ``count`` entries (XRANGE) until the end or ``max_entries``; returns the
    index and the last id read (pass it back to continue later). With ``kv_index`` (a
    ``kvpool.KVIndex``) every entry's events are applied to it as well, the instance named by
    ``instance_ids`` (instance name -> int id; new names get the next free id, added to it).
    """
    ids = instance_ids if instance_ids is not None else {}
    import redis

    t = timeout_ms / 1000.0
    client = redis.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t)
    index = index if index is not None else PrefixIndex()
    seen = 0
    try:
        while seen < max_entries:
            start = "-" if last_id in ("0", b"0") else b"(" + (last_id if isinstance(last_id, bytes) else last_id.encode())
            page = client.xrange(stream, min=start, max="+", count=min(count, max_entries - seen))
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
