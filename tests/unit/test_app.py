"""The Falcon app in-process: error shapes, limits, admin auth (no upstream needed)."""

from __future__ import annotations

import json

import falcon.testing
import pytest

from continuum.config import parse_config
from continuum.registry import PluginRegistry
from continuum.web.app import create_app

CFG = {"backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}],
       "server": {"max_body_bytes": 1024}, "admin": {"token": "s3cret"},
       "health_check": {"enabled": False}}


@pytest.fixture
def client() -> falcon.testing.TestClient:
    return falcon.testing.TestClient(create_app(parse_config(CFG), registry=PluginRegistry()))


def _error(resp: falcon.testing.Result) -> dict:
    body = json.loads(resp.content)
    assert set(body) == {"error"}
    assert {"message", "type", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_413_before_reading_a_large_body(client: falcon.testing.TestClient) -> None:
    resp = client.simulate_post("/v1/chat/completions", body=b"x" * 2048)
    assert resp.status_code == 413
    assert _error(resp)["code"] == "request_too_large"


def test_400_and_404_shapes(client: falcon.testing.TestClient) -> None:
    resp = client.simulate_post("/v1/chat/completions", body=b"{")
    assert resp.status_code == 400 and _error(resp)["type"] == "invalid_request_error"
    resp = client.simulate_post("/v1/chat/completions", json={
        "model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 404 and _error(resp)["code"] == "model_not_found"
    resp = client.simulate_get("/no/such/route")
    assert resp.status_code == 404 and _error(resp)["code"] == "404"
    assert _error(resp)["message"] == "no such endpoint: GET /no/such/route"


@pytest.mark.parametrize(("path", "hint"), [
    ("/v1/messages", "set the Anthropic SDK's base_url (ANTHROPIC_BASE_URL) to "
                     "http://<router>/anthropic"),
    ("/chat/completions", "set the SDK's base_url to http://<router>/v1"),
    ("/v1/v1/chat/completions", "the SDK's base_url ends in /v1 and the client adds /v1 "
                                "again: drop it from the base_url"),
    ("/anthropic/v1/v1/messages", "the SDK's base_url ends in /v1 and the client adds /v1 "
                                  "again: drop it from the base_url"),
])
def test_a_path_served_elsewhere_gets_a_404_saying_where(
        client: falcon.testing.TestClient, path: str, hint: str) -> None:
    resp = client.simulate_post(path, json={"model": "m"})
    assert resp.status_code == 404
    message = resp.json["error"]["message"]  # Anthropic's shape under /anthropic/
    assert message.startswith(f"no such endpoint: POST {path}; ") and message.endswith(hint)


def test_a_method_a_route_does_not_take_is_a_405_naming_the_allowed_ones(
        client: falcon.testing.TestClient) -> None:
    resp = client.simulate_delete("/v1/chat/completions")
    assert resp.status_code == 405
    assert _error(resp)["message"] == (
        "DELETE is not allowed on /v1/chat/completions (allowed: POST, OPTIONS)")
    assert resp.headers["Allow"] == "POST, OPTIONS"


def test_models_union_and_health(client: falcon.testing.TestClient) -> None:
    assert client.simulate_get("/v1/models").json["data"][0]["id"] == "m"
    assert client.simulate_get("/health").json == {
        "status": "ok", "backends": {"healthy": 1, "total": 1}}
    head = client.simulate_head("/health")  # load balancers' HEAD checks
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["Content-Length"]) == len(client.simulate_get("/health").content)


def test_head_health_is_503_when_no_backend_is_healthy() -> None:
    app = create_app(parse_config({**CFG, "backends": [
        {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"], "enabled": False}]}),
        registry=PluginRegistry())
    head = falcon.testing.TestClient(app).simulate_head("/health")
    assert head.status_code == 503 and head.content == b""


def test_admin_requires_bearer_token(client: falcon.testing.TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        resp = client.simulate_get("/admin/strategies", headers=headers)
        assert resp.status_code == 401
        assert _error(resp)["type"] == "authentication_error"
    ok = client.simulate_get("/admin/strategies", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert "RoundRobin" in ok.json["available"]
    loaded = {p["name"]: p["distribution"] for p in ok.json["loaded"]}
    assert loaded == {"RoundRobin": "continuum-router", "memory": "continuum-router"}


def test_metrics_exposition(client: falcon.testing.TestClient) -> None:
    resp = client.simulate_get("/metrics")
    assert resp.status_code == 200
    assert "continuum_backend_healthy" in resp.text


def test_unexpected_errors_are_logged_and_shaped(client: falcon.testing.TestClient,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    service = client.app.service  # type: ignore[attr-defined]

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyError("bug")

    service.proxy = boom
    resp = client.simulate_post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 500 and _error(resp)["code"] == "internal_error"
    assert "KeyError" not in resp.text
    assert any("unhandled error in POST /v1/chat/completions" in r.message for r in caplog.records)
    anthropic_resp = client.simulate_post("/anthropic/v1/messages", json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert anthropic_resp.status_code == 500
    assert anthropic_resp.json["type"] == "error"


def test_a_disabled_backend_shows_as_disabled_not_healthy() -> None:
    config = {**CFG, "backends": [*CFG["backends"], {  # type: ignore[list-item]
        "name": "later", "url": "http://127.0.0.1:9", "models": ["m"], "enabled": False}]}
    app = falcon.testing.TestClient(create_app(parse_config(config), registry=PluginRegistry()))
    rows = {row["name"]: row for row in app.simulate_get(
        "/admin/backends", headers={"Authorization": "Bearer s3cret"}).json["backends"]}
    assert (rows["later"]["state"], rows["later"]["healthy"]) == ("disabled", False)
    assert (rows["a"]["state"], rows["a"]["healthy"]) == ("healthy", True)


def test_workers_all_without_a_fleet_lists_this_worker_alone(
        client: falcon.testing.TestClient) -> None:
    auth = {"Authorization": "Bearer s3cret"}
    doc = client.simulate_get("/admin/backends", params={"workers": "all"}, headers=auth).json
    (only,) = doc["workers"]
    assert only["worker_pid"] == doc["worker_pid"] and only["backends"][0]["name"] == "a"
    assert "fleet" not in doc
    bad = client.simulate_get("/admin/kv-index/stats", params={"workers": "2"}, headers=auth)
    assert bad.status_code == 400 and _error(bad)["param"] == "workers"
    # views only: an action's path takes no workers parameter
    assert client.simulate_post("/admin/kv-index/clear", params={"workers": "all"},
                                headers=auth).status_code == 409
