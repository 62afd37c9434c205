"""``/admin`` fails closed: the real Falcon app in-process, one gate for every resource."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import falcon
import falcon.testing
import pytest

from continuum.config import parse_config
from continuum.registry import PluginRegistry
from continuum.web.app import create_app

BASE = {"backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}],
        "health_check": {"enabled": False}}
ADMIN_ROUTES = [
    ("GET", "/admin/strategies"), ("GET", "/admin/backends"),
    ("GET", "/admin/prefix-routing/stats"), ("POST", "/admin/routing/explain"),
    ("POST", "/admin/config/reload"), ("GET", "/admin/response-cache/stats"),
    ("POST", "/admin/response-cache/invalidate"), ("GET", "/admin/kv-index/stats"),
    ("GET", "/admin/kv-index/backends"), ("POST", "/admin/kv-index/clear"),
    ("GET", "/admin/gemini-context-cache/stats"), ("POST", "/admin/gemini-context-cache/clear"),
    ("POST", "/admin/backends/a/drain"), ("POST", "/admin/backends/a/undrain"),
    ("GET", "/admin"),
]


def _client(admin: dict[str, Any] | None = None) -> falcon.testing.TestClient:
    config = parse_config({**BASE, **({"admin": admin} if admin is not None else {})})
    return falcon.testing.TestClient(create_app(config, registry=PluginRegistry()))


def test_without_a_token_every_admin_endpoint_answers_403() -> None:
    client = _client()
    assert client.app.service.config.admin.resolved_token() is None  # type: ignore[attr-defined]
    for method, path in ADMIN_ROUTES:
        resp = client.simulate_request(method, path, json={"clear_all": True},
                                       headers={"Authorization": "Bearer anything"})
        assert resp.status_code == 403, (method, path, resp.text)
        error = json.loads(resp.content)["error"]
        assert error["type"] == "permission_error"
        assert error["code"] == "admin_token_not_configured"
        assert "admin.token" in error["message"] and "admin.token_env" in error["message"]
        assert "allow_unauthenticated" in error["message"]
    # not an admin path: unaffected
    assert client.simulate_get("/v1/models").status_code == 200


def test_the_gate_guards_any_admin_resource_before_its_responder() -> None:
    from continuum.web.admin import AdminResource

    class _Probe(AdminResource):
        """Added after the fact: the gate must cover it with no code of its own."""

        calls = 0

        def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
            type(self).calls += 1
            resp.media = {"ok": True}

    client = _client()
    client.app.add_route("/admin/probe", _Probe(client.app.service))  # type: ignore[attr-defined]
    _Probe.calls = 0
    assert client.simulate_get("/admin/probe").status_code == 403
    assert _Probe.calls == 0
    opened = _client({"token": "tk"})
    opened.app.add_route("/admin/probe", _Probe(opened.app.service))  # type: ignore[attr-defined]
    assert opened.simulate_get("/admin/probe").status_code == 401
    assert _Probe.calls == 0
    ok = opened.simulate_get("/admin/probe", headers={"Authorization": "Bearer tk"})
    assert ok.status_code == 200 and _Probe.calls == 1


def test_allow_unauthenticated_opens_admin() -> None:
    client = _client({"allow_unauthenticated": True})
    resp = client.simulate_get("/admin/backends")
    assert resp.status_code == 200
    assert [b["name"] for b in resp.json["backends"]] == ["a"]
    assert client.simulate_post("/admin/response-cache/invalidate",
                                json={"clear_all": True}).json["success"] is True


@pytest.mark.parametrize(("body", "code", "param"), [
    (b"{", "invalid_json", None),
    (b'{"clear_all": false}', "invalid_value", "clear_all"),
    (b'{"prefix": "x"}', "invalid_value", "clear_all"),
])
def test_invalidate_refuses_other_bodies_with_a_code(body: bytes, code: str,
                                                     param: str | None) -> None:
    client = _client({"allow_unauthenticated": True})
    resp = client.simulate_post("/admin/response-cache/invalidate", body=body)
    assert resp.status_code == 400
    error = resp.json["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert 'clear_all' in error["message"]


def test_token_from_env_and_rotation_on_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CR_TEST_ADMIN", "from-env")
    client = _client({"token_env": "CR_TEST_ADMIN"})
    assert client.simulate_get("/admin/strategies").status_code == 401
    good = {"Authorization": "Bearer from-env"}
    assert client.simulate_get("/admin/strategies", headers=good).status_code == 200
    service = client.app.service  # type: ignore[attr-defined]
    rotated = dataclasses.replace(service.config, admin=parse_config(
        {**BASE, "admin": {"token": "rotated"}}).admin)
    service.reload(rotated)
    assert client.simulate_get("/admin/strategies", headers=good).status_code == 401
    assert client.simulate_get("/admin/strategies",
                               headers={"Authorization": "Bearer rotated"}).status_code == 200


def test_get_admin_lists_every_admin_endpoint_with_its_methods() -> None:
    client = _client({"token": "tk"})
    assert client.simulate_get("/admin").status_code == 401
    resp = client.simulate_get("/admin", headers={"Authorization": "Bearer tk"})
    assert resp.status_code == 200
    rows = resp.json["endpoints"]
    listed = {(method, row["path"].replace("{name}", "a"))
              for row in rows for method in row["methods"]}
    assert listed == set(ADMIN_ROUTES) - {("GET", "/admin")}
    for row in rows:  # a sentence of its own, not the docstring's METHOD /path
        assert row["description"] and not row["description"].startswith("``"), row
        assert row["description"] != row["path"]
    views = {row["path"] for row in rows if "workers" in row.get("query", {})}
    assert views == {path for method, path in ADMIN_ROUTES if method == "GET"} - {"/admin"}
    drain = next(r for r in rows if r["path"] == "/admin/backends/{name}/drain")
    assert "in flight finish" in drain["description"]
    # every listed route answers with the token (no 404/405): none is listed by mistake
    for method, path in listed:
        answer = client.simulate_request(method, path, json={"clear_all": True},
                                         headers={"Authorization": "Bearer tk"})
        assert answer.status_code not in (404, 405), (method, path, answer.text)


def test_an_unknown_admin_path_points_at_the_index() -> None:
    resp = _client({"token": "tk"}).simulate_get("/admin/config")
    assert resp.status_code == 404
    assert resp.json["error"]["message"] == (
        "no such endpoint: GET /admin/config; GET /admin lists the admin endpoints")
