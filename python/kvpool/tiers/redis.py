"""The shared remote KV tier on Redis / Valkey / Redis Cluster: ``RedisRemoteTier``.

A third tier behind ``kvpool.HierarchyBlockManagerPool(..., remote=tier)``: device, then host,
then a store shared by many serving instances. See docs/remote_tier.md; the keys and payloads
are ``kvpool.tiers.payload``'s, the interface ``kvpool.tiers.base.RemoteTier``.

Invariants
----------
- **Failures degrade to misses.** Every method raises ``RemoteTierError`` on I/O failure
  (counted: errors, timeouts). After a connection failure a ``RedisRemoteTier`` refuses calls
  for ``retry_interval_ms`` (counted: skipped), so a dead server costs the scheduler nothing;
  each call is bounded by its ``timeout``.
- **One round trip per request** for lookups (a single server: one ``EVALSHA`` of a read-only
  script running ``EXISTS`` per key; Redis Cluster: one pipelined ``EXISTS`` batch, which
  redis-py splits per node), one per plan for fetches (``MGET``) and writes (pipelined
  ``SET``); no ``KEYS`` / ``SCAN`` anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvpool._args import check_int
from kvpool.tiers.base import RemoteTier, RemoteTierError
from kvpool.tiers.payload import check_mac_key, key_prefix

__all__ = ["RedisRemoteTier"]

# Batched existence in one command on a single server (read-only; EVALSHA after the first call).
_EXISTS_LUA = (
    "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end "
    "return table.concat(r)"
)  # one bulk string of '0'/'1': cheap to send and parse


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

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        cluster: bool = False,
        timeout_ms: float = 1000.0,
        retry_interval_ms: float = 1000.0,
        ttl_s: int | None = None,
        mac_key: bytes | None = None,
    ) -> None:
        super().__init__()
        self.mac_key = check_mac_key(mac_key)
        try:
            import redis  # noqa: F401
        except ImportError as e:  # pragma: no cover - redis is a dependency of the extra
            raise ImportError(
                "kvpool.tiers.redis needs redis-py: pip install 'kvpool[remote]'"
            ) from e
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url: must be a redis:// URL, got {url!r}")
        if not isinstance(cluster, (bool, np.bool_)):
            raise TypeError(f"cluster: must be a bool, got {type(cluster).__name__}")
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms: must be > 0, got {timeout_ms!r}")
        if ttl_s is not None:
            check_int("ttl_s", ttl_s, low=1)
        self.url = url
        self.namespace = namespace
        self.prefix = key_prefix(namespace)
        self.cluster = bool(cluster)
        self.timeout_s = timeout_ms / 1000.0
        self.retry_interval_s = retry_interval_ms / 1000.0
        self.ttl_s = ttl_s
        self._clients: dict[float, Any] = {}
        self._down_until = 0.0

    def __repr__(self) -> str:
        return (
            f"RedisRemoteTier({self.url!r}, namespace={self.namespace!r}, cluster={self.cluster})"
        )

    # -- plumbing
    def _client(self, timeout: float | None) -> Any:
        t = self.timeout_s if timeout is None else float(timeout)
        with self._lock:
            client = self._clients.get(t)
            if client is None:
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                opts: dict[str, Any] = {
                    "socket_timeout": t,
                    "socket_connect_timeout": t,
                    "retry": Retry(NoBackoff(), 0),
                }
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

    def get_many(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> list[bytes | None]:
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

    def put_many(
        self, keys: Sequence[bytes], payloads: Sequence[bytes], *, timeout: float | None = None
    ) -> None:
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
