"""Every metric family the router exports, and Prometheus naming conventions for each.

The list below is the inventory: a family added or renamed without updating it (and
docs/metrics.md) fails here. The conventions checked are those of the Prometheus docs
("Metric and label naming"): a ``continuum_`` prefix, snake case, counters ending in
``_total``, nothing else ending in ``_total`` or a reserved sample suffix, times in
``_seconds``, no PID label; then Prometheus' own linter (``promtool check metrics``) reads
the exposition with every family holding a sample.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from continuum.kv.consumer import KvConsumerMetrics
from continuum.metrics import RequestRecord, RouterMetrics

ROOT = Path(__file__).resolve().parents[2]

#: name (as exposed, counters with ``_total``) -> type
EXPORTED = {
    "continuum_requests_total": "counter",
    "continuum_upstream_attempts_total": "counter",
    "continuum_request_duration_seconds": "histogram",
    "continuum_time_to_first_token_seconds": "histogram",
    "continuum_upstream_time_to_first_byte_seconds": "histogram",
    "continuum_prompt_tokens_total": "counter",
    "continuum_cached_prompt_tokens_total": "counter",
    "continuum_cache_creation_prompt_tokens_total": "counter",
    "continuum_completion_tokens_total": "counter",
    "continuum_backend_in_flight": "gauge",
    "continuum_backend_healthy": "gauge",
    "continuum_upstream_errors_total": "counter",
    "continuum_upstream_retries_total": "counter",
    "continuum_backend_health_transitions_total": "counter",
    "continuum_prefix_routing_requests_total": "counter",
    "continuum_prefix_routing_backend_distribution_total": "counter",
    "continuum_response_cache_requests_total": "counter",
    "continuum_response_cache_stores_total": "counter",
    "continuum_response_cache_entries": "gauge",
    "continuum_response_cache_evictions_total": "counter",
    "continuum_semantic_cache_requests_total": "counter",
    "continuum_semantic_cache_skips_total": "counter",
    "continuum_semantic_cache_gate_refusals_total": "counter",
    "continuum_semantic_cache_embedding_seconds": "histogram",
    "continuum_semantic_cache_embedding_errors_total": "counter",
    "continuum_semantic_cache_index_entries": "gauge",
    "continuum_cache_redis_latency_seconds": "histogram",
    "continuum_cache_redis_errors_total": "counter",
    "continuum_cache_fallback_active": "gauge",
    "continuum_kv_index_routing_decisions_total": "counter",
    "continuum_kv_index_overlap_score": "histogram",
    "continuum_kv_index_query_latency_seconds": "histogram",
    "continuum_workers": "gauge",
    "continuum_kv_events_received_total": "counter",
    "continuum_kv_event_dropped_total": "counter",
    "continuum_kv_consumer_connected": "gauge",
    "continuum_kv_consumer_reconnects_total": "counter",
    "continuum_kv_malformed_records_total": "counter",
}

#: Histograms of a dimensionless quantity (a composite score in [0, 1]), not a time.
UNITLESS_HISTOGRAMS = {"continuum_kv_index_overlap_score"}
NAME = re.compile(r"continuum_[a-z][a-z0-9]*(_[a-z0-9]+)*")
LABEL = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
RESERVED_SUFFIXES = ("_count", "_sum", "_bucket", "_created", "_info")


def _metrics() -> RouterMetrics:
    metrics = RouterMetrics()
    KvConsumerMetrics.for_registry(metrics.registry)
    return metrics


def _exposed(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" else name


def _families(metrics: RouterMetrics) -> dict[str, tuple[str, str, list[str]]]:
    """name -> (type, help, label names) of every family the registry describes."""
    out = {}
    for collector in list(metrics.registry._collector_to_names):
        if isinstance(collector, Counter | Gauge | Histogram):
            kind = collector._type
            out[_exposed(collector._name, kind)] = (
                kind, collector._documentation, list(collector._labelnames))
    return out


def test_the_inventory_lists_every_exported_family() -> None:
    found = _families(_metrics())
    assert {name: kind for name, (kind, _h, _l) in found.items()} == EXPORTED


def test_names_labels_and_units_follow_prometheus_conventions() -> None:
    for name, (kind, help_text, labels) in _families(_metrics()).items():
        assert NAME.fullmatch(name), name
        assert help_text.strip(), f"{name} has no help text"
        assert (kind == "counter") == name.endswith("_total"), name
        assert not name.removesuffix("_total").endswith(RESERVED_SUFFIXES), name
        if kind == "histogram" and name not in UNITLESS_HISTOGRAMS:
            assert name.endswith("_seconds"), f"{name}: a histogram of times ends in _seconds"
        if re.search(r"latency|duration|time", name):
            assert name.endswith(("_seconds", "_seconds_total")), name
        for label in labels:
            assert LABEL.fullmatch(label), (name, label)
            assert label not in ("pid", "process", "le", "quantile"), (name, label)


def _populated() -> bytes:
    """The exposition with a sample in every family (dummy label values)."""
    metrics = _metrics()
    for collector in list(metrics.registry._collector_to_names):
        if not isinstance(collector, Counter | Gauge | Histogram):
            continue
        target = collector.labels(*["x"] * len(collector._labelnames)) \
            if collector._labelnames else collector
        if isinstance(target, Histogram):
            target.observe(0.5)
        else:
            target.inc()
    record = RequestRecord("chat", "rid")
    record.backend, record.decision, record.status, record.stream = "a", "strategy", 200, True
    record.mark_first_byte()
    record.prompt_tokens, record.cached_tokens, record.completion_tokens = 10, 4, 2
    metrics.observe_request(record)
    return metrics.exposition()


def test_promtool_lints_the_exposition_clean() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    result = subprocess.run([promtool, "check", "metrics"], input=_populated(),
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0 and not result.stdout.strip() \
        and not result.stderr.strip(), (result.stdout + result.stderr).decode()


def test_docs_name_every_family() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [name for name in EXPORTED if f"`{name}`" not in text]
    assert not missing, missing
