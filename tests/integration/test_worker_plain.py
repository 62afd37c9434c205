"""The router's worker serves plain connections with its own keep-alive loop
(``GeventWorker._serve_plain``), and a client cannot tell it from gunicorn's: the same raw
requests, on kept-alive connections, to a server on the router's worker class and to one on
gunicorn's own gevent worker, get the same answers (status lines, headers but the date,
bodies) and give the application the same environ, including where the loop hands a
connection to gunicorn's loop (a request outside its path) and what a gunicorn config's
hooks do. Real gunicorn, the probe app of ``wsgi_probe``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from continuum.devtools.procs import Child, child_env, free_port, wait_http
from continuum.gunicorn_worker import GC_YOUNG_THRESHOLD, WORKER_CLASS

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

#: The environ keys that differ between two servers for the same request.
_PER_SERVER = {"REMOTE_PORT", "SERVER_PORT", "HTTP_HOST", "wsgi.multiprocess"}


class Server:
    def __init__(self, port: int, post_log: Path) -> None:
        self.port = port
        self.post_log = post_log

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def posted(self) -> list[str]:
        return self.post_log.read_text().splitlines() if self.post_log.exists() else []


def _start(tmp: Path, worker_class: str) -> tuple[Child, Server]:
    port = free_port()
    post_log = tmp / f"{worker_class.rsplit('.', 1)[-1]}-{port}.post"
    child = Child([sys.executable, "-m", "gunicorn", "-c", "python:tests.integration.wsgi_probe",
                   "-k", worker_class, "-w", "1", "--keep-alive", "2", "-b", f"127.0.0.1:{port}",
                   "tests.integration.wsgi_probe:app"],
                  tmp / f"{port}.log", cwd=ROOT, stop_signal=signal.SIGQUIT,
                  env=child_env({"PROBE_POST_LOG": str(post_log)}))
    wait_http(f"http://127.0.0.1:{port}/health", 20, children=[child])
    return child, Server(port, post_log)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """(the router's worker, gunicorn's gevent worker), each serving the probe."""
    tmp = tmp_path_factory.mktemp("plain")
    ours, ours_server = _start(tmp, WORKER_CLASS)
    try:
        theirs, theirs_server = _start(tmp, "gevent")
        try:
            yield ours_server, theirs_server
        finally:
            theirs.stop()
    finally:
        ours.stop()


def _read_answer(sock: socket.socket, buf: bytearray) -> tuple[bytes, bytes]:
    """One answer from ``sock`` (bytes already read in ``buf``, which keeps what follows):
    its head (Date removed) and its body, by its Content-Length, chunks or the close."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed before an answer's head: {bytes(buf)!r}")
        buf += data
    end = buf.index(b"\r\n\r\n")
    head, rest = bytes(buf[:end]), buf[end + 4:]
    buf[:] = rest
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    pairs = (line.partition(b":") for line in lines[1:])
    fields = {name.strip().lower(): value.strip() for name, _, value in pairs}
    if b"content-length" in fields:
        length = int(fields[b"content-length"])
        while len(buf) < length:
            buf += sock.recv(65536)
        body = bytes(buf[:length])
        del buf[:length]
    elif fields.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            while b"\r\n" not in buf:
                buf += sock.recv(65536)
            size_end = buf.index(b"\r\n")
            size = int(bytes(buf[:size_end]), 16)
            while len(buf) < size_end + 2 + size + 2:
                buf += sock.recv(65536)
            body += bytes(buf[size_end + 2:size_end + 2 + size])
            del buf[:size_end + 2 + size + 2]
            if size == 0:
                break
    else:
        while data := sock.recv(65536):
            buf += data
        body = bytes(buf)
        buf.clear()
    return b"\r\n".join(lines), body


def _answers(server: Server, steps: list[tuple[bytes, int]], pause: float = 0.15,
             ) -> tuple[list[tuple[bytes, Any]], bool]:
    """Send each step's bytes on one connection (pausing between steps) and read the
    number of answers it expects; the answers (head, JSON body or raw bytes) and whether
    the server closed the connection at the end."""
    out: list[tuple[bytes, Any]] = []
    buf = bytearray()
    with server.connect() as sock:
        for data, expected in steps:
            sock.sendall(data)
            if not expected:
                time.sleep(pause)
            for _ in range(expected):
                head, body = _read_answer(sock, buf)
                try:
                    out.append((head, json.loads(body)))
                except ValueError:
                    out.append((head, body))
        sock.settimeout(3.0)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    return out, closed


def _comparable(answers: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
    """The answers without what differs between the two workers by design (the class of
    ``wsgi.input``, the worker's own pieces, per-server environ values, and so the length
    of the probe's JSON)."""
    out = []
    for head, body in answers:
        if isinstance(body, dict):
            head = b"\r\n".join(line for line in head.split(b"\r\n")
                                 if not line.startswith(b"Content-Length:"))
            body = {k: v for k, v in body.items()
                    if k not in ("input", "create", "finish_body", "response")}
            if body.get("environ"):
                body["environ"] = {k: v for k, v in body["environ"].items()
                                   if k not in _PER_SERVER}
        out.append((head, body))
    return out


# A kept-alive session: plain requests, a body split over two writes, a body left unread,
# two pipelined requests, a repeated field, one the loop hands to gunicorn (a chunked body),
# a plain one after it, and HTTP/1.0 (closes).
_SESSION = [
    (b"POST /environ?a=1&b=%20 HTTP/1.1\r\nHost: h\r\nX-One: 1\r\nContent-Type: text/plain\r\n"
     b"Content-Length: 7\r\n\r\n{\"a\":1}", 1),
    (b"GET /p%20q/r HTTP/1.1\r\nHost: h\r\nUser-Agent: probe\r\n\r\n", 1),
    (b"POST /split HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n0123", 0),
    (b"456789", 1),
    (b"POST /lines HTTP/1.1\r\nHost: h\r\nContent-Length: 8\r\n\r\nab\ncd\nef", 1),
    (b"POST /unread HTTP/1.1\r\nHost: h\r\nContent-Length: 6\r\n\r\nabc", 0),
    (b"def", 1),
    (b"GET /one HTTP/1.1\r\nHost: h\r\n\r\nGET /two HTTP/1.1\r\nHost: h\r\n\r\n", 2),
    (b"GET /stream HTTP/1.1\r\nHost: h\r\nX-Two: a\r\nX-Two: b\r\n\r\n", 1),
    (b"POST /chunked HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"3\r\nabc\r\n0\r\n\r\n", 1),
    (b"GET /after HTTP/1.1\r\nHost: h\r\n\r\n", 1),
    (b"GET /last HTTP/1.0\r\nHost: h\r\n\r\n", 1),
]


def test_a_kept_alive_session_gets_what_gunicorns_worker_gives(
        servers: tuple[Server, Server]) -> None:
    ours, theirs = servers
    got, closed = _answers(ours, _SESSION)
    expected, their_closed = _answers(theirs, _SESSION)
    assert _comparable(got) == _comparable(expected)
    assert closed and their_closed  # HTTP/1.0 without keep-alive: both close
    bodies = [body for _, body in got]
    # the worker's own loop served every request up to the chunked one, which and all
    # after it were gunicorn's
    inputs = [body["input"] for body in bodies]
    assert inputs[:8] == ["HeldInput"] * 8
    assert inputs[8:] == ["Body"] * 3
    assert bodies[2]["body"] == "0123456789" and bodies[3]["body"] == "ab\n|cd\n|ef"
    assert bodies[4]["body"] == "" and [b["path"] for b in bodies[5:7]] == ["/one", "/two"]
    assert bodies[7]["fields"]["HTTP_X_TWO"] == "a,b" and bodies[8]["body"] == "abc"
    # the config's pre_request hook added a field the environ has, on both paths
    assert bodies[0]["fields"]["HTTP_X_HOOK"] == "POST /environ"
    assert bodies[9]["fields"]["HTTP_X_HOOK"] == "GET /after"
    environ = bodies[0]["environ"]
    assert environ["QUERY_STRING"] == "a=1&b=%20" and environ["wsgi.multithread"] is True
    heads = [head for head, _ in got]
    assert b"\r\nTransfer-Encoding: chunked" in heads[7]
    assert b"\r\nConnection: close" in heads[-1] and b"\r\nConnection: keep-alive" in heads[0]


def test_post_request_hooks_see_every_request(servers: tuple[Server, Server]) -> None:
    ours, theirs = servers
    before = len(ours.posted()), len(theirs.posted())
    steps = [(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n", 1), (b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n", 1)]
    _answers(ours, steps)
    _answers(theirs, steps)
    time.sleep(0.2)
    assert ours.posted()[before[0]:] == theirs.posted()[before[1]:] == \
        ["GET /a 200 OK", "GET /b 200 OK"]


def _assert_serving(server: Server) -> None:
    answers, _ = _answers(server, [(b"GET /ok HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
                                    1)])
    assert answers[0][1]["path"] == "/ok"


def test_an_application_error_is_answered_in_json_and_the_connection_closed(
        servers: tuple[Server, Server]) -> None:
    ours, _ = servers
    answers, closed = _answers(ours, [(b"GET /fail HTTP/1.1\r\nHost: h\r\n\r\n", 1)])
    head, body = answers[0]
    assert head.startswith(b"HTTP/1.1 500 ") and closed
    assert body["error"]["type"] and "message" in body["error"]
    _assert_serving(ours)  # the worker lives on


def test_a_client_closing_within_the_body_ends_only_its_connection(
        servers: tuple[Server, Server]) -> None:
    ours, _ = servers
    with ours.connect() as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\nabc")
        time.sleep(0.1)
        sock.shutdown(socket.SHUT_WR)
        head, body = _read_answer(sock, bytearray())
        assert head.startswith(b"HTTP/1.1 200 ")
        assert json.loads(body)["body"] == "abc"  # the body ended short, as gunicorn's does
        sock.settimeout(3.0)
        assert sock.recv(1) == b""  # and the connection is closed after the answer
    _assert_serving(ours)


def test_an_idle_kept_alive_connection_is_closed_after_keepalive_seconds(
        servers: tuple[Server, Server]) -> None:
    ours, _ = servers
    with ours.connect() as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
        _read_answer(sock, bytearray())
        started = time.monotonic()
        sock.settimeout(10.0)
        assert sock.recv(1) == b""
        assert 1.5 <= time.monotonic() - started <= 6.0  # --keepalive 2


def test_gunicorns_own_pre_request_hook_still_logs_at_debug_level(tmp_path: Path) -> None:
    """The worker skips gunicorn's default ``pre_request`` hook only while its debug line
    would be dropped."""
    port = free_port()
    log = tmp_path / "debug.log"
    child = Child([sys.executable, "-m", "gunicorn", "-k", WORKER_CLASS, "-w", "1",
                   "--log-level", "debug", "-b", f"127.0.0.1:{port}",
                   "tests.integration.wsgi_probe:app"],
                  log, cwd=ROOT, stop_signal=signal.SIGQUIT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, children=[child])
        answers, _ = _answers(Server(port, tmp_path / "none"),
                              [(b"GET /debug-me HTTP/1.1\r\nHost: h\r\n\r\n", 1)])
        assert answers[0][1]["input"] == "HeldInput"  # the worker's own loop served it
    finally:
        child.stop()
    assert "GET /debug-me" in log.read_text()


def test_the_worker_freezes_what_it_loaded_and_collects_the_young_less_often(
    servers: tuple[Server, Server],
) -> None:
    """Before serving, the router's worker moves what is alive after loading the app to the
    collector's permanent generation and raises the youngest generation's threshold;
    gunicorn's own worker leaves the collector as CPython sets it up."""
    docs = []
    for server in servers:
        answers, _ = _answers(server, [(b"GET /gc HTTP/1.1\r\nHost: x\r\nConnection: close"
                                        b"\r\n\r\n", 1)])
        docs.append(answers[0][1]["gc"])
    ours, theirs = docs
    assert ours["threshold"][0] == GC_YOUNG_THRESHOLD
    assert ours["threshold"][1:] == theirs["threshold"][1:] == [10, 10]
    assert ours["frozen"] > 10_000  # the modules, gunicorn, gevent, the app
    # CPython's own setup: thresholds (700, 10, 10) up to 3.12, (2000, 10, 10) in 3.13;
    # nothing frozen, but 3.12.1 starts with 375 objects in the permanent generation
    fresh = subprocess.run([sys.executable, "-c", "import gc; print(*gc.get_threshold(), "
                            "gc.get_freeze_count())"],
                           capture_output=True, text=True, check=True, timeout=60)
    *default, frozen = [int(part) for part in fresh.stdout.split()]
    assert default[0] < GC_YOUNG_THRESHOLD and frozen < 1_000
    assert theirs == {"threshold": default, "frozen": frozen}
