"""OpenTelemetry tracing (the ``otel`` extra): the span tree of a request, checked with the
SDK's in-memory exporter, and W3C ``traceparent`` propagation to a real HTTP upstream on
127.0.0.1 that records the headers it gets. The router runs in this process behind a real
HTTP server (the exporter's spans have to be readable here); the official openai SDK is the
client. The last tests run real gunicorn -k gevent configured only by ``OTEL_*`` variables.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from continuum.config import parse_config
from continuum.devtools.procs import wait_until
from continuum.devtools.servers import FakeUpstream, RouterProcess
from continuum.web.app import create_app
from continuum.web.tracing import enabled_by_env

pytestmark = pytest.mark.e2e

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Threaded(WSGIServer):
    daemon_threads = True

    def process_request(self, request: Any, client_address: Any) -> None:
        threading.Thread(target=self._handle, args=(request, client_address),
                         daemon=True).start()

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        finally:
            self.shutdown_request(request)


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[FakeUpstream]:
    up = FakeUpstream("a", tmp_path)
    yield up
    up.stop()


@pytest.fixture
def traced(upstream: FakeUpstream) -> Iterator[tuple[str, InMemorySpanExporter]]:
    """The router app with an SDK provider and an in-memory exporter, on a real server."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = parse_config({
        "backends": [{"name": "a", "url": upstream.url, "models": ["m"]}],
        "response_cache": {"enabled": True},
        "health_check": {"enabled": False},
    })
    app = create_app(config, tracer_provider=provider)
    server = make_server("127.0.0.1", 0, app, server_class=_Threaded, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", exporter
    finally:
        server.shutdown()
        server.server_close()
        app.service.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                         default_headers={"traceparent": TRACEPARENT})


def _tree(exporter: InMemorySpanExporter, count: int) -> dict[str, ReadableSpan]:
    wait_until(lambda: len(exporter.get_finished_spans()) >= count, "the spans", timeout=5)
    spans = exporter.get_finished_spans()
    exporter.clear()
    assert len(spans) == count, [s.name for s in spans]
    return {s.name: s for s in spans}


def _traceparent_upstream_got(up: FakeUpstream) -> str | None:
    headers = {k.lower(): v for k, v in up.stats()["last_headers"].items()}
    return headers.get("traceparent")


def test_span_tree_of_a_request_and_the_traceparent_upstream(
        traced: tuple[str, InMemorySpanExporter], upstream: FakeUpstream) -> None:
    url, exporter = traced
    answer = _client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert answer.choices[0].message.content
    spans = _tree(exporter, 4)
    root = spans["POST /v1/chat/completions"]
    lookup, selection, call = (spans["continuum.cache_lookup"], spans["continuum.selection"],
                               spans["continuum.upstream"])
    # The server span continues the client's trace; the stages are its children.
    assert root.kind == SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_SPAN
    for child in (lookup, selection, call):
        assert child.context.trace_id == root.context.trace_id
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    assert lookup.attributes["continuum.cache.hit"] is False
    assert selection.attributes["continuum.decision"] == "strategy"
    assert selection.attributes["continuum.backend"] == "a"
    assert call.kind == SpanKind.CLIENT and call.attributes["http.response.status_code"] == 200
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["continuum.backend"] == "a"
    # W3C traceparent upstream: the client's trace, the upstream span as the parent.
    sent = _traceparent_upstream_got(upstream)
    assert sent == f"00-{CLIENT_TRACE}-{format(call.context.span_id, '016x')}-01"
    # The same request again is a cache hit: a lookup span, no selection, no upstream call.
    _client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=0)
    spans = _tree(exporter, 2)
    assert spans["continuum.cache_lookup"].attributes["continuum.cache.hit"] is True
    assert spans["POST /v1/chat/completions"].attributes["continuum.cache"] == "HIT"


def test_a_stream_has_a_relay_span_that_ends_with_the_last_byte(
        traced: tuple[str, InMemorySpanExporter], upstream: FakeUpstream) -> None:
    url, exporter = traced
    stream = _client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_body={"x_test": {"chunks": 5}})
    pieces = [c.choices[0].delta.content for c in stream if c.choices]
    assert len(pieces) == 5
    spans = _tree(exporter, 5)  # server, cache lookup (a miss), selection, upstream, relay
    root, relay, call = (spans["POST /v1/chat/completions"], spans["continuum.stream_relay"],
                         spans["continuum.upstream"])
    assert relay.parent is not None and relay.parent.span_id == root.context.span_id
    assert relay.attributes["continuum.stream.completed"] is True
    assert relay.attributes["continuum.stream.pieces"] >= 1
    # The server span ends with the stream, after the relay; the call at the response head.
    assert root.end_time >= relay.end_time >= call.end_time  # type: ignore[operator]
    assert relay.start_time >= call.end_time  # type: ignore[operator]
    assert _traceparent_upstream_got(upstream) is not None


def test_an_unknown_model_is_a_404_span_without_an_upstream_call(
        traced: tuple[str, InMemorySpanExporter]) -> None:
    url, exporter = traced
    with pytest.raises(openai.NotFoundError):
        _client(url).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], temperature=0)
    spans = _tree(exporter, 2)  # the lookup missed; no backend serves the model
    assert set(spans) == {"POST /v1/chat/completions", "continuum.cache_lookup"}
    root = spans["POST /v1/chat/completions"]
    assert root.attributes["http.response.status_code"] == 404
    assert root.status.status_code == StatusCode.UNSET  # a client error, not the router's


def test_enabled_only_when_the_otel_environment_asks() -> None:
    assert not enabled_by_env({})
    assert enabled_by_env({"OTEL_TRACES_EXPORTER": "console"})
    assert not enabled_by_env({"OTEL_TRACES_EXPORTER": "none"})
    assert enabled_by_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not enabled_by_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                               "OTEL_SDK_DISABLED": "true"})


def _router_with_env(tmp: Path, up: FakeUpstream, env: dict[str, str]) -> RouterProcess:
    return RouterProcess({"backends": [{"name": "a", "url": up.url, "models": ["m"]}]},
                         tmp, workers=2, env=env)


def test_gunicorn_traces_by_otel_environment_variables(tmp_path: Path,
                                                        upstream: FakeUpstream) -> None:
    router = _router_with_env(tmp_path, upstream, {
        "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "router-under-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0,
                               default_headers={"traceparent": TRACEPARENT})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        sent = _traceparent_upstream_got(upstream)
        assert sent is not None and sent.split("-")[1] == CLIENT_TRACE
        upstream_span = sent.split("-")[2]

        wanted = {"POST /v1/chat/completions", "continuum.selection", "continuum.upstream"}

        def spans() -> list[dict[str, Any]]:
            log = router.proc.log_text()
            return [json.loads(doc) for doc in _json_docs(log) if '"span_id"' in doc]

        def names() -> set[str]:
            return {s["name"] for s in spans() if s["context"]["trace_id"] == "0x" + CLIENT_TRACE}

        # The server span ends after the answer is sent: the batch processor may export it
        # in a later batch than the upstream span, so wait for all of them.
        wait_until(lambda: f'"span_id": "0x{upstream_span}"' in router.proc.log_text()
                   and wanted <= names(),
                   lambda: f"the console exporter's spans (seen: {sorted(names())})",
                   timeout=20)
        assert wanted <= names()
        assert all(s["resource"]["attributes"]["service.name"] == "router-under-test"
                   for s in spans())
    finally:
        router.stop()


def test_gunicorn_without_otel_variables_sends_no_traceparent(tmp_path: Path,
                                                              upstream: FakeUpstream) -> None:
    router = _router_with_env(tmp_path, upstream, {})
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0,
                               default_headers={"traceparent": TRACEPARENT})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert _traceparent_upstream_got(upstream) is None
    finally:
        router.stop()


def _json_docs(text: str) -> Iterator[str]:
    """The top-level JSON objects the console exporter printed (each spans lines)."""
    depth, start = 0, -1
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                yield text[start:i + 1]


def test_off_nothing_is_wrapped_and_no_middleware_runs(upstream: FakeUpstream,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without OTEL_* variables (or the extra), tracing adds nothing to the request path:
    the service's stages are the classes' own methods and no tracing middleware is in the
    app."""
    from continuum.routing.forwarder import Forwarder
    from continuum.web.tracing import Tracing

    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    config = parse_config({"backends": [{"name": "a", "url": upstream.url, "models": ["m"]}],
                           "health_check": {"enabled": False}})
    app = create_app(config)
    try:
        forwarder = app.service.forwarder
        assert forwarder.send.__func__ is Forwarder.send  # type: ignore[attr-defined]
        assert forwarder.relay.__func__ is Forwarder.relay  # type: ignore[attr-defined]
        assert "decide" not in vars(app.service.pipeline)
        assert "lookup" not in vars(app.service.response_cache)
        assert not any(isinstance(m, Tracing) for m in app._unprepared_middleware)
    finally:
        app.service.stop()
