"""Throwaway Redis Cluster and Sentinel sets on loopback ports, for tests and benchmarks.

:class:`ClusterSet`: ``masters`` ``redis-server --cluster-enabled yes`` processes, each
with ``replicas`` replicas, joined by ``redis-cli --cluster create``. :class:`SentinelSet`:
one master, one replica and three ``redis-server --sentinel`` processes watching it as
``mymaster`` (quorum 2). Both use short failure timeouts so a killed master is replaced in
a few seconds, and every process is stopped by its PID. Both are a :class:`RedisSet`: a
failure while starting stops what had started, and ``with`` stops the lot.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import redis

from continuum.devtools.procs import Child, free_port, wait_until
from continuum.devtools.redis_server import RedisServer

_SetT = TypeVar("_SetT", bound="RedisSet")

#: How long a node or master may be silent before it counts as failed (milliseconds).
NODE_TIMEOUT_MS = 1000


def _client(port: int, **kwargs: Any) -> Any:
    """A plain client to the server on ``port`` (typed Any: redis-py's stubs are partial),
    used in a ``with`` block: it closes its connection there, not whenever the collector
    happens to find it (a socket closed by the collector is a ResourceWarning, which the
    tests turn into an error in whichever test is running then)."""
    return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, **kwargs)


def cluster_port(attempts: int = 200) -> int:
    """A free port for a cluster node: at most 55535 and with its cluster bus port
    (+10000) free too."""
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(20000, 45000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _ping(port: int) -> bool:
    try:
        with _client(port) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _await(condition: Callable[[], bool], what: str, timeout: float) -> None:
    """Wait for a condition on the servers, a Redis error or refused connection counting
    as not yet."""
    wait_until(condition, what, timeout, interval=0.1, retry_on=(OSError, redis.RedisError))


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (not found on PATH)")
    return found


class RedisSet:
    """A set of Redis processes started together: :meth:`_start` starts them (a subclass
    sets its attributes first, so :meth:`stop` can run whatever failed), :meth:`stop`
    stops whatever runs, by PID, and may be called at any point of a failed start."""

    def __init__(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop every process of the set (idempotent)."""
        raise NotImplementedError

    def __enter__(self: _SetT) -> _SetT:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class ClusterSet(RedisSet):
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each."""

    def __init__(self, masters: int = 3, replicas: int = 1) -> None:
        self.servers: list[RedisServer] = []
        self._shape = masters, replicas
        self._cli = _tool("redis-cli")
        super().__init__()

    def _start(self) -> None:
        masters, replicas = self._shape
        for _ in range(masters * (1 + replicas)):
            self.servers.append(RedisServer(cluster_port(), args=(
                "--cluster-enabled", "yes", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no")))
        done = subprocess.run(
            [self._cli, "--cluster", "create", *self.nodes, "--cluster-replicas",
             str(replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}"
                               f"{done.stderr}")
        wait_until(self.healthy, "the cluster to reach cluster_state:ok", 30, interval=0.1)

    @property
    def nodes(self) -> list[str]:
        """``127.0.0.1:port`` of every node (running or not)."""
        return [f"127.0.0.1:{s.port}" for s in self.servers]

    def _info(self, server: RedisServer) -> dict[str, str]:
        with _client(server.port, decode_responses=True) as client:
            raw = client.execute_command("CLUSTER INFO")
        if isinstance(raw, dict):  # redis-py parses the reply
            return {str(k): str(v) for k, v in raw.items()}
        return dict(line.split(":", 1) for line in str(raw).split() if ":" in line)

    def healthy(self) -> bool:
        """Every running node reports ``cluster_state:ok`` with all 16384 slots served."""
        for server in self.servers:
            if not server.running:
                continue
            try:
                info = self._info(server)
            except redis.RedisError:
                return False
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                return False
        return True

    def masters(self) -> list[RedisServer]:
        """The running servers that are masters now."""
        out = []
        for server in self.servers:
            if server.running and _role(server.port) == "master":
                out.append(server)
        return out

    def master_of(self, key: str) -> RedisServer:
        """The running master that serves ``key`` now."""
        client: Any = redis.RedisCluster(host="127.0.0.1", port=self.masters()[0].port)
        try:
            node = client.get_node_from_key(key)
        finally:
            client.close()
        return next(s for s in self.servers if s.port == node.port)

    def kill(self, server: RedisServer, timeout: float = 30) -> None:
        """Stop ``server`` (by PID) and wait until its replica has taken over."""
        replicas = [s for s in self.servers if s.running and s is not server
                    and _role_of(s.port)[0] == "slave"
                    and int(_role_of(s.port)[2]) == server.port]
        server.stop()

        def promoted() -> bool:
            return any(_role_of(r.port)[0] == "master" for r in replicas) and self.healthy()

        _await(promoted, "a replica to take over the killed master", timeout)

    def stop(self) -> None:
        """Stop every node."""
        for server in self.servers:
            server.stop()


class SentinelSet(RedisSet):
    """A master, a replica and three sentinels watching them as ``master_name``.

    ``failover_timeout_ms`` is the sentinels' ``failover-timeout``: a failover that found
    no replica to promote is tried again after twice that.
    """

    def __init__(self, master_name: str = "mymaster", failover_timeout_ms: int = 5000) -> None:
        self.master_name = master_name
        self.failover_timeout_ms = failover_timeout_ms
        self.sentinels: list[Child] = []
        self.sentinel_ports: list[int] = []
        self.master: RedisServer  # both set by _start
        self.replica: RedisServer
        self._dir = Path(tempfile.mkdtemp(prefix="continuum-sentinel-"))
        self._executable = _tool("redis-server")
        super().__init__()

    def _start(self) -> None:
        name = self.master_name
        master = self.master = RedisServer()
        self.replica = RedisServer(args=("--replicaof", "127.0.0.1", str(master.port)))
        for i in range(3):
            port = free_port()
            conf = self._dir / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self._dir}\n"
                f"sentinel monitor {name} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {name} {NODE_TIMEOUT_MS}\n"
                f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {name} 1\n")
            self.sentinels.append(Child([self._executable, str(conf), "--sentinel"],
                                        self._dir / f"sentinel-{i}.log", name=f"sentinel-{i}"))
            self.sentinel_ports.append(port)
        for port in self.sentinel_ports:
            wait_until(partial(_ping, port), f"sentinel on {port}", 15,
                       children=self.sentinels, interval=0.05)
        wait_until(self._replica_known, "the sentinels to see the replica", 30, interval=0.1)

    @property
    def nodes(self) -> list[str]:
        """``127.0.0.1:port`` of each sentinel."""
        return [f"127.0.0.1:{p}" for p in self.sentinel_ports]

    def _replica_known(self) -> bool:
        return all(self._replica_flags(port) for port in self.sentinel_ports)

    def _replica_flags(self, port: int) -> list[str]:
        """What the sentinel on ``port`` says of each replica (its ``flags``)."""
        with _client(port) as client:
            replicas = client.sentinel_slaves(self.master_name)
        return [str(r.get("flags", "")) if isinstance(r, dict) else "" for r in replicas]

    def master_port(self) -> int:
        """The port of the master the sentinels name now."""
        with _client(self.sentinel_ports[0]) as client:
            _host, port = client.sentinel_get_master_addr_by_name(self.master_name)
        return int(port)

    def kill_master(self, timeout: float = 40) -> None:
        """Stop the master (by PID) and wait until the sentinels have promoted the replica."""
        self.stop_master()
        self.wait_promoted(timeout)

    def stop_master(self) -> None:
        """Stop the master (by PID); the sentinels notice within ``NODE_TIMEOUT_MS``."""
        self.master.stop()

    def wait_promoted(self, timeout: float = 40) -> None:
        """Wait until the sentinels name the replica as master and it serves as one."""
        replica = self.replica
        _await(lambda: self.master_port() == replica.port and _role(replica.port) == "master"
               and self._master_usable(), "the sentinels to promote the replica", timeout)

    @contextmanager
    def replica_paused(self, timeout: float = 30) -> Iterator[None]:
        """Hold the replica (``SIGSTOP``) until the sentinels count it as down, and let it
        go (``SIGCONT``) on exit: meanwhile a dead master cannot be replaced, so an outage
        lasts as long as the block. A failover that found no replica is tried again after
        twice ``failover_timeout_ms``."""
        pid = self.replica.pid
        if pid is None:
            raise RuntimeError("the replica is not running")
        os.kill(pid, signal.SIGSTOP)
        try:
            _await(lambda: all("s_down" in flags for port in self.sentinel_ports
                               for flags in self._replica_flags(port)),
                   "the sentinels to count the paused replica as down", timeout)
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def _master_usable(self) -> bool:
        # Right after a failover the sentinels flag their new link "disconnected" for a
        # moment, and clients refuse such a master: wait until every sentinel vouches.
        for port in self.sentinel_ports:
            with _client(port) as client:
                state = client.sentinel_master(self.master_name)
            if "disconnected" in str(state.get("flags", "")):
                return False
        return True

    def stop(self) -> None:
        """Stop the sentinels and the servers."""
        for child in reversed(self.sentinels):
            child.stop()
        for server in (getattr(self, "replica", None), getattr(self, "master", None)):
            if server is not None:
                server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def _role_of(port: int) -> list[str]:
    """``ROLE`` of the server on ``port``, its first three fields as strings."""
    with _client(port) as client:
        reply = client.execute_command("ROLE")
    return [x.decode() if isinstance(x, bytes) else str(x) for x in reply[:3]]


def _role(port: int) -> str:
    return _role_of(port)[0]


__all__ = ["NODE_TIMEOUT_MS", "ClusterSet", "RedisSet", "SentinelSet"]
