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

import pytest
from prometheus_client import Counter, Gauge, Histogram

from continuum.kv.consumer import KvConsumerMetrics
from continuum.metrics import RequestRecord, RouterMetrics
from continuum.routing.gemini_dispatch import GeminiMetrics

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
    "continuum_backend_draining": "gauge",
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
    "continuum_kv_index_placements_total": "counter",
    "continuum_kv_index_overlap_score": "histogram",
    "continuum_kv_index_query_latency_seconds": "histogram",
    "continuum_workers": "gauge",
    "continuum_kv_events_received_total": "counter",
    "continuum_kv_event_dropped_total": "counter",
    "continuum_kv_consumer_connected": "gauge",
    "continuum_kv_consumer_reconnects_total": "counter",
    "continuum_kv_malformed_records_total": "counter",
    "continuum_gemini_context_cache_requests_total": "counter",
    "continuum_gemini_context_cache_operations_total": "counter",
    "continuum_gemini_cached_tokens_total": "counter",
}

#: Histograms of a dimensionless quantity (a composite score in [0, 1]), not a time.
UNITLESS_HISTOGRAMS = {"continuum_kv_index_overlap_score"}
NAME = re.compile(r"continuum_[a-z][a-z0-9]*(_[a-z0-9]+)*")
LABEL = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
RESERVED_SUFFIXES = ("_count", "_sum", "_bucket", "_created", "_info")


def _metrics() -> RouterMetrics:
    metrics = RouterMetrics()
    KvConsumerMetrics.for_registry(metrics.registry)
    GeminiMetrics(metrics)  # registered once a type: gemini backend is configured
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


@pytest.mark.parametrize(("name", "label", "values"), [
    ("continuum_prefix_routing_requests_total", "strategy",
     ("prefix_hash", "overflow", "fallback")),
    ("continuum_cache_redis_errors_total", "kind",
     ("connection", "timeout", "protocol", "other")),
])
def test_fixed_label_series_exist_at_zero_from_the_start(
        name: str, label: str, values: tuple[str, ...]) -> None:
    """A rate() over them (the overflow ratio, the Redis error rate) is 0 before the first
    event, under any strategy, not "no data"."""
    registry = RouterMetrics().registry
    assert [registry.get_sample_value(name, {label: v}) for v in values] == \
        [0.0] * len(values)


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


# --- the KV listener (continuum-kv-listener's /metrics) -------------------------------------

#: Every family the listener exports (``continuum_kv_listener_`` + this), as exposed.
LISTENER_EXPORTED = {
    "batches_in_total": "counter", "events_in_total": "counter",
    "skipped_events_total": "counter", "decode_errors_total": "counter",
    "sequence_gaps_total": "counter", "duplicates_total": "counter",
    "engine_restarts_total": "counter", "resets_total": "counter",
    "replays_total": "counter", "replay_failures_total": "counter",
    "rejected_publishers_total": "counter", "processor_errors_total": "counter",
    "polls_total": "counter", "publisher_disconnects_total": "counter",
    "pruned_sequence_streams_total": "counter", "poll_errors_total": "counter",
    "source_connected": "gauge", "events_out_total": "counter",
    "buffer_overflows_total": "counter", "subscriptions_refused_total": "counter",
    "subscriptions_total": "counter", "subscribers": "gauge", "prefixes": "gauge",
    "unauthorized_requests_total": "counter",
    "processor_tracked_blocks": "gauge", "processor_retained_tokens": "gauge",
    "processor_attributed_prefixes": "gauge", "processor_chain_keys": "gauge",
    "processor_chain_unknown_parents_total": "counter",
    "processor_pruned_blocks_total": "counter",
    "processor_detokenize_calls_total": "counter",
    "processor_detokenize_errors_total": "counter",
    "processor_detokenize_too_large_total": "counter",
    "processor_detokenize_cache_hits_total": "counter",
    "processor_events_in_total": "counter", "processor_events_out_total": "counter",
    "processor_ignored_blocks_total": "counter", "processor_masked_blocks_total": "counter",
    "processor_placeholder_blocks_total": "counter", "malformed_events_total": "counter",
    "processor_mismatched_blocks_total": "counter", "processor_salt_rejected_total": "counter",
    "processor_unattributed_chains_total": "counter",
}


def _listener_exposition() -> tuple[dict[str, tuple[str, str, list[str]]], bytes]:
    """A real listener (a vLLM ZMQ source and a TensorRT-LLM polled one, with the real
    processor), built but not started: its families (name -> type, help, labels) and its
    exposition."""
    from prometheus_client import CollectorRegistry, generate_latest

    from listener.app import Listener
    from listener.config import check_listener_config
    from listener.server import ListenerCollector, _Events

    config, errors, _warnings = check_listener_config({
        "listen": "127.0.0.1:0", "cache_salt": {"secret": "inventory-test-secret"},
        "sources": [
            {"backend_name": "v", "engine": "vllm", "model": "m",
             "zmq_endpoint": "tcp://127.0.0.1:5999", "allowed_publishers": ["127.0.0.1"],
             "detokenize_endpoint": "http://127.0.0.1:9/detokenize"},
            {"backend_name": "t", "engine": "trtllm", "model": "m",
             "allowed_publishers": ["127.0.0.1"],
             "trtllm_endpoint": "http://127.0.0.1:9/kv_cache_events"}]})
    assert config is not None, errors
    listener = Listener(config)
    try:
        for source in listener.sources:  # one sample in every family, poll errors too
            source.stats.poll_errors["connect"] = 1
        events = _Events(listener.hub, 1.0, None)
        collector = ListenerCollector(listener.hub, listener.sources, events)
        listener.hub.publish("v", _created())
        families = {}
        for family in collector.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = sorted({k for s in family.samples for k in s.labels})
            families[name] = (family.type, family.documentation, labels)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        return families, generate_latest(registry)
    finally:
        listener.stop(drain=0)


def _created() -> object:
    from listener.model import CACHE_CREATED, PrefixEvent

    return PrefixEvent(CACHE_CREATED, prefix_hash="ab" * 32, token_count=16)


def test_the_listener_inventory_lists_every_exported_family() -> None:
    families, _text = _listener_exposition()
    prefix = "continuum_kv_listener_"
    assert all(name.startswith(prefix) for name in families)
    assert {name.removeprefix(prefix): kind for name, (kind, _h, _l) in families.items()} \
        == LISTENER_EXPORTED


def test_listener_names_and_labels_follow_prometheus_conventions() -> None:
    families, _text = _listener_exposition()
    for name, (kind, help_text, labels) in families.items():
        assert NAME.fullmatch(name), name
        assert help_text.strip(), name
        assert (kind == "counter") == name.endswith("_total"), name
        assert not name.removesuffix("_total").endswith(RESERVED_SUFFIXES), name
        assert not re.search(r"latency|duration|seconds", name), name  # no times here
        for label in labels:
            assert LABEL.fullmatch(label), (name, label)
            assert label not in ("pid", "process", "le", "quantile"), (name, label)


def test_promtool_lints_the_listener_exposition_clean() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    _families, text = _listener_exposition()
    result = subprocess.run([promtool, "check", "metrics"], input=text,
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 0 and not result.stdout.strip() \
        and not result.stderr.strip(), (result.stdout + result.stderr).decode()


def test_docs_name_every_listener_family() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [f"continuum_kv_listener_{name}" for name in LISTENER_EXPORTED
               if f"`continuum_kv_listener_{name}`" not in text]
    assert not missing, missing
