"""The whole Tier 4 pipeline as real processes on 127.0.0.1, for the end-to-end tests.

``continuum-sim --fleet N`` engines publish KV events (ZMQ in vLLM's or SGLang's wire
format, or ``/kv_cache_events`` polled for TensorRT-LLM), one ``continuum-kv-listener``
turns them into ``/events/<backend>`` streams, and the router (under gunicorn, started by
the ``router_factory`` fixture) consumes them. :class:`Pipeline` ties them together and
answers the questions the tests ask: who does the router's index say holds a system
prompt, what does the listener say, what does the engine really hold.

Every wait is a deadline-bounded poll (:func:`wait_for`); every process is stopped by its
PID; every socket, session and stream opened here is closed.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import requests
import yaml

from continuum.cache_salt import make_salt
from continuum.devtools.fleet import free_port_block
from continuum.prefix import request_prefix_key
from continuum.wire.sse import SseTransport
from tests.conftest import PYTHON, Proc, metric_value, wait_http

MODEL = "sim-model"
BLOCK = 16
SECRET = "pipeline-e2e-shared-secret"
T = TypeVar("T")


def listener_snapshot(url: str, backend: str) -> dict[str, int]:
    """prefix → token_count ``backend`` holds, read from a fresh subscription to the
    listener at ``url``: ``cache_cleared``, then one ``cache_created`` per prefix, the last
    record carrying the id."""
    records: list[tuple[str | None, dict[str, Any]]] = []
    transport = SseTransport.open(f"{url}/events/{backend}", None, 5.0, 30.0)
    try:
        for event, data, record_id in transport.records():
            records.append((event, json.loads(data or "{}")))
            if record_id is not None:
                break
    finally:
        transport.close()
    assert records and records[0][0] == "cache_cleared", records[:1]
    return {doc["prefix_hash"]: int(doc.get("token_count") or 0)
            for event, doc in records[1:] if event == "cache_created"}


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


def wait_for(cond: Callable[[], T], what: str | Callable[[], str],
             timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll ``cond()`` until it returns something truthy (returned) or fail after
    ``timeout`` seconds; ``what`` (or what it returns) explains the failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s waiting for {detail}")
        time.sleep(interval)


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
        argv = [PYTHON, "-m", "continuum.sim.cli", "--fast", "--engine", mode.engine,
                "--fleet", str(count), "--port", str(ports), "--num-blocks", str(num_blocks)]
        if mode.kv_format is not None:
            assert zmq_base is not None
            argv += ["--kv-format", mode.kv_format, "--zmq-connect",
                     "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_base}"]
            if replay_base is not None:
                argv += ["--zmq-replay-endpoint", f"tcp://127.0.0.1:{replay_base}"]
        self.proc = Proc(argv, log=tmp / f"fleet-{mode.name}.log")

    def wait(self) -> None:
        """Until every engine answers /health."""
        try:
            for url in self.urls:
                wait_http(url + "/health", proc=self.proc.popen)
        except RuntimeError:
            raise RuntimeError("continuum-sim did not start:\n" + self.proc.output()) from None

    def stop(self) -> None:
        """SIGTERM (clean exit), SIGKILL after a timeout."""
        self.proc.stop()


class Listener:
    """``continuum-kv-listener --config FILE``; restartable on the same port."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        self.tmp = tmp
        self.config = config
        self.url = "http://" + config["listen"]
        self.config_path = tmp / "listener.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.runs = 0
        self.proc: Proc | None = None

    def start(self) -> None:
        """Start a new run of the listener (same config, same port)."""
        self.runs += 1
        self.proc = Proc([PYTHON, "-m", "listener.cli", "--config", str(self.config_path)],
                         log=self.tmp / f"listener-{self.runs}.log")

    def wait(self) -> None:
        """Until the listener answers /health."""
        assert self.proc is not None
        try:
            wait_http(self.url + "/health", proc=self.proc.popen)
        except RuntimeError:
            raise RuntimeError("continuum-kv-listener did not start:\n"
                               + self.proc.output()) from None

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
        return metric_value(text, "continuum_kv_listener_" + name, **labels)

    def subscriptions(self, backend: str, start: str) -> int:
        """Subscriptions of ``backend`` that started from ``history`` (a resume) or with a
        ``snapshot`` (cache_cleared first)."""
        return int(self.metric("subscriptions_total", backend=backend, start=start))

    def snapshot(self, backend: str) -> dict[str, int]:
        """prefix → token_count the backend holds, from a fresh subscription's snapshot."""
        return listener_snapshot(self.url, backend)


# -- the pipeline ----------------------------------------------------------------------------


class Pipeline:
    """Engines, listener and router of one mode, plus the views the tests compare.

    Args:
        tmp: Where configs and logs go.
        mode: The engine flavour.
        engines: Fleet size.
        num_blocks: GPU KV capacity of each engine, in 16-token blocks.
        replay: Give ZMQ engines a replay endpoint (a restarted listener asks it).
    """

    def __init__(self, tmp: Path, mode: Mode, *, engines: int = 3, num_blocks: int = 4096,
                 replay: bool = False) -> None:
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
        self.listener = Listener(tmp, config)
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

    def router_config(self) -> dict[str, Any]:
        """RoundRobin (so KV-aware routing is visible), prefix keys, the index fed by the
        listener's streams (:attr:`endpoints`), salts for TensorRT-LLM."""
        sources = [{"backend_name": name, "endpoint": self.endpoints[name],
                    "reconnect_interval_ms": 50} for name in self.names]
        kv: dict[str, Any] = {"enabled": True, "event_sources": sources}
        if self.mode.salted:
            kv["cache_salt"] = {"enabled": True, "secret": SECRET}
        return {
            "backends": [{"name": n, "url": u, "models": [MODEL]} for n, u in self.urls.items()],
            "selection_strategy": "RoundRobin",
            "prefix_routing": {"enabled": True},
            "health_check": {"interval_seconds": 30},
            "kv_cache_index": kv,
        }

    def start_router(self, router_factory: Callable[[dict[str, Any]], Any]) -> None:
        """Start the router and wait until it reads every stream."""
        self.router = router_factory(self.router_config())
        wait_for(lambda: all(b["connection"]["connected"]
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
            wait_for(lambda: all(heard().values()), lambda: f"the polls to work: {heard()}")
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

        wait_for(matches, lambda: f"the index to hold {want}; explain: {last[0]}", timeout)
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

        wait_for(caught_up, lambda: f"the router to catch up with the listener: "
                 f"{self.kv_backends()} vs {self.listener.health()}")
        return dict(out)

    def listener_view(self, system: str) -> dict[str, int]:
        """backend → token_count the listener's streams give for this system prompt."""
        key = prefix_hex(system)
        return {name: self.listener.snapshot(name).get(key, 0) for name in self.names}
