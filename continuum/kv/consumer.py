"""Tier 4 event consumers: one background loop per listener stream feeds the KV index.

Each :class:`SourceConsumer` reads the listener's ``/events/<backend>`` stream — SSE over
http(s) through ``requests`` and :mod:`continuum.wire.sse`, or one JSON event per text message
over ws(s) through :mod:`continuum.wire.websocket` — and applies every event to the shared
:class:`~continuum.interfaces.KvCacheIndex` tagged with its backend.

Concurrency: :class:`KvEventConsumerManager` starts in the worker, after the fork. By
default it runs each consumer in a gevent greenlet when gevent has patched ``socket`` (the
gunicorn gevent worker) and in a daemon thread otherwise (tests, plain scripts); ``spawn``
overrides the choice. Either way ``stop()`` wakes a consumer from any blocking point:
it sets a ``threading.Event`` (gevent's own when patched) and shuts down the live socket.

Invariants:
  * A consumer is in exactly one state; only :meth:`SourceConsumer._advance` changes it, by
    the table below. ``stop`` is valid everywhere and ``stopped`` is final: a transition the
    loop attempts after a concurrent ``stop`` is skipped, any other unlisted pair raises
    :class:`ConsumerStateError` naming the state and the event.
  * ``connected`` (stats and the gauge) is true exactly while the state is ``streaming``.
  * ``last_event_id`` only moves when a record has been processed (applied, dropped or
    counted malformed), so a reconnect's ``Last-Event-ID`` / ``?last_event_id=`` neither
    replays nor skips an event. Control events (``draining``, ``buffer_overflow``) never
    move it.
  * Reconnect delays start at ``reconnect_interval_ms`` and double up to
    ``max(reconnect_interval_ms, 60 s)``; a connection that delivered at least one KV event,
    or that the listener ended with ``draining``/``buffer_overflow``, resets the delay to
    ``reconnect_interval_ms``. An SSE ``retry:`` raises the delay (never lowers it) up to the
    same cap.

Transitions (state, event) → state:

    ==========  =======  ==========
    state       event    next
    ==========  =======  ==========
    idle        start    connecting
    connecting  opened   streaming
    connecting  failed   backoff
    streaming   ended    backoff
    backoff     retry    connecting
    (any)       stop     stopped
    ==========  =======  ==========

All state (counters, last event id) is per worker; see :class:`KvConsumerMetrics` for what
each counter counts.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import urllib3
from prometheus_client import CollectorRegistry, Counter, Gauge

from continuum.errors import ContinuumError, StoreError
from continuum.interfaces import CACHE_CLEARED, CACHE_CREATED, KV_EVENT_TYPES, KvCacheIndex
from continuum.kv.stream import (
    Backoff,
    Clock,
    Spawn,
    SystemClock,
    Transport,
    default_spawn,
    open_transport,
)
from continuum.wire.sse import StreamOverflowError

if TYPE_CHECKING:
    from continuum.config import KvEventSourceConfig
    from continuum.kv.lease import LeasedConsumers

log = logging.getLogger(__name__)

IDLE, CONNECTING, STREAMING, BACKOFF, STOPPED = (
    "idle", "connecting", "streaming", "backoff", "stopped")
START, OPENED, FAILED, ENDED, RETRY, STOP = (
    "start", "opened", "failed", "ended", "retry", "stop")

TRANSITIONS: dict[tuple[str, str], str] = {
    (IDLE, START): CONNECTING,
    (CONNECTING, OPENED): STREAMING,
    (CONNECTING, FAILED): BACKOFF,
    (STREAMING, ENDED): BACKOFF,
    (BACKOFF, RETRY): CONNECTING,
    **{(state, STOP): STOPPED for state in (IDLE, CONNECTING, STREAMING, BACKOFF, STOPPED)},
}

DRAINING = "draining"
BUFFER_OVERFLOW = "buffer_overflow"
CONTROL_EVENTS = (DRAINING, BUFFER_OVERFLOW)
_HEX = re.compile(r"[0-9a-fA-F]{1,128}")
_ConsumerT = TypeVar("_ConsumerT", bound="SourceConsumer")


class ConsumerStateError(ContinuumError, RuntimeError):
    """An event that the consumer state machine does not allow in the current state."""

    def __init__(self, backend: str, state: str, event: str) -> None:
        super().__init__(f"KV consumer {backend}: event {event!r} is invalid in state "
                         f"{state!r}", backend=backend, state=state, event=event)
        self.backend, self.state, self.event = backend, state, event


class MalformedRecord(ContinuumError, ValueError):
    """A stream record that is not a valid KV event (counted and skipped)."""


class KvConsumerMetrics:
    """The consumers' Prometheus metrics, registered once per registry.

    ``received`` counts valid KV events; ``dropped`` counts events the index failed to store
    (``StoreError``), streams dropped for a record over the 1 MiB cap, and the listener's
    ``buffer_overflow`` (its backpressure signal); ``malformed`` counts skipped records.
    The stats of :class:`SourceConsumer` count the same way.
    """

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, KvConsumerMetrics]] = (
        weakref.WeakKeyDictionary())

    def __init__(self, registry: CollectorRegistry) -> None:
        self.received = Counter("continuum_kv_events_received_total",
                                "Valid KV events received by backend and event type",
                                ["backend", "type"], registry=registry)
        self.dropped = Counter("continuum_kv_event_dropped_total",
                               "KV events lost: index store failures, streams dropped for an "
                               "over-size record, listener buffer_overflow", ["backend"],
                               registry=registry)
        self.connected = Gauge("continuum_kv_consumer_connected",
                               "1 while the event stream is open, or another worker or "
                               "router holds its lease (minimum over workers)",
                               ["backend"], multiprocess_mode="livemin", registry=registry)
        self.reconnects = Counter("continuum_kv_consumer_reconnects_total",
                                  "Event stream reconnect attempts", ["backend"],
                                  registry=registry)
        self.malformed = Counter("continuum_kv_malformed_records_total",
                                 "Stream records skipped as malformed", ["backend"],
                                 registry=registry)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> KvConsumerMetrics:
        """The metrics in ``registry``, created on first use (a registry rejects duplicates)."""
        metrics = cls._by_registry.get(registry)
        if metrics is None:
            metrics = cls._by_registry[registry] = cls(registry)
        return metrics

    def touch(self, backend: str) -> None:
        """Create ``backend``'s series at zero (in the worker: a master-side livemin sample
        would pin the gauge at 0)."""
        self.connected.labels(backend).set(0)
        for counter in (self.dropped, self.reconnects, self.malformed):
            counter.labels(backend)


@dataclass(frozen=True, slots=True)
class SourceStats:
    """One event source's state and counters (the admin API's ``/admin/kv-index/...``)."""

    backend_name: str
    state: str
    connected: bool
    events_received: int
    events_dropped: int
    malformed: int
    #: When the last event arrived, ``2026-03-13T10:24:17Z``; None before the first.
    last_event_at: str | None
    reconnect_count: int
    index_created: int
    index_evicted: int
    last_event_id: str | None
    #: Who reads the stream: ``this worker``; with ``fleet.kv_event_lease``, the holder of
    #: its lease (``worker <pid>``, ``router <host> worker <pid>``), None while none does.
    consumed_by: str | None = "this worker"


def iso_utc(ts: float | None) -> str | None:
    """``2026-03-13T10:24:17Z`` for an epoch timestamp; None stays None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: ``(event type, [(chain key hex, token_count), …])`` groups of an event's ``chain`` field.
ChainGroups = list[tuple[str, list[tuple[str, int]]]]


def parse_chain(payload: Any) -> ChainGroups:
    """The optional ``chain`` field of an event: ``{"<event type>": [[key, tokens], …]}``
    (the listener's chain keys whose state changed with this event; see
    ``continuum-kv-listener(1)``). Absent or null: no groups.

    Raises:
        MalformedRecord: not an object of event types to lists of ``[hex key, int >= 0]``.
    """
    chain = payload.get("chain") if isinstance(payload, dict) else None
    if chain is None:
        return []
    if not isinstance(chain, dict):
        raise MalformedRecord("chain must be an object of event types")
    groups: ChainGroups = []
    for kind, items in chain.items():
        if kind not in KV_EVENT_TYPES or kind == CACHE_CLEARED or not isinstance(items, list):
            raise MalformedRecord(f"chain: {kind!r} is not a list of a KV event type")
        entries = []
        for item in items:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or not _HEX.fullmatch(item[0]) or isinstance(item[1], bool)
                    or not isinstance(item[1], int) or item[1] < 0):
                raise MalformedRecord(f"chain: {kind} entries are [hex key, token count >= 0]")
            entries.append((item[0].lower(), item[1]))
        groups.append((kind, entries))
    return groups


def parse_event(kind: Any, payload: Any) -> tuple[str, str, int]:
    """Validate one KV event; return ``(event, prefix_hash, token_count)``.

    Raises:
        MalformedRecord: not a JSON object, unknown type, bad ``prefix_hash`` (required
            except for ``cache_cleared``) or a ``token_count`` that is not an integer >= 0.
    """
    if not isinstance(payload, dict):
        raise MalformedRecord("event body is not a JSON object")
    if kind not in KV_EVENT_TYPES:
        raise MalformedRecord(f"unknown event type {kind!r}")
    prefix_hash = payload.get("prefix_hash")
    if kind == CACHE_CLEARED:
        prefix_hash = ""
    elif not isinstance(prefix_hash, str) or not _HEX.fullmatch(prefix_hash):
        raise MalformedRecord(f"{kind} needs a hex prefix_hash (got {prefix_hash!r})")
    tokens = payload.get("token_count", 0)
    if tokens is None:
        tokens = 0
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise MalformedRecord(f"token_count must be an integer >= 0 (got {tokens!r})")
    return kind, prefix_hash.lower(), tokens


class SourceConsumer:
    """The reconnecting reader of one listener stream (see the module's transition table)."""

    def __init__(self, source: KvEventSourceConfig, index: KvCacheIndex, metrics: KvConsumerMetrics,
                 clock: Clock, *, connect_timeout: float, read_timeout: float | None,
                 token: str | None = None) -> None:
        self.source = source
        self.backend: str = source.backend_name
        self.endpoint: str = source.endpoint or ""
        #: Called with every record read (the KV lease holder relays them to the host's
        #: other workers, see continuum.kv.lease); None: nobody listens.
        self.relay: Callable[[str, str | None, Any, str | None], None] | None = None
        self._token = token  # the listener's bearer token; never in stats or logs
        self.backoff = Backoff(source.reconnect_interval_ms)
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.state = IDLE
        self.last_event_id: str | None = None
        self.events_received = self.events_dropped = self.malformed = 0
        self.reconnect_count = self.index_created = self.index_evicted = 0
        self.last_event_at: float | None = None
        #: Largest line / record / message any of this consumer's parsers ever buffered.
        self.buffer_high_water = 0
        self._lock = threading.RLock()
        self._wake: threading.Event | None = None
        self._closer: Callable[[], None] | None = None
        self._delivered = 0

    #: Whether a KV lease (:mod:`continuum.kv.lease`) decides which worker runs this
    #: consumer; False: every worker runs its own (push mode's bus consumers).
    leased: ClassVar[bool] = True

    def fresh(self: _ConsumerT) -> _ConsumerT:
        """A new idle consumer of the same class, stream and index (after a stop)."""
        return type(self)(self.source, self.index, self.metrics, self.clock,
                          connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                          token=self._token, **self._fresh_options())

    def _fresh_options(self) -> dict[str, Any]:
        """A subclass's own constructor arguments, for :meth:`fresh`."""
        return {}

    def consumed_elsewhere(self) -> None:
        """This worker gave the stream up with its lease, and another worker or router
        holds it now: this worker's sample of ``continuum_kv_consumer_connected`` reads 1
        instead of the 0 its stop left, so the minimum over the host's workers and the
        router's alert follow the holder's own sample (a 0 kept by a worker that lost the
        lease to another router would fire the alert for as long as it lives)."""
        self.metrics.connected.labels(self.backend).set(1)

    @property
    def connected(self) -> bool:
        """True while streaming."""
        return self.state == STREAMING

    def _advance(self, event: str) -> bool:
        """Apply ``event``; False (and no change) when a concurrent stop came first."""
        with self._lock:
            if self.state == STOPPED and event != STOP:
                return False
            new = TRANSITIONS.get((self.state, event))
            if new is None:
                raise ConsumerStateError(self.backend, self.state, event)
            self.state = new
            self.metrics.connected.labels(self.backend).set(1 if new == STREAMING else 0)
        return True

    def start(self, spawn: Spawn) -> Any:
        """Leave ``idle`` and run the loop under ``spawn``; return its handle."""
        self._wake = threading.Event()  # made now, after gevent's patching, not at build
        self.metrics.touch(self.backend)
        self._advance(START)
        return spawn(self.run)

    def stop(self) -> None:
        """Enter ``stopped`` and wake the loop from a sleep or a blocked read."""
        with self._lock:  # atomically with _session publishing its closer
            self._advance(STOP)
            closer = self._closer
        if self._wake is not None:
            self._wake.set()
        if closer is not None:
            closer()

    def run(self) -> None:
        """The loop: connect, stream, back off, until stopped (runs in its own greenlet)."""
        assert self._wake is not None
        current = self.backoff.base_ms
        while self.state != STOPPED:
            reason, retry_ms = self._session()
            if self.state == STOPPED:
                break
            reset = self._delivered > 0 or reason in CONTROL_EVENTS
            delay, current = self._next_delay(reason, reset, retry_ms, current)
            log.log(logging.INFO if reset else logging.WARNING,
                    "KV event stream %s ended (%s); reconnecting in %d ms", self.backend,
                    reason, delay)
            if not self._advance(FAILED if self.state == CONNECTING else ENDED):
                break
            self.clock.wait(delay / 1000, self._wake)
            if not self._advance(RETRY):
                break
            self.reconnect_count += 1
            self.metrics.reconnects.labels(self.backend).inc()

    def _session(self) -> tuple[str, int | None]:
        """One connection; returns why it ended and the listener's ``retry:`` if any."""
        self._delivered = 0
        transport = None
        try:
            transport = self._open()
            with self._lock:
                stopping = self.state == STOPPED
                self._closer = None if stopping else transport.shutdown
            if stopping or not self._advance(OPENED):
                return "stopped", None
            for sse_event, data, record_id in transport.records():
                signal = self.handle(sse_event, data, record_id)
                if self.relay is not None and signal is None:
                    self.relay(self.backend, sse_event, data, record_id)
                if signal is not None:
                    if signal == BUFFER_OVERFLOW:
                        self._count_dropped()
                    return signal, transport.retry_ms
            return "end of stream", transport.retry_ms
        except StreamOverflowError as exc:
            self._count_dropped()
            log.warning("KV event stream %s: %s; dropping the stream", self.backend, exc)
            return "overflow", transport.retry_ms if transport else None
        except (OSError, urllib3.exceptions.HTTPError, http.client.HTTPException) as exc:
            return f"{type(exc).__name__}: {exc}", transport.retry_ms if transport else None
        except Exception as exc:  # a bug (ours or the index's) must not end the consumer
            log.exception("KV event stream %s failed", self.backend)
            return f"{type(exc).__name__}: {exc}", None
        finally:
            with self._lock:
                self._closer = None
            if transport is not None:
                self.buffer_high_water = max(self.buffer_high_water, transport.high_water)
                transport.close()

    def _open(self) -> Transport:
        """Connect to the stream, resuming after ``last_event_id`` (a hook: push mode's
        consumer finds the bus first)."""
        return open_transport(self.endpoint, self.last_event_id, self.connect_timeout,
                              self.read_timeout, self._token)

    def _next_delay(self, reason: str, reset: bool, retry_ms: int | None,
                    current: int) -> tuple[int, int]:
        """``(this delay, the next one)`` after a connection ended (a hook: push mode
        retries ``no_session`` at the plain interval and ``draining`` at once)."""
        return self.backoff.delay(current, reset, retry_ms)

    def handle(self, sse_event: str | None, data: str | dict[str, Any] | None,
               record_id: str | None) -> str | None:
        """Process one record; return a control event name when the stream must end.

        ``data`` is the SSE data text (JSON), an already decoded WebSocket message, or None
        for an SSE record without data (which only moves the last event id).
        """
        if sse_event in CONTROL_EVENTS:
            return sse_event
        if data is None:
            if record_id is not None:
                self.last_event_id = record_id or None
            return None
        try:
            payload = json.loads(data) if isinstance(data, str) else data
        except ValueError:
            payload = None
        kind = sse_event if sse_event not in (None, "message") else (
            payload.get("event") if isinstance(payload, dict) else None)
        if kind in CONTROL_EVENTS:
            return str(kind)
        try:
            event, prefix_hash, tokens = parse_event(kind, payload)
            chain = parse_chain(payload) if event != CACHE_CLEARED else []
            self._apply(event, prefix_hash, tokens, chain)
        except MalformedRecord as exc:
            self.malformed += 1
            self.metrics.malformed.labels(self.backend).inc()
            log.debug("KV event stream %s: skipping record %s: %s", self.backend, record_id, exc)
        if record_id is not None:
            self.last_event_id = record_id or None
        return None

    def _apply(self, event: str, prefix_hash: str, tokens: int,
               chain: ChainGroups | None = None) -> None:
        try:
            self.index.apply_event(self.backend, event, prefix_hash, tokens, chain or ())
        except StoreError as exc:
            self._count_dropped()
            log.debug("KV event stream %s: index dropped an event: %s", self.backend, exc)
        except ValueError as exc:  # the index refused it: the record was malformed after all
            raise MalformedRecord(str(exc)) from exc
        else:
            if event == CACHE_CREATED:
                self.index_created += 1
            else:
                self.index_evicted += 1
        self.events_received += 1
        self._delivered += 1
        self.last_event_at = self.clock.now()
        self.metrics.received.labels(self.backend, event).inc()

    def _count_dropped(self) -> None:
        self.events_dropped += 1
        self.metrics.dropped.labels(self.backend).inc()

    def stats(self) -> SourceStats:
        """This source's counters, read together."""
        return SourceStats(
            backend_name=self.backend,
            state=self.state,
            connected=self.connected,
            events_received=self.events_received,
            events_dropped=self.events_dropped,
            malformed=self.malformed,
            last_event_at=iso_utc(self.last_event_at),
            reconnect_count=self.reconnect_count,
            index_created=self.index_created,
            index_evicted=self.index_evicted,
            last_event_id=self.last_event_id,
        )


class KvEventConsumerManager:
    """One :class:`SourceConsumer` per configured event source, started in the worker.

    Args:
        sources: ``kv_cache_index.event_sources`` (sources without an endpoint are skipped).
        index: The index every consumer feeds.
        registry: The app's Prometheus registry (``RouterMetrics.registry``); a private one
            when None.
        clock: Time source for backoff sleeps and ``last_event_at``.
        spawn: Runs one consumer loop; :func:`default_spawn` when None.
        connect_timeout: Seconds to open a connection.
        read_timeout: Seconds a stream may stay silent; None (default) relies on TCP
            keepalive instead, so quiet but healthy streams are not churned.
        tokens: The listener's bearer token by backend name (from
            :meth:`~continuum.config.KvCacheIndexConfig.source_token`); none sent when
            absent.
        lease: run each consumer only while this worker holds its lease (one consumer
            per host or fleet, :mod:`continuum.kv.lease`); None: every consumer runs.
    """

    def __init__(self, sources: Sequence[KvEventSourceConfig], index: KvCacheIndex,
                 registry: CollectorRegistry | None = None, clock: Clock | None = None, *,
                 spawn: Spawn | None = None, connect_timeout: float = 5.0,
                 read_timeout: float | None = None,
                 tokens: Mapping[str, str | None] | None = None,
                 lease: LeasedConsumers | None = None) -> None:
        self.metrics = KvConsumerMetrics.for_registry(registry or CollectorRegistry())
        self.spawn = spawn
        self.clock: Clock = clock or SystemClock()
        #: With a lease (continuum.kv.lease), a consumer runs only in its lease's holder.
        self.lease = lease
        tokens = tokens or {}
        self.consumers = [
            SourceConsumer(source, index, self.metrics, self.clock,
                           connect_timeout=connect_timeout, read_timeout=read_timeout,
                           token=tokens.get(source.backend_name))
            for source in sources if source.endpoint
        ]
        self._handles: list[Any] = []

    def start(self) -> None:
        """Start every consumer (call in the worker, after the fork); idempotent.

        ``stop`` is final: a stopped manager does not start again (build a new one).
        """
        if self._handles:
            return
        spawn = self.spawn or default_spawn
        if self.lease is not None:
            self._handles = self.lease.start(self, spawn)
            return
        self._handles = [consumer.start(spawn) for consumer in self.consumers]

    def stop(self, timeout: float = 10.0, *, hand_over_leases: bool = False) -> None:
        """Stop every consumer and wait up to ``timeout`` seconds for each loop to end.

        ``hand_over_leases``: keep this worker's KV leases for the manager that replaces
        this one (:meth:`LeasedConsumers.renewed`) instead of releasing them."""
        if self.lease is not None:
            self.lease.stop(hand_over=hand_over_leases)
        for consumer in self.consumers:
            consumer.stop()
        for handle in self._handles:
            handle.join(timeout)
        self._handles = []

    def consumer(self, backend: str) -> SourceConsumer:
        """The consumer of ``backend``'s stream."""
        for consumer in self.consumers:
            if consumer.backend == backend:
                return consumer
        raise KeyError(backend)

    def stats(self) -> list[SourceStats]:
        """Per-source statistics, in config order."""
        lease = self.lease
        if lease is None:
            return [consumer.stats() for consumer in self.consumers]
        return [replace(consumer.stats(), consumed_by=lease.consumed_by(consumer.backend))
                if consumer.leased else consumer.stats() for consumer in self.consumers]
