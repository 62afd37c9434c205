"""The listener's HTTP side over real sockets, and the ``continuum-kv-listener`` process.

In-process tests serve the app with gevent in the test's main thread and read streams from
client threads with the router's own SSE client (``continuum.wire.sse.SseTransport``), waiting
cooperatively (``gevent.sleep``) so the server greenlets run. Process tests start the CLI
with a config file, a simulated engine and the router's real event consumer. Every wait has
a deadline; nothing asserts on time.
"""

from __future__ import annotations

import functools
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest
import requests
import yaml
import zmq.green as zmq

from continuum.config.schema import KvEventSourceConfig
from continuum.devtools import procs
from continuum.devtools.procs import Child, free_port, wait_http
from continuum.kv.consumer import KvEventConsumerManager
from continuum.kv_events import KvEventBatch
from continuum.wire.sse import SseTransport
from listener.config import SourceConfig
from listener.hub import EventHub
from listener.model import CACHE_CLEARED, CACHE_CREATED, CACHE_EVICTED, PrefixEvent
from listener.server import create_app, make_server, parse_listen
from listener.sources_zmq import ZapAuthenticator, ZmqSource
from stores.kv_memory import InMemoryKvIndex
from tests.integration.kv_helpers import SettledMatch

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
LISTENER = [sys.executable, "-m", "listener.cli"]
Record = tuple[str | None, str | None, Any]


def prefix(n: int) -> str:
    return f"{n:064x}"


#: Waits yield to gevent (``gevent.sleep``), so the server greenlets in this thread run.
wait_until = functools.partial(procs.wait_until, sleep=gevent.sleep, interval=0.02)


class Reader:
    """One SSE subscription read by the router's client in a thread."""

    def __init__(self, url: str, last_event_id: str | None = None,
                 token: str | None = None) -> None:
        self.url = url
        self.last_event_id = last_event_id
        self.headers = {"Authorization": f"Bearer {token}"} if token else None
        self.records: queue.Queue[Record] = queue.Queue()
        self.got: list[Record] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.opened = threading.Event()
        self.transport: SseTransport | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.transport = SseTransport.open(self.url, self.last_event_id, 5.0, 60.0,
                                               self.headers)
            self.opened.set()
            for event, data, record_id in self.transport.records():
                self.records.put((record_id, event, json.loads(data) if data else None))
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.opened.set()
            self.done.set()

    def take(self, n: int, timeout: float = 20.0) -> list[Record]:
        """The next ``n`` records."""
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            try:
                out.append(self.records.get_nowait())
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(f"got {out} of {n} records from {self.url} "
                                         f"(error: {self.error!r})") from None
                gevent.sleep(0.01)
        self.got += out
        return out

    def ended(self, timeout: float = 20.0) -> list[Record]:
        """Every record until the server ends the stream."""
        wait_until(self.done.is_set, f"the end of {self.url}", timeout)
        rest = []
        while not self.records.empty():
            rest.append(self.records.get_nowait())
        self.got += rest
        return rest

    def close(self) -> None:
        wait_until(self.opened.is_set, "the stream to open")
        if self.transport is not None:
            self.transport.shutdown()
        wait_until(self.done.is_set, "the reader thread")
        self.thread.join(5)
        if self.transport is not None:
            self.transport.close()


class StubProcessor:
    """The processor protocol with fixed stats (the sources are never started here)."""

    def handle_batch(self, batch: KvEventBatch) -> None:
        pass

    def reset(self, reason: str) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"tracked_blocks": 7, "mismatched_blocks": 2, "detokenize_calls": 3}


class Served:
    """The listener app on a real socket, served in this thread by gevent."""

    def __init__(self, ctx: Any, *, history: int = 50, queue_size: int = 5,
                 keepalive: float = 0.2, token: str | None = None,
                 max_subscribers: int = 256) -> None:
        self.hub = EventHub(["vllm-1", "vllm-2"], history_size=history,
                            subscriber_queue=queue_size, epoch="abc",
                            max_subscribers=max_subscribers)
        self.token = token
        self.zap = ZapAuthenticator(ctx)
        self.sources = [ZmqSource(SourceConfig(
            backend_name=name, engine="vllm", model="m", zmq_endpoint="tcp://127.0.0.1:1",
            detokenize_endpoint="http://127.0.0.1:9/detokenize",
            allowed_publishers=("127.0.0.1",)), StubProcessor(), context=ctx, zap=self.zap)
            for name in self.hub.backends]
        self.server = make_server(create_app(self.hub, self.sources, keepalive=keepalive,
                                             token=token), "127.0.0.1:0")
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.readers: list[Reader] = []

    def read(self, backend: str = "vllm-1", last_event_id: str | None = None,
             query: str = "") -> Reader:
        reader = Reader(f"{self.url}/events/{backend}{query}", last_event_id, self.token)
        self.readers.append(reader)
        return reader

    def get(self, path: str, headers: dict[str, str] | None = None) -> requests.Response:
        """A plain GET from a thread (the server needs this thread's loop meanwhile)."""
        result: list[Any] = []
        thread = threading.Thread(
            target=lambda: result.append(requests.get(self.url + path, timeout=10,
                                                      headers=headers)),
            daemon=True)
        thread.start()
        wait_until(lambda: not thread.is_alive(), f"GET {path}")
        assert result, f"GET {path} failed"
        response: requests.Response = result[0]
        return response

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.hub.close()
        self.server.stop(timeout=5)
        self.zap.close()


@pytest.fixture
def served_with() -> Iterator[Callable[..., Served]]:
    """Factory: the listener app with the given options (one per test)."""
    ctx = zmq.Context()
    apps: list[Served] = []

    def make(**options: Any) -> Served:
        app = Served(ctx, **options)
        apps.append(app)
        return app

    try:
        yield make
    finally:
        for app in apps:
            app.close()
        ctx.destroy(linger=0)


@pytest.fixture
def served(served_with: Callable[..., Served]) -> Served:
    return served_with()


def created(n: int, tokens: int = 16) -> PrefixEvent:
    return PrefixEvent(CACHE_CREATED, prefix(n), tokens)


# -- in process ------------------------------------------------------------------------------


def test_stream_records_resume_and_disconnect(served: Served) -> None:
    hub = served.hub
    for n in (1, 2, 3):
        hub.publish("vllm-1", created(n, 16 * n))
    first = served.read()
    records = first.take(4)  # no resume id: cache_cleared + snapshot, the last one with an id
    assert records[0] == (None, CACHE_CLEARED, {"event": CACHE_CLEARED})
    assert {(r[1], r[2]["prefix_hash"], r[2]["token_count"]) for r in records[1:]} == {
        (CACHE_CREATED, prefix(n), 16 * n) for n in (1, 2, 3)}
    assert [r[0] for r in records] == [None, None, None, "abc-3"]
    hub.publish("vllm-1", PrefixEvent(CACHE_EVICTED, prefix(1)))
    hub.publish("vllm-1", created(4))
    assert first.take(2) == [
        ("abc-4", CACHE_EVICTED, {"event": CACHE_EVICTED, "prefix_hash": prefix(1)}),
        ("abc-5", CACHE_CREATED, {"event": CACHE_CREATED, "prefix_hash": prefix(4),
                                  "token_count": 16}),
    ]
    # the client goes away: the stream generator is closed and the subscription released
    first.close()
    wait_until(lambda: hub.subscribers("vllm-1") == 0, "the subscription to be released")
    for n in (6, 7, 8):
        hub.publish("vllm-1", created(n))
    resumed = served.read(last_event_id="abc-5")
    assert [r[0] for r in resumed.take(3)] == ["abc-6", "abc-7", "abc-8"]
    by_query = served.read(query="?last_event_id=abc-7")
    assert [r[0] for r in by_query.take(1)] == ["abc-8"]
    hub.publish("vllm-1", created(9))
    assert [r[0] for r in resumed.take(1)] == [r[0] for r in by_query.take(1)] == ["abc-9"]
    assert resumed.records.empty() and by_query.records.empty()


def test_unknown_backend_is_a_json_404(served: Served) -> None:
    resp = served.get("/events/nope")
    assert resp.status_code == 404
    assert resp.headers["Content-Type"].startswith("application/json")
    assert resp.json()["error"]["backends"] == ["vllm-1", "vllm-2"]


def test_unknown_paths_and_methods_are_json_errors_in_the_same_shape(served: Served) -> None:
    resp = served.get("/stats")
    assert resp.status_code == 404
    assert resp.headers["Content-Type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["type"] == "not_found" and "'/stats'" in error["message"]
    assert "/events/<backend>" in error["message"]
    result: list[requests.Response] = []
    thread = threading.Thread(target=lambda: result.append(
        requests.post(served.url + "/health", timeout=10)), daemon=True)
    thread.start()
    wait_until(lambda: not thread.is_alive(), "POST /health")
    assert result[0].status_code == 405
    assert result[0].json()["error"]["type"] == "method_not_allowed"


def test_keepalive_comments_on_idle_streams(served: Served) -> None:
    chunks: list[bytes] = []
    done = threading.Event()

    def run() -> None:
        with requests.get(served.url + "/events/vllm-2", stream=True, timeout=10,
                          headers={"Last-Event-ID": "abc-0"}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["Cache-Control"] == "no-cache"
            for chunk in resp.iter_content(chunk_size=None):
                chunks.append(chunk)
                if b"keepalive" in b"".join(chunks):
                    break
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(done.is_set, "a keepalive comment")
    thread.join(5)
    assert b"".join(chunks).startswith(b": open\n\n")
    assert b": keepalive\n\n" in b"".join(chunks)


def test_slow_subscriber_gets_buffer_overflow_then_resumes(served: Served) -> None:
    reader = served.read(last_event_id="abc-0")
    wait_until(lambda: served.hub.subscribers("vllm-1") == 1, "the subscription")
    for n in range(1, 21):  # no yield in between: the subscriber cannot keep up
        served.hub.publish("vllm-1", created(n))
    records = reader.ended()
    assert [r[0] for r in records] == [f"abc-{n}" for n in range(1, 6)] + [None]
    assert records[-1][1] == "buffer_overflow"
    assert served.hub.counters("vllm-1").overflows == 1
    again = served.read(last_event_id="abc-5")
    assert [r[0] for r in again.take(15)] == [f"abc-{n}" for n in range(6, 21)]


def test_draining_ends_every_stream(served: Served) -> None:
    one = served.read()
    two = served.read("vllm-2", last_event_id="abc-0")
    wait_until(lambda: served.hub.subscribers("vllm-1") == served.hub.subscribers(
        "vllm-2") == 1, "both subscriptions")
    served.hub.publish("vllm-2", created(1))
    served.hub.close()
    assert [r[1] for r in one.ended()] == [CACHE_CLEARED, "draining"]
    assert [(r[0], r[1]) for r in two.ended()] == [("abc-1", CACHE_CREATED),
                                                   (None, "draining")]


def test_health_and_metrics(served: Served) -> None:
    served.hub.publish("vllm-1", created(1))
    served.hub.publish("vllm-1", PrefixEvent(CACHE_CLEARED))
    served.sources[0].stats.sequence_gaps = 2
    served.sources[0].stats.rejected_publishers = 1
    health = served.get("/health")
    assert health.status_code == 200
    doc = health.json()
    assert doc["status"] == "degraded" and doc["epoch"] == "abc"
    assert doc["sources"]["vllm-1"]["latest_event_id"] == "abc-2"
    assert doc["sources"]["vllm-1"]["state"] == "idle"
    text = served.get("/metrics").text
    for line in (
        'continuum_kv_listener_events_out_total{backend="vllm-1",event="cache_created"} 1.0',
        'continuum_kv_listener_events_out_total{backend="vllm-1",event="cache_cleared"} 1.0',
        'continuum_kv_listener_sequence_gaps_total{backend="vllm-1"} 2.0',
        'continuum_kv_listener_rejected_publishers_total{backend="vllm-1"} 1.0',
        'continuum_kv_listener_decode_errors_total{backend="vllm-2"} 0.0',
        'continuum_kv_listener_replays_total{backend="vllm-1"} 0.0',
        'continuum_kv_listener_batches_in_total{backend="vllm-1"} 0.0',
        'continuum_kv_listener_subscribers{backend="vllm-1"} 0.0',
        'continuum_kv_listener_processor_tracked_blocks{backend="vllm-1"} 7.0',
        'continuum_kv_listener_processor_mismatched_blocks_total{backend="vllm-2"} 2.0',
        'continuum_kv_listener_processor_detokenize_calls_total{backend="vllm-1"} 3.0',
        'continuum_kv_listener_source_connected{backend="vllm-1"} 0.0',
    ):
        assert line in text, line
    assert "# TYPE continuum_kv_listener_processor_tracked_blocks gauge" in text


def test_events_need_the_bearer_token_and_the_router_sends_it(
        served_with: Callable[..., Served]) -> None:
    served = served_with(token="s3cret-token")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"},
                    {"Authorization": "Bearer s3cret-token2"}):
        for path in ("/events/vllm-1", "/events/nope"):  # 401 first: names stay hidden
            resp = served.get(path, headers)
            assert resp.status_code == 401, (path, headers)
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            assert resp.json()["error"]["type"] == "authentication_error"
    assert served.get("/health").status_code == 200  # counts only: stays open
    served.hub.publish("vllm-1", created(1))

    def consumer(token: str | None) -> KvEventConsumerManager:
        source = KvEventSourceConfig(backend_name="vllm-1", reconnect_interval_ms=20,
                                     endpoint=served.url + "/events/vllm-1")
        return KvEventConsumerManager([source], InMemoryKvIndex(), connect_timeout=2.0,
                                      tokens={"vllm-1": token})

    refused, accepted = consumer("wrong"), consumer("s3cret-token")
    try:
        refused.start()
        accepted.start()
        wait_until(lambda: len(accepted.consumers[0].index) == 1, "the snapshot's prefix")
        served.hub.publish("vllm-1", created(2))
        wait_until(lambda: len(accepted.consumers[0].index) == 2, "a live event")
        wait_until(lambda: refused.consumers[0].reconnect_count >= 2, "refused reconnects")
        assert refused.consumers[0].events_received == 0
        assert not refused.consumers[0].connected and accepted.consumers[0].connected
    finally:
        refused.stop(timeout=10)
        accepted.stop(timeout=10)
    text = served.get("/metrics").text
    unauthorized = [line for line in text.splitlines()
                    if line.startswith("continuum_kv_listener_unauthorized_requests_total ")]
    assert len(unauthorized) == 1 and float(unauthorized[0].split()[1]) >= 8 + 2


def test_subscriber_cap_answers_503(served_with: Callable[..., Served]) -> None:
    served = served_with(token="t0k", max_subscribers=2)
    one, two = served.read(), served.read()
    wait_until(lambda: served.hub.subscribers("vllm-1") == 2, "two subscriptions")
    over = served.get("/events/vllm-1", {"Authorization": "Bearer t0k"})
    assert over.status_code == 503
    assert over.json()["error"] == {
        "message": "too many subscribers for backend 'vllm-1' (max_subscribers: 2)",
        "type": "service_unavailable"}
    assert over.headers["Retry-After"] == "5"
    other = served.read("vllm-2")  # the cap is per backend
    other.take(1)
    one.close()
    wait_until(lambda: served.hub.subscribers("vllm-1") == 1, "a freed place")
    three = served.read()
    assert three.take(1)[0][1] == CACHE_CLEARED
    assert served.hub.subscribers("vllm-1") == 2 and two.error is None
    assert 'continuum_kv_listener_subscriptions_refused_total{backend="vllm-1"} 1.0' in \
        served.get("/metrics").text


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:7817") == ("127.0.0.1", 7817)
    assert parse_listen("[::1]:7817") == ("::1", 7817)
    with pytest.raises(ValueError):
        parse_listen("7817")


# -- the continuum-kv-listener process -------------------------------------------------------


def test_importing_the_cli_imports_nothing_network_related() -> None:
    code = (
        "import sys, listener.cli\n"
        "bad = {'gevent', 'zmq', 'falcon', 'requests', 'socket', 'ssl'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_check_and_print_defaults(tmp_path: Path) -> None:
    example = ROOT / "conf" / "config.kv-listener.yaml.example"
    ok = subprocess.run([*LISTENER, "--config", str(example), "--check"], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().endswith("ok (0 warning(s))")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"listen": "0.0.0.0:7817", "sources": [{
        "backend_name": "a", "engine": "vllm", "model": "m",
        "zmq_endpoint": "tcp://10.0.0.9:5557", "zmq_mode": "connect",
        "detokenize_endpoint": "http://10.0.0.9:8000/detokenize",
        "allowed_publishers": ["127.0.0.1"]}]}))
    result = subprocess.run([*LISTENER, "--config", str(bad), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert f"error: {bad}: sources[0].zmq_endpoint: host 10.0.0.9 is not in " \
           "allowed_publishers" in result.stdout
    assert f"warning: {bad}: listen: binds every interface" in result.stdout
    run = subprocess.run([*LISTENER, "--config", str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1 and "sources[0].zmq_endpoint" in run.stderr
    with socket.socket() as busy:  # a port in use: a clear error, exit 1
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = tmp_path / "taken.yaml"
        taken.write_text(yaml.safe_dump({"listen": f"127.0.0.1:{busy.getsockname()[1]}"}))
        failed = subprocess.run([*LISTENER, "--config", str(taken)], capture_output=True,
                                text=True, timeout=60)
    assert failed.returncode == 1 and "error: cannot start:" in failed.stderr
    defaults = subprocess.run([*LISTENER, "--print-defaults"], capture_output=True, text=True,
                              timeout=60, check=True).stdout
    for key in ("listen:", "history_size: 10000", "subscriber_queue: 10000",
                "max_retained_tokens: 16777216", "allowed_publishers: []",
                'zmq_mode: "bind"', "trtllm_poll_interval_ms: 100"):
        assert key in defaults, key


class ListenerProcess:
    """``continuum-kv-listener --config FILE`` as a child process, stopped by its PID."""

    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "listener") -> None:
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.url = "http://" + config["listen"]
        self.proc = Child([*LISTENER, "--config", str(self.config_path)],
                          log=tmp / f"{name}-{time.monotonic_ns()}.log")
        try:
            wait_http(self.url + "/health", children=[self.proc])
        except BaseException:
            self.proc.stop(signal.SIGKILL)
            raise

    def health(self) -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(self.url + "/health", timeout=5).json()
        return doc


def listener_config(port: int, zmq_port: int, sim_port: int,
                    replay_port: int | None = None) -> dict[str, Any]:
    source: dict[str, Any] = {
        "backend_name": "vllm-1", "engine": "vllm", "model": "sim-model",
        "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}", "zmq_mode": "bind",
        "detokenize_endpoint": f"http://127.0.0.1:{sim_port}/detokenize",
        "allowed_publishers": ["127.0.0.1"],
    }
    if replay_port is not None:
        source["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return {"listen": f"127.0.0.1:{port}", "log_level": "debug", "sources": [source]}


def test_sighup_is_ignored_and_sigterm_sends_draining_and_exits_zero(tmp_path: Path) -> None:
    listener = ListenerProcess(tmp_path, listener_config(free_port(), free_port(), free_port()))
    reader = Reader(listener.url + "/events/vllm-1")
    try:
        records = reader.take(1)  # an empty snapshot: cache_cleared
        assert records[0][1] == CACHE_CLEARED and records[0][0] is not None
        wait_until(lambda: listener.health()["sources"]["vllm-1"]["subscribers"] == 1,
                   "the subscription")
        # A HUP (its default action would end the process) is logged and ignored.
        listener.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP ignored" in listener.proc.log_text(), "the HUP logged")
        assert listener.proc.running()
        assert listener.health()["sources"]["vllm-1"]["subscribers"] == 1
        listener.proc.send_signal(signal.SIGTERM)
        assert [r[1] for r in reader.ended()] == ["draining"]
        listener.proc.wait(30)
        assert listener.proc.returncode == 0, listener.proc.log_text()
        log = listener.proc.log_text()
        assert "draining 1 subscriber(s) of vllm-1" in log
    finally:
        reader.close()
        listener.proc.stop(signal.SIGKILL)


def test_listener_process_wires_token_and_subscriber_cap(tmp_path: Path) -> None:
    token_file = tmp_path / "listener.token"
    token_file.write_text("proc-s3cret\n")
    config = listener_config(free_port(), free_port(), free_port())
    config.update(events_auth={"token_file": str(token_file)}, max_subscribers=1)
    listener = ListenerProcess(tmp_path, config)
    url = listener.url + "/events/vllm-1"
    manager = KvEventConsumerManager(
        [KvEventSourceConfig(backend_name="vllm-1", endpoint=url, reconnect_interval_ms=50)],
        InMemoryKvIndex(), connect_timeout=2.0, tokens={"vllm-1": "proc-s3cret"})
    try:
        assert requests.get(url, timeout=5).status_code == 401
        manager.start()
        wait_until(lambda: listener.health()["sources"]["vllm-1"]["subscribers"] == 1,
                   "the router's subscription")
        # The listener counts the subscriber before the consumer has read the response head.
        wait_until(lambda: manager.consumers[0].connected, "the consumer to see its stream open")
        over = requests.get(url, timeout=5, headers={"Authorization": "Bearer proc-s3cret"})
        assert over.status_code == 503 and "max_subscribers: 1" in over.text
    finally:
        manager.stop(timeout=10)
        listener.proc.stop()
    assert "proc-s3cret" not in listener.proc.log_text()


def chat(sim_url: str, n: int) -> None:
    system = (f"You are assistant number {n} of the Continuum listener restart test. Your "
              "instructions are long enough to fill several KV-cache blocks of sixteen tokens.")
    resp = requests.post(sim_url + "/v1/chat/completions", timeout=10, json={
        "model": "sim-model", "max_tokens": 2,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": f"question {n}"}]})
    resp.raise_for_status()


def test_router_resumes_across_a_listener_kill_and_restart(
        tmp_path: Path, listener_snapshot: Callable[[str, str], dict[str, int]]) -> None:
    """The router's consumer ends with exactly the listener's state, before and after a
    ``kill -9`` of the listener and a restart (which rebuilds from the engine's replay)."""
    port, zmq_port, sim_port, replay_port = free_port(), free_port(), free_port(), free_port()
    config = listener_config(port, zmq_port, sim_port, replay_port)
    first = ListenerProcess(tmp_path, config, "first")
    sim = Child([sys.executable, "-m", "continuum.sim.cli", "--fast", "--port", str(sim_port),
                 "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}", "--zmq-connect",
                 "--zmq-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"],
                log=tmp_path / "sim.log")
    sim_url = f"http://127.0.0.1:{sim_port}"
    index = InMemoryKvIndex()
    manager = KvEventConsumerManager(
        [KvEventSourceConfig(backend_name="vllm-1", endpoint=first.url + "/events/vllm-1",
                             reconnect_interval_ms=50)], index, connect_timeout=2.0)
    consumer = manager.consumers[0]
    second: ListenerProcess | None = None
    try:
        wait_http(sim_url + "/health", children=[sim])
        manager.start()
        wait_until(lambda: consumer.connected, "the router's consumer")
        wait_until(lambda: first.health()["sources"]["vllm-1"]["connected"], "the engine")
        n = 0
        while first.health()["sources"]["vllm-1"]["batches"] == 0 and n < 100:
            chat(sim_url, n)  # until the engine's PUB has our subscription
            n += 1
            gevent.sleep(0.05)
        for _ in range(3):
            chat(sim_url, n)
            n += 1
        wait_until(lambda: len(listener_snapshot(first.url, "vllm-1")) >= 3,
                   "prefixes on the first listener")
        # Late events of the priming chats may still add prefixes: wait until they stop.
        first_state = SettledMatch(index, lambda: listener_snapshot(first.url, "vllm-1"))
        wait_until(first_state, first_state.describe, interval=0.1)
        before = dict(first_state.state)
        resume_id = consumer.last_event_id
        assert resume_id is not None and resume_id.startswith(first.health()["epoch"])

        first.proc.stop(signal.SIGKILL)
        for _ in range(2):  # published while no listener runs: only the replay has them
            chat(sim_url, n)
            n += 1
        second = ListenerProcess(tmp_path, config, "second")
        wait_until(lambda: second is not None and second.health()["sources"]["vllm-1"][
            "connected"], "the engine to reconnect")
        while second.health()["sources"]["vllm-1"]["batches"] == 0 and n < 200:
            chat(sim_url, n)
            n += 1
            gevent.sleep(0.05)
        assert second.health()["epoch"] != resume_id.split("-")[0]
        # The replayed chains (the first listener's and the two sent in between) are
        # attributed one /detokenize at a time: wait for all of them, not just the first.
        wait_until(lambda: second is not None and set(before) <= set(listener_snapshot(
            second.url, "vllm-1")) and len(listener_snapshot(second.url, "vllm-1"))
            >= len(before) + 2,
            "the second listener to rebuild the first one's prefixes and the two missed "
            "ones by replay")
        # The chats that waited for the engine's subscription are attributed later still:
        # compare with the second listener's state once it has stopped changing.
        assert second is not None
        second_url = second.url
        second_state = SettledMatch(index, lambda: listener_snapshot(second_url, "vllm-1"))
        wait_until(second_state, second_state.describe, interval=0.1)
        assert set(before) <= set(second_state.state)
        assert consumer.malformed == 0 and consumer.reconnect_count >= 1
        assert consumer.last_event_id is not None
        assert consumer.last_event_id.startswith(second.health()["epoch"])
        metrics = requests.get(second.url + "/metrics", timeout=5).text
        assert 'continuum_kv_listener_replays_total{backend="vllm-1"} 1.0' in metrics
        assert 'continuum_kv_listener_subscriptions_total{backend="vllm-1",start="snapshot"}' \
            in metrics
        for proc in (first.proc, second.proc):  # debug logs, and still no prompt text
            assert "question" not in proc.log_text()
            assert "assistant number" not in proc.log_text()
    finally:
        manager.stop(timeout=10)
        if second is not None:
            second.proc.stop()
        first.proc.stop(signal.SIGKILL)
        sim.stop()
