"""Tiers 2 and 3 through real gunicorn: hits, bypass, tenants, Redis fallback, sharing."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import openai
import pytest
import redis
import requests

from continuum.caching.cache_key import cache_key
from continuum.caching.response_cache import decode_entry
from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import wait_until
from continuum.request import CHAT, parse_request

pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "What is 2+2?"}]


def _config(up: Any, **cache: Any) -> dict[str, Any]:
    return {
        "backends": [{"name": up.name, "url": up.url, "models": ["m"]}],
        "response_cache": {"enabled": True, **cache},
        "auth": {"keys": [{"key": "key-acme", "tenant": "acme"},
                          {"key": "key-globex", "tenant": "globex"}]},
        "health_check": {"interval_seconds": 30},
    }


def _redis_cache(server: Any, prefix: str, **redis_cfg: Any) -> dict[str, Any]:
    return {"backend": "redis",
            "redis": {"url": server.url, "key_prefix": prefix, **redis_cfg}}


def _client(router: Any, key: str = "key-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


def _post(router: Any, body: dict[str, Any], key: str = "key-acme") -> requests.Response:
    return requests.post(router.url + "/v1/chat/completions", json=body, timeout=10,
                         headers={"Authorization": f"Bearer {key}"})


def test_miss_then_hit_plain_and_streamed(upstreams, router_factory) -> None:
    up = upstreams("a")
    router = router_factory(_config(up))
    with _client(router) as client:
        first = client.chat.completions.with_raw_response.create(
            model="m", messages=MSG, temperature=0)
        second = client.chat.completions.with_raw_response.create(
            model="m", messages=MSG, temperature=0)
        assert first.headers["x-cache"] == "MISS" and second.headers["x-cache"] == "HIT"
        assert first.parse().choices[0].message.content == \
            second.parse().choices[0].message.content == "hello from a"
        assert up.stats()["requests"] == 1

        texts, caches = [], []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=MSG, temperature=0, stream=True)
            caches.append(raw.headers["x-cache"])
            texts.append("".join(c.choices[0].delta.content or "" for c in raw.parse()
                                 if c.choices))
        assert caches == ["MISS", "HIT"] and texts == ["t0 t1 t2 "] * 2
        assert up.stats()["requests"] == 2  # the streamed hit never reached the upstream

        hot = client.chat.completions.with_raw_response.create(
            model="m", messages=MSG, temperature=0.7)
        assert hot.headers["x-cache"] == "BYPASS"
    text = router.metrics()
    assert metric_sum(text, "continuum_response_cache_requests_total", result="hit") == 2
    assert metric_sum(text, "continuum_response_cache_requests_total", result="skip") == 1
    stats = requests.get(router.url + "/admin/response-cache/stats", timeout=5).json()
    assert stats["requests"] == {"hit": 2, "miss": 2, "skip": 1, "total": 5}
    assert stats["entries"] == 2 and stats["backend_type"] == "memory"
    cleared = requests.post(router.url + "/admin/response-cache/invalidate",
                            json={"clear_all": True}, timeout=5).json()
    assert cleared == {"success": True, "action": "clear_all", "cleared_entries": 2,
                       "worker_pid": cleared["worker_pid"],
                       # the one worker applied it (docs/scale-out.md)
                       "fleet": {"workers": 1, "workers_applied": 1, "routers": 1,
                                 "routers_applied": 1, "complete": True}}
    assert _post(router, {"model": "m", "messages": MSG}).headers["X-Cache"] == "MISS"


def test_tenants_and_output_fields_never_share(upstreams, router_factory) -> None:
    up = upstreams("a")
    router = router_factory(_config(up))
    body = {"model": "m", "messages": MSG, "temperature": 0}
    assert _post(router, body).headers["X-Cache"] == "MISS"
    assert _post(router, body).headers["X-Cache"] == "HIT"
    assert _post(router, body, key="key-globex").headers["X-Cache"] == "MISS"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _post(router, {**body, "tools": tools}).headers["X-Cache"] == "MISS"
    assert _post(router, {**body, "response_format": {"type": "json_object"}}
                 ).headers["X-Cache"] == "MISS"
    assert _post(router, {**body, "user": "someone"}).headers["X-Cache"] == "HIT"
    assert up.stats()["requests"] == 4


def test_required_auth_rejects_unknown_keys(upstreams, router_factory) -> None:
    up = upstreams("a")
    cfg = _config(up)
    cfg["auth"]["required"] = True
    router = router_factory(cfg)
    with _client(router, key="wrong") as client, pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=MSG)
    assert _post(router, {"model": "m", "messages": MSG}).status_code == 200


@pytest.mark.redis
def test_two_routers_share_one_redis_and_garbage_is_a_miss(
    upstreams, router_factory, redis_server
) -> None:
    up = upstreams("a")
    prefix = f"cr:test:{time.monotonic_ns()}:"
    cfg = _config(up, **_redis_cache(redis_server, prefix))
    one, two = router_factory(cfg), router_factory(cfg)
    body = {"model": "m", "messages": MSG, "temperature": 0}
    assert _post(one, body).headers["X-Cache"] == "MISS"
    hit = _post(two, body)
    assert hit.headers["X-Cache"] == "HIT" and hit.json()["choices"][0]["message"][
        "content"] == "hello from a"

    planted = {"model": "m", "messages": [{"role": "user", "content": "planted"}],
               "temperature": 0}
    key = prefix + cache_key(parse_request(json.dumps(planted).encode(), CHAT, tenant="acme"))
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(key, b"\xffnot an entry")
        resp = _post(one, planted)
        assert resp.status_code == 200 and resp.headers["X-Cache"] == "MISS"
        entry = decode_entry(client.get(key) or b"")
        assert entry is not None and entry.kind == "body"  # replaced by the real answer
    finally:
        client.close()


@pytest.mark.redis
def test_redis_outage_falls_back_without_client_errors(
    upstreams, router_factory, fresh_redis
) -> None:
    up = upstreams("a")
    cfg = _config(up, **_redis_cache(fresh_redis, "cr:fault:", probe_interval_seconds=0.5,
                                     command_timeout_ms=300, connect_timeout_ms=300))
    router = router_factory(cfg)
    errors: list[Any] = []
    stop = threading.Event()

    def traffic() -> None:
        with requests.Session() as session:
            deadline = time.monotonic() + 40
            i = 0
            while not stop.is_set() and time.monotonic() < deadline and i < 4000:
                body = {"model": "m", "messages": [{"role": "user", "content": f"q{i % 5}"}]}
                try:
                    resp = session.post(router.url + "/v1/chat/completions", json=body,
                                        timeout=10)
                    if resp.status_code != 200:
                        errors.append(resp.status_code)
                except requests.RequestException as exc:
                    errors.append(exc)
                i += 1
                time.sleep(0.01)

    def gauge() -> float:
        return metric_sum(router.metrics(), "continuum_cache_fallback_active")

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        time.sleep(0.5)
        assert gauge() == 0
        fresh_redis.stop()
        wait_until(lambda: gauge() == 1, "the fallback gauge to go up", 10, interval=0.1)
        stats = requests.get(router.url + "/admin/response-cache/stats", timeout=5).json()
        assert stats["redis"]["fallback_active"] is True
        assert stats["redis"]["errors"]["connection"] + stats["redis"]["errors"]["timeout"] >= 1
        # traffic keeps flowing from the in-memory fallback, which stores the answers
        wait_until(lambda: requests.get(router.url + "/admin/response-cache/stats",
                                        timeout=5).json()["redis"]["fallback_entries"] > 0,
                   "the fallback to hold entries", 10, interval=0.1)
        fresh_redis.start()
        wait_until(lambda: gauge() == 0, "the fallback gauge to go down", 10, interval=0.1)
    finally:
        stop.set()
        thread.join(30)
    assert errors == []
    assert _post(router, {"model": "m", "messages": MSG}).headers["X-Cache"] in ("MISS", "HIT")


@pytest.mark.redis
def test_reload_applies_cache_settings_and_a_new_redis(
    upstreams, router_factory, redis_server, fresh_redis
) -> None:
    import yaml

    up = upstreams("a")
    router = router_factory(_config(up, **_redis_cache(redis_server, "cr:reload:")))
    body = {"model": "m", "messages": MSG, "temperature": 0}
    assert _post(router, body).headers["X-Cache"] == "MISS"
    assert _post(router, body).headers["X-Cache"] == "HIT"

    config = yaml.safe_load(router.config_path.read_text())
    config["response_cache"]["redis"]["url"] = fresh_redis.url
    config["response_cache"]["ttl"] = "10m"
    router.config_path.write_text(yaml.safe_dump(config))
    reply = requests.post(router.url + "/admin/config/reload", timeout=10).json()
    assert reply["restart_required"] == []
    assert {"response_cache.redis.url", "response_cache.ttl"} <= set(reply["applied"])
    # The new Redis takes over at once (a new pool; it is empty).
    assert _post(router, body).headers["X-Cache"] == "MISS"
    assert _post(router, body).headers["X-Cache"] == "HIT"

    config["response_cache"]["backend"] = "memory"  # restart-only: reported, not applied
    router.config_path.write_text(yaml.safe_dump(config))
    for _ in range(2):  # reported on every reload until a restart, never half-applied
        reply = requests.post(router.url + "/admin/config/reload", timeout=10).json()
        assert reply["restart_required"] == ["response_cache.backend"]
    stats = requests.get(router.url + "/admin/response-cache/stats", timeout=5).json()
    assert stats["backend_type"] == "redis"
    assert _post(router, body).headers["X-Cache"] == "HIT"
    client = redis.Redis.from_url(fresh_redis.url)
    try:
        keys = client.keys("cr:reload:*")
        assert len(keys) == 1 and 590 < client.ttl(keys[0]) <= 600
    finally:
        client.close()
