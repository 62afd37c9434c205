"""A throwaway ``redis-server`` for tests: free port, no persistence, stopped by PID.

Plain helpers, no fixtures (``tests/integration/conftest.py`` builds those)::

    server = RedisServer()
    try:
        link = RedisLink(RedisConfig(url=server.url))
        ...
        server.stop()    # Redis goes away: the link falls back
        server.start()   # and comes back on the same port
    finally:
        server.stop()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.conftest import free_port

#: Seconds to wait for a started server to answer PING before failing loudly.
STARTUP_TIMEOUT = 10.0


def redis_available() -> str | None:
    """Path of the ``redis-server`` executable, or None when it is not installed."""
    return shutil.which("redis-server")


def ping(port: int, timeout: float = 0.5) -> bool:
    """Whether a Redis on ``127.0.0.1:port`` answers ``PING`` (raw socket, no client)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_pid(port: int, timeout: float = 0.5) -> int | None:
    """``process_id`` from ``INFO server`` of the Redis on ``127.0.0.1:port``, if any."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return None
    for line in reply.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.partition(b":")[2])
    return None


class RedisServer:
    """One ``redis-server`` child process on a fixed port, restartable on that port.

    Args:
        port: the port to listen on; by default a free one (retried a few times should
            another process grab it between choosing and binding).
        executable: the ``redis-server`` binary; by default the one on ``PATH``.

    Raises:
        RuntimeError: no ``redis-server``, or it did not answer PING in time (the
            message includes its log).
    """

    def __init__(self, port: int | None = None, *, executable: str | None = None,
                 start: bool = True) -> None:
        found = executable or redis_available()
        if found is None:
            raise RuntimeError("redis-server is not installed (not found on PATH)")
        self.executable = found
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the running server, None when stopped."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        if self.running:
            return
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.port = free_port()  # someone took the port meanwhile; choose another

    def stop(self) -> None:
        """SIGTERM the server by PID and wait for it (SIGKILL after 10 s); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn_and_wait(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="continuum-redis-"))
        log = self._dir / "redis.log"
        argv = [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self._dir),
            "--logfile", str(log),
        ]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            # Ask for the PID: a PONG alone could come from whoever took the port first.
            if server_pid(self.port) == self._proc.pid:
                return
            time.sleep(0.02)
        output = log.read_text(errors="replace") if log.exists() else "<no log>"
        code = self._proc.poll()
        self.stop()
        state = f"exited with {code}" if code is not None else "did not answer PING"
        raise RuntimeError(
            f"redis-server on port {self.port} {state} within {STARTUP_TIMEOUT}s:\n{output}"
        )


def unique_prefix(tag: str = "t") -> str:
    """A key prefix no other test uses (tests share the session's redis-server)."""
    import uuid

    return f"test:{tag}:{uuid.uuid4().hex[:12]}:"


class Links:
    """RedisLinks and raw clients made by one test, all closed at its end (``close``)."""

    def __init__(self) -> None:
        from stores.redis_link import RedisLink

        self._link_class = RedisLink
        self.links: list[RedisLink] = []
        self.clients: list[Any] = []
        self.closing: list[Any] = []  # stores, indexes: closed before the links

    def link(self, url: str, metrics: Any = None, **settings: Any) -> Any:
        """A RedisLink to ``url`` with ``response_cache.redis`` settings."""
        from continuum.config import RedisConfig

        link = self._link_class(RedisConfig(url=url, **settings), metrics)
        self.links.append(link)
        return link

    def raw(self, url: str) -> Any:
        """A plain redis-py client (to plant or inspect keys)."""
        import redis

        client = redis.Redis.from_url(url)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for item in self.closing:
            item.close()
        for link in self.links:
            link.close()
        for client in self.clients:
            client.close()
