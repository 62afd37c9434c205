"""``/admin`` fails closed under real gunicorn: 403 without a token, the opt-out warned at
start, and a ``token_env`` naming an unset variable stops the start (without printing any
secret of the config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests

from continuum.devtools.servers import RouterProcess

BACKENDS = [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]
BASE = {"backends": BACKENDS, "health_check": {"enabled": False}}


def test_no_token_means_403_for_every_admin_call(
        router_factory: Callable[..., RouterProcess]) -> None:
    router = router_factory({**BASE, "admin": {}})
    for method, path in (("GET", "/admin/backends"), ("POST", "/admin/config/reload"),
                         ("POST", "/admin/response-cache/invalidate")):
        resp = requests.request(method, router.url + path, json={"clear_all": True}, timeout=5)
        assert resp.status_code == 403, (path, resp.text)
        error = resp.json()["error"]
        assert error["code"] == "admin_token_not_configured"
        assert "admin.token" in error["message"]
    assert "no token: every /admin endpoint answers 403" in router.proc.log_text()


def test_opt_out_opens_admin_and_warns_at_start(
        router_factory: Callable[..., RouterProcess]) -> None:
    config: dict[str, Any] = {**BASE, "admin": {"allow_unauthenticated": True}}
    router = router_factory(config)
    resp = requests.get(router.url + "/admin/backends", timeout=5)
    assert resp.status_code == 200 and resp.json()["backends"][0]["name"] == "a"
    log = router.proc.log_text()
    assert "WARNING continuum.web.app: config: " in log
    assert log.count("admin.allow_unauthenticated: every /admin endpoint is open") == 1, log


def test_token_env_unset_stops_the_start(router_factory: Callable[..., RouterProcess],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CR_E2E_UNSET_TOKEN", raising=False)
    planted = "plant-e2e-api-key-93x"
    config = {**BASE, "backends": [{**BACKENDS[0], "api_key": planted,
                                    "url": "http://u:plant-e2e-pw-94x@127.0.0.1:9"}],
              "admin": {"token_env": "CR_E2E_UNSET_TOKEN"}}
    with pytest.raises(RuntimeError) as err:
        router_factory(config)
    output = str(err.value)
    assert "admin.token_env: environment variable is not set" in output
    assert planted not in output and "plant-e2e-pw-94x" not in output
