"""Integration fixtures: real servers on free ports, stopped by PID."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer, redis_available

REQUIRE_REDIS_ENV = "CONTINUUM_REQUIRE_REDIS"


def _need_redis_server() -> None:
    """Skip when redis-server is missing — or fail, when CI says Redis is required."""
    if redis_available():
        return
    reason = "redis-server is not installed (not on PATH)"
    if os.environ.get(REQUIRE_REDIS_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_REDIS_ENV}=1 requires it", pytrace=False)
    pytest.skip(f"{reason}; install it, or set {REQUIRE_REDIS_ENV}=1 to make this an error")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session (tests use their own key prefixes)."""
    _need_redis_server()
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, which the test may stop and start again."""
    _need_redis_server()
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
