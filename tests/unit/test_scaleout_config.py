"""Config keys of scale-out: fleet, response_cache.redis.mode/nodes/sentinel_master, and
errors that name the key path."""

from __future__ import annotations

import pytest

from continuum.config import ConfigError, parse_config
from continuum.redis_topology import hash_tagged


def _errors(doc: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    return str(info.value)


def test_defaults() -> None:
    config = parse_config({})
    assert config.response_cache.redis.mode == "standalone"
    assert config.fleet.share_in_flight and config.fleet.kv_event_lease
    assert config.fleet.lease_ttl_ms == 3000


def test_cluster_and_sentinel_parse() -> None:
    config = parse_config({"response_cache": {"redis": {
        "mode": "sentinel", "nodes": ["127.0.0.1:26379", "[::1]:26380"],
        "sentinel_master": "cache"}}})
    assert config.response_cache.redis.nodes == ("127.0.0.1:26379", "[::1]:26380")


@pytest.mark.parametrize(("redis", "path"), [
    ({"mode": "ring"}, "response_cache.redis.mode"),
    ({"mode": "sentinel"}, "response_cache.redis.nodes"),
    ({"mode": "cluster", "nodes": ["127.0.0.1"]}, "response_cache.redis.nodes[0]"),
    ({"mode": "cluster", "nodes": ["h:1", "h:99999"]}, "response_cache.redis.nodes[1]"),
    ({"mode": "sentinel", "nodes": ["h:1"], "sentinel_master": ""},
     "response_cache.redis.sentinel_master"),
    ({"mode": "cluster", "url": "unix:///tmp/r.sock"}, "response_cache.redis.url"),
])
def test_bad_topology_names_the_key(redis: dict, path: str) -> None:
    assert path in _errors({"response_cache": {"redis": redis}})


@pytest.mark.parametrize(("fleet", "path"), [
    ({"lease_ttl_ms": 10}, "fleet.lease_ttl_ms"),
    ({"ack_timeout_seconds": 100}, "fleet.ack_timeout_seconds"),
    ({"share_in_flight": "yes please"}, "fleet.share_in_flight"),
    ({"unknown": 1}, "fleet.unknown"),
])
def test_bad_fleet_key_names_the_path(fleet: dict, path: str) -> None:
    assert path in _errors({"fleet": fleet})


def test_hash_tag_wraps_the_prefix_once() -> None:
    assert hash_tagged("cr:kvidx:") == "{cr:kvidx}:"
    assert hash_tagged("idx") == "{idx}"
    assert hash_tagged("{mine}:kv:") == "{mine}:kv:"


@pytest.mark.parametrize(("doc", "expected"), [
    ({}, False),
    ({"response_cache": {"enabled": True}}, False),  # a memory cache shares nothing
    ({"response_cache": {"enabled": True, "backend": "redis"}}, True),
    ({"response_cache": {"enabled": False, "backend": "redis"}}, False),
    ({"kv_cache_index": {"enabled": True, "backend": "redis"}}, True),
    ({"fleet": {"use_redis": True}}, True),
])
def test_fleet_on_redis(doc: dict, expected: bool) -> None:
    """The routers reach each other through Redis when a tier is on it, or on request."""
    assert parse_config(doc).fleet_on_redis is expected
