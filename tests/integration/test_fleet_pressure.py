"""KV pressure exchanged between router hosts through a real Redis, with the in-flight
counts (continuum.routing.fleet_load): one host's placement sees the other's pressure."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from continuum.devtools.procs import free_port
from continuum.devtools.redis_server import unique_prefix
from continuum.hostshm import HostSegment
from continuum.registry import PluginRegistry
from continuum.routing.fleet_load import IDLE_SECONDS, PRESSURE_FIELD, TTL_INTERVALS, FleetLoad
from continuum.testing import make_backends, make_context

WINDOW = 8.0


@pytest.fixture
def plain(redis_server: Any) -> Iterator[Any]:
    """A plain client of the test's Redis, to read what the hosts wrote; closed after the
    test (a client left to the collector closes its socket with a ResourceWarning)."""
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Any]:
    made: list[tuple[HostSegment, Any]] = []

    def host(name: str, url: str, prefix: str, window: float | None = WINDOW,
             ) -> tuple[HostSegment, FleetLoad]:
        directory = tmp_path / name
        directory.mkdir()
        segment = HostSegment(directory)
        client = redis.Redis.from_url(url)
        made.append((segment, client))
        return segment, FleetLoad(make_backends(2), segment, client, prefix, 0.1, window)

    yield host
    for segment, client in made:
        segment.release()
        segment.close()
        client.close()


def test_a_hosts_pressure_reaches_the_other_router_and_not_its_own_count(
        hosts: Any, redis_server: Any) -> None:
    prefix = unique_prefix("fp")
    one, one_load = hosts("one", redis_server.url, prefix)
    two, two_load = hosts("two", redis_server.url, prefix)
    col = one.column("b0")
    one.set_pressure(col, 500.0, time.monotonic())
    one.words[one.cell(col)] = 2  # two requests in flight on b0 from host one
    assert one_load.exchange() == {}  # nobody else yet
    counts = two_load.exchange()
    assert counts == {"b0": 2, "b1": 0}  # the pressure fields are not counts
    assert two_load.elsewhere_pressure == {"b0": 500.0, "b1": 0.0}
    now = time.monotonic()
    col_two = two.column("b0")
    assert two.workers_pressure(col_two, now, WINDOW) == 0.0
    assert 490.0 < two.host_pressure(col_two, now, WINDOW) <= 500.0
    assert two.host_total(col_two) == 2
    # host one hears nothing back of its own pressure: two has none
    one_load.exchange()
    assert one_load.elsewhere_pressure == {"b0": 0.0, "b1": 0.0}
    assert one.host_pressure(col, time.monotonic(), WINDOW) <= 500.0


def test_without_placement_no_pressure_is_sent_or_kept(hosts: Any, redis_server: Any,
                                                       plain: Any) -> None:
    prefix = unique_prefix("fp")
    one, one_load = hosts("one", redis_server.url, prefix, window=None)
    two, two_load = hosts("two", redis_server.url, prefix)
    one.set_pressure(one.column("b0"), 500.0, time.monotonic())
    one_load.exchange()
    fields = plain.hkeys(prefix + one.host_id)
    assert not any(f.decode().startswith(PRESSURE_FIELD) for f in fields)
    two_load.exchange()
    assert two_load.elsewhere_pressure == {}
    # and a host without placement ignores the pressure others send
    two.set_pressure(two.column("b0"), 900.0, time.monotonic())
    two_load.exchange()
    assert one_load.exchange() == {"b0": 0, "b1": 0}
    assert one_load.elsewhere_pressure == {}
    assert one.host_pressure(one.column("b0"), time.monotonic(), WINDOW) <= 500.0


def test_redis_gone_zeroes_the_elsewhere_pressure(hosts: Any, fresh_redis: Any) -> None:
    prefix = unique_prefix("fp")
    one, one_load = hosts("one", fresh_redis.url, prefix)
    two, two_load = hosts("two", fresh_redis.url, prefix)
    one.set_pressure(one.column("b0"), 500.0, time.monotonic())
    one_load.exchange()
    two_load.exchange()
    col = two.column("b0")
    assert two.host_pressure(col, time.monotonic(), WINDOW) > 400.0
    fresh_redis.stop()
    assert two_load.exchange() == {}
    assert two_load.failures == 1 and two_load.elsewhere_pressure == {}
    assert two.host_pressure(col, time.monotonic(), WINDOW) == 0.0


def test_a_busy_host_exchanges_every_interval_and_an_idle_one_every_idle_interval(
        hosts: Any, redis_server: Any, plain: Any) -> None:
    prefix = unique_prefix("fp")
    one, load = hosts("one", redis_server.url, prefix)
    _two, other = hosts("two", redis_server.url, prefix)
    other.exchange()  # another router is live
    assert load.interval == 0.1 and load.idle_interval == IDLE_SECONDS
    now = time.monotonic()
    assert load.due(now)  # never exchanged
    load.exchange()
    assert not load.alone
    t = time.monotonic()
    assert not load.due(t + load.interval)  # idle: waits for the idle interval
    assert load.due(t + IDLE_SECONDS)
    col = one.column("b0")
    one.words[one.cell(col)] = 1  # a request in flight on this host
    assert load.due(t + load.interval)
    load.exchange()
    t = time.monotonic()
    one.words[one.cell(col)] = 0
    assert load.due(t + load.interval)  # the zeros go out at once
    load.exchange()
    assert not load.due(time.monotonic() + load.interval)
    # a host's counts outlive four idle intervals, not four busy ones
    ttl = plain.pttl(load.key_prefix + one.host_id)
    assert 3 * IDLE_SECONDS * 1000 < ttl <= 4 * IDLE_SECONDS * 1000


def test_a_lone_host_exchanges_every_idle_interval_until_another_joins(
        hosts: Any, redis_server: Any) -> None:
    prefix = unique_prefix("fp")
    one, load = hosts("one", redis_server.url, prefix)
    one.words[one.cell(one.column("b0"))] = 3  # busy
    assert load.exchange() == {} and load.alone
    t = time.monotonic()
    assert not load.due(t + load.interval)  # nobody reads its counts soon
    assert load.due(t + IDLE_SECONDS)
    _two, other = hosts("two", redis_server.url, prefix)
    assert other.exchange() == {"b0": 3, "b1": 0}  # the joiner reads them at once
    assert not other.alone
    assert load.exchange() == {"b0": 0, "b1": 0} and not load.alone
    assert load.due(time.monotonic() + load.interval)  # busy with company: every interval


def test_after_a_failed_exchange_a_busy_host_waits_an_idle_interval(
        hosts: Any, redis_server: Any) -> None:
    one, load = hosts("one", f"redis://127.0.0.1:{free_port()}/0", unique_prefix("fp"))
    one.words[one.cell(one.column("b0"))] = 1
    assert load.exchange() == {} and load.failures == 1
    t = time.monotonic()
    assert not load.due(t + load.interval)
    assert load.due(t + IDLE_SECONDS)


def test_two_hundred_backends_with_pressure_go_in_one_exchange(
        tmp_path: Path, redis_server: Any) -> None:
    # the script writes every field with one variadic HSET (unpack of the arguments)
    prefix = unique_prefix("fp")
    loads = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        segment = HostSegment(tmp_path / name)
        loads.append((segment, FleetLoad(make_backends(200), segment,
                                         redis.Redis.from_url(redis_server.url), prefix,
                                         0.1, WINDOW)))
    try:
        (one, one_load), (_, two_load) = loads
        one.words[one.cell(one.column("b199"))] = 3
        one.set_pressure(one.column("b7"), 250.0, time.monotonic())
        one_load.exchange()
        counts = two_load.exchange()
        assert len(counts) == 200 and counts["b199"] == 3 and sum(counts.values()) == 3
        assert two_load.elsewhere_pressure["b7"] == 250.0
    finally:
        for segment, load in loads:
            load.client.close()
            segment.release()
            segment.close()


def test_routers_taking_requests_in_turn_go_round_half_a_cycle_apart(
        hosts: Any, redis_server: Any, plain: Any) -> None:
    """Two routers alternating requests: once the exchange has told each its place, their
    RoundRobin cycles run half-way round from each other, so no backend gets two requests
    in a row. In step (each on its own count from b0) they sent b0 b0 b1 b1 ..."""
    prefix = unique_prefix("fp")
    one, one_load = hosts("one", redis_server.url, prefix)
    two, two_load = hosts("two", redis_server.url, prefix)
    for _ in range(2):  # each host publishes, then reads the other
        one_load.exchange()
        two_load.exchange()
    fields = plain.hgetall(prefix + one.host_id)
    assert fields[b"r:" + one.host_id.encode()] == b"0"
    cls = PluginRegistry().load("continuum.strategies", "RoundRobin")
    routers = [cls(host=one), cls(host=two)]
    backends = make_backends(4)
    served = [routers[i % 2].select(backends, make_context()).name for i in range(16)]
    assert all(a != b for a, b in itertools.pairwise(served)), served
    for start in (0, 8):
        assert sorted(served[start:start + 8]) == sorted(["b0", "b1", "b2", "b3"] * 2)
    assert one.turns == two.turns == 8
    # two requests at the same moment, one on each router, on the same count
    a, b = (router.select(backends, make_context()).name for router in routers)
    assert abs(int(a[1]) - int(b[1])) == 2
    # a router left alone starts at 0 again: its cycle covers every backend
    one_load.client.delete(prefix + "hosts", prefix + two.host_id)
    one_load.exchange()
    assert [routers[0].select(backends, make_context()).name for _ in range(4)] == \
        ["b1", "b2", "b3", "b0"]


def _next_message(pubsub: Any) -> bytes:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message is not None and message["type"] == "message":
            return bytes(message["data"])
    raise AssertionError("no message on the channel within 5 s")


def test_a_change_in_counts_is_pushed_and_taken_before_the_next_exchange(
        hosts: Any, redis_server: Any, plain: Any) -> None:
    """A push (a message on <prefix>counts) carries a host's new counts to the other
    router between exchanges; an exchange that reads the host's older hash afterwards does
    not undo it, an older push does not either, and a host ignores its own."""
    prefix = unique_prefix("fp")
    one, one_load = hosts("one", redis_server.url, prefix)
    two, two_load = hosts("two", redis_server.url, prefix)
    for load in (one_load, two_load, one_load):
        load.exchange()
    assert not one_load.alone and not two_load.alone
    listener = plain.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(two_load.channel)  # what two's listener greenlet reads
    try:
        col_one, col_two = one.column("b0"), two.column("b0")
        one.words[one.cell(col_one)] = 2
        assert one_load.push() and not one_load.push()  # only a change goes out
        first = _next_message(listener)
        assert two.host_total(col_two) == 0  # not seen until taken
        assert two_load.on_counts(first) and two_load.pushed_in == 1
        assert two.host_total(col_two) == 2
        # one's hash still holds the 0 of its last exchange, read before the push
        assert two_load.exchange()["b0"] == 2 and two.host_total(col_two) == 2
        one.words[one.cell(col_one)] = 0
        assert one_load.push()
        assert two_load.on_counts(_next_message(listener))
        assert two.host_total(col_two) == 0
        assert not two_load.on_counts(first)  # an older push changes nothing
        assert two.host_total(col_two) == 0
        assert not one_load.on_counts(first)  # a host's own push
        assert one.host_total(col_one) == 0
    finally:
        listener.close()


def test_a_push_from_a_new_router_ends_being_alone_and_a_silent_one_drops_out(
        hosts: Any, redis_server: Any, plain: Any) -> None:
    prefix = unique_prefix("fp")
    one, one_load = hosts("one", redis_server.url, prefix)
    assert one_load.exchange() == {} and one_load.alone
    two, two_load = hosts("two", redis_server.url, prefix)
    two_load.exchange()
    listener = plain.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(one_load.channel)
    try:
        two.words[two.cell(two.column("b1"))] = 3
        assert two_load.push()
        assert one_load.on_counts(_next_message(listener))
        assert not one_load.alone  # so it pushes too, without waiting an idle interval
        assert one.host_total(one.column("b1")) == 3
    finally:
        listener.close()
    # two goes silent: its hash outlives four idle intervals, then the next exchange drops
    # its pushed counts with it
    time.sleep(TTL_INTERVALS * IDLE_SECONDS + 0.2)
    assert one_load.exchange() == {} and one_load.alone
    assert one.host_total(one.column("b1")) == 0


def test_an_unreadable_push_is_ignored(hosts: Any, redis_server: Any) -> None:
    one, load = hosts("one", redis_server.url, unique_prefix("fp"))
    for data in (b"not json", b"[]", b'{"h": "x"}', b'{"h": "x", "s": 1, "c": {"b0": "?"}}'):
        assert not load.on_counts(data)
    assert one.host_total(one.column("b0")) == 0 and load.pushed_in == 0
