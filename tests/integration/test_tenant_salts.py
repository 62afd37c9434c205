"""``kv_cache_index.cache_salt.per_tenant``: salts bound to the client's tenant (router under
real gunicorn -k gevent, salts read off a real upstream).

Tenants with the same prompt get different salts, so an engine never reuses one tenant's
KV blocks for another (no cross-tenant timing side channel); a client's own ``cache_salt``
is refused for models a salted backend serves. Off, the old behaviour stays: one salt per
prefix and backend, and a client's salt is forwarded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests

from continuum.cache_salt import make_salt, verify_salt
from continuum.devtools.servers import FakeUpstream, RouterProcess
from continuum.prefix import request_prefix_key

pytestmark = pytest.mark.e2e

SECRET = "tenant-salt-secret"
MSG = [{"role": "system", "content": "You answer questions about caches."},
       {"role": "user", "content": "What is a prefix cache?"}]
KEYS = {"acme": "sk-acme", "globex": "sk-globex"}


def _config(up: FakeUpstream, per_tenant: bool) -> dict[str, Any]:
    """Backend ``a`` is salted (it has an event source); ``plain`` (same upstream, model
    ``other``) is not."""
    return {
        "backends": [{"name": "a", "url": up.url, "models": ["m"]},
                     {"name": "plain", "url": up.url, "models": ["other"]}],
        "health_check": {"enabled": False},
        "prefix_routing": {"enabled": True},
        "auth": {"keys": [{"key": key, "tenant": tenant} for tenant, key in KEYS.items()]},
        "kv_cache_index": {
            "event_sources": [{"backend_name": "a", "endpoint": "http://127.0.0.1:9/events/a"}],
            "cache_salt": {"enabled": True, "secret": SECRET, "per_tenant": per_tenant},
        },
    }


def _send(router: RouterProcess, tenant: str | None, model: str = "m",
          **extra: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return requests.post(router.url + "/v1/chat/completions", timeout=10, headers=headers,
                         json={"model": model, "messages": MSG, **extra})


def _salt_sent(router: RouterProcess, up: FakeUpstream, tenant: str | None) -> str:
    """The ``cache_salt`` the upstream received for one request of ``tenant``."""
    assert _send(router, tenant).status_code == 200
    salt = up.stats()["last_body"].get("cache_salt")
    assert isinstance(salt, str)
    return salt


def _prefix_hash() -> str:
    key = request_prefix_key({"messages": MSG}, "m")
    assert key is not None
    return key.hex()


def test_per_tenant_salts_isolate_tenants_and_refuse_client_salts(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    up = upstreams("a")
    router = router_factory(_config(up, per_tenant=True))
    prefix = _prefix_hash()

    acme, globex = _salt_sent(router, up, "acme"), _salt_sent(router, up, "globex")
    assert acme != globex
    assert _salt_sent(router, up, "acme") == acme
    assert acme == make_salt(SECRET.encode(), "a", prefix, "acme")
    assert globex == make_salt(SECRET.encode(), "a", prefix, "globex")
    # No tenant (no key, auth not required): the shared salt, which no tenant gets.
    assert _salt_sent(router, up, None) == make_salt(SECRET.encode(), "a", prefix)
    # The listener attributes every one of them to the prefix key of backend a.
    for salt in (acme, globex):
        assert verify_salt(SECRET.encode(), "a", salt) == prefix

    before = up.stats()["requests"]
    refused = _send(router, "acme", cache_salt="shared-by-agreement")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert "cache_salt" in error["message"]
    assert up.stats()["requests"] == before  # nothing went upstream

    # A model no salted backend serves: the client's salt is its own business.
    assert _send(router, "acme", model="other", cache_salt="mine").status_code == 200
    assert up.stats()["last_body"]["cache_salt"] == "mine"


def test_without_per_tenant_salts_are_shared_and_client_salts_forwarded(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    up = upstreams("a")
    router = router_factory(_config(up, per_tenant=False))
    shared = make_salt(SECRET.encode(), "a", _prefix_hash())
    assert {_salt_sent(router, up, t) for t in ("acme", "globex", None)} == {shared}

    assert _send(router, "acme", cache_salt="mine").status_code == 200
    assert up.stats()["last_body"]["cache_salt"] == "mine"
