"""Tier 4 end to end: simulated engines → ``continuum-kv-listener`` → router, all real.

Each engine flavour is exercised the way it is deployed: vLLM (array and map wire formats)
and SGLang publish ZMQ KV events that the listener attributes to prompts through the
engines' ``/detokenize``; TensorRT-LLM's ``/kv_cache_events`` is polled and its blocks are
attributed through router-issued cache salts. System prompts are warmed up straight on one
engine, so the test knows who holds what; the router (RoundRobin, so KV-aware routing is
visible) must learn it from the streams, route there, and forget it once the engine
evicts. The second test kills the listener under traffic and restarts it, and cuts one
stream while the listener keeps running. Every wait is a deadline-bounded poll.

The pipeline is real processes on 127.0.0.1: ``continuum-sim --fleet N`` engines publish KV
events (ZMQ in vLLM's or SGLang's wire format, or ``/kv_cache_events`` polled for
TensorRT-LLM), one ``continuum-kv-listener`` turns them into ``/events/<backend>`` streams,
and the router (under gunicorn, started by the ``router_factory`` fixture) consumes them.
:class:`Pipeline` ties them together and answers the questions the tests ask: who does the
router's index say holds a system prompt, what does the listener say, what does the engine
really hold. Every process is stopped by its PID; every socket, session and stream opened
here is closed.
"""

from __future__ import annotations

import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from continuum.cache_salt import make_salt
from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import Child, free_port_block, wait_http, wait_until
from continuum.prefix import request_prefix_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "sim-model"
BLOCK = 16
SECRET = "pipeline-e2e-shared-secret"


@dataclass(frozen=True)
class Mode:
    """One engine flavour: the sim's ``--engine`` and ZMQ ``--kv-format`` (None: trtllm)."""

    name: str
    engine: str
    kv_format: str | None

    @property
    def salted(self) -> bool:
        """TensorRT-LLM has no /detokenize: its blocks are attributed by router salts."""
        return self.engine == "trtllm"


MODES = {mode.name: mode for mode in (
    Mode("vllm-array", "vllm", "vllm-0.22"),
    Mode("vllm-map", "vllm", "vllm-0.33"),
    Mode("sglang", "sglang", "sglang-0.5.22"),
    Mode("sglang-0.5.9", "sglang", "sglang-0.5.9"),
    Mode("trtllm", "trtllm", None),
)}


# -- prompts ---------------------------------------------------------------------------------


def system_prompt(tag: str) -> str:
    """A system prompt of several 16-token blocks (well under the 1024-byte prefix cut)."""
    return (f"You are the {tag} assistant of the Continuum pipeline test. Answer questions "
            "about caches, tokens, engines and routers in one short paragraph, name the "
            "block that holds the answer, keep every number exact, and never repeat the "
            f"question back to the user. Sign every answer as the {tag} assistant.")


def question(tag: str) -> str:
    """A user turn long enough that the system prompt ends inside the full blocks."""
    return (f"Question {tag}: please explain how the prefix cache keeps the blocks of this "
            "conversation warm between two requests that share the system prompt.")


def chat_body(system: str, user: str, max_tokens: int = 1) -> dict[str, Any]:
    """A chat request; one output token, so no output block enters the cache."""
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


def prefix_hex(system: str) -> str:
    """The router's prefix key of requests with this system prompt."""
    key = request_prefix_key(chat_body(system, "x"), MODEL)
    assert key is not None
    return key.hex()


def cached_tokens(doc: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion."""
    return int((doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def event_number(event_id: str | None) -> int:
    """``n`` of a listener event id ``<epoch>-<n>``."""
    assert event_id is not None, "no event id"
    return int(event_id.rsplit("-", 1)[1])


# -- processes -------------------------------------------------------------------------------


class Fleet:
    """``continuum-sim --fleet N``: engines ``e0``… on consecutive ports, one process."""

    def __init__(self, tmp: Path, mode: Mode, count: int, num_blocks: int,
                 ports: int, zmq_base: int | None, replay_base: int | None) -> None:
        self.mode = mode
        self.names = [f"e{i}" for i in range(count)]
        self.urls = [f"http://127.0.0.1:{ports + i}" for i in range(count)]
        argv = [sys.executable, "-m", "continuum.sim.cli", "--fast", "--engine", mode.engine,
                "--fleet", str(count), "--port", str(ports), "--num-blocks", str(num_blocks)]
        if mode.kv_format is not None:
            assert zmq_base is not None
            argv += ["--kv-format", mode.kv_format, "--zmq-connect",
                     "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_base}"]
            if replay_base is not None:
                argv += ["--zmq-replay-endpoint", f"tcp://127.0.0.1:{replay_base}"]
        self.proc = Child(argv, tmp / f"fleet-{mode.name}.log")

    def wait(self) -> None:
        """Until every engine answers /health."""
        for url in self.urls:
            wait_http(url + "/health", children=[self.proc])

    def stop(self) -> None:
        """SIGTERM (clean exit), SIGKILL after a timeout."""
        self.proc.stop()


class Listener:
    """``continuum-kv-listener --config FILE``; restartable on the same port."""

    def __init__(self, tmp: Path, config: dict[str, Any],
                 snapshot_of: Callable[[str, str], dict[str, int]]) -> None:
        self.tmp = tmp
        self.config = config
        self.snapshot_of = snapshot_of
        self.url = "http://" + config["listen"]
        self.config_path = tmp / "listener.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.runs = 0
        self.proc: Child | None = None

    def start(self) -> None:
        """Start a new run of the listener (same config, same port)."""
        self.runs += 1
        self.proc = Child([sys.executable, "-m", "listener.cli", "--config",
                           str(self.config_path)], self.tmp / f"listener-{self.runs}.log")

    def wait(self) -> None:
        """Until the listener answers /health."""
        assert self.proc is not None
        wait_http(self.url + "/health", children=[self.proc])

    def kill(self) -> None:
        """``kill -9``: no draining, no goodbye to subscribers."""
        assert self.proc is not None
        self.proc.stop(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM (drains subscribers), SIGKILL after a timeout."""
        if self.proc is not None:
            self.proc.stop()

    def health(self) -> dict[str, Any]:
        """``GET /health``."""
        doc: dict[str, Any] = requests.get(self.url + "/health", timeout=5).json()
        return doc

    def metric(self, name: str, **labels: str) -> float:
        """One sample (summed) of ``GET /metrics``."""
        text = requests.get(self.url + "/metrics", timeout=5).text
        return metric_sum(text, "continuum_kv_listener_" + name, **labels)

    def subscriptions(self, backend: str, start: str) -> int:
        """Subscriptions of ``backend`` that started from ``history`` (a resume) or with a
        ``snapshot`` (cache_cleared first)."""
        return int(self.metric("subscriptions_total", backend=backend, start=start))

    def snapshot(self, backend: str) -> dict[str, int]:
        """prefix → token_count the backend holds, from a fresh subscription's snapshot."""
        return self.snapshot_of(self.url, backend)


# -- the pipeline ----------------------------------------------------------------------------


class Pipeline:
    """Engines, listener and router of one mode, plus the views the tests compare.

    Args:
        tmp: Where configs and logs go.
        mode: The engine flavour.
        engines: Fleet size.
        num_blocks: GPU KV capacity of each engine, in 16-token blocks.
        snapshot_of: The ``listener_snapshot`` fixture.
        replay: Give ZMQ engines a replay endpoint (a restarted listener asks it).
    """

    def __init__(self, tmp: Path, mode: Mode, snapshot_of: Callable[[str, str], dict[str, int]],
                 *, engines: int = 3, num_blocks: int = 4096, replay: bool = False) -> None:
        self.mode = mode
        tmp.mkdir(parents=True, exist_ok=True)
        base = free_port_block(3 * engines + 1)
        zmq_base = base + engines if mode.kv_format else None
        replay_base = base + 2 * engines if mode.kv_format and replay else None
        self.fleet = Fleet(tmp, mode, engines, num_blocks, base, zmq_base, replay_base)
        self.names = self.fleet.names
        self.urls = dict(zip(self.names, self.fleet.urls, strict=True))
        sources = []
        for i, (name, url) in enumerate(self.urls.items()):
            source: dict[str, Any] = {"backend_name": name, "engine": mode.engine,
                                      "model": MODEL, "allowed_publishers": ["127.0.0.1"]}
            if mode.salted:
                source.update(trtllm_endpoint=url + "/kv_cache_events",
                              trtllm_poll_interval_ms=20)
            else:
                assert zmq_base is not None
                source.update(zmq_endpoint=f"tcp://127.0.0.1:{zmq_base + i}", zmq_mode="bind",
                              detokenize_endpoint=url + "/detokenize")
                if replay_base is not None:
                    source["replay_endpoint"] = f"tcp://127.0.0.1:{replay_base + i}"
            sources.append(source)
        config: dict[str, Any] = {"listen": f"127.0.0.1:{base + 3 * engines}",
                                  "log_level": "info", "sources": sources}
        if mode.salted:
            config["cache_salt"] = {"secret": SECRET}
        self.listener = Listener(tmp, config, snapshot_of)
        #: backend → the stream URL the router is given (tests may put a relay in between)
        self.endpoints = {name: f"{self.listener.url}/events/{name}" for name in self.names}
        self.router: Any = None
        self.session = requests.Session()
        try:
            self.listener.start()
            self.listener.wait()
            self.fleet.wait()
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------

    @property
    def listener_port(self) -> int:
        """The listener's HTTP port (the same across restarts)."""
        return int(self.listener.url.rsplit(":", 1)[1])

    def router_config(self, match: str = "seed", approximate: bool = False) -> dict[str, Any]:
        """RoundRobin (so KV-aware routing is visible), prefix keys, the index fed by the
        listener's streams (:attr:`endpoints`), salts for TensorRT-LLM. ``match``: the
        index's key (``seed`` by default: these tests pin the seed key's events);
        ``approximate`` off by default, so every routing decision comes from the listener's
        events."""
        sources = [{"backend_name": name, "endpoint": self.endpoints[name],
                    "reconnect_interval_ms": 50} for name in self.names]
        kv: dict[str, Any] = {"enabled": True, "event_sources": sources, "match": match,
                              "approximate": {"enabled": approximate}}
        if self.mode.salted:
            kv["cache_salt"] = {"enabled": True, "secret": SECRET}
        return {
            "backends": [{"name": n, "url": u, "models": [MODEL]} for n, u in self.urls.items()],
            "selection_strategy": "RoundRobin",
            "prefix_routing": {"enabled": True},
            "health_check": {"interval_seconds": 30},
            "kv_cache_index": kv,
        }

    def start_router(self, router_factory: Callable[[dict[str, Any]], Any],
                     match: str = "seed", approximate: bool = False) -> None:
        """Start the router and wait until it reads every stream."""
        self.router = router_factory(self.router_config(match, approximate))
        wait_until(lambda: all(b["connection"]["connected"]
                               for b in self.kv_backends().values()),
                   lambda: f"the router's consumers to connect: {self.kv_backends()}")

    def hear_engines(self, tag: str) -> None:
        """Until the listener has events from every engine.

        A bound SUB only gets a connecting PUB's messages once its subscription has
        arrived there, so ZMQ engines are sent small probe prompts until a batch arrives;
        TensorRT-LLM's queue is polled, nothing gets lost.
        """
        def heard() -> dict[str, bool]:
            sources = self.listener.health()["sources"]
            if self.mode.salted:
                return {n: bool(sources[n]["connected"]) for n in self.names}
            return {n: sources[n]["batches"] > 0 for n in self.names}

        if self.mode.salted:
            wait_until(lambda: all(heard().values()), lambda: f"the polls to work: {heard()}")
            return
        for attempt in range(200):
            state = heard()
            if all(state.values()):
                return
            for name, ok in state.items():
                if not ok:
                    self.direct(name, system_prompt(f"probe {tag} {name}"),
                                question(f"probe {attempt}"))
            time.sleep(0.05)
        raise AssertionError(f"the listener never heard every engine: {heard()}")

    def close(self) -> None:
        """Stop the listener and the engines (the router is the fixture's)."""
        self.session.close()
        self.listener.stop()
        self.fleet.stop()

    # -- requests ------------------------------------------------------------------------

    def salt(self, backend: str, system: str) -> str:
        """The salt the router would send ``backend`` for this system prompt."""
        return make_salt(SECRET.encode(), backend, prefix_hex(system))

    def direct(self, backend: str, system: str, user: str) -> dict[str, Any]:
        """A chat completion sent straight to one engine (bypassing the router); salted as
        the router would salt it when the mode needs salts."""
        body = chat_body(system, user)
        if self.mode.salted:
            body["cache_salt"] = self.salt(backend, system)
        resp = self.session.post(self.urls[backend] + "/v1/chat/completions", json=body,
                                 timeout=10)
        assert resp.status_code == 200, resp.text
        doc: dict[str, Any] = resp.json()
        return doc

    def reset(self, backend: str) -> None:
        """``POST /reset_prefix_cache`` on one engine."""
        resp = self.session.post(self.urls[backend] + "/reset_prefix_cache", timeout=10)
        assert resp.status_code == 200, resp.text

    def route(self, system: str, user: str,
              session: requests.Session | None = None) -> tuple[int, str | None, int]:
        """A chat completion through the router: ``(status, backend, cached_tokens)``."""
        assert self.router is not None
        resp = (session or self.session).post(self.router.url + "/v1/chat/completions",
                                              json=chat_body(system, user), timeout=10)
        cached = cached_tokens(resp.json()) if resp.status_code == 200 else -1
        return resp.status_code, resp.headers.get("X-Continuum-Backend"), cached

    # -- views ---------------------------------------------------------------------------

    def explain(self, system: str) -> dict[str, Any]:
        """``POST /admin/routing/explain`` for a request with this system prompt."""
        resp = self.session.post(self.router.url + "/admin/routing/explain",
                                 json=chat_body(system, "explain"), timeout=5)
        assert resp.status_code == 200, resp.text
        doc: dict[str, Any] = resp.json()
        return doc

    def index_tokens(self, system: str) -> dict[str, int]:
        """backend → token_count the router's index holds for this system prompt."""
        return {row["backend"]: row["token_count"] for row in self.explain(system)["kv_scores"]}

    def kv_backends(self) -> dict[str, dict[str, Any]]:
        """``GET /admin/kv-index/backends`` by backend name."""
        doc = self.session.get(self.router.url + "/admin/kv-index/backends", timeout=5).json()
        return {b["backend_name"]: b for b in doc["backends"]}

    def kv_stats(self) -> dict[str, Any]:
        """``GET /admin/kv-index/stats``."""
        doc: dict[str, Any] = self.session.get(self.router.url + "/admin/kv-index/stats",
                                               timeout=5).json()
        return doc

    def wait_holders(self, system: str, expected: dict[str, int], timeout: float = 20.0
                     ) -> dict[str, Any]:
        """Until explain's rows give exactly ``expected`` (backend → token count; every
        other backend 0) for this system prompt; returns that explain answer."""
        want = {name: expected.get(name, 0) for name in self.names}
        last: list[dict[str, Any]] = [{}]

        def matches() -> bool:
            last[0] = self.explain(system)
            return {r["backend"]: r["token_count"] for r in last[0]["kv_scores"]} == want

        wait_until(matches, lambda: f"the index to hold {want}; explain: {last[0]}", timeout)
        return last[0]

    def positions(self) -> dict[str, tuple[int, int]]:
        """backend → (events the router received, number of the listener's latest event),
        once the router has caught up with every stream (same last event id)."""
        out: dict[str, tuple[int, int]] = {}

        def caught_up() -> bool:
            health = self.listener.health()["sources"]
            backends = self.kv_backends()
            out.clear()
            for name in self.names:
                latest = health[name]["latest_event_id"]
                b = backends[name]
                if not b["connection"]["connected"] or b["last_event_id"] != latest:
                    return False
                out[name] = (b["events"]["received"], event_number(latest))
            return True

        wait_until(caught_up, lambda: f"the router to catch up with the listener: "
                   f"{self.kv_backends()} vs {self.listener.health()}")
        return dict(out)

    def listener_view(self, system: str) -> dict[str, int]:
        """backend → token_count the listener's streams give for this system prompt."""
        key = prefix_hex(system)
        return {name: self.listener.snapshot(name).get(key, 0) for name in self.names}


# -- relays, traffic and the fixture ---------------------------------------------------------

#: vLLM array (0.22) and map (0.33) wire formats, SGLang 0.5.22 and 0.5.9 over ZMQ with
#: /detokenize, TensorRT-LLM polled with router-issued salts.
ALL_MODES = list(MODES)


class TcpRelay:
    """A TCP relay 127.0.0.1:port → 127.0.0.1:target whose connections the test can cut,
    so a router's event stream drops while the listener behind it keeps running."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.holding = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._peers: dict[socket.socket, socket.socket] = {}
        self._commands: list[tuple[str, threading.Event, list[int]]] = []
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.server, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="tcp-relay", daemon=True)
        self._thread.start()

    def url(self, path: str) -> str:
        """``http://127.0.0.1:<relay port><path>``."""
        return f"http://127.0.0.1:{self.port}{path}"

    def cut(self, hold: bool = False) -> int:
        """Close every relayed connection now; returns how many there were. With ``hold``,
        new connections are closed at once too, until :meth:`release`."""
        return self._command("hold" if hold else "cut")

    def release(self) -> None:
        """Relay new connections again."""
        self._command("release")

    def close(self) -> None:
        """Close everything and stop the relay thread."""
        if self._thread.is_alive():
            self._command("close")
            self._thread.join(10)
        self._wake_w.close()

    def _command(self, name: str) -> int:
        done, result = threading.Event(), [0]
        with self._lock:
            self._commands.append((name, done, result))
        self._wake_w.send(b"x")
        assert done.wait(10), f"the relay did not {name}"
        return result[0]

    def _cut(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peers.pop(s, None)
            try:
                self._selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def _accept(self) -> None:
        client, _ = self.server.accept()
        if self.holding:  # the connection is refused after the TCP handshake
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=2)
        except OSError:  # nothing listens behind us: the client sees the connection close
            client.close()
            return
        upstream.settimeout(None)
        self._peers[client], self._peers[upstream] = upstream, client
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(upstream, selectors.EVENT_READ)

    def _run(self) -> None:
        running = True
        while running:
            for key, _ in self._selector.select(0.5):
                sock: Any = key.fileobj
                try:
                    if sock is self.server:
                        self._accept()
                    elif sock is self._wake_r:
                        sock.recv(64)
                        with self._lock:
                            commands, self._commands = self._commands, []
                        for name, done, result in commands:
                            self.holding = name == "hold"
                            if name != "release":
                                result[0] = len(self._peers) // 2
                                for s in list(self._peers):
                                    if s in self._peers:
                                        self._cut(s)
                            running = running and name != "close"
                            done.set()
                    elif sock in self._peers:
                        data = sock.recv(65536)
                        if data:
                            self._peers[sock].sendall(data)
                        else:
                            self._cut(sock)
                except OSError:
                    if sock in self._peers:
                        self._cut(sock)
        for s in list(self._peers):
            if s in self._peers:
                self._cut(s)
        self._selector.close()
        self.server.close()
        self._wake_r.close()


class Traffic:
    """Client threads sending chat requests through the router until stopped (bounded by
    ``limit`` requests per thread and ``deadline`` seconds); every result is kept with the
    phase it was sent in."""

    def __init__(self, pipeline: Pipeline, systems: list[str], threads: int = 2,
                 limit: int = 400, deadline: float = 60.0) -> None:
        self.pipeline = pipeline
        self.systems = systems
        self.phase = "start"
        self.results: list[tuple[str, int, str | None, int]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._limit = limit
        self._deadline = time.monotonic() + deadline
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True,
                                          name=f"traffic-{n}") for n in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, n: int) -> None:
        session = requests.Session()
        try:
            for i in range(self._limit):
                if self._stop.is_set() or time.monotonic() > self._deadline:
                    return
                phase = self.phase
                system = self.systems[(n + i) % len(self.systems)]
                status, backend, cached = self.pipeline.route(
                    system, question(f"traffic {n}.{i}"), session)
                with self._lock:
                    self.results.append((phase, status, backend, cached))
                time.sleep(0.01)
        except BaseException as exc:  # reported by the test, never lost in the thread
            with self._lock:
                self.errors.append(exc)
        finally:
            session.close()

    def count(self, phase: str) -> int:
        """Requests completed that were sent in ``phase``."""
        with self._lock:
            return sum(1 for r in self.results if r[0] == phase)

    def stop(self) -> list[tuple[str, int, str | None, int]]:
        """Stop the threads and return every result."""
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
        assert not any(t.is_alive() for t in self._threads), "traffic threads did not stop"
        with self._lock:
            return list(self.results)


class Pipelines:
    """``pipeline(mode, relayed=(...), **options)`` builds a :class:`Pipeline`, puts a
    :class:`TcpRelay` in front of the streams of the ``relayed`` backends and starts the
    router; :meth:`close` stops everything built."""

    def __init__(self, tmp: Path, router_factory: Callable[[dict[str, Any]], Any],
                 snapshot_of: Callable[[str, str], dict[str, int]]) -> None:
        self.tmp = tmp
        self.router_factory = router_factory
        self.snapshot_of = snapshot_of
        self.built: list[Pipeline] = []
        self.relays: dict[str, TcpRelay] = {}

    def __call__(self, mode: str, *, relayed: tuple[str, ...] = (), match: str = "seed",
                 approximate: bool = False, **options: Any) -> Pipeline:
        pipeline = Pipeline(self.tmp / f"{mode}-{len(self.built)}", MODES[mode],
                            self.snapshot_of, **options)
        self.built.append(pipeline)
        for name in relayed:
            relay = self.relays[name] = TcpRelay(pipeline.listener_port)
            pipeline.endpoints[name] = relay.url(f"/events/{name}")
        pipeline.start_router(self.router_factory, match, approximate)
        return pipeline

    def close(self) -> None:
        """Stop relays, listeners and engines (the routers are ``router_factory``'s)."""
        for relay in self.relays.values():
            relay.close()
        for pipeline in self.built:
            pipeline.close()


@pytest.fixture
def pipeline(tmp_path: Path, router_factory: Callable[..., Any],
             listener_snapshot: Callable[[str, str], dict[str, int]]) -> Iterator[Pipelines]:
    """``pipeline(mode, **options)`` starts engines, listener and router of one mode;
    logs and configs stay in ``tmp_path``."""
    built = Pipelines(tmp_path, router_factory, listener_snapshot)
    yield built
    built.close()


def warm_up(p: Pipeline, holders: dict[str, str]) -> dict[str, int]:
    """Send each system prompt straight to its holder; returns the token count the index
    must show (the prompt's full blocks: one output token adds no block)."""
    expected = {}
    for backend, system in holders.items():
        doc = p.direct(backend, system, question(f"warm-up {backend}"))
        assert cached_tokens(doc) == 0  # nobody had it before
        expected[backend] = doc["usage"]["prompt_tokens"] // BLOCK * BLOCK
        assert expected[backend] >= 4 * BLOCK  # several blocks
    return expected


@pytest.mark.parametrize("mode", ALL_MODES)
def test_index_names_the_holder_routes_to_it_and_forgets_evictions(
        pipeline: Pipelines, mode: str) -> None:
    p = pipeline(mode, engines=3, num_blocks=48)
    p.hear_engines("start")
    holders = {"e0": system_prompt(f"{mode} alpha"), "e1": system_prompt(f"{mode} bravo")}
    expected = warm_up(p, holders)

    # The index names exactly the engine that holds each prompt, with its token count.
    for backend, system in holders.items():
        doc = p.wait_holders(system, {backend: expected[backend]})
        assert doc["decision"]["decision"] == "kv_aware", doc
        assert doc["decision"]["backend"] == backend

    # Requests with that system prompt all go there, and hit the engine's cache.
    for backend, system in holders.items():
        for n in range(3):
            status, chosen, cached = p.route(system, question(f"routed {n}"))
            assert (status, chosen) == (200, backend)
            assert cached >= BLOCK, "the holder did not have the prompt cached"
    # Control: prompts nobody holds rotate over the fleet (RoundRobin decides).
    spread = {p.route(system_prompt(f"{mode} fresh {n}"), question("fresh"))[1]
              for n in range(3)}
    assert spread == set(p.names)

    # Evict on e0 with /reset_prefix_cache: the entry disappears from the router's index.
    p.reset("e0")
    doc = p.wait_holders(holders["e0"], {})
    assert doc["kv_fallback_reason"] == "no candidate holds this prefix"
    assert doc["decision"].get("decision") != "kv_aware"

    # Evict on e1 by filling its small cache (48 blocks) with other prompts.
    for n in range(40):
        p.direct("e1", system_prompt(f"{mode} filler {n}"), question(f"filler {n}"))
        if p.index_tokens(holders["e1"])["e1"] == 0:
            break
    doc = p.wait_holders(holders["e1"], {})
    assert doc["kv_fallback_reason"] == "no candidate holds this prefix"
    # ... and the engines really lost them (asked directly: no cached tokens).
    for backend, system in holders.items():
        assert cached_tokens(p.direct(backend, system, question("after eviction"))) == 0

    # Nothing was lost or malformed on the way: the router is at the listener's last event.
    p.positions()
    for name, b in p.kv_backends().items():
        assert b["events"]["malformed"] == 0 and b["events"]["dropped"] == 0, (name, b)
        assert b["connection"]["reconnect_count"] == 0, (name, b)
    # ... and every event arrived as the event the listener published. A prefix still held
    # whose chain keys were evicted (e1's, by the fillers) is a cache_created carrying
    # evicted chain keys; the stream used to name such a record cache_evicted, and the
    # router dropped the holding until the engine's next store.
    def evictions() -> dict[str, tuple[float, float]]:
        """backend → (cache_evicted published, received), read after the router caught up."""
        p.positions()
        published = {name: p.listener.metric("events_out_total", backend=name,
                                              event="cache_evicted") for name in p.names}
        text = p.session.get(p.router.url + "/metrics", timeout=5).text
        return {name: (published[name], metric_sum(
            text, "continuum_kv_events_received_total", backend=name, type="cache_evicted"))
            for name in p.names}

    # (an engine may still publish what its last requests left, so this polls)
    wait_until(lambda: all(a == b for a, b in evictions().values()),
               lambda: f"cache_evicted published, received: {evictions()}", timeout=10)
    assert evictions()["e1"][0] >= 1


def consistent(p: Pipeline, systems: list[str]) -> bool:
    """The router's index is the listener's view: same number of entries overall, same
    token counts for every test prompt on every backend."""
    p.positions()
    gauge = sum(p.listener.metric("prefixes", backend=n) for n in p.names)
    if p.kv_stats()["index"]["entry_count"] != gauge:
        return False
    return all(p.index_tokens(s) == p.listener_view(s) for s in systems)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_listener_kill_and_restart_under_traffic(
        pipeline: Pipelines, mode: str) -> None:
    p = pipeline(mode, engines=3, num_blocks=1024, replay=True, relayed=("e0",))
    p.hear_engines("start")
    holders = {"e0": system_prompt(f"{mode} alpha"), "e1": system_prompt(f"{mode} bravo")}
    systems = list(holders.values())
    expected = warm_up(p, holders)
    for backend, system in holders.items():
        p.wait_holders(system, {backend: expected[backend]})

    traffic = Traffic(p, systems)
    try:
        wait_until(lambda: traffic.count("start") >= 6, "traffic to flow")

        # -- the stream to e0 drops while the listener keeps running: the router resumes
        # from the listener's history, missing nothing published meanwhile.
        before = p.positions()
        history = p.listener.subscriptions("e0", "history")
        snapshots = p.listener.subscriptions("e0", "snapshot")
        traffic.phase = "stream cut"
        assert pipeline.relays["e0"].cut(hold=True) == 1
        for n in range(3):  # events on e0's stream while its consumer cannot read it
            p.direct("e0", system_prompt(f"{mode} during the cut {n}"), question("cut"))

        def missed() -> bool:
            seen = event_number(p.kv_backends()["e0"]["last_event_id"])
            return event_number(p.listener.health()["sources"]["e0"]["latest_event_id"]) > seen

        wait_until(missed, "events on e0's stream that the cut-off router has not seen")
        assert not p.kv_backends()["e0"]["connection"]["connected"]
        pipeline.relays["e0"].release()
        after = p.positions()
        for name in p.names:  # every event applied exactly once: no replay, no gap
            received = after[name][0] - before[name][0]
            published = after[name][1] - before[name][1]
            assert received == published, (name, before, after)
        assert after["e0"][1] > before["e0"][1]
        assert p.listener.subscriptions("e0", "history") == history + 1
        assert p.listener.subscriptions("e0", "snapshot") == snapshots
        backends = p.kv_backends()
        assert backends["e0"]["connection"]["reconnect_count"] >= 1
        assert all(backends[n]["connection"]["reconnect_count"] == 0 for n in ("e1", "e2"))
        assert backends["e0"]["events"]["dropped"] == 0

        # -- kill -9 the listener under traffic, restart it on the same port.
        epoch = p.listener.health()["epoch"]
        traffic.phase = "listener down"
        p.listener.kill()
        wait_until(lambda: not any(b["connection"]["connected"]
                                   for b in p.kv_backends().values()),
                   "the router to notice the listener is gone")
        wait_until(lambda: traffic.count("listener down") >= 4, "traffic while it is down")
        p.listener.start()
        p.listener.wait()
        traffic.phase = "restarted"
        new_epoch = p.listener.health()["epoch"]
        assert new_epoch != epoch
        p.hear_engines("restart")

        def resumed() -> bool:
            backends = p.kv_backends().values()
            return all(b["connection"]["connected"]
                       and b["connection"]["reconnect_count"] >= 1
                       and (b["last_event_id"] or "").startswith(new_epoch + "-")
                       for b in backends)

        wait_until(resumed, lambda: f"the consumers to resume on the new listener: "
                   f"{p.kv_backends()}")
        wait_until(lambda: traffic.count("restarted") >= 4, "traffic after the restart")
    finally:
        results = traffic.stop()
    assert not traffic.errors, traffic.errors
    assert [r for r in results if r[1] != 200] == [], "client requests failed"

    # A restarted listener knows nothing: it sent cache_cleared and a snapshot (the resume
    # id was from the old run) and rebuilds its view from the engines — by replay over
    # ZMQ; for TensorRT-LLM, whose queue the old run drained, from blocks stored since
    # (salted requests to the holders re-announce them).
    assert p.listener.subscriptions("e1", "snapshot") >= 1
    assert p.listener.subscriptions("e1", "history") == 0
    if p.mode.salted:
        for backend, system in holders.items():
            p.direct(backend, system, question("after the restart"))
    else:
        assert all(p.listener.metric("replays_total", backend=n) >= 1 for n in p.names)
    wait_until(lambda: consistent(p, systems),
               lambda: f"the router's index to match the listener: "
               f"{[(p.index_tokens(s), p.listener_view(s)) for s in systems]}")
    for backend, system in holders.items():
        tokens = p.index_tokens(system)
        assert tokens[backend] > 0, f"{backend} is not named again as a holder: {tokens}"
        if not p.mode.salted:  # the replay rebuilt the whole chain
            assert tokens[backend] >= expected[backend], tokens
        for name, count in tokens.items():  # every holder named really holds the prompt
            if count:
                assert cached_tokens(p.direct(name, system, question("truth"))) >= BLOCK, name
    for name, b in p.kv_backends().items():
        assert b["events"]["malformed"] == 0, (name, b)


def document(tag: str) -> str:
    """A retrieved document of a few hundred tokens (several 1 KiB chain chunks)."""
    return " ".join(f"Paragraph {n} of the {tag} document: the harbour keeps its ships "
                    "in numbered berths and the pilots log every arrival." for n in range(40))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_chain_keys_arrive_and_requests_go_to_the_longest_match(
        pipeline: Pipelines, mode: str) -> None:
    """The same system prompt everywhere, a document in the user turn held by one engine:
    with ``match: chain`` the listener's chain keys name that engine and the router sends
    the document's next questions there. TensorRT-LLM (salts, no /detokenize) reports the
    seed key only: the router credits its holders with the system prompt, and the chain it
    recorded itself (an approximate entry) sends the document's next questions to the
    engine it sent the first one to."""
    p = pipeline(mode, engines=3, num_blocks=512, match="chain", approximate=MODES[mode].salted)
    p.hear_engines("start")
    system = system_prompt(f"{mode} shared")
    for name in p.names:  # every engine holds the system prompt
        p.direct(name, system, question(f"warm {name}"))
    doc = document(mode)
    p.direct("e1", system, doc + " Question: which berth?")
    body = chat_body(system, doc + " Question: who logs arrivals?")

    def rows() -> dict[str, dict[str, Any]]:
        resp = p.session.post(p.router.url + "/admin/routing/explain", json=body, timeout=5)
        return {row["backend"]: row for row in resp.json()["kv_scores"]}

    if p.mode.salted:
        got = wait_until(lambda: (r := rows()) and all(r[n]["seed_key_only"] for n in p.names)
                         and r, lambda: f"seed-key holders in the index: {rows()}")
        assert all(got[n]["matched_depth"] == 0 for n in p.names)
        # No chain keys come from TensorRT-LLM: the router's own record of where it sent the
        # document (an approximate entry) is the longest match, and its answer shows the
        # engine's cache holds the document.
        first = p.session.post(p.router.url + "/v1/chat/completions", json=body, timeout=10)
        assert first.status_code == 200
        holder = first.headers["X-Continuum-Backend"]
        got = rows()
        assert got[holder]["approximate"] and got[holder]["matched_depth"] >= 3, got
        assert all(got[n]["matched_depth"] == 0 for n in p.names if n != holder), got
        for n in range(3):
            resp = p.session.post(p.router.url + "/v1/chat/completions", timeout=10,
                                  json=chat_body(system, doc + f" Question {n}: how many?"))
            assert resp.status_code == 200 and resp.headers["X-Continuum-Backend"] == holder
            assert cached_tokens(resp.json()) > cached_tokens(first.json()) + 4 * BLOCK
        return
    got = wait_until(lambda: (r := rows()) and r["e1"]["matched_depth"] >= 3 and r,
                     lambda: f"e1's chain keys in the index: {rows()}")
    depth = got["e1"]["chain_depth"]
    assert got["e1"]["matched_depth"] >= depth - 1 and not got["e1"]["approximate"]
    assert all(got[n]["matched_depth"] <= 1 for n in ("e0", "e2"))  # the system prompt only
    assert got["e1"]["matched_tokens"] > 4 * got["e0"]["matched_tokens"] > 0
    for n in range(3):
        resp = p.session.post(p.router.url + "/v1/chat/completions", timeout=10,
                              json=chat_body(system, doc + f" Question {n}: how many?"))
        assert resp.status_code == 200 and resp.headers["X-Continuum-Backend"] == "e1"
        assert cached_tokens(resp.json()) >= got["e1"]["matched_tokens"] // BLOCK * BLOCK - BLOCK
    for name, b in p.kv_backends().items():
        assert b["events"]["malformed"] == 0 and b["events"]["dropped"] == 0, (name, b)
