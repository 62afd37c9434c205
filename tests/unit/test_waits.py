"""continuum.wire.waits: a reused timer runs its whole length every time it is armed."""

from __future__ import annotations

import socket
import time

import gevent
from gevent.socket import socket as GeventSocket

from continuum.wire.waits import arm, timer_for, wait_watcher

SECONDS = 0.2


def test_a_timer_armed_again_after_a_stop_runs_its_whole_length() -> None:
    timer = timer_for(None, SECONDS)
    clock = arm(timer)
    gevent.sleep(SECONDS * 0.75)  # three quarters used, then stopped as a wait ends
    clock.stop()
    started = time.monotonic()
    arm(timer)
    try:
        gevent.sleep(SECONDS * 5)
    except gevent.Timeout as exc:
        assert exc is timer
    else:
        raise AssertionError("the armed timer never fired")
    # Stopped, libev kept a quarter of it; armed again it must run the whole length.
    assert time.monotonic() - started >= SECONDS * 0.9
    assert timer_for(timer, SECONDS) is timer  # kept for the same length


def test_wait_watcher_gives_each_wait_the_whole_timeout() -> None:
    left, right = socket.socketpair()
    reader = GeventSocket(fileno=left.detach())
    try:
        # Each byte comes 0.3 of the timeout into its wait: a stall of this process (a busy
        # machine) that lets the timeout expire with the byte's timer would fail the wait.
        timeout = 1.0
        timer = timer_for(None, timeout)
        watcher = reader._read_event
        for _ in range(4):  # 1.2 s of waiting in all, more than the timeout
            gevent.spawn_later(timeout * 0.3, right.send, b"x")
            assert wait_watcher(watcher, timer)
            assert reader.recv(1) == b"x"
        assert not wait_watcher(watcher, timer)  # nothing sent: it runs out
    finally:
        reader.close()
        right.close()
