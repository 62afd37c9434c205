"""continuum.wire.accept_balance: when a worker leaves a new connection to the others."""

from __future__ import annotations

from pathlib import Path

from continuum.hostshm import NOT_ACCEPTING, HostSegment
from continuum.wire.accept_balance import AcceptGate


def _two_workers(tmp_path: Path) -> tuple[AcceptGate, AcceptGate]:
    # PID 1 always lives, so the second view claims a slot of its own
    return AcceptGate(HostSegment(tmp_path)), AcceptGate(HostSegment(tmp_path, pid=1))


def test_a_lone_worker_always_accepts(tmp_path: Path) -> None:
    gate = AcceptGate(HostSegment(tmp_path))
    for _ in range(50):
        assert gate.may_accept()
        gate.opened()
    assert gate.deferred == 0
    assert gate.segment.connections == 50


def test_a_worker_more_than_one_above_the_least_loaded_defers(tmp_path: Path) -> None:
    one, two = _two_workers(tmp_path)
    one.opened()
    assert one.may_accept()  # 1 against 0: within the slack
    one.opened()
    assert not one.may_accept()  # 2 against 0
    assert one.deferred == 1
    assert two.may_accept()
    two.opened()
    assert one.may_accept()  # 2 against 1
    one.closed()
    one.closed()
    two.opened()
    two.opened()
    assert not two.may_accept() and one.may_accept()  # the counts are the published ones
    assert (one.segment.connections, two.segment.connections) == (0, 3)


def test_after_a_pause_the_next_connection_is_taken_whatever_the_counts(
    tmp_path: Path
) -> None:
    one, _ = _two_workers(tmp_path)
    for _ in range(5):
        one.opened()
    assert not one.may_accept()
    one.force_next()  # the pause ran out: the others did not take it
    assert one.may_accept()
    assert not one.may_accept()  # once only


def test_a_retired_worker_is_never_waited_for(tmp_path: Path) -> None:
    one, two = _two_workers(tmp_path)
    for _ in range(5):
        one.opened()
    assert not one.may_accept()
    two.opened()
    two.retire()  # its server closed: shutdown, max_requests or a reload
    assert two.segment.connections == NOT_ACCEPTING
    assert one.may_accept()
    two.closed()  # its last connection ends: it still accepts nothing
    assert two.segment.connections == NOT_ACCEPTING
    assert one.may_accept()


def test_a_released_slot_no_longer_counts(tmp_path: Path) -> None:
    one, two = _two_workers(tmp_path)
    for _ in range(3):
        one.opened()
    assert not one.may_accept()
    two.segment.release()  # the worker exited
    assert one.segment.fewest_connections_elsewhere() is None
    assert one.may_accept()
