"""A real redis-server on loopback for the remote-tier tests: never a mock.

``RedisServer`` starts ``redis-server`` on a free 127.0.0.1 port with no persistence, waits
(bounded) until it answers PING, and stops it. The binary must be installed (Debian:
``apt-get install -y redis-server``; ``make deps`` / .ci/run do it); a missing binary fails the
tests rather than skipping them.

``RedisClusterServers`` starts three such servers in cluster mode and joins them with
``redis-cli --cluster create`` (redis-cli comes with the same package); the fixtures
``redis_cluster_servers`` (one cluster per module) and ``redis_cluster`` (that cluster, emptied
before each test) are imported into the test modules that use them (as ``*_fixture``).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free too, not in ``taken``."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


class RedisServer:
    """One redis-server process on 127.0.0.1 (``url``); ``kill()`` / ``start()`` for failure tests."""

    def __init__(self, port: int | None = None, extra: list[str] | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError(
                "redis-server is not installed: apt-get install -y redis-server "
                "(the remote-tier tests need a real server)"
            )
        self.port = port or free_port()
        self.extra = extra or []
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--daemonize",
                "no",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("redis-server did not answer PING in time")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.resume()
            except ProcessLookupError:
                pass
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """A 3-master Redis Cluster on 127.0.0.1 (no replicas), for the cluster code path.

    Each node is a ``RedisServer`` with ``--cluster-enabled yes`` in its own temp dir (its
    ``nodes-PORT.conf`` there); ``start()`` joins them with ``redis-cli --cluster create`` and
    waits (bounded) until every node reports ``cluster_state:ok``. ``url`` is any node's URL
    (redis-py discovers the others); ``stop()`` kills every node and removes the temp dirs.
    """

    def __init__(self, n: int = 3) -> None:
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            raise RuntimeError(
                "redis-cli is not installed (it comes with Debian's redis-server package)"
            )
        self.nodes: list[RedisServer] = []
        taken: set[int] = set()
        for _ in range(n):
            node = RedisServer(free_cluster_port(taken))
            taken |= {node.port, node.port + 10000}
            node.extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"{node.dir}/nodes-{node.port}.conf",
                "--cluster-node-timeout",
                "5000",
            ]
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _cli(self, port: int, *args: str, timeout_s: float = 10.0) -> str:
        out = subprocess.run(
            [self.cli, "-h", "127.0.0.1", "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        return out.stdout + out.stderr

    def start(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
            out = subprocess.run(
                [
                    self.cli,
                    "--cluster",
                    "create",
                    *addrs,
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
            while True:
                states = [
                    self._cli(node.port, "cluster", "info", timeout_s=5.0) for node in self.nodes
                ]
                if all("cluster_state:ok" in s for s in states):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster not ok after {timeout_s} s: {states}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def flushall(self) -> None:
        """Deletes every key on every node (each node holds only its own slots)."""
        for node in self.nodes:
            out = self._cli(node.port, "flushall")
            if "OK" not in out:
                raise RuntimeError(f"FLUSHALL on 127.0.0.1:{node.port} failed: {out}")

    def slot_owners(self, keys: list[bytes]) -> set[int]:
        """The ports of the nodes owning ``keys`` (CLUSTER KEYSLOT + CLUSTER SLOTS)."""
        import redis

        c = redis.Redis(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5)
        try:
            ranges = c.execute_command("CLUSTER", "SLOTS")
            owners = set()
            for k in keys:
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", k))
                for r in ranges:
                    if int(r[0]) <= slot <= int(r[1]):
                        owners.add(int(r[2][1]))
            return owners
        finally:
            c.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture(scope="module", name="redis_cluster_servers")
def redis_cluster_servers_fixture() -> Iterator[RedisClusterServers]:
    """A 3-node Redis Cluster on loopback shared by the tests of one module; every node is
    killed at the end of the module."""
    cluster = RedisClusterServers()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(name="redis_cluster")
def redis_cluster_fixture(redis_cluster_servers: RedisClusterServers) -> RedisClusterServers:
    """``redis_cluster_servers``, emptied (FLUSHALL on every node) before the test."""
    redis_cluster_servers.flushall()
    return redis_cluster_servers
