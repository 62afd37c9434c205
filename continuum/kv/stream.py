"""One listener stream as a consumer sees it: transports, the reconnect backoff rule, time.

Split from :mod:`continuum.kv.consumer` (which holds the state machine and the event
handling) so each module stays one concept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from continuum.wire.sse import SseTransport
from continuum.wire.websocket import WebSocketTransport

MAX_BACKOFF_MS = 60_000


class Clock(Protocol):
    """Time as the consumer sees it; tests inject a fake one to assert backoff delays."""

    def now(self) -> float:
        """Wall-clock seconds since the epoch (for ``last_event_at``)."""

    def wait(self, seconds: float, wake: threading.Event) -> None:
        """Sleep ``seconds``, or less when ``wake`` gets set."""


class SystemClock:
    """The real clock; ``wait`` is ``wake.wait`` (cooperative under gevent's patching)."""

    def now(self) -> float:
        """``time.time()``."""
        return time.time()

    def wait(self, seconds: float, wake: threading.Event) -> None:
        """Block on ``wake`` for up to ``seconds``."""
        wake.wait(seconds)


Spawn = Callable[[Callable[[], None]], Any]


def default_spawn(target: Callable[[], None]) -> Any:
    """A greenlet when gevent has patched ``socket``, else a daemon thread; both ``join``."""
    from gevent import monkey

    if monkey.is_module_patched("socket"):
        import gevent

        return gevent.spawn(target)
    thread = threading.Thread(target=target, name="kv-consumer", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class Backoff:
    """The reconnect delay rule, in milliseconds (see the module's invariants)."""

    base_ms: int

    @property
    def cap_ms(self) -> int:
        """``max(reconnect_interval_ms, 60 s)``."""
        return max(self.base_ms, MAX_BACKOFF_MS)

    def delay(self, current_ms: int, reset: bool, retry_ms: int | None = None) -> tuple[int, int]:
        """``(this delay, the next one)`` after a connection ended.

        Args:
            current_ms: The delay the schedule is at (``base_ms`` before any failure).
            reset: The connection delivered an event, or the listener ended it on purpose.
            retry_ms: The stream's SSE ``retry:``; a floor for this delay only.
        """
        scheduled = self.base_ms if reset else current_ms
        wait = scheduled if retry_ms is None else max(scheduled, min(retry_ms, self.cap_ms))
        return wait, min(scheduled * 2, self.cap_ms)


class Transport(Protocol):
    """One open stream (:class:`~continuum.wire.sse.SseTransport` or
    :class:`~continuum.wire.websocket.WebSocketTransport`)."""

    @property
    def retry_ms(self) -> int | None:
        """The stream's SSE ``retry:`` (None for WebSocket or when never sent)."""

    @property
    def high_water(self) -> int:
        """The most bytes one buffer of the stream ever held."""

    def records(self) -> Iterator[tuple[str | None, str | dict[str, Any] | None, str | None]]:
        """``(sse event field, data, id)`` per record, until the stream ends."""

    def shutdown(self) -> None:
        """Wake a blocked read from another thread or greenlet."""

    def close(self) -> None:
        """Release the connection."""


def open_transport(endpoint: str, last_event_id: str | None, connect_timeout: float,
                   read_timeout: float | None, token: str | None = None) -> Transport:
    """Connect to ``endpoint`` resuming after ``last_event_id`` (header or query parameter),
    sending ``Authorization: Bearer <token>`` when the listener wants a token."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if urlsplit(endpoint).scheme in ("ws", "wss"):
        return WebSocketTransport.open(endpoint, last_event_id, connect_timeout, read_timeout,
                                       headers)
    return SseTransport.open(endpoint, last_event_id, connect_timeout, read_timeout, headers)
