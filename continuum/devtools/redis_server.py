"""A throwaway ``redis-server`` for tests and benchmarks: free port, no persistence, stopped
by its PID.

A Redis-backed plugin runs the shipped contract against a real server with it, never the
machine's shared Redis::

    from continuum.devtools.redis_server import RedisServer, unique_prefix

    server = RedisServer()
    try:
        store = MyRedisStore(url=server.url, key_prefix=unique_prefix())
        ...
        server.stop()    # Redis goes away: the store falls back
        server.start()   # and comes back on the same port
    finally:
        server.stop()

Standard library only (no Redis client: the readiness check speaks RESP over a socket);
pytest is not needed.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import uuid
from pathlib import Path
from types import TracebackType

from continuum.devtools.procs import Child, ChildExited, WaitTimeout, free_port, wait_until

#: Seconds to wait for a started server to answer before failing loudly.
STARTUP_TIMEOUT = 10.0


def redis_available() -> str | None:
    """Path of the ``redis-server`` executable, or None when it is not installed."""
    return shutil.which("redis-server")


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


def unique_prefix(tag: str = "t") -> str:
    """A key prefix no other test uses (tests share one server)."""
    return f"test:{tag}:{uuid.uuid4().hex[:12]}:"


class RedisServer:
    """One ``redis-server`` child process on a fixed port, restartable on that port.

    Args:
        port: the port to listen on; by default a free one (retried a few times should
            another process grab it between choosing and binding).
        executable: the ``redis-server`` binary; by default the one on ``PATH``.
        start: start it now (default); otherwise call :meth:`start`.
        args: extra ``redis-server`` options.

    Raises:
        RuntimeError: no ``redis-server``, or it did not answer in time (the message
            includes its log).
    """

    def __init__(self, port: int | None = None, *, executable: str | None = None,
                 start: bool = True, args: tuple[str, ...] = ()) -> None:
        found = executable or redis_available()
        if found is None:
            raise RuntimeError("redis-server is not installed (not found on PATH)")
        self.executable = found
        #: Extra command-line options (``--cluster-enabled yes``, ``--replicaof h p``).
        self.args = args
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self._child: Child | None = None
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
        return self._child.pid if self._child is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._child is not None and self._child.running()

    def start(self) -> None:
        """Start the server (again, on the same port) and wait until it answers."""
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
        child, self._child = self._child, None
        if child is not None:
            child.stop()
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
        child = self._child = Child([
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self._dir),
            "--logfile", str(log), *self.args,
        ], name="redis-server")
        try:
            # Ask for the PID: a PONG alone could come from whoever took the port first.
            wait_until(lambda: server_pid(self.port) == child.pid,
                       f"redis-server on port {self.port} to answer", STARTUP_TIMEOUT,
                       children=[child], interval=0.02)
        except (ChildExited, WaitTimeout) as exc:
            output = log.read_text(errors="replace") if log.exists() else "<no log>"
            self.stop()
            raise RuntimeError(f"{exc}:\n{output}") from None
