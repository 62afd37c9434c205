"""Metrics, access log and request ids as an operator sees them: real gunicorn -k gevent
with 2 workers, the simulated vLLM engine and the fake Anthropic API as engines, the
official openai and anthropic SDKs and plain HTTP as clients.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import requests

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import Child, free_port, refused_port, wait_http, wait_until
from continuum.devtools.servers import RouterProcess
from continuum.web.observe import tenant_hash

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
CLAUDE = "claude-sonnet-4-6"
ANT_KEY = "sk-ant-upstream"
SYSTEM = "You are the operator's assistant for the Continuum router fleet. " * 40
USER = [{"role": "user", "content": "x"}]
LONG_SYSTEM = "You answer questions about the model cache of the router. " * 150


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A continuum-sim engine and the fake Anthropic API, for the module."""
    tmp = tmp_path_factory.mktemp("obs-engines")
    sim_port, ant_port = free_port(), free_port()
    sim = Child([sys.executable, "-m", "continuum.sim.cli", "--fast", "--port", str(sim_port),
                 "--model", MODEL], log=tmp / "sim.log")
    ant = Child([sys.executable, "-m", "continuum.sim.anthropic", "--port", str(ant_port),
                 "--api-key", ANT_KEY], log=tmp / "anthropic.log")
    try:
        wait_http(f"http://127.0.0.1:{sim_port}/health", children=[sim])
        wait_http(f"http://127.0.0.1:{ant_port}/health", children=[ant])
        yield {"sim": f"http://127.0.0.1:{sim_port}", "anthropic": f"http://127.0.0.1:{ant_port}"}
    finally:
        sim.stop()
        ant.stop()


def _config(ups: dict[str, str], **extra: Any) -> dict[str, Any]:
    dead = f"http://127.0.0.1:{refused_port()}"
    return {
        "backends": [
            {"name": "e", "url": ups["sim"], "models": [MODEL]},
            {"name": "claude", "url": ups["anthropic"], "type": "anthropic",
             "api_key": ANT_KEY, "models": [CLAUDE]},
            # Nothing listens there: its only model is in a full outage once probed.
            {"name": "dead", "url": dead, "models": ["gone"]},
        ],
        # "dead" refuses at once; the live engines get a probe timeout a busy machine's
        # engine answers within (one late probe would take the only engine of a model out).
        "health_check": {"interval_seconds": 0.3, "unhealthy_threshold": 1,
                         "timeout_ms": 2000},
        **extra,
    }


@pytest.fixture(scope="module")
def router(engines: dict[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("obs-router")
    cfg = {"admin": {"allow_unauthenticated": True}, **_config(engines)}
    proc = RouterProcess(cfg, tmp, workers=2)
    yield proc
    proc.stop()


def _oai(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def _count(text: str, name: str, **labels: str) -> float:
    return metric_sum(text, name, **labels)


def _tokens(router: RouterProcess, backend: str, decision: str = "strategy") -> tuple[int, ...]:
    text = router.metrics()
    return tuple(int(_count(text, f"continuum_{name}_total", backend=backend, decision=decision))
                 for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens"))


def _after_stream(router: RouterProcess, backend: str, before: tuple[int, ...]) -> tuple[int, ...]:
    """The token counters once the stream's end is recorded: the SDK stops reading at the
    last event, a moment before the worker's relay sees its end and records the request."""
    wait_until(lambda: _tokens(router, backend)[0] > before[0], "the stream to be recorded", 20)
    return _tokens(router, backend)


def _delta(after: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(after, before, strict=True))


def test_openai_usage_from_bodies_and_streams_the_client_did_not_ask_for(
        router: RouterProcess) -> None:
    client = _oai(router)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "how many workers?"}]
    t0 = _tokens(router, "e")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert plain.usage is not None
    t1 = _tokens(router, "e")
    assert _delta(t1, t0) == (plain.usage.prompt_tokens,
                              plain.usage.prompt_tokens_details.cached_tokens,
                              plain.usage.completion_tokens)

    # A stream without include_usage: the router asks for it and strips the usage chunk.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    t2 = _after_stream(router, "e", t1)
    prompt, cached, completion = _delta(t2, t1)
    assert prompt == plain.usage.prompt_tokens
    assert 0 < cached <= prompt  # the sim's prefix cache holds the first request's prefix
    assert completion == sum(1 for c in chunks if c.choices[0].delta.content)

    # A client that asks gets the usage chunk, and the metrics count the same numbers.
    asked = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    usage = asked[-1].usage
    assert usage is not None and asked[-1].choices == []
    t3 = _after_stream(router, "e", t2)
    assert _delta(t3, t2) == (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                              usage.completion_tokens)
    text = router.metrics()
    assert _count(text, "continuum_time_to_first_token_seconds_count", backend="e",
                  decision="strategy") >= 2
    assert _count(text, "continuum_request_duration_seconds_count", backend="e",
                  decision="strategy") >= 3


def test_anthropic_usage_counts_cache_reads_as_cached_prompt_tokens(
        router: RouterProcess) -> None:
    client = anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="x",
                                 max_retries=0)
    kwargs: dict[str, Any] = {"model": CLAUDE, "max_tokens": 16, "system": LONG_SYSTEM,
                              "messages": [{"role": "user", "content": "What is cached?"}]}
    t0 = _tokens(router, "claude")
    first = client.messages.create(**kwargs)  # the router injects cache_control
    second = client.messages.create(**kwargs)
    assert second.usage.cache_read_input_tokens and second.usage.cache_read_input_tokens > 0
    t1 = _tokens(router, "claude")

    def prompt(u: Any) -> int:
        return int(u.input_tokens + (u.cache_read_input_tokens or 0)
                   + (u.cache_creation_input_tokens or 0))

    assert _delta(t1, t0) == (
        prompt(first.usage) + prompt(second.usage),
        (first.usage.cache_read_input_tokens or 0) + second.usage.cache_read_input_tokens,
        first.usage.output_tokens + second.usage.output_tokens)

    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    t2 = _after_stream(router, "claude", t1)
    assert _delta(t2, t1) == (prompt(final.usage), final.usage.cache_read_input_tokens,
                              final.usage.output_tokens)
    text = router.metrics()
    assert _count(text, "continuum_cache_creation_prompt_tokens_total", backend="claude") \
        == (first.usage.cache_creation_input_tokens or 0)


def test_every_request_counted_once_router_answers_and_retries_included(
        router: RouterProcess, engines: dict[str, str]) -> None:
    wait_until(lambda: not _healthy(router)["dead"], "the dead backend to be probed", 10)
    before = router.metrics()

    def requests_total(text: str, **labels: str) -> float:
        return _count(text, "continuum_requests_total", **labels)

    url = router.url + "/v1/chat/completions"
    ok = requests.post(url, json={"model": MODEL, "messages": [{"role": "user",
                                                                "content": "hi"}]}, timeout=10)
    unknown = requests.post(url, json={"model": "nope", "messages": USER}, timeout=10)
    bad = requests.post(url, data=b"{not json", timeout=10,
                        headers={"Content-Type": "application/json"})
    outage = requests.post(url, json={"model": "gone", "messages": [{"role": "user",
                                                                     "content": "hi"}]},
                           timeout=10)
    assert (ok.status_code, unknown.status_code, bad.status_code, outage.status_code) == \
        (200, 404, 400, 503)
    assert outage.json()["error"]["code"] == "no_healthy_backend"
    after = router.metrics()
    for labels, expected in [
        ({"endpoint": "chat", "status_class": "2xx", "outcome": "upstream"}, 1),
        ({"endpoint": "chat", "status_class": "4xx", "outcome": "router_error"}, 2),
        ({"endpoint": "chat", "status_class": "5xx", "outcome": "router_error"}, 1),
    ]:
        assert requests_total(after, **labels) - requests_total(before, **labels) == expected, \
            labels
    assert requests_total(after) - requests_total(before) == 4


def test_a_retried_request_is_one_request_and_two_attempts(
        engines: dict[str, str], tmp_path: Path,
        router_factory: Callable[..., RouterProcess]) -> None:
    dead = f"http://127.0.0.1:{refused_port()}"
    router = router_factory({
        "backends": [{"name": "dead", "url": dead, "models": [MODEL]},
                     {"name": "e", "url": engines["sim"], "models": [MODEL]}],
        "selection_strategy": "RoundRobin",
        "health_check": {"enabled": False},
    })
    client = _oai(router)
    for _ in range(4):
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ).choices
    text = router.metrics()
    retries = _count(text, "continuum_upstream_retries_total", backend="dead")
    assert retries >= 1
    assert _count(text, "continuum_requests_total", endpoint="chat") == 4
    assert _count(text, "continuum_upstream_attempts_total", backend="e", status="200") == 4
    assert _count(text, "continuum_upstream_attempts_total", backend="dead",
                  status="502") == retries


def _healthy(router: RouterProcess) -> dict[str, bool]:
    rows = requests.get(router.url + "/admin/backends", timeout=5).json()["backends"]
    return {row["name"]: row["healthy"] for row in rows}


def test_request_id_echoed_in_errors_and_logged_with_the_access_line(
        engines: dict[str, str], router_factory: Callable[..., RouterProcess]) -> None:
    router = router_factory({**_config(engines),
                             "server": {"access_log": "json"},
                             "auth": {"keys": [{"key": "tenant-key", "tenant": "acme"}]},
                             "response_cache": {"enabled": True}})
    url = router.url + "/v1/chat/completions"
    missing = requests.post(url, json={"model": "nope", "messages": USER}, timeout=10,
                            headers={"X-Request-Id": "client-req-1",
                                     "Authorization": "Bearer tenant-key"})
    assert missing.status_code == 404
    assert missing.headers["X-Request-Id"] == "client-req-1"
    assert missing.json()["error"]["request_id"] == "client-req-1"
    ant = requests.post(router.url + "/anthropic/v1/messages", data=b"[", timeout=10,
                        headers={"X-Request-Id": "client-req-2"})
    assert ant.status_code == 400 and ant.json()["request_id"] == "client-req-2"
    # Forwarded upstream with the request.
    sent = requests.post(router.url + "/anthropic/v1/messages", timeout=10, json={
        "model": CLAUDE, "max_tokens": 4, "messages": USER},
        headers={"X-Request-Id": "client-req-4"})
    assert sent.status_code == 200 and sent.headers["X-Request-Id"] == "client-req-4"
    received = requests.get(engines["anthropic"] + "/_sim/received?n=1", timeout=5).json()
    assert received["received"][0]["headers"]["x-request-id"] == "client-req-4"

    body = {"model": MODEL, "messages": [{"role": "user", "content": "cache me"}],
            "temperature": 0, "max_tokens": 4}
    first = requests.post(url, json=body, timeout=10, headers={"X-Request-Id": "client-req-3"})
    second = requests.post(url, json=body, timeout=10)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    generated = second.headers["X-Request-Id"]
    assert len(generated) == 32

    def lines() -> dict[str, dict[str, Any]]:
        found = {}
        for line in router.proc.log_text().splitlines():
            if line.startswith("{") and '"request_id"' in line:
                doc = json.loads(line)
                found[doc["request_id"]] = doc
        return found

    wait_until(lambda: generated in lines(), "the access-log line of the cache hit", 20)
    logged = lines()
    assert logged["client-req-1"]["status"] == 404
    assert logged["client-req-1"]["outcome"] == "router_error"
    assert logged["client-req-1"]["tenant"] == tenant_hash("acme") != "acme"
    assert logged["client-req-2"]["endpoint"] == "anthropic_messages"
    miss, hit = logged["client-req-3"], logged[generated]
    usage = first.json()["usage"]
    assert (miss["backend"], miss["decision"], miss["cache"], miss["status"]) == \
        ("e", "strategy", "miss", 200)
    assert (miss["prompt_tokens"], miss["completion_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    assert miss["duration_ms"] > 0 and miss["model"] == MODEL
    assert (hit["backend"], hit["decision"], hit["cache"], hit["outcome"]) == \
        (None, "cache", "hit", "cache_hit")
    text = router.metrics()
    assert _count(text, "continuum_requests_total", outcome="cache_hit") == 1
    assert _count(text, "continuum_prompt_tokens_total", backend="cache", decision="cache") \
        == usage["prompt_tokens"]
    # The startup line names the backends, the strategy and the tiers.
    log = router.proc.log_text()
    assert "backends: e=http://127.0.0.1:" in log and "strategy: " in log
    assert "response_cache=memory" in log


def test_model_endpoints_the_sdks_call(router: RouterProcess) -> None:
    client = _oai(router)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    ant = anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="x", max_retries=0)
    assert [m.id for m in ant.models.list()] == [CLAUDE]
    assert ant.models.retrieve(CLAUDE).id == CLAUDE
    with pytest.raises(anthropic.NotFoundError):
        ant.models.retrieve(MODEL)  # an OpenAI-side model is not an Anthropic one
    text = router.metrics()
    assert _count(text, "continuum_requests_total", endpoint="anthropic_models",
                  status_class="4xx", outcome="router_error") == 1
