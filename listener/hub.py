"""Per-backend SSE event streams: ids, bounded history, resume, snapshots, backpressure.

Every :class:`~listener.model.PrefixEvent` a processor emits is published here, numbered,
formatted once as an SSE record and handed to each subscriber of that backend's stream
(``GET /events/<backend>``).

**Event ids.** ``<epoch>-<n>``: ``n`` counts a backend's events from 1 in this listener run;
``epoch`` is chosen at start (hex seconds plus random hex), so a restarted listener never
reissues an id of a previous run. The router treats ids as opaque strings and resumes with
``Last-Event-ID`` (or ``?last_event_id=``):

=================================================  =========================================
resume id                                          the subscriber first receives
=================================================  =========================================
``<epoch>-<n>``, this epoch, ``n`` in history      the events after ``n`` (none if ``n`` is
(``oldest - 1 <= n <= latest``)                    the latest), then live events
none, malformed, another epoch (a previous run),   ``cache_cleared``, then a *snapshot*: one
``n`` older than the history or newer than the     ``cache_created`` (``cache_offloaded`` for
latest                                             prefixes last reported offloaded) per prefix
                                                   the backend holds now, then live events
=================================================  =========================================

Snapshot records carry no ``id:`` except the last one, which carries the id of the latest
event the snapshot reflects: a consumer that loses the connection in the middle of a
snapshot still holds its old id and is sent a complete snapshot again, and one that got to
the end resumes exactly after the snapshot. The snapshot comes from the hub's own view of
the stream — prefix → (tier, token_count), kept from the events it published
(``cache_created``/``cache_offloaded`` set an entry, ``cache_evicted`` removes it,
``cache_cleared`` empties the backend) — so processors need no snapshot API. A prefix whose
last event was ``cache_evicted`` is not in a snapshot (the router, whatever its
``treat_eviction_as_offload``, would at most hold it as warm storage).

**Subscriber lifecycle** (one per connection; only the hub changes it):

=========  ===============================================  ===========
state      event                                            next
=========  ===============================================  ===========
open       more than ``subscriber_queue`` events waiting     overflowed
open       :meth:`EventHub.close` (SIGTERM)                 draining
open       client gone (the stream generator is closed)     closed
overflowed queued events sent, then ``buffer_overflow``      closed
draining   queued events sent, then ``draining``            closed
=========  ===============================================  ===========

Invariants:
  * Ids of one backend in one run are consecutive; each live subscriber receives every
    event after its starting point exactly once and in order, or is closed with
    ``buffer_overflow``/``draining`` (control records carry no id and never move the
    consumer's position) — events are never dropped silently.
  * A subscriber's pending queue never holds more than ``subscriber_queue`` events, and a
    backend never has more than ``max_subscribers`` subscribers: :meth:`EventHub.stream`
    raises :class:`SubscriberLimitError` instead (counted in ``refused``). The check and the
    registration run in the same greenlet without a switch between them (the WSGI server
    runs the stream generator right after the responder returns), so concurrent requests
    cannot both take the last place.
  * Subscribing (backlog + registration) happens without yielding to another greenlet, so
    no event can fall between the backlog and the live queue. The hub is used from one OS
    thread (gevent); it takes no locks.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from gevent.event import Event

from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, CACHE_OFFLOADED, PrefixEvent

__all__ = [
    "BUFFER_OVERFLOW",
    "DRAINING",
    "KEEPALIVE",
    "EventHub",
    "HubStateError",
    "SubscriberLimitError",
    "format_record",
    "new_epoch",
]

log = logging.getLogger(__name__)

#: Control events: end the stream, carry no id.
BUFFER_OVERFLOW = "buffer_overflow"
DRAINING = "draining"
#: Comment line sent on idle streams so proxies and dead peers are noticed.
KEEPALIVE = b": keepalive\n\n"
#: First bytes of every stream, so the response headers go out at once.
OPENED = b": open\n\n"

OPEN, OVERFLOWED, CLOSED = "open", "overflowed", "closed"
_TRANSITIONS: dict[tuple[str, str], str] = {
    (OPEN, BUFFER_OVERFLOW): OVERFLOWED,
    (OPEN, DRAINING): DRAINING,
    (OPEN, "gone"): CLOSED,
    (OVERFLOWED, "sent"): CLOSED,
    (OVERFLOWED, "gone"): CLOSED,
    (DRAINING, "sent"): CLOSED,
    (DRAINING, "gone"): CLOSED,
}

_ID = re.compile(r"([0-9a-f]{1,32})-(\d{1,18})")
_GPU, _STORAGE = "gpu", "storage"


class HubStateError(RuntimeError):
    """A subscriber transition that the lifecycle table does not allow."""

    def __init__(self, state: str, event: str) -> None:
        super().__init__(f"subscriber in state {state!r} cannot take event {event!r}")
        self.state = state
        self.event = event


class SubscriberLimitError(RuntimeError):
    """A backend already has ``max_subscribers`` open subscriptions."""

    def __init__(self, backend: str, limit: int) -> None:
        super().__init__(f"backend {backend!r} already has {limit} subscribers")
        self.backend = backend
        self.limit = limit


def new_epoch() -> str:
    """A run id for event ids: start time in hex seconds plus 16 random bits."""
    return f"{int(time.time()):x}{secrets.token_hex(2)}"


def format_record(event: PrefixEvent | str, record_id: str | None = None) -> bytes:
    """One SSE record: ``id:`` (optional), ``event:``, ``data:`` JSON, blank line.

    A control event (``buffer_overflow``, ``draining``) is given by name. ``prefix_hash``
    and ``token_count`` appear in the JSON only when set; ``chain`` (an object of event
    types to ``[key, token_count]`` lists) only when the event carries chain changes.
    """
    payload: dict[str, Any]
    if isinstance(event, str):
        kind, payload = event, {"event": event}
    else:
        kind, payload = event.type, {"event": event.type}
        if event.prefix_hash is not None:
            payload["prefix_hash"] = event.prefix_hash
        if event.token_count is not None:
            payload["token_count"] = event.token_count
        if event.chain:
            chain: dict[str, list[list[str | int]]] = {}
            for change, key, tokens in event.chain:
                chain.setdefault(change, []).append([key, tokens])
            payload["chain"] = chain
    head = f"id: {record_id}\n" if record_id is not None else ""
    data = json.dumps(payload, separators=(",", ":"))
    return f"{head}event: {kind}\ndata: {data}\n\n".encode()


@dataclass
class BackendCounters:
    """What the hub counts per backend (exported by ``/metrics``)."""

    events_out: dict[str, int] = field(default_factory=dict)
    overflows: int = 0
    refused: int = 0
    resumes_history: int = 0
    resumes_snapshot: int = 0


class _Stream:
    """One backend: its numbering, history, current view and subscribers."""

    def __init__(self, history_size: int) -> None:
        self.latest = 0
        self.history: deque[tuple[int, bytes]] = deque(maxlen=history_size)
        self.view: dict[str, tuple[str, int | None]] = {}
        #: prefix -> chain key -> (tier, tokens): the chain keys last reported per prefix
        self.chain_view: dict[str, dict[str, tuple[str, int]]] = {}
        self.subscribers: set[_Subscriber] = set()
        self.counters = BackendCounters()

    def apply(self, event: PrefixEvent) -> None:
        if event.type == CACHE_CLEARED:
            self.view.clear()
            self.chain_view.clear()
            return
        if event.prefix_hash is None:
            return
        if event.chain:
            keys = self.chain_view.setdefault(event.prefix_hash, {})
            for kind, key, held in event.chain:
                if kind == CACHE_EVICTED:
                    keys.pop(key, None)
                else:
                    keys[key] = (_GPU if kind == CACHE_CREATED else _STORAGE, held)
            if not keys:
                del self.chain_view[event.prefix_hash]
        if event.type == CACHE_EVICTED:
            self.chain_view.pop(event.prefix_hash, None)
        if event.type == CACHE_CREATED:
            self.view[event.prefix_hash] = (_GPU, event.token_count)
        elif event.type == CACHE_OFFLOADED:
            old = self.view.get(event.prefix_hash)
            tokens = event.token_count if event.token_count is not None else (
                old[1] if old else None)
            self.view[event.prefix_hash] = (_STORAGE, tokens)
        elif event.type == CACHE_EVICTED:
            self.view.pop(event.prefix_hash, None)


class _Subscriber:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.state = OPEN
        self.queue: deque[bytes] = deque()
        self.wake = Event()

    def advance(self, event: str) -> None:
        new = _TRANSITIONS.get((self.state, event))
        if new is None:
            raise HubStateError(self.state, event)
        self.state = new
        self.wake.set()


class EventHub:
    """Numbered, resumable per-backend event streams.

    Args:
        backends: The backend names (one stream each; others are unknown).
        history_size: Events kept per backend for ``Last-Event-ID`` resume.
        subscriber_queue: Events one subscriber may have waiting before it is closed with
            ``buffer_overflow``.
        epoch: Run id used in event ids (default :func:`new_epoch`).
        max_subscribers: Open subscriptions one backend may have.
    """

    def __init__(self, backends: Iterable[str], *, history_size: int = 10000,
                 subscriber_queue: int = 10000, epoch: str | None = None,
                 max_subscribers: int = 256) -> None:
        if history_size < 1 or subscriber_queue < 1 or max_subscribers < 1:
            raise ValueError("history_size, subscriber_queue and max_subscribers must be >= 1")
        self.max_subscribers = max_subscribers
        self.epoch = epoch or new_epoch()
        if not re.fullmatch(r"[0-9a-f]{1,32}", self.epoch):
            raise ValueError(f"epoch must be 1-32 lowercase hex digits, got {self.epoch!r}")
        self.subscriber_queue = subscriber_queue
        self._streams = {name: _Stream(history_size) for name in backends}
        self._closed = False

    @property
    def backends(self) -> tuple[str, ...]:
        """The backend names, in configuration order."""
        return tuple(self._streams)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def has_backend(self, backend: str) -> bool:
        """Whether ``backend`` has a stream."""
        return backend in self._streams

    def event_id(self, n: int) -> str:
        """The id of event ``n`` of this run."""
        return f"{self.epoch}-{n}"

    def latest_id(self, backend: str) -> str:
        """The id of the latest event of ``backend`` (``<epoch>-0`` before the first)."""
        return self.event_id(self._streams[backend].latest)

    def publish(self, backend: str, event: PrefixEvent) -> str:
        """Number ``event``, keep it in history and queue it for every subscriber.

        Returns:
            The event id.

        Raises:
            KeyError: Unknown backend.
        """
        stream = self._streams[backend]
        stream.latest += 1
        record_id = self.event_id(stream.latest)
        record = format_record(event, record_id)
        stream.history.append((stream.latest, record))
        stream.apply(event)
        counts = stream.counters.events_out
        counts[event.type] = counts.get(event.type, 0) + 1
        for sub in list(stream.subscribers):
            if len(sub.queue) >= sub.limit:
                stream.subscribers.discard(sub)
                stream.counters.overflows += 1
                sub.advance(BUFFER_OVERFLOW)
                log.warning("subscriber of %s fell %d events behind: closing its stream with "
                            "buffer_overflow", backend, sub.limit)
            else:
                sub.queue.append(record)
                sub.wake.set()
        return record_id

    def publisher(self, backend: str) -> _Publisher:
        """A callable that publishes to ``backend`` (a processor's ``emit``)."""
        if backend not in self._streams:
            raise KeyError(backend)
        return _Publisher(self, backend)

    def close(self) -> None:
        """Send ``draining`` to every subscriber (after what is queued) and end their streams;
        later subscribers get ``draining`` at once. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for name, stream in self._streams.items():
            for sub in list(stream.subscribers):
                sub.advance(DRAINING)
            if stream.subscribers:
                log.info("draining %d subscriber(s) of %s", len(stream.subscribers), name)
            stream.subscribers.clear()

    def subscribers(self, backend: str) -> int:
        """Open subscriptions of ``backend``."""
        return len(self._streams[backend].subscribers)

    def counters(self, backend: str) -> BackendCounters:
        """The counters of ``backend``."""
        return self._streams[backend].counters

    def view_size(self, backend: str) -> int:
        """Prefixes the backend holds according to its stream."""
        return len(self._streams[backend].view)

    def stream(self, backend: str, last_event_id: str | None = None,
               keepalive: float = 15.0) -> Generator[bytes, None, None]:
        """The SSE byte stream of one subscriber (a generator for ``resp.stream``).

        The subscription starts when the generator first runs and ends in its ``finally``:
        a client that goes away (the WSGI server closes the generator) is unsubscribed.

        Args:
            backend: A known backend (check :meth:`has_backend` first).
            last_event_id: The resume id, if any (see the module docstring).
            keepalive: Seconds of silence before a ``: keepalive`` comment.

        Raises:
            KeyError: Unknown backend (raised when the generator is created).
            SubscriberLimitError: The backend has ``max_subscribers`` subscribers already.
        """
        stream = self._streams[backend]  # KeyError now, not at the first next()
        if len(stream.subscribers) >= self.max_subscribers:
            stream.counters.refused += 1
            raise SubscriberLimitError(backend, self.max_subscribers)
        return self._run(backend, stream, last_event_id, keepalive)

    def _run(self, backend: str, stream: _Stream, last_event_id: str | None,
             keepalive: float) -> Generator[bytes, None, None]:
        sub = _Subscriber(self.subscriber_queue)
        backlog = self._backlog(backend, stream, last_event_id)
        if self._closed:
            sub.advance(DRAINING)
        else:
            stream.subscribers.add(sub)
        try:
            yield OPENED + b"".join(backlog)
            while True:
                if sub.queue:
                    chunk = b"".join(sub.queue)
                    sub.queue.clear()
                    yield chunk
                    continue
                if sub.state in (OVERFLOWED, DRAINING):
                    control = BUFFER_OVERFLOW if sub.state == OVERFLOWED else DRAINING
                    sub.advance("sent")
                    yield format_record(control)
                    return
                sub.wake.clear()
                if not sub.wake.wait(keepalive):
                    yield KEEPALIVE
        finally:
            stream.subscribers.discard(sub)
            if sub.state != CLOSED:
                sub.advance("gone")

    def _backlog(self, backend: str, stream: _Stream, last_event_id: str | None) -> list[bytes]:
        match = _ID.fullmatch(last_event_id.strip()) if last_event_id else None
        if match and match.group(1) == self.epoch:
            n = int(match.group(2))
            oldest = stream.history[0][0] if stream.history else stream.latest + 1
            if oldest - 1 <= n <= stream.latest:
                stream.counters.resumes_history += 1
                # history holds consecutive numbers: event n+1 sits at index n+1-oldest
                start = n + 1 - oldest
                return [record for _, record in itertools.islice(stream.history, start, None)]
            why = "older than the history" if n < oldest - 1 else "newer than the latest event"
        elif last_event_id:
            why = "from another listener run" if match else "not an id of this listener"
        else:
            why = "none given"
        stream.counters.resumes_snapshot += 1
        log.info("new subscriber of %s (resume id %s): sending cache_cleared and a snapshot of "
                 "%d prefixes", backend, why, len(stream.view))
        return self._snapshot(stream)

    def _snapshot(self, stream: _Stream) -> list[bytes]:
        events = [PrefixEvent(CACHE_CLEARED)]
        for prefix, (tier, tokens) in stream.view.items():
            kind = CACHE_CREATED if tier == _GPU else CACHE_OFFLOADED
            chain = tuple((CACHE_CREATED if held == _GPU else CACHE_OFFLOADED, key, count)
                          for key, (held, count) in stream.chain_view.get(prefix, {}).items())
            events.append(PrefixEvent(kind, prefix, tokens, chain))
        last = self.event_id(stream.latest)
        return [format_record(event, last if i == len(events) - 1 else None)
                for i, event in enumerate(events)]


class _Publisher:
    """``emit`` for one backend's processor."""

    __slots__ = ("backend", "hub")

    def __init__(self, hub: EventHub, backend: str) -> None:
        self.hub = hub
        self.backend = backend

    def __call__(self, event: PrefixEvent) -> None:
        self.hub.publish(self.backend, event)
