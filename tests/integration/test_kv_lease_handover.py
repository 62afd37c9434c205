"""A KV lease across a hot reload of the event sources: the worker that holds a backend's
lease hands it to its own next manager, so no other worker takes it in between (and opens
that backend's stream only to close it at its own reload).

Two workers are two lease objects on one lock directory (``flock`` conflicts between open
file descriptions, in one process as in two) or one Redis server under two holder names.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from continuum.devtools.procs import wait_until
from continuum.kv.lease import FileLease, Lease, LeasedConsumers, RedisLease

TTL_MS = 300


class _Consumer:
    """What a supervisor needs of a consumer: start, stop and a fresh copy; counts the
    streams it would have opened."""

    leased = True

    def __init__(self, backend: str, opened: Counter[str]) -> None:
        self.backend = backend
        self.opened = opened
        self._stop = threading.Event()

    def fresh(self) -> _Consumer:
        return _Consumer(self.backend, self.opened)

    def start(self, spawn: Callable[[Callable[[], None]], Any]) -> Any:
        self.opened[self.backend] += 1
        return spawn(self._stop.wait)

    def stop(self) -> None:
        self._stop.set()


class _Manager:
    def __init__(self, backends: list[str], opened: Counter[str]) -> None:
        self.consumers = [_Consumer(backend, opened) for backend in backends]


@pytest.fixture(params=["file", "redis"])
def two_workers(request: pytest.FixtureRequest,
                tmp_path: Path) -> Iterator[Callable[[str], Lease]]:
    """A factory of one worker's lease; each call is another worker of the host or fleet."""
    if request.param == "file":
        leases: list[FileLease] = []

        def file_lease(_name: str) -> Lease:
            leases.append(FileLease(tmp_path))
            return leases[-1]

        yield file_lease
        for lease in leases:
            for backend in list(lease._fds):
                lease.release(backend)
        return
    server = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url)
    prefix = f"test:lease:{time.monotonic_ns()}:"
    yield lambda name: RedisLease(client, prefix, f"host:{name}", TTL_MS)
    client.close()


def _spawn(target: Callable[[], Any]) -> threading.Thread:
    """The supervisors and consumers in threads (the router runs them in greenlets of a
    patched threading; these tests are not patched)."""
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _join(handles: list[threading.Thread]) -> None:
    for handle in handles:
        handle.join(5)
        assert not handle.is_alive()


def test_a_reload_hands_the_lease_to_the_next_manager(
        two_workers: Callable[[str], Lease]) -> None:
    opened: Counter[str] = Counter()
    first = LeasedConsumers(two_workers("w1"), TTL_MS)
    handles = first.start(_Manager(["a"], opened), _spawn)
    wait_until(lambda: first.held == {"a"}, "first to hold {'a'}", 5)
    other = two_workers("w2")
    assert not other.acquire("a")

    first.stop(hand_over=True)
    _join(handles)
    assert first.held == set() and first.kept == {"a"}
    # Between the two managers the lease is still this worker's.
    assert not other.acquire("a")

    second = first.renewed()
    handles = second.start(_Manager(["a"], opened), _spawn)
    wait_until(lambda: second.held == {"a"}, "second to hold {'a'}", 5)
    assert not other.acquire("a")
    assert opened == {"a": 2}  # the old stream and the new one: nobody else's between
    second.stop()
    _join(handles)
    assert other.acquire("a")  # a plain stop (shutdown) releases it


def test_a_lease_handed_over_for_a_backend_no_longer_read_is_released(
        two_workers: Callable[[str], Lease]) -> None:
    opened: Counter[str] = Counter()
    first = LeasedConsumers(two_workers("w1"), TTL_MS)
    handles = first.start(_Manager(["a", "b"], opened), _spawn)
    wait_until(lambda: first.held == {"a", "b"}, "first to hold {'a', 'b'}", 5)
    first.stop(hand_over=True)
    _join(handles)
    other = two_workers("w2")
    assert not other.acquire("b")

    second = first.renewed()
    handles = second.start(_Manager(["a"], opened), _spawn)  # "b" left the config
    assert other.acquire("b")
    wait_until(lambda: second.held == {"a"}, "second to hold {'a'}", 5)
    assert not other.acquire("a")
    second.stop()
    _join(handles)


def test_a_worker_asking_again_for_its_own_lease_keeps_it(
        two_workers: Callable[[str], Lease]) -> None:
    mine, theirs = two_workers("w1"), two_workers("w2")
    assert mine.acquire("a")
    assert mine.acquire("a")
    assert not theirs.acquire("a")
    mine.release("a")
    assert theirs.acquire("a")
    assert not mine.acquire("a")
