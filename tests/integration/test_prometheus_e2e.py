"""A real Prometheus scrapes a real router (gunicorn -k gevent, 2 workers) in front of
simulated engines, with every tier on (PrefixAwareHash, the Redis response cache, the KV
index and its event consumers), loads ``deploy/prometheus/alerts.yml``, and answers every
dashboard panel query and every alert's query through its HTTP API. Each must return data:
a misspelled metric or label in them returns none.

Prometheus is Debian's ``prometheus`` package (``.ci/run`` installs it when missing).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from continuum.devtools.procs import Child, free_port, wait_http, wait_until
from continuum.devtools.servers import RouterProcess
from tests.unit.test_deploy_files import RULES, alert_queries, dashboard_queries

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
SYSTEM = "You are the fleet's assistant; answer in one short sentence. " * 30


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[str]]:
    children, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            children.append(Child([sys.executable, "-m", "continuum.sim.cli", "--fast",
                                   "--port", str(port), "--model", MODEL],
                                  log=tmp_path / f"sim-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for url, child in zip(urls, children, strict=True):
            wait_http(url + "/health", children=[child])
        yield urls
    finally:
        for child in children:
            child.stop()


def _router_config(engines: list[str], redis_url: str) -> dict[str, Any]:
    nowhere = f"http://127.0.0.1:{free_port()}"
    return {
        "admin": {"allow_unauthenticated": True},
        "backends": [{"name": f"e{i}", "url": url, "models": [MODEL]}
                     for i, url in enumerate(engines)]
        + [{"name": "dead", "url": nowhere, "models": ["gone"]}],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "response_cache": {"enabled": True, "backend": "redis", "redis": {"url": redis_url}},
        "kv_cache_index": {"enabled": True, "event_sources": [
            {"backend_name": f"e{i}", "endpoint": f"{nowhere}/events/e{i}",
             "reconnect_interval_ms": 200} for i in range(len(engines))]},
        "health_check": {"interval_seconds": 0.3, "unhealthy_threshold": 1, "timeout_ms": 300},
    }


class Prometheus:
    """``prometheus`` on loopback scraping ``target`` every second, with the rules."""

    def __init__(self, tmp: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: apt-get install prometheus (.ci/run does)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{RULES}']\n"
            "scrape_configs:\n"
            "  - job_name: continuum-router\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.proc = Child([binary, f"--config.file={config}",
                           f"--storage.tsdb.path={tmp / 'tsdb'}",
                           f"--web.listen-address=127.0.0.1:{self.port}"],
                          log=tmp / "prometheus.log")
        wait_http(self.url + "/-/ready", 30, children=[self.proc])

    def query(self, expr: str) -> list[Any]:
        doc = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert doc["status"] == "success", (expr, doc)
        return doc["data"]["result"]  # type: ignore[no-any-return]


def _traffic(router: RouterProcess) -> None:
    """Every kind of request the panels show: proxied plain and streamed, cached, bypassed,
    unknown model, full outage."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    try:
        for i in range(3):
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"question {i}"}]
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)  # a response-cache hit
            list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                temperature=0.7, stream=True))
        url = router.url + "/v1/chat/completions"
        assert requests.post(url, json={"model": "nope", "messages": [
            {"role": "user", "content": "x"}]}, timeout=10).status_code == 404
        assert requests.post(url, json={"model": "gone", "messages": [
            {"role": "user", "content": "x"}]}, timeout=10).status_code in (502, 503)
    finally:
        client.close()


def test_every_panel_and_alert_query_returns_data(
        engines: list[str], redis_server: Any, tmp_path: Path) -> None:
    router = RouterProcess(_router_config(engines, redis_server.url), tmp_path, workers=2)
    prometheus = None
    try:
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{router.port}")
        wait_until(lambda: prometheus.query('up{job="continuum-router"} == 1'),
                   "Prometheus to scrape the router", 20)
        queries = dashboard_queries() + alert_queries()
        assert len(queries) > 20
        _traffic(router)
        empty: list[tuple[str, str]] = []
        headline: list[float] = []

        def all_answer() -> bool:
            _traffic(router)  # keeps every rate() moving between scrapes
            empty[:] = [(where, expr) for where, expr in queries
                        if not prometheus.query(expr)]
            if empty:
                return False
            # The headline number is a fraction, and the engines served some prefix from
            # cache. Its first evaluations may span only two scrapes with no request to an
            # engine between them: 0/0, NaN. The traffic above puts requests between the
            # later ones.
            rate = prometheus.query("continuum:prefix_hit_rate:ratio_rate5m")
            headline[:] = [float(rate[0]["value"][1])]
            return 0 < headline[0] < 1

        try:
            wait_until(all_answer, "every query to return data, the hit rate a fraction", 40,
                       interval=1.0)
        except Exception:
            raise AssertionError(f"queries without data: {empty}; "
                                 f"continuum:prefix_hit_rate:ratio_rate5m = {headline}") from None
    finally:
        if prometheus is not None:
            prometheus.proc.stop()
        router.stop()
