"""The operator files under deploy/: Prometheus rules (checked and unit-tested by promtool)
and the Grafana dashboard, whose every query names only metrics the router exports.

tests/integration/test_prometheus_e2e.py then evaluates every query against a real
Prometheus scraping a real router.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.unit.test_metric_names import EXPORTED

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "continuum-router.json"
_METRIC = re.compile(r"\b(continuum_[a-z0-9_]+)")
_SERIES_SUFFIXES = ("_bucket", "_count", "_sum")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target."""
    doc = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in doc["panels"]
            for target in panel.get("targets", [])]


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_queries() -> list[tuple[str, str]]:
    """(alert name, the series its expression compares) of every alert."""
    return [(rule["alert"], rule["annotations"]["query"]) for rule in rules() if "alert" in rule]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                          check=False, cwd=RULES.parent)


def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_the_prefix_hit_rate_and_alerts() -> None:
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_compares_the_query_it_names() -> None:
    for rule in rules():
        if "alert" in rule:
            assert rule["annotations"]["query"] in rule["expr"], rule["alert"]
            assert rule["labels"]["severity"] in ("page", "warning", "info"), rule["alert"]


def _names(expr: str) -> set[str]:
    out = set()
    for name in _METRIC.findall(expr):
        for suffix in _SERIES_SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in EXPORTED:
                name = name.removesuffix(suffix)
        out.add(name)
    return out


def test_every_query_names_only_exported_metrics() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    exprs = dashboard_queries() + alert_queries() + \
        [(rule["record"], rule["expr"]) for rule in rules() if "record" in rule]
    for where, expr in exprs:
        unknown = _names(expr) - set(EXPORTED) - recorded
        assert not unknown, (where, unknown)


def test_the_dashboard_shows_what_the_issue_lists() -> None:
    used = set().union(*(_names(expr) for _t, expr in dashboard_queries()))
    for needed in ("continuum_requests_total", "continuum_time_to_first_token_seconds",
                   "continuum_cached_prompt_tokens_total", "continuum_prompt_tokens_total",
                   "continuum_response_cache_requests_total",
                   "continuum_kv_index_routing_decisions_total",
                   "continuum_kv_index_overlap_score", "continuum_backend_in_flight",
                   "continuum_prefix_routing_backend_distribution_total",
                   "continuum_cache_redis_latency_seconds", "continuum_cache_redis_errors_total",
                   "continuum_cache_fallback_active", "continuum_kv_consumer_connected",
                   "continuum_kv_event_dropped_total"):
        assert needed in used, needed
