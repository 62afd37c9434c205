"""Transport equivalence: ``tests/fixtures/push_stream_golden.sse`` on both sides.

Listener side: one hub, the golden events; the bytes of ``GET /events/vllm-1`` (pull) and
the bytes the router's bus relays after the listener pushed them over HTTP/2 + TLS (push)
both equal the fixture, byte for byte. Router side: the fixture read by the pull consumer
and by the push-mode consumer (the same SSE parser) gives the same index state.

The listener parts run in this thread under gevent (waits yield with ``gevent.sleep``);
HTTP reads run in threads.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path
from typing import Any

import gevent
import pytest
import requests

from continuum.config.schema import KvEventSourceConfig
from continuum.devtools import procs
from continuum.devtools.procs import free_port
from continuum.kv.bus_consumer import add_bus_consumers
from continuum.kv.bus_process import read_bus_file
from continuum.kv.consumer import KvEventConsumerManager
from listener.bus_client import BusClient
from listener.bus_config import BusClientConfig
from listener.hub import EventHub
from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, CACHE_OFFLOADED, PrefixEvent
from listener.server import create_app, make_server
from stores.kv_memory import InMemoryKvIndex
from tests.integration.push_helpers import BusProcess, Pki, router_config, token_hash

pytestmark = pytest.mark.timeout(120)

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "push_stream_golden.sse"
EPOCH = "0abc"
wait_until = functools.partial(procs.wait_until, sleep=gevent.sleep, interval=0.02)


def p(n: int) -> str:
    return f"{n:064x}"


GOLDEN_EVENTS = [
    PrefixEvent(CACHE_CLEARED),
    PrefixEvent(CACHE_CREATED, p(1), 32),
    PrefixEvent(CACHE_CREATED, p(2), 48),
    PrefixEvent(CACHE_CREATED, p(3), 16),
    PrefixEvent(CACHE_OFFLOADED, p(1), None),
    PrefixEvent(CACHE_EVICTED, p(2), None),
    PrefixEvent(CACHE_CREATED, p(4), 1024),
]
#: What the router holds after the golden stream (storage offloading off: offloaded and
#: evicted entries are gone).
EXPECTED = {p(3): 16, p(4): 1024}


def golden_hub() -> EventHub:
    hub = EventHub(["vllm-1"], epoch=EPOCH)
    for event in GOLDEN_EVENTS:
        hub.publish("vllm-1", event)
    return hub


def read_bytes(url: str, size: int, headers: dict[str, str]) -> bytes:
    """The first ``size`` body bytes of a GET, read in a thread while gevent serves."""
    got: list[bytes] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with requests.get(url, headers=headers, stream=True, timeout=10) as resp:
                assert resp.status_code == 200, resp.text
                data = b""
                for chunk in resp.raw.stream(1024, decode_content=False):
                    data += chunk
                    if len(data) >= size:
                        break
                got.append(data)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: not thread.is_alive(), f"{size} bytes of {url}", 30)
    assert not errors, errors
    return got[0]


def test_listener_pull_and_push_bytes_equal_the_golden_fixture(tmp_path: Path) -> None:
    golden = GOLDEN.read_bytes()
    resume = {"Last-Event-ID": f"{EPOCH}-0"}  # from the start of the history
    hub = golden_hub()
    server = make_server(create_app(hub, [], keepalive=60), "127.0.0.1:0")
    server.start()
    pki = Pki(tmp_path)
    bus_port = free_port()
    (tmp_path / "token").write_text("golden-token")
    bus = BusProcess(tmp_path, router_config(pki, bus_port, [
        {"id": "kv-g", "role": "kv_listener", "token_hash": token_hash("golden-token"),
         "backends": ["vllm-1"]}]))
    client = BusClient(BusClientConfig(url=f"https://127.0.0.1:{bus_port}", client_id="kv-g",
                                       ca_file=pki.ca_file,
                                       credential_file=str(tmp_path / "token")), hub, 60.0)
    try:
        pulled = read_bytes(f"http://127.0.0.1:{server.server_port}/events/vllm-1",
                            len(golden), resume)
        assert pulled == golden
        client.start()
        wait_until(lambda: client.connected, "the bus session", 20)
        found = read_bus_file(str(bus.runtime))
        assert found is not None
        url, token = found
        pushed = read_bytes(f"{url}/events/vllm-1", len(golden),
                            {**resume, "Authorization": f"Bearer {token}"})
        assert pushed == golden
        assert client.counters.streams == 1 and client.counters.bytes_out >= len(golden)
    finally:
        client.stop(0)
        hub.close()
        server.stop(timeout=2)
        bus.stop()


class _GoldenHandler(http.server.BaseHTTPRequestHandler):
    done: threading.Event

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(GOLDEN.read_bytes())
        self.wfile.flush()
        self.done.wait(30)  # the stream stays open: no reconnect, no replay

    def log_message(self, *args: Any) -> None:
        pass


def test_router_parses_the_golden_fixture_alike_on_pull_and_push(tmp_path: Path) -> None:
    done = threading.Event()
    handler = type("Handler", (_GoldenHandler,), {"done": done})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "bus-local.json").write_text(json.dumps({"url": url, "token": "t"}))
    pull_index, push_index = InMemoryKvIndex(), InMemoryKvIndex()
    pull = KvEventConsumerManager([KvEventSourceConfig(
        backend_name="vllm-1", endpoint=url + "/events/vllm-1")], pull_index)
    bus_sources = [KvEventSourceConfig(backend_name="vllm-1", transport="event_bus")]
    push = KvEventConsumerManager(bus_sources, push_index)
    add_bus_consumers(push, bus_sources, push_index, runtime_dir=str(runtime))
    try:
        pull.start()
        push.start()
        for manager in (pull, push):
            wait_until(lambda m=manager: m.consumers[0].last_event_id == f"{EPOCH}-7",
                       "the last golden event", 20)

        def state(index: InMemoryKvIndex) -> dict[str, int]:
            return {h: holding.token_count for h in (p(1), p(2), p(3), p(4))
                    for holding in index.query_backends(h) if holding.backend == "vllm-1"}

        assert state(pull_index) == state(push_index) == EXPECTED
        (a,), (b,) = pull.stats(), push.stats()
        assert (a.events_received, a.malformed, a.index_created, a.index_evicted) == \
            (b.events_received, b.malformed, b.index_created, b.index_evicted) == (7, 0, 4, 3)
    finally:
        pull.stop(timeout=5)
        push.stop(timeout=5)
        done.set()
        server.shutdown()
        server.server_close()


def test_a_consumer_that_stops_reading_gets_buffer_overflow_through_the_bus(
        tmp_path: Path) -> None:
    """Backpressure end to end: a reader of the bus that stops reading stalls its relay,
    the bus stops returning HTTP/2 credit, the listener's subscriber queue fills and the
    listener ends that stream with buffer_overflow (nothing dropped silently)."""
    import socket

    hub = EventHub(["vllm-1"], epoch=EPOCH, subscriber_queue=2, history_size=10)
    pki = Pki(tmp_path)
    bus_port = free_port()
    (tmp_path / "token").write_text("slow-token")
    bus = BusProcess(tmp_path, router_config(pki, bus_port, [
        {"id": "kv-g", "role": "kv_listener", "token_hash": token_hash("slow-token"),
         "backends": ["vllm-1"]}]))
    client = BusClient(BusClientConfig(url=f"https://127.0.0.1:{bus_port}", client_id="kv-g",
                                       ca_file=pki.ca_file,
                                       credential_file=str(tmp_path / "token")), hub, 60.0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.start()
        wait_until(lambda: client.connected, "the bus session", 20)
        found = read_bus_file(str(bus.runtime))
        assert found is not None
        url, token = found
        port = int(url.rsplit(":", 1)[1])
        opened = threading.Event()

        def connect() -> None:
            sock.connect(("127.0.0.1", port))
            sock.sendall(f"GET /events/vllm-1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         f"{token}\r\n\r\n".encode())
            opened.set()

        threading.Thread(target=connect, daemon=True).start()
        wait_until(lambda: opened.is_set() and hub.subscribers("vllm-1") == 1,
                   "the pushed subscription", 20)
        published = 0
        while hub.counters("vllm-1").overflows == 0 and published < 200_000:
            for _ in range(500):  # bounded: the reader reads nothing meanwhile
                published += 1
                hub.publish("vllm-1", PrefixEvent(CACHE_CREATED, p(published), 16))
            gevent.sleep(0.01)  # let the pusher send until flow control stops it
        assert hub.counters("vllm-1").overflows == 1, published
        tail: list[bytes] = []

        def drain() -> None:
            sock.settimeout(20)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
                if b"event: buffer_overflow" in data[-4096:]:
                    break
            tail.append(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        wait_until(lambda: not reader.is_alive(), "the stream's end", 30)
        assert tail and b"event: buffer_overflow" in tail[0][-4096:]
        assert b"id: " + f"{EPOCH}-1\n".encode() in tail[0]  # from the first event on
    finally:
        sock.close()
        client.stop(0)
        hub.close()
        bus.stop()
