"""The host relay of KV records (memory index, one consumer per host): its receiver."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import gevent
import gevent.socket
import pytest

from continuum.hostshm import HostSegment
from continuum.kv import lease
from continuum.kv.lease import HostRelay


class _Consumer:
    def __init__(self) -> None:
        self.records: list[tuple[Any, ...]] = []

    def handle(self, sse_event: str | None, data: Any, record_id: str | None) -> None:
        self.records.append((sse_event, data, record_id))


class _Manager:
    """What the receiver needs of a consumer manager: the consumer of a backend."""

    def __init__(self) -> None:
        self.consumers: dict[str, _Consumer] = {}

    def consumer(self, backend: str) -> _Consumer:
        return self.consumers.setdefault(backend, _Consumer())


@pytest.fixture
def green_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver's sockets as the gevent workers have them (monkey-patched), so a
    close wakes a blocked receive as it does in the router."""
    monkeypatch.setattr(lease, "socket", gevent.socket)


def _send(path: Path, record: list[Any]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
        out.sendto(json.dumps(record).encode(), str(path))


def _wait_for(condition: Any, seconds: float = 5.0) -> bool:
    with gevent.Timeout(seconds, False):
        while not condition():
            gevent.sleep(0.01)
    return bool(condition())


def test_a_relay_closed_before_its_receiver_first_ran_does_not_wait_forever(
        tmp_path: Path) -> None:
    """A reload or shutdown may stop the consumers before the receiver's greenlet first
    ran; it must end at once rather than bind and wait on a socket nobody will close
    (the stop joined it for 10 s)."""
    relay = HostRelay(HostSegment(tmp_path))
    span = relay.open()
    relay.close()
    receiver = threading.Thread(target=relay.serve, args=(None, span), daemon=True)
    receiver.start()
    receiver.join(5)
    assert not receiver.is_alive()
    assert not relay.path.exists()


def test_a_receiver_whose_span_was_replaced_leaves_the_next_receiver_alone(
        tmp_path: Path, green_sockets: None) -> None:
    """Closed and reopened for the next manager before the first receiver ever ran: the
    first must not bind the path (it would steal the records) nor unlink the second's."""
    relay = HostRelay(HostSegment(tmp_path))
    old_manager, new_manager = _Manager(), _Manager()
    old_span = relay.open()
    relay.close()
    new_span = relay.open()
    new = gevent.spawn(relay.serve, new_manager, new_span)
    assert _wait_for(relay.path.exists)
    old = gevent.spawn(relay.serve, old_manager, old_span)  # runs late, after the new one
    assert old.join(5) is None and old.dead
    assert relay.path.exists()

    _send(relay.path, ["engine-0", "cache_created", {"prefix_hash": "p"}, "7"])
    assert _wait_for(lambda: relay.received == 1)
    assert new_manager.consumers["engine-0"].records == [
        ("cache_created", {"prefix_hash": "p"}, "7")]
    assert old_manager.consumers == {}

    relay.close()
    new.join(5)
    assert new.dead
    assert not relay.path.exists()


def test_open_ends_the_span_still_running(tmp_path: Path, green_sockets: None) -> None:
    """An open() without a close() first (a caller that forgot) still leaves one receiver."""
    relay = HostRelay(HostSegment(tmp_path))
    first = gevent.spawn(relay.serve, _Manager(), relay.open())
    assert _wait_for(relay.path.exists)
    manager = _Manager()
    second = gevent.spawn(relay.serve, manager, relay.open())
    first.join(5)
    assert first.dead
    assert _wait_for(relay.path.exists)
    _send(relay.path, ["engine-1", None, {"n": 1}, None])
    assert _wait_for(lambda: relay.received == 1)
    assert manager.consumers["engine-1"].records == [(None, {"n": 1}, None)]
    relay.close()
    second.join(5)
    assert second.dead


def test_a_bad_record_does_not_end_the_receiver(tmp_path: Path, green_sockets: None) -> None:
    relay = HostRelay(HostSegment(tmp_path))
    manager = _Manager()
    receiver = gevent.spawn(relay.serve, manager, relay.open())
    assert _wait_for(relay.path.exists)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
        out.sendto(b"not json", str(relay.path))
    _send(relay.path, ["engine-2", None, {"n": 2}, "9"])
    assert _wait_for(lambda: relay.received == 1)
    assert manager.consumers["engine-2"].records == [(None, {"n": 2}, "9")]
    assert not receiver.dead
    relay.close()
    receiver.join(5)
    assert receiver.dead
