"""Integration fixtures: real servers on free ports, stopped by PID."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from continuum.devtools.redis_server import RedisServer, redis_available, unique_prefix
from continuum.wire.sse import SseTransport

REQUIRE_REDIS_ENV = "CONTINUUM_REQUIRE_REDIS"


def _need_redis_server() -> None:
    """Skip when redis-server is missing — or fail, when CI says Redis is required."""
    if redis_available():
        return
    reason = "redis-server is not installed (not on PATH)"
    if os.environ.get(REQUIRE_REDIS_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_REDIS_ENV}=1 requires it", pytrace=False)
    pytest.skip(f"{reason}; install it, or set {REQUIRE_REDIS_ENV}=1 to make this an error")


def _own_redis_server() -> Iterator[RedisServer]:
    _need_redis_server()
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session (tests use their own key prefixes)."""
    yield from _own_redis_server()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, which the test may stop and start again."""
    yield from _own_redis_server()


class Links:
    """RedisLinks, raw clients and indexes made by one test, all closed at its end."""

    def __init__(self) -> None:
        self.links: list[Any] = []
        self.clients: list[Any] = []
        self.closing: list[Any] = []  # stores, indexes: closed before the links

    def link(self, url: str, metrics: Any = None, **settings: Any) -> Any:
        """A RedisLink to ``url`` with ``response_cache.redis`` settings."""
        from continuum.config import RedisConfig
        from stores.redis_link import RedisLink

        link = RedisLink(RedisConfig(url=url, **settings), metrics)
        self.links.append(link)
        return link

    def raw(self, url: str) -> Any:
        """A plain redis-py client (to plant or inspect keys)."""
        import redis

        client = redis.Redis.from_url(url)
        self.clients.append(client)
        return client

    def index(self, link: Any, prefix: str | None = None, **settings: Any) -> Any:
        """A RedisKvIndex on ``link`` under ``prefix`` (default: a fresh one)."""
        from stores.kv_redis import RedisKvIndex

        index = RedisKvIndex(link, key_prefix=prefix or unique_prefix("kv"), **settings)
        self.closing.append(index)
        return index

    def close(self) -> None:
        for item in self.closing:
            item.close()
        for link in self.links:
            link.close()
        for client in self.clients:
            client.close()


@pytest.fixture
def links() -> Iterator[Links]:
    """Redis links, raw clients and KV indexes for this test, closed at its end."""
    made = Links()
    yield made
    made.close()


def _listener_snapshot(url: str, backend: str) -> dict[str, int]:
    records: list[tuple[str | None, dict[str, Any]]] = []
    transport = SseTransport.open(f"{url}/events/{backend}", None, 5.0, 30.0)
    try:
        for event, data, record_id in transport.records():
            records.append((event, json.loads(data or "{}")))
            if record_id is not None:
                break
    finally:
        transport.close()
    assert records and records[0][0] == "cache_cleared", records[:1]
    return {doc["prefix_hash"]: int(doc.get("token_count") or 0)
            for event, doc in records[1:] if event == "cache_created"}


@pytest.fixture
def listener_snapshot() -> Callable[[str, str], dict[str, int]]:
    """``listener_snapshot(url, backend)``: prefix → token_count ``backend`` holds, read
    from a fresh subscription to the KV listener at ``url`` (``cache_cleared``, then one
    ``cache_created`` per prefix, the last record carrying the id)."""
    return _listener_snapshot
