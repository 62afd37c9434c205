"""KV events consumed once: one consumer per listener stream per host, or per fleet.

Without this every gunicorn worker of every router opened its own stream to each listener
and, with the Redis index, wrote every event to Redis once per worker. With
``fleet.kv_event_lease`` (on by default under gunicorn) each backend's stream is read by
the one worker holding that backend's **lease**:

* **Redis KV index** — one consumer per *fleet*: ``SET <lease key> <holder> NX PX ttl``,
  renewed every ``ttl/3`` by a compare-and-``PEXPIRE`` script and dropped by a
  compare-and-``DEL`` on a clean stop. The holder writes each event to Redis once; every
  worker of every router reads the index from Redis. A holder that dies stops renewing, so
  its lease expires within ``fleet.lease_ttl_ms`` and the next worker to try (every
  ``ttl/3``) takes over: takeover within ``ttl + ttl/3`` plus a connect. The lease keys
  live at ``<kv redis_key_prefix without its last colon>.lease:<backend>``, outside the
  index's prefix, so clearing the index never drops a lease.
* **Memory KV index** — one consumer per *host*: the lease is an ``flock`` on
  ``$CONTINUUM_RUNTIME_DIR/kv-lease-<backend>.lock``, which the kernel releases the moment
  its holder dies (takeover within ``ttl/3``). Each worker's index is its own memory, so the
  holder **relays** every record it reads to the host's other workers over Unix datagram
  sockets (``kv-relay-<pid>.sock`` in the same directory; :class:`HostRelay`), and each
  applies it through the same parsing path (:meth:`SourceConsumer.handle`). A record too
  big for one datagram, or a worker whose socket buffer is full, loses that record (counted
  in ``relay_dropped``) — as the index tolerates any lost event.

A worker that holds no lease keeps its consumer idle (``state: idle`` in
``/admin/kv-index/backends``). When the lease is lost (renewal fails: Redis unreachable, or
another worker took it after a long pause) the consumer is stopped and rebuilt from its
config, and the worker tries for the lease again; once another worker or router holds it,
this worker's ``continuum_kv_consumer_connected`` sample reads 1, leaving the holder's own
sample to say whether the stream is open. A hot reload of the event sources hands
each lease the worker holds to its next consumers instead of releasing it
(:meth:`LeasedConsumers.stop`), so the stream is opened once more, not twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from continuum.hostshm import pid_alive, try_lock

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.hostshm import HostSegment
    from continuum.kv.consumer import KvEventConsumerManager, SourceConsumer
    from continuum.kv.stream import Spawn

log = logging.getLogger(__name__)

RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease(Protocol):
    """Who may consume one backend's stream."""

    def acquire(self, backend: str) -> bool:
        """Take the lease for ``backend`` if nobody holds it."""

    def renew(self, backend: str) -> bool:
        """Keep it; False when it is lost."""

    def release(self, backend: str) -> None:
        """Give it up."""

    def holder_of(self, backend: str) -> str | None:
        """Who holds ``backend``'s lease, seen from a worker that does not (``worker
        <pid>``, or ``router <host> worker <pid>`` on another host); None: nobody."""


class FileLease:
    """A host-local lease: ``flock`` on one lock file per backend (held while the fd is)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._fds: dict[str, int] = {}

    def _path(self, backend: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in backend)
        return self.directory / f"kv-lease-{safe}.lock"

    def acquire(self, backend: str) -> bool:
        if backend in self._fds:
            return True
        fd = try_lock(self._path(backend))
        if fd is None:
            return False
        self._fds[backend] = fd
        with contextlib.suppress(OSError):  # who holds it, for the others' admin views
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        return True

    def renew(self, backend: str) -> bool:
        return backend in self._fds

    def holder_of(self, backend: str) -> str | None:
        try:
            pid = int(self._path(backend).read_text() or 0)
        except (OSError, ValueError):
            return None
        # the file outlives a dead holder (its lock does not)
        return f"worker {pid}" if pid_alive(pid) else None

    def release(self, backend: str) -> None:
        fd = self._fds.pop(backend, None)
        if fd is not None:
            os.close(fd)  # drops the lock


class RedisLease:
    """A fleet-wide lease: ``SET NX PX`` with compare-and-renew and compare-and-delete."""

    def __init__(self, client: Any, key_prefix: str, holder: str, ttl_ms: int) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.holder = holder
        self.ttl_ms = ttl_ms
        self._renew = client.register_script(RENEW_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)

    def key(self, backend: str) -> str:
        return f"{self.key_prefix}{backend}"

    def acquire(self, backend: str) -> bool:
        try:
            if self.client.set(self.key(backend), self.holder, nx=True, px=self.ttl_ms):
                return True
            # Already this worker's (kept across a hot reload): renewed, still held.
            return bool(self._renew(keys=[self.key(backend)], args=[self.holder, self.ttl_ms]))
        except Exception as exc:  # Redis away: nobody new consumes until it is back
            log.debug("KV lease %s: acquire failed: %s", backend, exc)
            return False

    def renew(self, backend: str) -> bool:
        try:
            return bool(self._renew(keys=[self.key(backend)], args=[self.holder, self.ttl_ms]))
        except Exception as exc:
            log.warning("KV lease %s: renewal failed (%s); giving the stream up", backend, exc)
            return False

    def release(self, backend: str) -> None:
        try:
            self._release(keys=[self.key(backend)], args=[self.holder])
        except Exception as exc:  # it expires on its own
            log.debug("KV lease %s: release failed: %s", backend, exc)

    def holder_of(self, backend: str) -> str | None:
        """:meth:`Lease.holder_of` (``self.holder`` is this worker's own lease value)."""
        try:
            value = self.client.get(self.key(backend))
        except Exception:  # Redis away: unknown
            return None
        if value is None:
            return None
        text = value.decode() if isinstance(value, bytes) else str(value)
        host, _, pid = text.rpartition(":")
        mine, _, _ = self.holder.rpartition(":")
        return f"worker {pid}" if host == mine else f"router {host} worker {pid}"


class _Receiving:
    """One :meth:`HostRelay.open` .. :meth:`HostRelay.close` span: the receiver spawned for
    it serves only while it is the relay's current span and not closed."""

    __slots__ = ("closed", "sock")

    def __init__(self) -> None:
        self.closed = False
        self.sock: socket.socket | None = None


class HostRelay:
    """Hands the records the lease holder reads to the host's other workers (memory index).

    Every worker binds ``kv-relay-<pid>.sock`` (a Unix datagram socket) in the runtime
    directory; the holder sends each record to every other live worker's socket.

    Each :meth:`open` starts a span that the receiver it was spawned for carries
    (:meth:`serve`). A receiver whose span was closed, or replaced by a later
    :meth:`open`, before its greenlet first ran returns without binding, so a relay
    reopened for the next manager never has two receivers on its path, whatever order
    the greenlets run in.
    """

    def __init__(self, segment: HostSegment) -> None:
        self.segment = segment
        self.path = segment.directory / f"kv-relay-{os.getpid()}.sock"
        self.relayed = self.received = self.dropped = 0
        self._out: socket.socket | None = None
        self._peer_paths: list[str] = []
        self._peers_until = 0.0
        self._span = _Receiving()
        self._span.closed = True  # until the first open()

    def _peers(self) -> list[str]:
        # The worker table changes when a worker starts or dies: looked at once a second,
        # not for every record.
        now = time.monotonic()
        if now >= self._peers_until:
            self._peer_paths = [
                str(self.segment.directory / f"kv-relay-{pid}.sock")
                for _slot, pid, _gen in self.segment.live_workers() if pid != os.getpid()]
            self._peers_until = now + 1.0
        return self._peer_paths

    def send(self, backend: str, sse_event: str | None, data: Any,
             record_id: str | None) -> None:
        """Relay one record (called by the holder's consumer for every record it reads)."""
        if self._out is None:
            self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._out.setblocking(False)
        message = json.dumps([backend, sse_event, data, record_id]).encode()
        for peer in self._peers():
            try:
                self._out.sendto(message, peer)
                self.relayed += 1
            except FileNotFoundError:
                continue  # that worker relays nothing yet (booting) or has gone
            except OSError as exc:  # buffer full, datagram too big: the record is lost there
                self.dropped += 1
                log.debug("KV relay to %s failed: %s", peer, exc)

    def open(self) -> _Receiving:
        """Start a span for a new receiver (a manager that replaces a stopped one's); pass
        it to :meth:`serve`. An earlier span still open is closed first."""
        self.close()
        self._span = _Receiving()
        return self._span

    def serve(self, manager: KvEventConsumerManager, span: _Receiving) -> None:
        """Receive relayed records and apply them to this worker's index (a greenlet),
        while ``span`` (from :meth:`open`) is the relay's current one."""
        if span.closed or span is not self._span:
            return  # closed or replaced before this greenlet first ran
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = span.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(self.path))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        while True:
            try:
                raw = sock.recv(1 << 20)
            except OSError:
                return  # closed by close()
            try:
                backend, sse_event, data, record_id = json.loads(raw)
                manager.consumer(backend).handle(sse_event, data, record_id)
                self.received += 1
            except Exception:  # a bad record must not end the relay
                log.exception("KV relay: record not applied")

    def close(self) -> None:
        """End the current span: its receiver stops (or never starts); the path goes."""
        if self._out is not None:
            self._out.close()
            self._out = None
        span = self._span
        if span.closed:
            return
        span.closed = True
        if span.sock is not None:
            span.sock.close()
            span.sock = None
        with contextlib.suppress(OSError):
            self.path.unlink()


class LeasedConsumers:
    """Runs each of ``manager``'s consumers only while this worker holds its lease."""

    def __init__(self, lease: Lease, ttl_ms: int, relay: HostRelay | None = None, *,
                 kept: set[str] | None = None) -> None:
        self.lease = lease
        self.ttl_ms = ttl_ms
        self.interval = ttl_ms / 3000
        self.relay = relay
        self._stopping = threading.Event()
        self._handing_over = False
        self._handles: list[Any] = []
        self.held: set[str] = set()
        #: Leases still held that a stopped predecessor handed over (:meth:`stop`), until
        #: :meth:`start` (with ``hand_over``: the ones this one's supervisors kept).
        self.kept: set[str] = set(kept or ())
        self.takeovers = 0

    def start(self, manager: KvEventConsumerManager, spawn: Spawn) -> list[Any]:
        """Start one supervisor per consumer (and the relay's receiver); their handles.

        A lease handed over for a backend that ``manager`` no longer reads is released."""
        self._stopping = threading.Event()  # made now, after gevent's patching
        leased = {consumer.backend for consumer in manager.consumers if consumer.leased}
        for backend in self.kept - leased:
            self.lease.release(backend)
        self.kept = set()
        if self.relay is not None:
            relay = self.relay
            span = relay.open()
            self._handles.append(spawn(lambda: relay.serve(manager, span)))
        for index, consumer in enumerate(manager.consumers):
            if consumer.leased:
                self._handles.append(spawn(partial(self._supervise, manager, index, spawn)))
            else:  # push mode: every worker reads its host's bus
                self._handles.append(consumer.start(spawn))
        return self._handles

    def _supervise(self, manager: KvEventConsumerManager, index: int, spawn: Spawn) -> None:
        backend = manager.consumers[index].backend
        lost = False  # this worker's consumer stopped with the lease: its gauge reads 0
        while not self._stopping.is_set():
            if not self.lease.acquire(backend):
                if lost and self.lease.holder_of(backend) is not None:
                    manager.consumers[index].consumed_elsewhere()
                    lost = False
                self._stopping.wait(self.interval)
                continue
            consumer: SourceConsumer = manager.consumers[index].fresh()
            if self.relay is not None:
                consumer.relay = self.relay.send
            manager.consumers[index] = consumer
            self.held.add(backend)
            self.takeovers += 1
            log.info("KV events of %s: this worker (pid %d) holds the lease and consumes",
                     backend, os.getpid())
            handle = consumer.start(spawn)
            try:
                while not self._stopping.wait(self.interval):
                    if not self.lease.renew(backend):
                        break
            finally:
                consumer.stop()
                handle.join(5)
                self.held.discard(backend)
                if self._handing_over:  # the next manager's supervisor takes it as held
                    self.kept.add(backend)
                else:
                    self.lease.release(backend)
                manager.consumers[index] = consumer.fresh()
            lost = True

    def consumed_by(self, backend: str) -> str | None:
        """Who reads ``backend``'s stream for this host or fleet: ``this worker``, another
        (:meth:`Lease.holder_of`), or None while nobody holds the lease."""
        if backend in self.held:
            return "this worker"
        return self.lease.holder_of(backend)

    def renewed(self) -> LeasedConsumers:
        """The same lease (and relay) for the manager that replaces this one's after a
        hot reload of the event sources, with the leases this one handed over; call once
        this one is stopped."""
        return LeasedConsumers(self.lease, self.ttl_ms, self.relay, kept=self.kept)

    def stop(self, *, hand_over: bool = False) -> None:
        """Stop every supervisor: each stops its consumer and releases its lease, or, with
        ``hand_over`` (a hot reload), keeps it for :meth:`renewed`'s supervisors. Released
        between the two, another worker polling for the lease could take it and open the
        stream only to close it again at its own reload: each backend's stream would be
        opened twice instead of once."""
        self._handing_over = hand_over
        self._stopping.set()
        if self.relay is not None:
            self.relay.close()


def leased_consumers(config: RouterConfig, segment: HostSegment | None) -> LeasedConsumers | None:
    """The lease arrangement for ``config`` on this host; None (every worker consumes, as
    without gunicorn) when ``fleet.kv_event_lease`` is off or there is no host segment."""
    fleet, kv = config.fleet, config.kv_cache_index
    if not (fleet.kv_event_lease and kv.enabled and segment is not None):
        return None
    if kv.backend == "redis":
        from continuum.redis_topology import make_client

        client = make_client(config.response_cache.redis)
        prefix = kv.redis_key_prefix.rstrip(":") + ".lease:"
        holder = f"{segment.host_id}:{os.getpid()}"
        return LeasedConsumers(RedisLease(client, prefix, holder, fleet.lease_ttl_ms),
                               fleet.lease_ttl_ms)
    if kv.backend == "memory":
        return LeasedConsumers(FileLease(segment.directory), fleet.lease_ttl_ms,
                               HostRelay(segment))
    return None  # a third-party index: its sharing is unknown, so every worker consumes


__all__ = ["FileLease", "HostRelay", "Lease", "LeasedConsumers", "RedisLease",
           "leased_consumers"]
