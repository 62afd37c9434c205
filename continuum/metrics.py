"""Prometheus metrics, correct with several gunicorn workers.

With ``PROMETHEUS_MULTIPROC_DIR`` set (``continuum-router serve`` and
``conf/gunicorn.conf.py`` set it), every worker writes its samples to files there and
``/metrics`` aggregates all live and dead workers through ``MultiProcessCollector``; the
``child_exit`` hook marks dead workers. Without it, one process serves its own registry.

Metric objects live on a :class:`RouterMetrics` instance (no module-level singletons), so
tests can build as many apps as they like.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def multiprocess_enabled() -> bool:
    """Whether samples go through the multiprocess directory."""
    return bool(os.environ.get(MULTIPROC_ENV))


class RouterMetrics:
    """Every router metric, registered in one registry per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "continuum_requests_total",
            "Client requests by endpoint, backend and HTTP status",
            ["endpoint", "backend", "status"],
            registry=r,
        )
        self.duration = Histogram(
            "continuum_request_duration_seconds",
            "Time from dispatch to the last byte of the upstream response",
            ["endpoint", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "continuum_time_to_first_byte_seconds",
            "Time from dispatch to the first byte of the upstream response",
            ["endpoint", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "continuum_backend_in_flight",
            "Requests dispatched to a backend and not yet finished",
            ["backend"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.healthy = Gauge(
            "continuum_backend_healthy",
            "1 when the backend passes health checks (minimum over workers)",
            ["backend"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.upstream_errors = Counter(
            "continuum_upstream_errors_total",
            "Upstream failures by backend and kind (connect, timeout, stream, status, "
            "too_large, stream_duration)",
            ["backend", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "continuum_upstream_retries_total",
            "Requests retried on another backend after a connect failure",
            ["backend"],
            registry=r,
        )
        self.health_transitions = Counter(
            "continuum_backend_health_transitions_total",
            "Health state changes by backend and new state",
            ["backend", "state"],
            registry=r,
        )
        self.prefix_requests = Counter(
            "continuum_prefix_routing_requests_total",
            "PrefixAwareHash selections by decision (prefix_hash, overflow, fallback)",
            ["strategy"],
            registry=r,
        )
        self.prefix_distribution = Gauge(
            "continuum_prefix_routing_backend_distribution",
            "Requests PrefixAwareHash sent to each backend (rate() gives the load split)",
            ["backend"],
            multiprocess_mode="sum",
            registry=r,
        )
        self.response_cache = Counter(
            "continuum_response_cache_requests_total",
            "Response cache lookups by result (hit, miss, skip)",
            ["result"],
            registry=r,
        )
        self.response_cache_stores = Counter(
            "continuum_response_cache_stores_total",
            "Responses offered to the cache by outcome (stored, too_large, error, incomplete)",
            ["outcome"],
            registry=r,
        )
        self.cache_entries = Gauge(
            "continuum_response_cache_entries",
            "Entries in the in-memory response cache (per worker, summed)",
            [],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.cache_evictions = Counter(
            "continuum_response_cache_evictions_total",
            "Entries evicted from the in-memory response cache (LRU)",
            [],
            registry=r,
        )
        self.semantic_requests = Counter(
            "continuum_semantic_cache_requests_total",
            "Semantic cache lookups after an exact miss by result (hit, miss, skip)",
            ["result"],
            registry=r,
        )
        self.semantic_skips = Counter(
            "continuum_semantic_cache_skips_total",
            "Requests that skipped the semantic path, by reason",
            ["reason"],
            registry=r,
        )
        self.semantic_gate_refusals = Counter(
            "continuum_semantic_cache_gate_refusals_total",
            "Matches above the threshold the false-hit gate refused (negation, number, entity)",
            ["reason"],
            registry=r,
        )
        self.semantic_embedding_latency = Histogram(
            "continuum_semantic_cache_embedding_seconds",
            "Embedding call latency (failures included)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.semantic_embedding_errors = Counter(
            "continuum_semantic_cache_embedding_errors_total",
            "Failed embedding calls by kind (timeout, connect, status, invalid, protocol)",
            ["kind"],
            registry=r,
        )
        self.semantic_entries = Gauge(
            "continuum_semantic_cache_index_entries",
            "Vectors in the semantic index (per worker, summed)",
            [],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.redis_latency = Histogram(
            "continuum_cache_redis_latency_seconds",
            "Redis command latency by operation",
            ["operation"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0),
            registry=r,
        )
        self.redis_errors = Counter(
            "continuum_cache_redis_errors_total",
            "Redis failures by kind (connection, timeout, protocol, other)",
            ["kind"],
            registry=r,
        )
        self.fallback_active = Gauge(
            "continuum_cache_fallback_active",
            "1 while Redis is unreachable and the in-memory fallback serves (max over workers)",
            [],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.kv_decisions = Counter(
            "continuum_kv_index_routing_decisions_total",
            "KV scorer passes by decision (kv_aware, fallback) and the chosen backend's tier",
            ["decision", "tier"],
            registry=r,
        )
        self.kv_overlap_score = Histogram(
            "continuum_kv_index_overlap_score",
            "Best composite score of kv_aware decisions",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )
        self.kv_query_latency = Histogram(
            "continuum_kv_index_query_latency_seconds",
            "KV index query latency (one per scorer prepare)",
            buckets=(0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1),
            registry=r,
        )
        self.worker_requests = Gauge(
            "continuum_worker_requests",
            "Requests proxied by each live worker (pid label), to see how workers share load",
            [],
            multiprocess_mode="liveall",
            registry=r,
        )
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """The labelled child of ``metric``, cached (``labels()`` costs microseconds)."""
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def exposition(self) -> bytes:
        """The text exposition for ``GET /metrics``."""
        if multiprocess_enabled():
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return bytes(generate_latest(registry))
        return bytes(generate_latest(self.registry))
