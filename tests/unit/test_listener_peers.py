"""The ZMQ source's peer count from synthetic socket-monitor event sequences.

libzmq reports each connection as: opened (``ACCEPTED``/``CONNECTED``, value: its fd), one
handshake outcome (``HANDSHAKE_SUCCEEDED`` or ``HANDSHAKE_FAILED_*``, no fd), closed
(``DISCONNECTED``, its fd). Since an outcome names no connection, a refused publisher
reconnecting beside the engine used to get the engine's success pinned on its own fd (the
oldest waiting one), which then closed: ``peers`` fell to 0 while the engine streamed.
These tests feed :meth:`ZmqSource.on_monitor_event` the sequences the socket tests cannot
order at will; ``test_listener_sources`` and ``test_listener_dp`` keep the real sockets.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import zmq.green as zmq

from listener.config import SourceConfig
from listener.sources_zmq import ZmqSource

PORT = 5557
FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class _Processor:
    def handle_batch(self, batch: Any) -> None:
        pass

    def reset(self, reason: str) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


@pytest.fixture
def context() -> Iterator[Any]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def make_source(context: Any, ranks: int = 1) -> ZmqSource:
    """A source that is not started: only its monitor bookkeeping is exercised."""
    config = SourceConfig(backend_name="b", engine="vllm", model="m",
                          zmq_endpoint=f"tcp://127.0.0.1:{PORT}", zmq_mode="connect",
                          data_parallel_size=ranks, allowed_publishers=("127.0.0.1",),
                          require_salt=True)
    return ZmqSource(config, _Processor(), context=context)  # type: ignore[arg-type]


class Events:
    """Feeds one source monitor events on rank ``rank``'s endpoint (``host``: the address
    the event names, e.g. the interface of a connection accepted on a wildcard)."""

    def __init__(self, source: ZmqSource) -> None:
        self.source = source
        self.counts: list[int] = []

    def send(self, kind: int, value: int = 0, rank: int = 0, host: str = "127.0.0.1") -> int:
        endpoint = f"tcp://{host}:{PORT + rank}".encode()
        self.source.on_monitor_event({"event": kind, "value": value, "endpoint": endpoint})
        peers = self.source.peers()
        self.counts.append(peers)
        return peers

    def open(self, fd: int, rank: int = 0) -> int:
        return self.send(zmq.EVENT_CONNECTED, fd, rank)

    def ok(self, rank: int = 0) -> int:
        return self.send(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, rank)

    def refused(self, rank: int = 0) -> int:
        return self.send(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 13, rank)

    def close(self, fd: int, rank: int = 0) -> int:
        return self.send(zmq.EVENT_DISCONNECTED, fd, rank)


@pytest.mark.parametrize("engine_first", [True, False])
@pytest.mark.parametrize("success_first", [True, False])
def test_a_refused_publisher_reconnecting_beside_the_engine_leaves_its_count(
        context: Any, engine_first: bool, success_first: bool) -> None:
    """The engine (fd 7) and a refused publisher (a new fd every 100 ms) handshake side by
    side, their outcomes in either order: the count stays the engine's one connection
    throughout, and 0 once it closes. (Before: with the refused one opened first, the
    engine's success went to the refused fd and left with it: 0 peers, engine streaming.)"""
    source = make_source(context)
    events = Events(source)
    fds = iter(range(100, 200))
    refused = next(fds)
    for fd in ((7, refused) if engine_first else (refused, 7)):
        events.open(fd)
    for outcome in ((events.ok, events.refused) if success_first else
                    (events.refused, events.ok)):
        outcome()
    assert events.close(refused) == 1
    for _ in range(20):  # the refused publisher keeps reconnecting
        refused = next(fds)
        events.open(refused)
        events.refused()
        assert events.close(refused) == 1
    assert source.connected and source.health()["peers"] == 1
    assert events.close(7) == 0 and not source.connected
    assert min(events.counts) == 0 and source._links == {}


def test_the_count_never_goes_negative_and_converges(context: Any) -> None:
    """Events out of the usual order or lost (a close of an unknown fd, an outcome without
    an open connection, a connection closed before its outcome, a close never reported):
    the count stays within the open connections and is 0 once none is open."""
    source = make_source(context)
    events = Events(source)
    assert events.close(3) == 0 and events.ok() == 0 and events.refused() == 0
    events.open(4)
    assert events.close(4) == 0  # closed while handshaking (its outcome lost)
    assert events.ok() == 0  # a stray outcome: no pending connection
    events.open(5)
    events.ok()
    events.open(6)
    events.refused()
    # the established one closes before the refused one: one too many, until it closes
    assert events.close(5) == 1
    assert events.close(6) == 0
    events.open(8)
    events.ok()
    assert events.open(8) == 0  # fd 8 again: its close was missed; the new one handshakes
    assert events.ok() == 1
    assert events.close(8) == 0
    assert min(events.counts) >= 0 and source._links == {}


def test_each_rank_counts_its_own_connections(context: Any) -> None:
    """With two ranks, each event goes to the rank its endpoint's port names (in bind mode
    a connection accepted on a wildcard names the bound address, its handshake the
    interface's: the same port)."""
    source = make_source(context, ranks=2)
    events = Events(source)
    events.send(zmq.EVENT_ACCEPTED, 20, rank=1, host="0.0.0.0")
    events.send(zmq.EVENT_ACCEPTED, 21, rank=0)
    events.send(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, rank=1)
    events.send(zmq.EVENT_ACCEPTED, 22, rank=1)
    events.send(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 13, rank=1)
    events.send(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, rank=0)
    assert (source.peers(0), source.peers(1), source.peers()) == (1, 1, 2)
    events.send(zmq.EVENT_DISCONNECTED, 22, rank=1)
    assert (source.peers(0), source.peers(1)) == (1, 1)
    health = source.health()
    assert [health["ranks"][r]["peers"] for r in ("0", "1")] == [1, 1]
    events.send(zmq.EVENT_DISCONNECTED, 20, rank=1)
    assert (source.peers(0), source.peers(1)) == (1, 0)


@pytest.mark.parametrize("seed", range(20))
def test_random_interleavings_count_exactly(context: Any, seed: int) -> None:
    """Random interleavings of engines and refused publishers, each connection opening,
    settling and closing in libzmq's order, a refused one closing right after its failure:
    the count is exact after every event, and 0 at the end."""
    rng = random.Random(seed)
    source = make_source(context)
    events = Events(source)
    fds = iter(range(10, 10_000))
    # connection state: fd -> "pending" (good or bad, unsettled) / "up"
    pending: list[tuple[int, bool]] = []
    up: list[int] = []
    for _ in range(300):
        move = rng.random()
        if move < 0.35 or not (pending or up):
            fd = next(fds)
            pending.append((fd, rng.random() < 0.5))
            events.open(fd)
        elif move < 0.75 and pending:
            fd, good = pending.pop(rng.randrange(len(pending)))  # any order of outcomes
            if good:
                events.ok()
                up.append(fd)
            else:
                events.send(rng.choice(FAILED), 1)
                events.close(fd)
        elif up:
            events.close(up.pop(rng.randrange(len(up))))
        assert source.peers() == len(up), seed
    for fd, good in pending:
        events.send(zmq.EVENT_HANDSHAKE_SUCCEEDED if good else zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        events.close(fd)
    for fd in up:
        events.close(fd)
    assert source.peers() == 0 and source._links == {}
