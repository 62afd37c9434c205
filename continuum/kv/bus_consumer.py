"""The router's consumer of a ``transport: event_bus`` source (push mode).

The listener pushes to the host's event-bus process (:mod:`continuum.kv.bus_process`); a
worker reads the bus over loopback with the **pull-mode consumer and SSE parser**
(:class:`~continuum.kv.consumer.SourceConsumer`), so both transports apply the same bytes
the same way. Only two things differ, through the consumer's hooks:

* where to connect: ``bus-local.json`` in the runtime directory names the bus's loopback URL
  and token, read again at every connect (a restarted bus moves);
* when to retry: ``no_session`` (no bus yet, or the bus answered 503 because no listener
  session announces the source) retries at ``reconnect_interval_ms`` without growing, so a
  stream opens right after a listener connects; ``draining`` (the listener is shutting
  down, the bus no longer offers its session) retries at once, so another session takes
  over. Every other end follows the pull-mode rule (doubling up to
  ``max(reconnect_interval_ms, 60 s)``; ``buffer_overflow`` resubscribes from the last id).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from continuum.config import KvEventSourceConfig
from continuum.errors import ContinuumError
from continuum.hostshm import RUNTIME_DIR_ENV
from continuum.interfaces import KvCacheIndex
from continuum.kv.bus_process import read_bus_file
from continuum.kv.consumer import DRAINING, KvEventConsumerManager, SourceConsumer
from continuum.kv.stream import Transport, open_transport
from continuum.wire.sse import StreamOpenError

NO_SESSION = "no_session"
EVENT_BUS = "event_bus"


class BusUnavailable(ContinuumError, ConnectionError):
    """No event-bus process has published its address on this host (yet)."""


class BusSourceConsumer(SourceConsumer):
    """A :class:`SourceConsumer` whose stream comes from the host's event bus.

    Args:
        runtime_dir: Where ``bus-local.json`` is (``$CONTINUUM_RUNTIME_DIR``).
        (the rest as :class:`SourceConsumer`)
    """

    #: Every worker reads the host's bus over loopback (the bus process holds the one
    #: session per listener), so no KV lease applies.
    leased: ClassVar[bool] = False

    def __init__(self, *args: object, runtime_dir: str | None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.runtime_dir = runtime_dir
        #: Connect attempts that found no session announcing this source.
        self.no_session = 0
        self._no_session = False

    def _fresh_options(self) -> dict[str, Any]:
        return {"runtime_dir": self.runtime_dir}

    def _open(self) -> Transport:
        self._no_session = False
        found = read_bus_file(self.runtime_dir)
        if found is None:
            self._no_session = True
            self.no_session += 1
            raise BusUnavailable("no event bus on this host yet (bus-local.json)")
        url, token = found
        self.endpoint = f"{url}/events/{self.backend}"
        try:
            return open_transport(self.endpoint, self.last_event_id, self.connect_timeout,
                                  self.read_timeout, token)
        except StreamOpenError as exc:
            # 503 is no_session; 504 (subscribe_timeout) backs off like any failure
            if exc.fields.get("status") == 503:
                self._no_session = True
                self.no_session += 1
            raise

    def _next_delay(self, reason: str, reset: bool, retry_ms: int | None,
                    current: int) -> tuple[int, int]:
        if self._no_session:
            return self.backoff.base_ms, current
        if reason == DRAINING:
            return 0, self.backoff.base_ms
        return super()._next_delay(reason, reset, retry_ms, current)


def add_bus_consumers(manager: KvEventConsumerManager, sources: Sequence[KvEventSourceConfig],
                      index: KvCacheIndex, *, runtime_dir: str | None = None,
                      connect_timeout: float = 5.0) -> list[BusSourceConsumer]:
    """Add a :class:`BusSourceConsumer` to ``manager`` for each ``transport: event_bus``
    source (call before :meth:`KvEventConsumerManager.start`)."""
    runtime_dir = runtime_dir or os.environ.get(RUNTIME_DIR_ENV)
    added = [
        BusSourceConsumer(source, index, manager.metrics, manager.clock,
                          connect_timeout=connect_timeout, read_timeout=None,
                          runtime_dir=runtime_dir)
        for source in sources if source.transport == EVENT_BUS and not source.endpoint
    ]
    manager.consumers.extend(added)
    return added


def rebuild_consumers(old: KvEventConsumerManager, sources: Sequence[KvEventSourceConfig],
                      index: KvCacheIndex, tokens: Mapping[str, str | None],
                      registry: CollectorRegistry | None = None) -> KvEventConsumerManager:
    """A ``kv_cache_index.event_sources`` hot reload: stop every consumer of ``old`` and
    start one per source in ``sources``, pull and push alike. A source whose stream did not
    change (same backend, transport and endpoint) resumes from its last event id, so the
    restart neither replays nor skips an event; a new stream starts with the listener's
    snapshot. The new manager keeps the old one's KV lease (:mod:`continuum.kv.lease`):
    still one consumer per host or fleet."""
    resume = {(c.backend, type(c), c.endpoint if not isinstance(c, BusSourceConsumer) else ""):
              c.last_event_id for c in old.consumers}
    old.stop(hand_over_leases=True)
    lease = old.lease.renewed() if old.lease is not None else None
    manager = KvEventConsumerManager(sources, index, registry, old.clock, spawn=old.spawn,
                                     tokens=tokens, lease=lease)
    add_bus_consumers(manager, sources, index)
    for consumer in manager.consumers:
        key = (consumer.backend, type(consumer),
               consumer.endpoint if not isinstance(consumer, BusSourceConsumer) else "")
        consumer.last_event_id = resume.get(key)
    manager.start()
    return manager
