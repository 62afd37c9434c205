"""continuum.devtools.procs: free ports, child processes stopped by PID, bounded waits.

Real processes and real sockets on 127.0.0.1; every wait has a deadline, nothing asserts
on time.
"""

from __future__ import annotations

import http.server
import re
import signal
import socket
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from continuum.devtools import procs
from continuum.devtools.procs import (
    Child,
    ChildExited,
    Children,
    WaitTimeout,
    child_env,
    free_port,
    free_port_block,
    http_status,
    refused_port,
    wait_http,
    wait_until,
)

PY = sys.executable


def test_exit_report_names_the_child_its_status_and_its_error(tmp_path: Path) -> None:
    children = Children(tmp_path)
    failed = children.spawn([PY, "-c", "import sys; print('starting', flush=True);"
                             "raise SystemExit('LookupError: no engine named x')"], "engine.log")
    killed = children.spawn([PY, "-c",
                             "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], "sim.log")
    running = children.spawn([PY, "-c", "import time; time.sleep(30)"], "idle.log")
    try:
        failed.wait(10)
        killed.wait(10)
        assert children.exited() == [failed, killed]
        report = failed.exit_report()
        assert report is not None
        head, _, tail = report.partition("\n")
        assert re.fullmatch(rf"engine \(pid {failed.pid}\) exited with status 1 after \d+\.\ds "
                            r"\(LookupError: no engine named x\); the end of engine.log:", head)
        assert tail == "starting\nLookupError: no engine named x"
        assert re.fullmatch(rf"sim \(pid {killed.pid}\) was killed by SIGKILL after \d+\.\ds",
                            killed.exit_report() or "")
        assert running.exit_report() is None
        with pytest.raises(ChildExited) as err:
            wait_until(lambda: False, "the engine", 10, children=[running, failed])
        assert err.value.child is failed
        assert str(err.value) == f"while waiting for the engine: {failed.exit_report()}"
    finally:
        children.stop_all()
    assert children.live == [] and children.exited() == []
    assert children.pids == [failed.pid, killed.pid, running.pid]
    assert running.returncode == -signal.SIGTERM


def test_wait_until_returns_the_first_truthy_value_and_retries_os_errors() -> None:
    calls: list[int] = []

    def condition() -> list[int]:
        calls.append(len(calls))
        if len(calls) == 1:
            raise ConnectionRefusedError("not serving yet")
        return calls[2:]

    assert wait_until(condition, "three calls", 20, interval=0.001) == [2]
    assert len(calls) == 3


def test_other_errors_of_the_condition_are_not_swallowed() -> None:
    def condition() -> bool:
        raise KeyError("bad document")

    with pytest.raises(KeyError):
        wait_until(condition, "a document", 20)


def test_a_timeout_names_what_the_last_error_and_the_watched_log(tmp_path: Path) -> None:
    child = Child([PY, "-c", "import time; print('listening soon', flush=True); "
                             "time.sleep(30)"], tmp_path / "server.log")
    try:
        wait_until(lambda: "listening" in child.log_text(), "the first line", 20)

        def refused() -> bool:
            raise ConnectionRefusedError("nobody home")

        with pytest.raises(WaitTimeout) as err:
            wait_until(refused, lambda: "the server (state: starting)", 0.2,
                       children=[child])
    finally:
        child.stop()
    assert str(err.value) == (
        "timed out after 0.2s waiting for the server (state: starting) "
        "(last error: ConnectionRefusedError('nobody home')):\nlistening soon")


def test_stop_kills_a_child_that_ignores_its_stop_signal(tmp_path: Path) -> None:
    child = Child([PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                             "print('ignoring', flush=True); time.sleep(30)"],
                  tmp_path / "stubborn.log")
    wait_until(lambda: "ignoring" in child.log_text(), "the handler", 20, children=[child])
    assert child.stop(timeout=0.2) == -signal.SIGKILL
    assert child.stop() == -signal.SIGKILL  # idempotent


class _Status(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def unhealthy() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_wait_http_waits_for_the_statuses_asked_for(unhealthy: str) -> None:
    assert http_status(unhealthy) == 503
    wait_http(unhealthy, statuses=(200, 503))
    with pytest.raises(WaitTimeout, match=r"waiting for http://127\.0\.0\.1:\d+/health "
                                          r"\(last status: 503\)$"):
        wait_http(unhealthy, 0.2)


def test_http_status_is_none_where_nothing_listens() -> None:
    assert http_status(f"http://127.0.0.1:{refused_port()}/") is None


def test_a_port_block_is_free_as_a_whole() -> None:
    base = free_port_block(5)
    held = []
    try:
        for port in range(base, base + 5):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


@pytest.fixture
def one_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every port in this process's lane, as outside pytest-xdist (the kernel's offers
    are scripted below)."""
    for name in procs.LANE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _lane(monkeypatch: pytest.MonkeyPatch, worker: str, count: str) -> None:
    for name, value in zip(procs.LANE_VARIABLES, (worker, count), strict=True):
        monkeypatch.setenv(name, value)


def test_a_port_the_kernel_offers_twice_is_handed_out_once(
        monkeypatch: pytest.MonkeyPatch, one_lane: None) -> None:
    """Two fake servers of one fixture once got the same port from two calls in a row."""
    first, second = free_port(), free_port()  # two real free ports, now remembered
    procs._recent.pop(first)
    procs._recent.pop(second)
    offers = iter([first, first, first, second])
    monkeypatch.setattr(procs, "_unused_port", lambda: next(offers))
    assert free_port() == first
    assert free_port() == second  # the kernel's two repeats of the first were passed over


def test_the_remembered_ports_are_bounded_oldest_first(
        monkeypatch: pytest.MonkeyPatch, one_lane: None) -> None:
    monkeypatch.setattr(procs, "_recent", {})
    monkeypatch.setattr(procs, "RECENT_PORTS", 3)
    offers = iter([40001, 40002, 40003, 40004, 40001])
    monkeypatch.setattr(procs, "_unused_port", lambda: next(offers))
    assert [free_port() for _ in range(5)] == [40001, 40002, 40003, 40004, 40001]
    assert list(procs._recent) == [40003, 40004, 40001]


def test_a_port_block_never_overlaps_a_port_handed_out(
        monkeypatch: pytest.MonkeyPatch, one_lane: None) -> None:
    monkeypatch.setattr(procs, "_recent", {})
    taken = free_port_block(4)
    draws = iter([taken - 2, taken + 3, taken, taken + 4])

    class Draws:
        def randrange(self, _start: int, _stop: int) -> int:
            return next(draws)

    monkeypatch.setattr(procs.random, "SystemRandom", Draws)
    # taken - 2 and taken + 3 overlap the first block; taken is that block itself
    assert free_port_block(4) == taken + 4


@pytest.mark.parametrize(("worker", "count", "lane"), [
    ("gw0", "2", (0, 2)), ("gw3", "4", (3, 4)), ("gw5", "4", (1, 4)), ("gw0", "0", (0, 1)),
    ("", "", (0, 1)), ("master", "2", (0, 1)), ("gwx", "2", (0, 1)), ("gw1", "two", (0, 1)),
])
def test_the_port_lane_comes_from_pytest_xdists_worker_variables(
        worker: str, count: str, lane: tuple[int, int]) -> None:
    assert procs.port_lane(dict(zip(procs.LANE_VARIABLES, (worker, count), strict=True))) == lane


def test_free_port_hands_out_only_ports_of_its_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-xdist's workers pick ports at once, each remembering only its own: one
    worker's lane never holds a port of another's."""
    monkeypatch.setattr(procs, "_recent", {})
    _lane(monkeypatch, "gw1", "3")
    offered = list(range(40200, 40240, 2))
    offers = iter(offered)
    monkeypatch.setattr(procs, "_unused_port", lambda: next(offers))
    mine = [port for port in offered if procs.lane_of(port, 3) == 1]
    assert len(mine) >= 2 and [free_port(), free_port()] == mine[:2]
    assert procs.lane_of(mine[0], 3) == 1 and {procs.lane_of(p, 3) for p in offered} == {0, 1, 2}


@pytest.mark.parametrize("lanes", [2, 3, 4, 8])
@pytest.mark.parametrize("parity", [0, 1])
def test_the_lanes_share_the_ports_of_one_parity_evenly(lanes: int, parity: int) -> None:
    """The kernel offers bind(0) ports of one parity only: by remainder, two lanes would
    leave one of them nothing."""
    ports = range(32768 + parity, 61000, 2)
    shares = Counter(procs.lane_of(port, lanes) for port in ports)
    assert sorted(shares) == list(range(lanes))
    assert max(shares.values()) <= 1.05 * min(shares.values()), shares


def test_a_port_block_is_drawn_from_its_lanes_part_of_the_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_recent", {})
    _lane(monkeypatch, "gw2", "3")
    asked: list[tuple[int, int]] = []

    class Draws:
        def randrange(self, start: int, stop: int) -> int:
            asked.append((start, stop))
            return start

    monkeypatch.setattr(procs.random, "SystemRandom", Draws)
    base = free_port_block(6)
    # lane 2 of 3 of 20000-31999 is 28000-31999: the last block ends at 31999
    assert asked == [(28000, 31995)] and base == 28000


def test_child_env_drops_proxies_and_adds_what_is_asked() -> None:
    env = child_env({"EXTRA": "1"}, base={"HTTP_PROXY": "http://proxy:3128",
                                          "https_proxy": "x", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "NO_PROXY": "127.0.0.1,localhost", "EXTRA": "1"}


def test_a_refused_port_refuses_and_cannot_be_taken_by_another_server() -> None:
    port = refused_port()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    other = socket.socket()
    try:
        with pytest.raises(OSError):  # still held: no server comes alive there
            other.bind(("127.0.0.1", port))
    finally:
        other.close()
    assert refused_port() != port


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Another test's server, answering /health on a port a fake upstream was given."""

    def do_GET(self) -> None:
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


def test_a_fake_upstream_whose_port_another_server_took_moves_to_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests run in parallel: between free_port() and the fake upstream's bind another
    test's server may take the port, and answer its /health. The upstream tells it by
    the pid its own /health reports, and starts again on another port."""
    from continuum.devtools import servers

    impostor = http.server.HTTPServer(("127.0.0.1", 0), _Impostor)
    thread = threading.Thread(target=impostor.serve_forever, daemon=True)
    thread.start()
    taken = impostor.server_address[1]
    ports = iter([taken])
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or free_port())
    try:
        upstream = servers.FakeUpstream("a", tmp_path)
        try:
            assert upstream.port != taken
            assert upstream.stats()["requests"] == 0  # its own, answering
        finally:
            upstream.stop()
    finally:
        impostor.shutdown()
        impostor.server_close()
