"""Push mode end to end: real TLS (a CA made in the test), the real bus process (under real
gunicorn -k gevent where the router is involved), real listener processes, 127.0.0.1 only.

Every wait has a deadline; nothing asserts on time. The cadence test records the delays the
consumer asks its clock for, it does not time them.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from continuum.config.schema import KvEventSourceConfig
from continuum.devtools.procs import free_port, wait_until
from continuum.devtools.servers import RouterProcess
from continuum.kv.bus_consumer import BusSourceConsumer, BusUnavailable, add_bus_consumers
from continuum.kv.bus_process import read_bus_file
from continuum.kv.consumer import KvEventConsumerManager
from stores.kv_memory import InMemoryKvIndex
from tests.integration.kv_helpers import SettledMatch
from tests.integration.push_helpers import (
    BusProcess,
    Engine,
    ListenerProcess,
    Pki,
    bus_client,
    listener_config,
    router_config,
    token_hash,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.e2e]

Factory = Callable[..., RouterProcess]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of ``name`` samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def sources(*names: str) -> dict[str, tuple[int, int]]:
    """Listener sources without an engine (a bound ZMQ port, an unused detokenizer)."""
    return {name: (free_port(), 9) for name in names}


def test_sessions_refusals_and_allowlist_shrink_under_gunicorn(
        tmp_path: Path, router_factory: Factory) -> None:
    """Token and mTLS sessions succeed; a wrong token, a wrong SAN, a wrong role and an
    unlisted backend are refused; both gunicorn workers' consumers read the stream over one
    session per listener; shrinking a broker's allowlist ends its session with forbidden."""
    pki = Pki(tmp_path)
    bus_port = free_port()
    (tmp_path / "good.token").write_text("good-token\n")
    (tmp_path / "wrong.token").write_text("wrong-token\n")
    (tmp_path / "broker.token").write_text("broker-token\n")
    brokers: list[dict[str, Any]] = [
        {"id": "kv-a", "role": "kv_listener", "token_hash": token_hash("good-token"),
         "backends": ["vllm-1"]},
        {"id": "kv-m", "role": "kv_listener", "backends": ["vllm-2"]},  # mTLS only
        {"id": "brk", "role": "broker", "token_hash": token_hash("broker-token"),
         "backends": ["vllm-1"]},
    ]
    config = router_config(pki, bus_port, brokers, mtls=True,
                           backends={"vllm-1": "http://127.0.0.1:9",
                                     "vllm-2": "http://127.0.0.1:9"})
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    router = router_factory(config, workers=2, env={"CONTINUUM_RUNTIME_DIR": str(runtime)})
    wait_until(lambda: read_bus_file(str(runtime)) is not None, "the bus process", 20)
    started: list[ListenerProcess] = []

    def listener(name: str, client: dict[str, Any], *backends: str) -> ListenerProcess:
        proc = ListenerProcess(tmp_path, listener_config(free_port(), sources(*backends),
                                                         client), name)
        started.append(proc)
        return proc

    try:
        by_token = listener("token", bus_client(pki, bus_port, "kv-a",
                                                token_file=tmp_path / "good.token"), "vllm-1")
        by_cert = listener("mtls", bus_client(pki, bus_port, "kv-m", cert=pki.issue(
            "kv-m", ["kv-m"], client=True)), "vllm-2")
        wait_until(by_token.bus_connected, "the token session", 20)
        wait_until(by_cert.bus_connected, "the mTLS session", 20)
        refused = [
            listener("wrong-token", bus_client(pki, bus_port, "kv-a",
                                               token_file=tmp_path / "wrong.token"), "vllm-1"),
            listener("wrong-san", bus_client(pki, bus_port, "kv-m", cert=pki.issue(
                "other", ["other"], client=True)), "vllm-2"),
            listener("wrong-role", bus_client(pki, bus_port, "brk",
                                              token_file=tmp_path / "broker.token"), "vllm-1"),
            listener("unlisted", bus_client(pki, bus_port, "kv-a",
                                            token_file=tmp_path / "good.token"),
                     "vllm-1", "vllm-9"),
        ]
        for proc in refused:
            wait_until(lambda p=proc: metric(p.metrics(), "continuum_kv_listener_bus_sessions"
                                             "_total", outcome="refused") >= 1,
                       f"{proc.config_path.name} to be refused", 20)
            assert not proc.bus_connected()

        def router_metrics() -> str:
            return requests.get(router.url + "/metrics", timeout=5).text

        def consumers_connected() -> bool:
            text = router_metrics()
            # livemin over the workers: 1 only when every worker's consumer is streaming
            return all(metric(text, "continuum_kv_consumer_connected", backend=b) == 1
                       for b in ("vllm-1", "vllm-2"))

        wait_until(consumers_connected, "both workers' consumers of both sources", 30)
        text = router_metrics()
        refusals = {reason: metric(text, "continuum_event_bus_sessions_refused_total",
                                   reason=reason)
                    for reason in ("unauthenticated", "wrong_role", "unlisted_backend")}
        assert refusals["unauthenticated"] >= 2  # wrong token, wrong SAN (each retries)
        assert refusals["wrong_role"] >= 1 and refusals["unlisted_backend"] >= 1
        assert metric(text, "continuum_event_bus_sessions", role="kv_listener") == 2
        # every stream starts with the listener's snapshot: bytes were relayed to each
        for backend in ("vllm-1", "vllm-2"):
            assert metric(text, "continuum_event_bus_relayed_bytes_total",
                          backend=backend) > 0
        # two workers, one session each for two listeners: two streams per backend
        assert metric(text, "continuum_event_bus_subscribes_total", backend="vllm-1",
                      outcome="opened") >= 2
        assert metric(by_token.metrics(), "continuum_kv_listener_bus_sessions_total",
                      outcome="welcomed") == 1
        for proc in refused:
            assert "good-token" not in proc.proc.log_text()
            assert "wrong-token" not in proc.proc.log_text()

        # Hot reload: kv-a may no longer announce vllm-1 -> its session ends with forbidden.
        doc = yaml.safe_load(router.config_path.read_text())
        doc["dynamo"]["event_bus"]["brokers"][0]["backends"] = []
        tmp = router.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc))
        tmp.replace(router.config_path)
        wait_until(lambda: metric(by_token.metrics(), "continuum_kv_listener_bus_sessions"
                                  "_total", outcome="forbidden") == 1,
                   "the listener to get forbidden", 20)
        assert not by_token.bus_connected()
        text = router_metrics()
        assert metric(text, "continuum_event_bus_sessions_forbidden_total") == 1
        assert by_cert.bus_connected()  # the other session stays
        assert metric(text, "continuum_kv_consumer_connected", backend="vllm-2") == 1
    finally:
        for proc in started:
            proc.proc.stop()


def _manager(runtime: Path, backend: str = "vllm-1", interval_ms: int = 50,
             clock: Any = None) -> tuple[KvEventConsumerManager, BusSourceConsumer,
                                         InMemoryKvIndex]:
    index = InMemoryKvIndex()
    src = [KvEventSourceConfig(backend_name=backend, transport="event_bus",
                               reconnect_interval_ms=interval_ms)]
    manager = KvEventConsumerManager(src, index, clock=clock, connect_timeout=5.0)
    (consumer,) = add_bus_consumers(manager, src, index, runtime_dir=str(runtime))
    return manager, consumer, index


def test_two_listeners_fail_over_on_draining(tmp_path: Path) -> None:
    """SIGTERM on the serving listener: it sends draining, the consumer resubscribes at once
    and the bus hands it the other listener's session announcing the same backend."""
    pki = Pki(tmp_path)
    bus_port = free_port()
    (tmp_path / "a.token").write_text("token-a")
    (tmp_path / "b.token").write_text("token-b")
    brokers = [{"id": f"kv-{x}", "role": "kv_listener", "token_hash": token_hash(f"token-{x}"),
                "backends": ["vllm-1"]} for x in "ab"]
    bus = BusProcess(tmp_path, router_config(pki, bus_port, brokers))
    first = ListenerProcess(tmp_path, listener_config(free_port(), sources("vllm-1"), bus_client(
        pki, bus_port, "kv-a", token_file=tmp_path / "a.token")), "first")
    second: ListenerProcess | None = None
    manager, consumer, _ = _manager(bus.runtime, interval_ms=60_000)
    try:
        wait_until(first.bus_connected, "the first session", 20)
        second = ListenerProcess(tmp_path, listener_config(
            free_port(), sources("vllm-1"), bus_client(pki, bus_port, "kv-b",
                                                       token_file=tmp_path / "b.token")),
            "second")
        wait_until(second.bus_connected, "the second session", 20)
        assert bus.health()["announced"] == {"vllm-1": 2}
        manager.start()
        first_epoch = first.health()["epoch"]
        wait_until(lambda: (consumer.last_event_id or "").startswith(first_epoch),
                   "the consumer to read the oldest session (the first listener)", 20)
        first.proc.send_signal(signal.SIGTERM)
        second_epoch = second.health()["epoch"]
        # reconnect_interval_ms is a minute: only the immediate retry after draining fits
        wait_until(lambda: (consumer.last_event_id or "").startswith(second_epoch),
                   "the consumer to move to the second listener", 20)
        assert consumer.connected and consumer.reconnect_count == 1
        assert first.proc.wait(20) == 0
        assert "draining" in bus.proc.log_text()
        assert bus.health()["announced"] == {"vllm-1": 1}
    finally:
        manager.stop(timeout=10)
        for proc in (first, second):
            if proc is not None:
                proc.proc.stop()
        bus.stop()


class RecordingClock:
    """Real time, but every requested delay is recorded (and cut short to 10 ms)."""

    def __init__(self) -> None:
        import time

        self.time = time
        self.delays: list[float] = []
        self.lock = threading.Lock()

    def now(self) -> float:
        return self.time.time()

    def wait(self, seconds: float, wake: threading.Event) -> None:
        with self.lock:
            self.delays.append(seconds)
        wake.wait(min(seconds, 0.01))


def test_no_session_retries_at_the_plain_interval(tmp_path: Path) -> None:
    """While no session announces the source the consumer retries every
    reconnect_interval_ms without growing; a failing bus address doubles as in pull mode."""
    pki = Pki(tmp_path)
    bus = BusProcess(tmp_path, router_config(pki, free_port(), [
        {"id": "kv-a", "role": "kv_listener", "token_hash": token_hash("t"),
         "backends": ["vllm-1"]}]))
    clock = RecordingClock()
    manager, consumer, _ = _manager(bus.runtime, interval_ms=500, clock=clock)
    try:
        manager.start()
        wait_until(lambda: len(clock.delays) >= 6, "six no_session retries", 20)
        no_session = list(clock.delays[:6])
        assert no_session == [0.5] * 6 and consumer.no_session >= 6
        assert not consumer.connected
    finally:
        manager.stop(timeout=10)
        bus.stop()
    # the same consumer rule against an address that refuses connections: it grows
    dead = tmp_path / "dead"
    dead.mkdir()
    (dead / "bus-local.json").write_text(json.dumps(
        {"url": f"http://127.0.0.1:{free_port()}", "token": "x"}))
    clock = RecordingClock()
    manager, consumer, _ = _manager(dead, interval_ms=500, clock=clock)
    try:
        manager.start()
        wait_until(lambda: len(clock.delays) >= 4, "four failed connects", 20)
        assert clock.delays[:4] == [0.5, 1.0, 2.0, 4.0]
    finally:
        manager.stop(timeout=10)


def test_listener_killed_under_traffic_converges_without_failed_requests(
        tmp_path: Path, router_factory: Factory,
        listener_snapshot: Callable[[str, str], dict[str, int]]) -> None:
    """kill -9 of the listener while clients send requests through the gunicorn router: no
    request fails; after a restart the index holds exactly the new listener's state (an
    extra consumer of the router's own bus checks it prefix by prefix, the workers' index
    by count)."""
    pki = Pki(tmp_path)
    bus_port, zmq_port, replay_port, listen_port = (free_port() for _ in range(4))
    (tmp_path / "token").write_text("kill-token")
    engine = Engine(tmp_path, zmq_port, replay_port=replay_port)
    config = router_config(pki, bus_port, [
        {"id": "kv-a", "role": "kv_listener", "token_hash": token_hash("kill-token"),
         "backends": ["vllm-1"]}], backends={"vllm-1": engine.url})
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    router = router_factory(config, workers=2, env={"CONTINUUM_RUNTIME_DIR": str(runtime)})
    wait_until(lambda: read_bus_file(str(runtime)) is not None, "the bus process", 20)
    lconf = listener_config(listen_port, {"vllm-1": (zmq_port, engine.port)}, bus_client(
        pki, bus_port, "kv-a", token_file=tmp_path / "token"), replay=replay_port)
    first = ListenerProcess(tmp_path, lconf, "first")
    second: ListenerProcess | None = None
    manager, consumer, index = _manager(runtime)
    failures: list[str] = []
    sent = [0]
    stop = threading.Event()

    def traffic() -> None:
        http = requests.Session()
        while not stop.is_set() and sent[0] < 2000:  # bounded in count and by the test
            n = sent[0]
            sent[0] += 1
            try:
                resp = http.post(router.url + "/v1/chat/completions", timeout=30, json={
                    "model": "sim-model", "max_tokens": 2, "messages": [
                        {"role": "system", "content": f"Kill test system prompt {n}, "
                         "long enough to fill a couple of sixteen-token KV blocks for sure."},
                        {"role": "user", "content": f"question {n}"}]})
                if resp.status_code != 200:
                    failures.append(f"{n}: {resp.status_code} {resp.text[:200]}")
            except requests.RequestException as exc:
                failures.append(f"{n}: {exc!r}")
            stop.wait(0.02)

    client = threading.Thread(target=traffic, daemon=True)
    try:
        wait_until(first.bus_connected, "the first session", 20)
        manager.start()
        wait_until(lambda: consumer.connected, "the test's consumer of the bus", 20)
        client.start()
        wait_until(lambda: len(listener_snapshot(first.url, "vllm-1")) >= 3,
                   "prefixes on the first listener", 30)
        first_state = SettledMatch(index, lambda: listener_snapshot(first.url, "vllm-1"),
                                   settle=1)  # under traffic the state never stops changing
        wait_until(first_state, first_state.describe, 30)
        resume_id = consumer.last_event_id
        first.proc.stop(signal.SIGKILL)
        mark = sent[0]
        wait_until(lambda: sent[0] >= mark + 10, "requests while no listener runs", 30)
        second = ListenerProcess(tmp_path, lconf, "second")
        wait_until(second.bus_connected, "the second session", 20)
        wait_until(lambda: sent[0] >= mark + 30, "requests after the restart", 30)
        stop.set()
        client.join(30)
        # the replayed chains are attributed one /detokenize at a time: wait until the
        # listener's state has stopped changing, then compare
        second_url = second.url
        settled = SettledMatch(index, lambda: listener_snapshot(second_url, "vllm-1"))
        wait_until(settled, settled.describe, 60, interval=0.3)
        after = settled.state
        assert after, "the second listener rebuilt nothing"
        assert resume_id is not None and consumer.last_event_id is not None
        assert consumer.last_event_id.split("-")[0] == second.health()["epoch"] != \
            resume_id.split("-")[0]
        assert consumer.malformed == 0
        assert failures == [], failures[:5]

        counts: list[Any] = []

        def workers_agree() -> bool:  # each answer comes from one of the two workers
            docs = [requests.get(router.url + "/admin/kv-index/stats", timeout=5).json()
                    for _ in range(6)]
            counts[:] = [(d["index"]["entry_count"], d["event_sources"]) for d in docs]
            return all(d["index"]["entry_count"] == len(after) for d in docs)

        wait_until(workers_agree, lambda: f"every worker's index to hold {len(after)} "
                   f"entries: {counts}", 30)
    finally:
        stop.set()
        manager.stop(timeout=10)
        for proc in (first, second):
            if proc is not None:
                proc.proc.stop()
        engine.proc.stop()


def test_kv_index_hot_reload_restarts_bus_sources_with_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kv_cache_index.event_sources reload restarts every consumer, the bus source
    included, and the bus source resumes from its last id (the listener counts a history
    resume, not a second snapshot)."""
    from continuum.config import check_config
    from continuum.metrics import RouterMetrics
    from continuum.registry import PluginRegistry
    from continuum.service import RouterService

    pki = Pki(tmp_path)
    bus_port = free_port()
    (tmp_path / "token").write_text("reload-token")
    brokers = [{"id": "kv-a", "role": "kv_listener", "token_hash": token_hash("reload-token"),
                "backends": ["vllm-1"]}]
    doc = router_config(pki, bus_port, brokers)
    bus = BusProcess(tmp_path, doc)
    monkeypatch.setenv("CONTINUUM_RUNTIME_DIR", str(bus.runtime))
    lst = ListenerProcess(tmp_path, listener_config(free_port(), sources("vllm-1"), bus_client(
        pki, bus_port, "kv-a", token_file=tmp_path / "token")))
    registry = PluginRegistry()
    result = check_config(doc, registry=registry)
    assert result.config is not None, result.errors
    service = RouterService(result.config, registry=registry, metrics=RouterMetrics())
    try:
        wait_until(lst.bus_connected, "the session", 20)
        service.start()
        assert service.kv_consumers is not None
        (before,) = service.kv_consumers.consumers
        assert isinstance(before, BusSourceConsumer)
        wait_until(lambda: before.last_event_id is not None, "the first snapshot", 20)
        doc["kv_cache_index"]["event_sources"][0]["reconnect_interval_ms"] = 250
        doc["kv_cache_index"]["event_sources"].append(
            {"backend_name": "vllm-2", "endpoint": lst.url + "/events/vllm-2"})
        reloaded = check_config(doc, registry=registry)
        assert reloaded.config is not None, reloaded.errors
        report = service.reload(reloaded.config)
        assert "kv_cache_index.event_sources" in report.applied
        assert not [p for p in report.restart_required if "event_sources" in p]
        kinds = {c.backend: type(c).__name__ for c in service.kv_consumers.consumers}
        assert kinds == {"vllm-1": "BusSourceConsumer", "vllm-2": "SourceConsumer"}
        restarted = service.kv_consumers.consumer("vllm-1")
        assert restarted is not before and before.state == "stopped"
        assert restarted.backoff.base_ms == 250
        wait_until(lambda: restarted.connected, "the restarted bus source", 20)
        wait_until(lambda: metric(lst.metrics(), "continuum_kv_listener_subscriptions_total",
                                  backend="vllm-1", start="history") == 1,
                   "the listener to count a history resume", 20)
        assert metric(lst.metrics(), "continuum_kv_listener_subscriptions_total",
                      backend="vllm-1", start="snapshot") == 1
    finally:
        service.stop()
        lst.proc.stop()
        bus.stop()


def test_many_streams_open_at_once_on_one_connection(tmp_path: Path) -> None:
    """Eight consumers subscribe together: the listener opens every stream on its one
    connection (stream ids allocated and opened in order) and none is reset."""
    pki = Pki(tmp_path)
    bus_port = free_port()
    names = [f"engine-{i}" for i in range(4)]
    (tmp_path / "token").write_text("many-token")
    bus = BusProcess(tmp_path, router_config(pki, bus_port, [
        {"id": "kv-a", "role": "kv_listener", "token_hash": token_hash("many-token"),
         "backends": names}], backends={n: "http://127.0.0.1:9" for n in names}))
    lst = ListenerProcess(tmp_path, listener_config(free_port(), sources(*names), bus_client(
        pki, bus_port, "kv-a", token_file=tmp_path / "token")))
    index = InMemoryKvIndex()
    src = [KvEventSourceConfig(backend_name=n, transport="event_bus",
                               reconnect_interval_ms=50) for n in names]
    managers = []
    for _ in range(2):  # two "workers"
        manager = KvEventConsumerManager(src, index, connect_timeout=5.0)
        add_bus_consumers(manager, src, index, runtime_dir=str(bus.runtime))
        managers.append(manager)
    try:
        wait_until(lst.bus_connected, "the session", 20)
        for manager in managers:
            manager.start()
        consumers = [c for m in managers for c in m.consumers]
        wait_until(lambda: all(c.connected and c.last_event_id for c in consumers),
                   "all eight streams", 20)
        assert metric(lst.metrics(), "continuum_kv_listener_bus_streams_total") == 8
        assert metric(lst.metrics(), "continuum_kv_listener_bus_sessions_total",
                      outcome="welcomed") == 1
        assert all(c.reconnect_count == 0 for c in consumers)
        assert "PROTOCOL_ERROR" not in lst.proc.log_text()
    finally:
        for manager in managers:
            manager.stop(timeout=10)
        lst.proc.stop()
        bus.stop()


def test_a_fresh_bus_consumer_still_reads_the_bus(tmp_path: Path) -> None:
    """``fresh()`` (what a KV lease's supervisor makes after a stop) keeps the consumer's
    class: the new one looks for the host's bus, not for a listener endpoint it has none of."""
    _, consumer, index = _manager(tmp_path / "no-bus-here")
    again = consumer.fresh()
    assert type(again) is BusSourceConsumer
    assert (again.backend, again.index, again.runtime_dir) == ("vllm-1", index,
                                                               consumer.runtime_dir)
    assert again.leased is False  # every worker reads its host's bus
    with pytest.raises(BusUnavailable):
        again._open()
    assert again.no_session == 1
