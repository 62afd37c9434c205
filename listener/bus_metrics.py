"""``/metrics`` of the push-mode client: read from :class:`listener.bus_client.BusClient` at
scrape time, like every other listener metric."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from listener.bus_client import BusClient

PREFIX = "continuum_kv_listener_bus_"


class BusCollector:
    """``bus_connected`` (1 while a session is open), ``bus_sessions_total{outcome}``
    (welcomed, refused, forbidden), ``bus_streams_total`` (streams pushed) and
    ``bus_bytes_total`` (SSE bytes pushed)."""

    def __init__(self, client: BusClient) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        """The client's metrics."""
        counters = self.client.counters
        yield GaugeMetricFamily(PREFIX + "connected", "1 while the event-bus session is open",
                                value=1 if self.client.connected else 0)
        sessions = CounterMetricFamily(PREFIX + "sessions", "Event-bus session attempts by "
                                       "outcome", labels=["outcome"])
        for outcome in ("welcomed", "refused", "forbidden"):
            sessions.add_metric([outcome], counters.sessions.get(outcome, 0))
        yield sessions
        yield CounterMetricFamily(PREFIX + "streams", "Streams pushed to the event bus",
                                  value=counters.streams)
        yield CounterMetricFamily(PREFIX + "bytes", "SSE bytes pushed to the event bus",
                                  value=counters.bytes_out)
