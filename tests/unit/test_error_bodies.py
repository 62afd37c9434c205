"""502/504 bodies and broken-stream events name the request id, never the backend address;
the address goes to the log under that id (real HTTP upstreams on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import falcon.testing
import pytest

from continuum.config import parse_config
from continuum.devtools.procs import free_port, refused_port
from continuum.devtools.servers import FakeUpstream
from continuum.registry import PluginRegistry
from continuum.web.app import RouterApp, create_app

CHAT = "/v1/chat/completions"
ANTHROPIC = "/anthropic/v1/messages"
BODY = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def client_for() -> Iterator[Callable[..., falcon.testing.TestClient]]:
    """Factory: the app with one backend at ``url``; its upstream connections are closed
    at teardown."""
    apps: list[RouterApp] = []

    def make(url: str, type_: str = "openai", **backend: Any) -> falcon.testing.TestClient:
        cfg = {"backends": [{"name": "secret-backend-7", "url": url, "type": type_,
                             "models": ["m"], **backend}],
               "health_check": {"enabled": False}}
        apps.append(create_app(parse_config(cfg), registry=PluginRegistry()))
        return falcon.testing.TestClient(apps[-1])

    yield make
    for app in apps:
        app.service.stop()


def _message(path: str, resp: falcon.testing.Result) -> str:
    doc = json.loads(resp.content)
    if path == ANTHROPIC:
        assert doc["type"] == "error"
    return str(doc["error"]["message"])


def _hides(resp_text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in resp_text, (secret, resp_text)


def _logged_with(caplog: pytest.LogCaptureFixture, request_id: str) -> str:
    lines = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    return "\n".join(lines)


@pytest.mark.parametrize(("path", "type_"), [(CHAT, "openai"), (ANTHROPIC, "anthropic")])
def test_502_names_the_request_id_and_logs_the_address(
    path: str, type_: str, client_for: Callable[..., falcon.testing.TestClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = refused_port()  # nothing listens there
    client = client_for(f"http://127.0.0.1:{port}", type_)
    with caplog.at_level(logging.WARNING):
        resp = client.simulate_post(path, json=BODY, headers={"X-Request-Id": "client-id.42"})
    assert resp.status_code == 502
    assert resp.headers["X-Request-Id"] == "client-id.42"
    message = _message(path, resp)
    assert message == "the backend serving this model could not be reached " \
        "(request id client-id.42)"
    _hides(resp.text, "127.0.0.1", str(port), "secret-backend-7", "refused")
    log = _logged_with(caplog, "client-id.42")
    assert f"127.0.0.1:{port}" in log and "secret-backend-7" in log


def test_a_generated_request_id_is_the_same_in_header_body_and_log(
    client_for: Callable[..., falcon.testing.TestClient], caplog: pytest.LogCaptureFixture,
) -> None:
    client = client_for(f"http://127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING):
        resp = client.simulate_post(CHAT, json=BODY, headers={"X-Request-Id": "no spaces!"})
    rid = resp.headers["X-Request-Id"]
    assert rid != "no spaces!" and len(rid) == 32
    assert f"(request id {rid})" in _message(CHAT, resp)
    _logged_with(caplog, rid)


def test_504_names_the_request_id_and_logs_the_address(
    upstreams: Callable[[str], FakeUpstream], client_for: Callable[..., falcon.testing.TestClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    up = upstreams("slow")
    client = client_for(up.url, request_timeout_ms=300)
    with caplog.at_level(logging.WARNING):
        resp = client.simulate_post(CHAT, json={**BODY, "x_test": {"hang": 1.5}},
                                    headers={"X-Request-Id": "slow-1"})
    assert resp.status_code == 504
    assert _message(CHAT, resp) == "the backend serving this model did not answer in time " \
        "(request id slow-1)"
    _hides(resp.text, "127.0.0.1", str(up.port), "secret-backend-7")
    assert up.url in _logged_with(caplog, "slow-1")


@pytest.mark.parametrize(("path", "type_"), [(CHAT, "openai"), (ANTHROPIC, "anthropic")])
def test_a_broken_stream_ends_with_an_event_naming_only_the_request_id(
    path: str, type_: str, upstreams: Callable[[str], FakeUpstream],
    client_for: Callable[..., falcon.testing.TestClient], caplog: pytest.LogCaptureFixture,
) -> None:
    up = upstreams("breaks")
    client = client_for(up.url, type_)
    body = {**BODY, "stream": True, "x_test": {"chunks": 5, "break_after": 2}}
    with caplog.at_level(logging.WARNING):
        resp = client.simulate_post(path, json=body, headers={"X-Request-Id": "stream-9"})
    assert resp.status_code == 200 and resp.headers["X-Request-Id"] == "stream-9"
    last = resp.text.rstrip().rsplit("\n\n", 1)[-1]
    event = json.loads(last.split("data: ", 1)[1])
    assert event["error"]["message"] == "the upstream stream broke off (request id stream-9)"
    if path == ANTHROPIC:
        assert last.startswith("event: error") and event["type"] == "error"
    _hides(resp.text, "127.0.0.1", str(up.port), "secret-backend-7")
    log = _logged_with(caplog, "stream-9")
    assert up.url in log and "secret-backend-7" in log


def test_every_answer_carries_the_request_id(
    upstreams: Callable[[str], FakeUpstream], client_for: Callable[..., falcon.testing.TestClient]
) -> None:
    client = client_for(upstreams("ok").url)
    ok = client.simulate_post(CHAT, json=BODY, headers={"X-Request-Id": "mine"})
    assert ok.status_code == 200 and ok.headers["X-Request-Id"] == "mine"
    for resp in (client.simulate_post(CHAT, body=b"{"), client.simulate_get("/nope"),
                 client.simulate_get("/health"), client.simulate_get("/v1/models")):
        assert len(resp.headers["X-Request-Id"]) == 32
    four_hundred = client.simulate_post(CHAT, body=b"{")
    assert "request id" not in four_hundred.json["error"]["message"]  # only 5xx carry it
