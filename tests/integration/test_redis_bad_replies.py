"""A Redis that answers what no parser can use costs a cache miss, never a 500.

Two real servers on 127.0.0.1: a tiny RESP server that answers every data command with an
array nested 100 000 levels deep (redis-py's parser recurses per level: ``RecursionError``),
and a real ``redis-server`` holding a crafted KV-index entry whose tier is not UTF-8. The
router is the real app in-process, talking to a real upstream
(``continuum.devtools.fake_upstream``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import falcon.testing
import pytest

from continuum.config import parse_config
from continuum.devtools.fleet import metric_sum
from continuum.devtools.redis_server import RedisServer, unique_prefix
from continuum.devtools.servers import FakeUpstream
from continuum.prefix import request_prefix_key
from continuum.registry import PluginRegistry
from continuum.web.app import create_app

#: Array levels of the poisoned reply.
DEPTH = 100_000
NESTED = b"*1\r\n" * DEPTH + b":1\r\n"
#: What the handshake commands get (RESP3 ``HELLO 3`` needs a map with ``proto``).
HELLO = b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n"
CHAT = {"model": "m", "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "hi"}]}


class NestedRespServer:
    """Speaks just enough RESP for redis-py's handshake, then poisons every data command."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.poisoned = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                name = command[0].upper() if command else b""
                if name == b"HELLO":
                    conn.sendall(HELLO)
                elif name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif name in (b"CLIENT", b"SELECT", b"AUTH"):
                    conn.sendall(b"+OK\r\n")
                else:
                    self.poisoned += 1
                    conn.sendall(NESTED)
        except OSError:
            return
        finally:
            reader.close()
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(5)


def _read_command(reader: Any) -> list[bytes] | None:
    """One RESP array of bulk strings (what clients send); None at EOF."""
    head = reader.readline()
    if not head:
        return None
    if not head.startswith(b"*"):
        return [head.strip()]  # an inline command
    parts = []
    for _ in range(int(head[1:])):
        size = int(reader.readline()[1:])
        parts.append(reader.read(size + 2)[:-2])
    return parts


@pytest.fixture
def nested_redis() -> Iterator[NestedRespServer]:
    server = NestedRespServer()
    yield server
    server.stop()


@pytest.fixture
def app_factory() -> Iterator[Callable[[dict[str, Any]], falcon.testing.TestClient]]:
    apps: list[Any] = []

    def make(cfg: dict[str, Any]) -> falcon.testing.TestClient:
        app = create_app(parse_config(cfg), registry=PluginRegistry())
        apps.append(app)
        return falcon.testing.TestClient(app)

    yield make
    for app in apps:
        app.service.stop()


def _config(upstream: FakeUpstream, redis_url: str, **sections: Any) -> dict[str, Any]:
    return {"backends": [{"name": "a", "url": upstream.url, "models": ["m"]}],
            "health_check": {"enabled": False},
            "response_cache": {"redis": {"url": redis_url, "key_prefix": unique_prefix()}},
            **sections}


def test_deeply_nested_reply_to_a_cache_get_is_a_miss(
        upstreams: Any, nested_redis: NestedRespServer, app_factory: Any) -> None:
    a = upstreams("a")
    cfg = _config(a, nested_redis.url)
    cfg["response_cache"].update(enabled=True, backend="redis")
    client = app_factory(cfg)
    for _ in range(2):
        resp = client.simulate_post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Cache"] == "MISS"
        assert resp.json["choices"][0]["message"]["content"] == "hello from a"
    assert nested_redis.poisoned >= 2
    metrics = client.simulate_get("/metrics").text
    assert metric_sum(metrics, "continuum_cache_redis_errors_total", kind="protocol") >= 2
    assert metric_sum(metrics, "continuum_response_cache_requests_total", result="miss") == 2
    stats = client.app.service.response_cache.stats()
    assert stats["redis"]["errors"]["protocol"] >= 2
    assert stats["redis"]["fallback_active"] is False  # reachable, just unusable: no fallback


def test_deeply_nested_reply_to_a_kv_index_query_falls_back_to_the_strategy(
        upstreams: Any, nested_redis: NestedRespServer, app_factory: Any) -> None:
    a = upstreams("a")
    client = app_factory(_config(
        a, nested_redis.url, prefix_routing={"enabled": True},
        kv_cache_index={"enabled": True, "backend": "redis"}))
    resp = client.simulate_post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Continuum-Backend"] == "a"
    scorer = client.app.service.kv_scorer
    assert scorer.query_errors == 1
    metrics = client.simulate_get("/metrics").text
    assert metric_sum(metrics, "continuum_cache_redis_errors_total", kind="protocol") >= 1


@pytest.mark.redis
def test_crafted_kv_entry_in_a_real_redis_is_a_counted_miss(
        upstreams: Any, redis_server: RedisServer, app_factory: Any, links: Any) -> None:
    a = upstreams("a")
    prefix = unique_prefix("kv")
    client = app_factory(_config(
        a, redis_server.url, prefix_routing={"enabled": True},
        kv_cache_index={"enabled": True, "backend": "redis", "redis_key_prefix": prefix}))
    key = prefix + (request_prefix_key(CHAT, "m") or b"").hex()
    raw = links.raw(redis_server.url)
    try:
        raw.zadd(key, {"a": 100})
        raw.hset(key + ":tier", "a", b"\xff\xfe|not-utf-8")
        raw.expire(key, 60)
        raw.expire(key + ":tier", 60)
        resp = client.simulate_post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200, resp.text
        assert client.app.service.kv_scorer.query_errors == 1
        metrics = client.simulate_get("/metrics").text
        assert metric_sum(metrics, "continuum_cache_redis_errors_total", kind="protocol") == 1
    finally:
        raw.delete(key, key + ":tier")
