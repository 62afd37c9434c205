"""Hot-path shortcuts keep their behaviour: the worker's head/body coalescing, request ids,
the pid the multiprocess metric values use."""

from __future__ import annotations

import os
import uuid

import gevent
from gevent import socket

from continuum.gunicorn_worker import _CoalescingSocket
from continuum.request import new_request_id


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.settimeout(2)
    return a, b


def _read_available(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(2)


def test_head_goes_out_with_the_body_in_one_send() -> None:
    a, b = _pair()
    out = _CoalescingSocket(a)
    out.sendall(b"HEAD\r\n\r\n")
    assert _read_available(b) == b""  # held back: the greenlet has not blocked yet
    out.sendall(b"body")
    assert b.recv(100) == b"HEAD\r\n\r\nbody"
    out.sendall(b"more")
    assert b.recv(100) == b"more"
    out.flush()
    assert _read_available(b) == b""
    a.close()
    b.close()


def test_held_head_is_sent_as_soon_as_the_greenlet_blocks() -> None:
    a, b = _pair()
    out = _CoalescingSocket(a)
    out.sendall(b"HEAD\r\n\r\n")
    gevent.sleep(0.01)  # e.g. waiting for the first piece of an upstream stream
    assert _read_available(b) == b"HEAD\r\n\r\n"
    out.sendall(b"first piece")
    assert b.recv(100) == b"first piece"
    a.close()
    b.close()


def test_head_alone_is_flushed_when_the_request_ends() -> None:
    a, b = _pair()
    out = _CoalescingSocket(a)
    out.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
    out.flush()
    assert b.recv(100) == b"HTTP/1.1 204 No Content\r\n\r\n"
    gevent.sleep(0)  # the hub's callback finds nothing left to send
    assert _read_available(b) == b""
    assert out.fileno() == a.fileno()  # everything else is the socket's
    a.close()
    b.close()


def test_generated_request_ids_are_uuid4_hex_and_distinct() -> None:
    ids = {new_request_id() for _ in range(2000)}
    assert len(ids) == 2000
    for rid in list(ids)[:200]:
        parsed = uuid.UUID(hex=rid)
        assert len(rid) == 32 and rid == parsed.hex
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert new_request_id("client-id-1") == "client-id-1"
    assert new_request_id("bad id") != "bad id"


def test_metric_values_follow_the_pid_into_a_forked_child(tmp_path: object) -> None:
    """The cached pid is refreshed after a fork: a child's samples go to its own file."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from continuum.metrics import RouterMetrics\n"
        "m = RouterMetrics(); m.workers.inc()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    m2 = RouterMetrics(); m2.workers.inc(); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "names = sorted(os.listdir(os.environ['PROMETHEUS_MULTIPROC_DIR']))\n"
        "print(os.getpid(), pid, ' '.join(names))\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    parent, child, names = out[0], out[1], out[2:]
    assert f"gauge_livesum_{parent}.db" in names
    assert f"gauge_livesum_{child}.db" in names


def test_cached_http_date_is_gunicorns() -> None:
    """The worker's ``http_date`` gives gunicorn's text, for given times and for now."""
    import time

    from gunicorn.util import http_date

    from continuum.gunicorn_worker import _HttpDate

    cached = _HttpDate(http_date)
    for stamp in (0, 1764604800, 1764604800.999, 2000000000.5):
        assert cached(stamp) == http_date(stamp)
    for _ in range(3):  # the second may turn between the two calls: one try is enough
        before, text, after = http_date(), cached(), http_date()
        if before == after:
            assert text == before
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the clock turned a second in every try")
