"""A real redis-server on loopback for the remote-tier tests (issue 10): never a mock.

``RedisServer`` starts ``redis-server`` on a free 127.0.0.1 port with no persistence, waits
(bounded) until it answers PING, and stops it. The binary must be installed (Debian:
``apt-get install -y redis-server``; ``make deps`` / .ci/run do it); a missing binary fails the
tests rather than skipping them.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1 (``url``); ``kill()`` / ``start()`` for failure tests."""

    def __init__(self, port: int | None = None, extra: list[str] | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install -y redis-server "
                               "(the remote-tier tests need a real server)")
        self.port = port or free_port()
        self.extra = extra or []
        self.dir = tempfile.mkdtemp(prefix="kvpool-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--daemonize", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
