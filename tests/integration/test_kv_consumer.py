"""KV event consumers against real SSE and WebSocket servers on 127.0.0.1.

How it runs: the servers are ``socketserver`` threads in this process; the consumers run in
real threads too, because :func:`continuum.kv.consumer.default_spawn` picks a daemon thread
when gevent has not patched ``socket`` (a gunicorn gevent worker gets greenlets instead).
``stop()`` wakes a consumer blocked in a read by shutting down its socket, so nothing here
needs monkey patching — except the one test that runs the consumer the way a gunicorn gevent
worker does, in a monkey-patched subprocess with greenlets. Backoff sleeps go through
:class:`FakeClock`, which records every delay and returns at once (or parks until the test
allows more), so delays are asserted exactly and no assertion depends on timing; every wait
is a bounded poll with a deadline.

Each scripted event ``i`` carries ``prefix_hash`` ``f"{i:04x}"``, so the recording index's
log shows which event ids the consumer applied, in which order, and how often.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import select
import socket
import socketserver
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from prometheus_client import CollectorRegistry

from continuum.config.schema import KvEventSourceConfig
from continuum.devtools import procs
from continuum.errors import StoreError
from continuum.interfaces import KvCacheIndex, KvHolding
from continuum.kv.consumer import Backoff, KvEventConsumerManager, SourceConsumer
from continuum.wire.sse import MAX_SSE_BUFFER_SIZE

pytestmark = pytest.mark.timeout(120)

BASE_MS = 100
DEADLINE = 20.0


#: Waits poll often: the consumers under test run in threads of this process.
wait_until = functools.partial(procs.wait_until, timeout=DEADLINE, interval=0.005)


class RecordingIndex(KvCacheIndex):
    """Logs every applied event; raises StoreError for prefixes in ``fail_on``."""

    name = "recording"

    def __init__(self, fail_on: Sequence[str] = ()) -> None:
        self.log: list[tuple[str, str, str, int]] = []
        self.fail_on = set(fail_on)
        self._lock = threading.Lock()

    def apply(self, backend: str, event: str, prefix_hash: str, token_count: int = 0) -> None:
        if prefix_hash in self.fail_on:
            raise StoreError("simulated outage", store="recording")
        with self._lock:
            self.log.append((backend, event, prefix_hash, token_count))

    def ids(self) -> list[int]:
        with self._lock:
            return [int(prefix, 16) for _, _, prefix, _ in self.log if prefix]

    def query_backends(self, prefix_hash: str) -> Sequence[KvHolding]:
        return []

    def clear(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"entry_count": len(self.log)}


class FakeClock:
    """Records delays (ms) and returns at once while ``allowed`` waits are left, then parks
    until :meth:`allow` or the consumer's stop (bounded)."""

    def __init__(self, allowed: int = 1000) -> None:
        self.delays_ms: list[int] = []
        self._allowed = allowed
        self._cond = threading.Condition()

    def now(self) -> float:
        return 1_773_397_457.0  # 2026-03-13T10:24:17Z

    def wait(self, seconds: float, wake: threading.Event) -> None:
        deadline = time.monotonic() + DEADLINE
        with self._cond:
            self.delays_ms.append(round(seconds * 1000))
            mine = len(self.delays_ms)
            while mine > self._allowed and not wake.is_set() and time.monotonic() < deadline:
                self._cond.wait(0.01)

    def allow(self, more: int) -> None:
        with self._cond:
            self._allowed += more
            self._cond.notify_all()


def event(i: int, kind: str = "cache_created", *, sse_event: bool = True,
          tokens: int | None = 16) -> bytes:
    """One SSE record with id ``i`` whose prefix_hash encodes ``i``."""
    body: dict[str, Any] = {"prefix_hash": f"{i:04x}"}
    if tokens is not None:
        body["token_count"] = tokens
    head = f"id: {i}\n"
    if sse_event:
        head += f"event: {kind}\n"
    else:
        body["event"] = kind
    return f"{head}data: {json.dumps(body)}\n\n".encode()


class ScriptedServer(socketserver.ThreadingTCPServer):
    """A threaded server on 127.0.0.1 that serves numbered connections from a script.

    It records each connection's resume point, can drop every open connection (``kick``),
    and joins all handler threads on close.
    """

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, handler: type[socketserver.BaseRequestHandler],
                 records: Sequence[tuple[str, bytes]], plans: Sequence[Any], default: Any) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.records = list(records)
        self.plans = list(plans)
        self.default = default
        self.resume_ids: list[str | None] = []
        self.closed_by_client: list[bool] = []
        self.notes: list[Any] = []  # whatever a plan wants the test to check
        self.closing = threading.Event()
        self._active: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def register(self, resume_id: str | None, sock: socket.socket) -> tuple[int, Any, int]:
        """Record a connection; return its number, its plan and the first record to send."""
        with self._lock:
            number = len(self.resume_ids)
            self.resume_ids.append(resume_id)
            self.closed_by_client.append(False)
            self._active.add(sock)
        ids = [record_id for record_id, _ in self.records]
        start = ids.index(resume_id) + 1 if resume_id in ids else 0
        plan = self.plans[number] if number < len(self.plans) else self.default
        return number, plan, start

    def unregister(self, sock: socket.socket) -> None:
        with self._lock:
            self._active.discard(sock)

    def hold(self, sock: socket.socket, number: int) -> None:
        """Keep the connection open until the client closes it, a kick, or teardown."""
        deadline = time.monotonic() + DEADLINE
        while not self.closing.is_set() and time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.02)
            if readable and not sock.recv(4096):
                self.closed_by_client[number] = True
                return

    def kick(self) -> None:
        """Force-disconnect every open connection."""
        with self._lock:
            active = list(self._active)
        for sock in active:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closing.set()
        self.kick()
        self.shutdown()
        self._thread.join(DEADLINE)
        self.server_close()


@dataclass
class Plan:
    """What the SSE server does on one connection."""

    status: int = 200
    max_events: int | None = None  # records to send (after the resume point)
    tail: bytes = b""  # raw bytes after them: a control event, half a record …
    flood: bool = False  # then "a" without a newline, up to 8 MiB or until the client leaves
    hold: bool = True  # then wait for the client to close; False: the server closes


class SseHandler(http.server.BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        number, plan, start = self.server.register(self.headers.get("Last-Event-ID"),
                                                   self.connection)
        try:
            self._serve(number, plan, start)
        except OSError:
            pass  # the client left mid-write
        finally:
            self.server.unregister(self.connection)

    def _serve(self, number: int, plan: Plan, start: int) -> None:
        if plan.status != 200:
            self.send_response(plan.status)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        records = self.server.records[start:]
        if plan.max_events is not None:
            records = records[:plan.max_events]
        self.wfile.write(b": hello\n\n" + b"".join(raw for _, raw in records) + plan.tail)
        if plan.flood:
            for _ in range(128):
                self.wfile.write(b"a" * 65536)
        if plan.hold:
            self.server.hold(self.connection, number)


# -- a small server side of RFC 6455 ---------------------------------------------------------

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def ws_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([n])
    elif n < 65536:
        head += bytes([126]) + struct.pack("!H", n)
    else:
        head += bytes([127]) + struct.pack("!Q", n)
    return head + payload


def ws_recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("client closed")
        out += chunk
    return out


def ws_read_frame(sock: socket.socket) -> tuple[int, bytes, bool]:
    """``(opcode, unmasked payload, was masked)`` of one client frame."""
    b0, b1 = ws_recv_exact(sock, 2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack("!H", ws_recv_exact(sock, 2))[0]
    elif n == 127:
        n = struct.unpack("!Q", ws_recv_exact(sock, 8))[0]
    key = ws_recv_exact(sock, 4) if b1 & 0x80 else b"\0\0\0\0"
    payload = bytes(b ^ key[i % 4] for i, b in enumerate(ws_recv_exact(sock, n)))
    return b0 & 0x0F, payload, bool(b1 & 0x80)


def ws_event(i: int, kind: str = "cache_created") -> bytes:
    return json.dumps({"id": i, "event": kind, "prefix_hash": f"{i:04x}",
                       "token_count": 16}).encode()


class WsHandler(socketserver.BaseRequestHandler):
    server: ScriptedServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(DEADLINE)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                return
            head += chunk
        request_line, *lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        assert headers["upgrade"].lower() == "websocket"
        assert headers["sec-websocket-version"] == "13"
        accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode() + GUID)
                                  .digest()).decode()
        sock.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n").encode())
        query = parse_qs(urlsplit(request_line.split(" ")[1]).query)
        number, plan, start = self.server.register(query.get("last_event_id", [None])[0], sock)
        try:
            plan(self.server, sock, number, start)
        except OSError:
            pass
        finally:
            self.server.unregister(sock)


WsPlan = Callable[[ScriptedServer, socket.socket, int, int], None]


# -- fixtures --------------------------------------------------------------------------------

@pytest.fixture
def servers() -> Iterator[list[ScriptedServer]]:
    started: list[ScriptedServer] = []
    yield started
    for server in started:
        server.close()


def sse_server(servers: list[ScriptedServer], records: Sequence[bytes],
               plans: Sequence[Plan] = ()) -> ScriptedServer:
    ids = [raw.split(b"\n", 1)[0].removeprefix(b"id: ").decode() for raw in records]
    server = ScriptedServer(SseHandler, list(zip(ids, records, strict=True)), plans, Plan())
    servers.append(server)
    return server


@dataclass
class Running:
    manager: KvEventConsumerManager
    consumer: SourceConsumer
    index: RecordingIndex
    clock: FakeClock
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"backend": "b1", **labels})


@pytest.fixture
def run_consumer(servers: list[ScriptedServer]) -> Iterator[Callable[..., Running]]:
    """Start a manager with one source ``b1``; every manager is stopped before the servers."""
    managers: list[KvEventConsumerManager] = []

    def start(endpoint: str, *, index: RecordingIndex | None = None,
              clock: FakeClock | None = None, base_ms: int = BASE_MS) -> Running:
        registry = CollectorRegistry()
        source = KvEventSourceConfig(backend_name="b1", endpoint=endpoint,
                                     reconnect_interval_ms=base_ms)
        index = index or RecordingIndex()
        clock = clock or FakeClock()
        manager = KvEventConsumerManager([source], index, registry, clock)
        managers.append(manager)
        manager.start()
        return Running(manager, manager.consumer("b1"), index, clock, registry)

    yield start
    for manager in managers:
        manager.stop()
        assert all(c.state == "stopped" for c in manager.consumers)
    assert not [t for t in threading.enumerate() if t.name == "kv-consumer"]


# -- SSE -------------------------------------------------------------------------------------

def test_events_applied_in_order_with_event_precedence(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    records = [
        event(1),
        event(2, sse_event=False),
        # The SSE event field wins over the body's "event".
        b'id: 3\nevent: cache_evicted\ndata: {"event": "cache_created", "prefix_hash": "0001"}\n\n',
        event(4, "cache_offloaded", tokens=None),
        b"id: 5\nevent: cache_cleared\ndata: {}\n\n",
        # Multi-line data, CRLF endings, a comment and an explicit default event type.
        b'id: 6\r\n: note\r\nevent: message\r\ndata: {"event": "cache_created",\r\n'
        b'data:  "prefix_hash": "00AB", "token_count": 7}\r\n\r\n',
    ]
    server = sse_server(servers, records)
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 6, "six events")
    assert run.index.log == [
        ("b1", "cache_created", "0001", 16),
        ("b1", "cache_created", "0002", 16),
        ("b1", "cache_evicted", "0001", 0),
        ("b1", "cache_offloaded", "0004", 0),
        ("b1", "cache_cleared", "", 0),
        ("b1", "cache_created", "00ab", 7),
    ]
    stats = asdict(run.manager.stats()[0])
    assert stats == {
        "backend_name": "b1", "state": "streaming", "connected": True, "events_received": 6,
        "events_dropped": 0, "malformed": 0, "last_event_at": "2026-03-13T10:24:17Z",
        "reconnect_count": 0, "index_created": 3, "index_evicted": 3, "last_event_id": "6",
        "consumed_by": "this worker",
    }
    assert run.metric("continuum_kv_events_received_total", type="cache_created") == 3
    assert run.metric("continuum_kv_events_received_total", type="cache_cleared") == 1
    assert run.metric("continuum_kv_consumer_connected") == 1
    assert server.resume_ids == [None]


def test_in_memory_index_is_fed(servers: list[ScriptedServer]) -> None:
    from stores.kv_memory import InMemoryKvIndex

    records = [event(1, tokens=64), event(2, tokens=32), event(2, "cache_evicted")]
    server = sse_server(servers, records)
    index = InMemoryKvIndex()
    source = KvEventSourceConfig(backend_name="b1", endpoint=f"http://127.0.0.1:{server.port}/",
                                 reconnect_interval_ms=BASE_MS)
    manager = KvEventConsumerManager([source], index, clock=FakeClock())
    manager.start()
    try:
        wait_until(lambda: manager.stats()[0].events_received == 3, "three events")
        assert [(h.backend, h.token_count) for h in index.query_backends("0001")] == [("b1", 64)]
        assert list(index.query_backends("0002")) == []
    finally:
        manager.stop()


def test_resume_after_disconnects_has_no_duplicates_or_gaps(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    records = [event(i) for i in range(1, 13)]
    plans = [
        # The server closes in the middle of record 5: it must be discarded, not applied.
        Plan(max_events=4, tail=b'id: 5\nevent: cache_created\ndata: {"prefix_ha', hold=False),
        Plan(max_events=3),  # then the test force-disconnects it
    ]
    server = sse_server(servers, records, plans)
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 7, "seven events")
    wait_until(lambda: len(server.resume_ids) == 2, "the second connection")
    server.kick()
    wait_until(lambda: len(run.index.log) == 12, "all twelve events")
    assert run.index.ids() == list(range(1, 13))
    assert server.resume_ids == [None, "4", "7"]
    assert run.consumer.reconnect_count == 2
    assert run.clock.delays_ms == [BASE_MS, BASE_MS]  # both connections delivered events
    assert run.metric("continuum_kv_consumer_reconnects_total") == 2
    assert run.consumer.malformed == 0


def test_endless_data_line_is_dropped_and_resumed_with_bounded_buffers(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    records = [event(i) for i in range(1, 4)]
    server = sse_server(servers, records, [Plan(max_events=2, tail=b"data: ", flood=True)])
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 3, "three events")
    assert run.index.ids() == [1, 2, 3]
    assert server.resume_ids == [None, "2"]
    # The parser filled its line buffer up to the cap and not a byte further.
    high_water = run.consumer.buffer_high_water
    assert MAX_SSE_BUFFER_SIZE - 64 * 1024 <= high_water <= MAX_SSE_BUFFER_SIZE
    assert run.consumer.events_dropped == 1
    assert run.metric("continuum_kv_event_dropped_total") == 1
    # The overflowing connection had delivered events, so the delay is the base one.
    assert run.clock.delays_ms == [BASE_MS]


def test_backoff_doubles_to_the_cap_and_resets_after_an_event(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    failures = [Plan(status=503)] * 12
    plans = [*failures, Plan(max_events=1, hold=False), Plan(status=503), Plan(status=503)]
    server = sse_server(servers, [event(1)], plans)
    clock = FakeClock(allowed=14)
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1", clock=clock)
    wait_until(lambda: len(clock.delays_ms) == 15, "fifteen reconnect delays")
    assert clock.delays_ms == [
        100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200, 60000, 60000,
        100,  # the 13th connection delivered an event
        200, 400,
    ]
    assert len(server.resume_ids) == 15
    assert server.resume_ids[13:] == ["1", "1"]
    assert run.consumer.state == "backoff"
    assert run.consumer.reconnect_count == 14


def test_backoff_rule() -> None:
    rule = Backoff(100)
    assert rule.delay(100, reset=False) == (100, 200)
    assert rule.delay(60000, reset=False) == (60000, 60000)
    assert rule.delay(6400, reset=True) == (100, 200)
    # retry: is a floor for one delay, capped, and never lowers the schedule.
    assert rule.delay(400, reset=False, retry_ms=2500) == (2500, 800)
    assert rule.delay(400, reset=False, retry_ms=10) == (400, 800)
    assert rule.delay(100, reset=False, retry_ms=10**9) == (60000, 200)
    # A base above 60 s is its own cap.
    assert Backoff(120000).delay(120000, reset=False) == (120000, 120000)


def test_retry_field_raises_the_next_delay(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    server = sse_server(servers, [event(1), event(2)],
                        [Plan(max_events=1, tail=b"retry: 2500\n\n", hold=False)])
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 2, "two events")
    assert run.clock.delays_ms == [2500]
    assert server.resume_ids == [None, "1"]


def test_malformed_records_are_counted_and_skipped(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    records = [
        event(1),
        b"id: 2\nevent: cache_created\ndata: {not json\n\n",
        b'id: 3\nevent: cache_created\ndata: {"token_count": 3}\n\n',
        b'id: 4\nevent: cache_exploded\ndata: {"prefix_hash": "0004"}\n\n',
        event(5, tokens=-1),
        b"id: 6\nevent: cache_cleared\ndata: {}\n\n",
        event(7),  # the index fails to store this one
        b"id: 8\ndata: []\n\n",
        b'id: 9\nevent: cache_created\ndata: {"prefix_hash": "0009", "token_count": "12"}\n\n',
        b'id: 10\nevent: cache_created\ndata: {"prefix_hash": "not-hex"}\n\n',
        event(11),
    ]
    server = sse_server(servers, records)
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1",
                       index=RecordingIndex(fail_on=["0007"]))
    wait_until(lambda: run.consumer.last_event_id == "11", "the last record")
    assert [(e, p) for _, e, p, _ in run.index.log] == [
        ("cache_created", "0001"), ("cache_cleared", ""), ("cache_created", "000b")]
    stats = run.manager.stats()[0]
    assert (stats.malformed, stats.events_dropped, stats.events_received) == (7, 1, 4)
    assert (stats.connected, stats.reconnect_count) == (True, 0)
    assert run.metric("continuum_kv_malformed_records_total") == 7
    assert run.metric("continuum_kv_event_dropped_total") == 1


@pytest.mark.parametrize(("tail", "dropped"), [
    (b"event: draining\ndata: {}\n\n", 0),
    (b'data: {"event": "draining"}\n\n', 0),
    (b"id: 99\nevent: buffer_overflow\ndata:\n\n", 1),
])
def test_control_events_close_and_resume_promptly(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running], tail: bytes,
        dropped: int) -> None:
    records = [event(i) for i in range(1, 5)]
    plans = [
        Plan(status=503),  # makes the next delay 200 ms if nothing resets it
        Plan(max_events=0, tail=tail),  # no events, then the control event; held open
        Plan(max_events=2, tail=tail),
    ]
    server = sse_server(servers, records, plans)
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 4, "four events")
    assert run.index.ids() == [1, 2, 3, 4]
    # The consumer closed both held-open streams itself, and never took id 99 as processed.
    assert server.resume_ids == [None, None, None, "2"]
    assert server.closed_by_client[1:3] == [True, True]
    assert run.clock.delays_ms == [100, 100, 100]  # no growth after a control event
    assert run.consumer.events_dropped == 2 * dropped


def test_connected_gauge_and_state_follow_the_stream(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    server = sse_server(servers, [event(1), event(2)], [Plan(max_events=1)])
    clock = FakeClock(allowed=0)
    run = run_consumer(f"http://127.0.0.1:{server.port}/events/b1", clock=clock)
    wait_until(lambda: len(run.index.log) == 1, "the first event")
    assert run.metric("continuum_kv_consumer_connected") == 1
    assert run.consumer.state == "streaming"
    server.kick()
    wait_until(lambda: len(clock.delays_ms) == 1, "the backoff")
    assert run.metric("continuum_kv_consumer_connected") == 0
    assert run.manager.stats()[0].connected is False
    assert run.consumer.state == "backoff"
    clock.allow(1)
    wait_until(lambda: len(run.index.log) == 2, "the second event")
    assert run.metric("continuum_kv_consumer_connected") == 1
    run.manager.stop()
    assert run.consumer.state == "stopped"
    assert run.metric("continuum_kv_consumer_connected") == 0


def test_unreachable_listener_backs_off_and_stop_wakes_the_sleep(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    server = sse_server(servers, [])
    port = server.port
    server.close()
    servers.remove(server)
    clock = FakeClock(allowed=3)
    run = run_consumer(f"http://127.0.0.1:{port}/events/b1", clock=clock)
    wait_until(lambda: len(clock.delays_ms) == 4, "four failed connects")
    assert clock.delays_ms == [100, 200, 400, 800]
    assert run.consumer.state == "backoff"
    assert run.metric("continuum_kv_consumer_connected") == 0
    run.manager.stop(timeout=DEADLINE)
    assert run.consumer.state == "stopped"
    assert run.consumer.reconnect_count == 3


# -- WebSocket -------------------------------------------------------------------------------

OP_TEXT, OP_CONT, OP_CLOSE, OP_PING, OP_PONG = 0x1, 0x0, 0x8, 0x9, 0xA


def ws_server(servers: list[ScriptedServer], count: int, plans: Sequence[WsPlan],
              default: WsPlan) -> ScriptedServer:
    records = [(str(i), ws_event(i)) for i in range(1, count + 1)]
    server = ScriptedServer(WsHandler, records, plans, default)
    servers.append(server)
    return server


def ws_hold(server: ScriptedServer, sock: socket.socket, number: int, start: int) -> None:
    for _, raw in server.records[start:]:
        sock.sendall(ws_frame(OP_TEXT, raw))
    server.hold(sock, number)


def test_ws_delivers_events_and_resumes_with_last_event_id(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    def first(server: ScriptedServer, sock: socket.socket, number: int, start: int) -> None:
        sock.sendall(ws_frame(OP_PING, b"hb"))
        server.notes.append(ws_read_frame(sock))  # the pong
        raws = [raw for _, raw in server.records[start:start + 3]]
        sock.sendall(ws_frame(OP_TEXT, raws[0]))
        # A fragmented message with a ping between its fragments.
        sock.sendall(ws_frame(OP_TEXT, raws[1][:10], fin=False) + ws_frame(OP_PING, b"p2")
                     + ws_frame(OP_CONT, raws[1][10:20], fin=False)
                     + ws_frame(OP_CONT, raws[1][20:]))
        server.notes.append(ws_read_frame(sock))
        # Not an object: malformed, skipped; then event 3 and an abrupt end (no close frame).
        sock.sendall(ws_frame(OP_TEXT, b"[1, 2]") + ws_frame(OP_TEXT, raws[2]))

    def second(server: ScriptedServer, sock: socket.socket, number: int, start: int) -> None:
        for _, raw in server.records[start:start + 3]:
            sock.sendall(ws_frame(OP_TEXT, raw))
        sock.sendall(ws_frame(OP_CLOSE, struct.pack("!H", 1001) + b"going away"))
        server.notes.append(ws_read_frame(sock))  # the echoed close

    server = ws_server(servers, 8, [first, second], ws_hold)
    run = run_consumer(f"ws://127.0.0.1:{server.port}/events/b1?token=x")
    wait_until(lambda: len(run.index.log) == 8, "eight events")
    assert run.index.ids() == list(range(1, 9))
    assert server.resume_ids == [None, "3", "6"]
    # The second connection's thread notes the echoed close after the consumer has moved
    # on to the third: wait for it rather than race it.
    wait_until(lambda: len(server.notes) >= 3, "the echoed close frame")
    assert server.notes == [
        (OP_PONG, b"hb", True),
        (OP_PONG, b"p2", True),
        (OP_CLOSE, struct.pack("!H", 1001), True),
    ]
    stats = run.manager.stats()[0]
    assert (stats.malformed, stats.events_received, stats.reconnect_count) == (1, 8, 2)
    assert stats.last_event_id == "8"
    assert run.metric("continuum_kv_consumer_connected") == 1


def test_ws_fragmented_message_over_the_cap_is_dropped(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    def oversized(server: ScriptedServer, sock: socket.socket, number: int, start: int) -> None:
        sock.sendall(ws_frame(OP_TEXT, server.records[start][1]))
        piece = b"x" * (600 * 1024)
        sock.sendall(ws_frame(OP_TEXT, piece, fin=False))
        sock.sendall(ws_frame(OP_CONT, piece, fin=False))  # 1.2 MiB: over the cap
        sock.sendall(ws_frame(OP_CONT, b"}"))
        server.hold(sock, number)

    server = ws_server(servers, 3, [oversized], ws_hold)
    run = run_consumer(f"ws://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 3, "three events")
    assert run.index.ids() == [1, 2, 3]
    assert server.resume_ids == [None, "1"]
    assert run.consumer.events_dropped == 1
    assert 600 * 1024 <= run.consumer.buffer_high_water <= MAX_SSE_BUFFER_SIZE + 1


def test_ws_message_of_endless_empty_continuations_is_dropped(
        servers: list[ScriptedServer], run_consumer: Callable[..., Running]) -> None:
    """Zero-length continuation frames carry no payload bytes; the frame cap stops them."""
    def empties(server: ScriptedServer, sock: socket.socket, number: int, start: int) -> None:
        sock.sendall(ws_frame(OP_TEXT, server.records[start][1]))
        sock.sendall(ws_frame(OP_TEXT, b"{", fin=False))
        empty = ws_frame(OP_CONT, b"", fin=False) * 65536  # 128 KiB of frames per send
        sent = 0
        while sent < 4_000_000:  # 8 MB on the wire unless the client leaves first
            sock.sendall(empty)
            sent += 65536
        server.notes.append(sent)

    server = ws_server(servers, 3, [empties], ws_hold)
    run = run_consumer(f"ws://127.0.0.1:{server.port}/events/b1")
    wait_until(lambda: len(run.index.log) == 3, "three events")
    assert run.index.ids() == [1, 2, 3]
    assert server.resume_ids == [None, "1"]
    assert run.consumer.events_dropped == 1
    assert run.metric("continuum_kv_event_dropped_total") == 1
    assert server.notes == []  # the client left before the flood was through


def test_ws_client_frame_cap_bounds_memory() -> None:
    """The client itself: a message of a million empty continuations is refused after
    ``max_frames`` frames, with next to no memory."""
    from continuum.wire.sse import StreamOverflowError
    from continuum.wire.websocket import MAX_MESSAGE_FRAMES, WebSocketClient

    ours, theirs = socket.socketpair()
    flood = ws_frame(OP_TEXT, b"{", fin=False) + ws_frame(OP_CONT, b"", fin=False) * 1_000_000

    def send() -> None:
        try:
            theirs.sendall(flood + ws_frame(OP_CONT, b"}"))
        except OSError:
            pass  # the client closed its end

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    client = WebSocketClient(ours)
    tracemalloc.start()
    try:
        with pytest.raises(StreamOverflowError) as caught:
            client.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        ours.close()
        sender.join(DEADLINE)
        theirs.close()
    assert caught.value.what == "frames"
    assert caught.value.size == MAX_MESSAGE_FRAMES + 1
    assert peak < 512 * 1024, peak


GEVENT_SCRIPT = """
from gevent import monkey
monkey.patch_all()

import json, sys, time
from dataclasses import asdict
import gevent
from continuum.config.schema import KvEventSourceConfig
from continuum.interfaces import KvCacheIndex
from continuum.kv.consumer import KvEventConsumerManager

class Index(KvCacheIndex):
    def __init__(self):
        self.seen = []
    def apply(self, backend, event, prefix_hash, token_count=0):
        self.seen.append(prefix_hash)
    def query_backends(self, prefix_hash):
        return []
    def clear(self):
        return 0
    def stats(self):
        return {}

index = Index()
source = KvEventSourceConfig(backend_name="b1", endpoint=sys.argv[1], reconnect_interval_ms=10)
manager = KvEventConsumerManager([source], index)
manager.start()
deadline = time.monotonic() + 20
while len(index.seen) < 4 and time.monotonic() < deadline:
    gevent.sleep(0.01)
kind = type(manager._handles[0]).__module__
manager.stop()
print(json.dumps({"seen": index.seen, "handle": kind,
                  "stats": [asdict(s) for s in manager.stats()]}))
"""


def test_runs_in_greenlets_under_gevent_patching(servers: list[ScriptedServer]) -> None:
    """The worker's setting: monkey-patched gevent, default spawn, a real reconnect."""
    import subprocess
    import sys

    server = sse_server(servers, [event(i) for i in range(1, 5)], [Plan(max_events=2, hold=False)])
    out = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT,
                          f"http://127.0.0.1:{server.port}/events/b1"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["seen"] == ["0001", "0002", "0003", "0004"]
    assert result["handle"].startswith("gevent")
    assert result["stats"][0]["state"] == "stopped"
    assert result["stats"][0]["reconnect_count"] == 1
    assert server.resume_ids == [None, "2"]
