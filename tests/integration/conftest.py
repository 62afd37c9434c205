"""Integration fixtures: real servers on free ports, stopped by PID."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import zmq.green as zmq

from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.devtools.redis_server import RedisServer, redis_available, unique_prefix
from continuum.wire.sse import SseTransport
from listener.sources_zmq import ZapAuthenticator

REQUIRE_REDIS_ENV = "CONTINUUM_REQUIRE_REDIS"


def _need_redis_server() -> None:
    """Skip when redis-server is missing — or fail, when CI says Redis is required."""
    if redis_available():
        return
    reason = "redis-server is not installed (not on PATH)"
    if os.environ.get(REQUIRE_REDIS_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_REDIS_ENV}=1 requires it", pytrace=False)
    pytest.skip(f"{reason}; install it, or set {REQUIRE_REDIS_ENV}=1 to make this an error")


def _own_redis_server() -> Iterator[RedisServer]:
    _need_redis_server()
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _close_sdk_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every openai and anthropic SDK client a test made, at its end. A client holds
    kept-alive sockets and refers to itself (its resources point back at it), so a test
    that drops it leaves it to the cycle collector, which may finalise a socket before the
    client that would have closed it: the socket's ResourceWarning then fails whichever
    later test is running (``filterwarnings = error``; seen under CPython 3.13)."""
    import anthropic
    import openai

    made: list[Any] = []
    for cls in (openai.OpenAI, anthropic.Anthropic):
        def init(self: Any, *args: Any, __init: Any = cls.__init__, **kwargs: Any) -> None:
            __init(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    yield
    for client in made:
        client.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session (tests use their own key prefixes)."""
    yield from _own_redis_server()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, which the test may stop and start again."""
    yield from _own_redis_server()


class Links:
    """RedisLinks, raw clients and indexes made by one test, all closed at its end."""

    def __init__(self) -> None:
        self.links: list[Any] = []
        self.clients: list[Any] = []
        self.closing: list[Any] = []  # stores, indexes: closed before the links

    def link(self, url: str, metrics: Any = None, **settings: Any) -> Any:
        """A RedisLink to ``url`` with ``response_cache.redis`` settings."""
        from continuum.config import RedisConfig
        from stores.redis_link import RedisLink

        link = RedisLink(RedisConfig(url=url, **settings), metrics)
        self.links.append(link)
        return link

    def raw(self, url: str) -> Any:
        """A plain redis-py client (to plant or inspect keys)."""
        import redis

        client = redis.Redis.from_url(url)
        self.clients.append(client)
        return client

    def index(self, link: Any, prefix: str | None = None, **settings: Any) -> Any:
        """A RedisKvIndex on ``link`` under ``prefix`` (default: a fresh one)."""
        from stores.kv_redis import RedisKvIndex

        index = RedisKvIndex(link, key_prefix=prefix or unique_prefix("kv"), **settings)
        self.closing.append(index)
        return index

    def close(self) -> None:
        for item in self.closing:
            item.close()
        for link in self.links:
            link.close()
        for client in self.clients:
            client.close()


@pytest.fixture
def links() -> Iterator[Links]:
    """Redis links, raw clients and KV indexes for this test, closed at its end."""
    made = Links()
    yield made
    made.close()


def _listener_snapshot(url: str, backend: str) -> dict[str, int]:
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


@pytest.fixture
def listener_snapshot() -> Callable[[str, str], dict[str, int]]:
    """``listener_snapshot(url, backend)``: prefix → token_count ``backend`` holds, read
    from a fresh subscription to the KV listener at ``url`` (``cache_cleared``, then one
    ``cache_created`` per prefix, the last record carrying the id)."""
    return _listener_snapshot


class EventStreams:
    """A real SSE listener on 127.0.0.1: ``/events/<backend>`` serves the events queued
    for ``backend`` (each connection from the first), and counts its open connections."""

    def __init__(self) -> None:
        self.queues: dict[str, list[bytes]] = {}
        self.open: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                backend = self.path.rsplit("/", 1)[-1]
                with outer.lock:
                    outer.open[backend] = outer.open.get(backend, 0) + 1
                    outer.total[backend] = outer.total.get(backend, 0) + 1
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    sent = 0
                    while not outer.stop.is_set():
                        with outer.lock:
                            pending = outer.queues.get(backend, [])[sent:]
                        for record in pending:
                            self.wfile.write(record)
                            sent += 1
                        self.wfile.write(b": keep-alive\n\n")  # notices a closed client
                        self.wfile.flush()
                        time.sleep(0.02)
                except OSError:
                    pass
                finally:
                    with outer.lock:
                        outer.open[backend] -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, backend: str) -> str:
        """The stream of ``backend``'s events."""
        return f"http://127.0.0.1:{self.port}/events/{backend}"

    def push(self, backend: str, event: str, prefix_hash: str, tokens: int = 100) -> None:
        """Queue one event for ``backend`` (its id: its position in the queue)."""
        with self.lock:
            queue = self.queues.setdefault(backend, [])
            data = json.dumps({"prefix_hash": prefix_hash, "token_count": tokens})
            queue.append(f"id: {len(queue) + 1}\nevent: {event}\ndata: {data}\n\n".encode())

    def connections(self) -> dict[str, int]:
        """Open connections per backend."""
        with self.lock:
            return dict(self.open)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def streams() -> Iterator[EventStreams]:
    """A test SSE listener (:class:`EventStreams`), closed at the end of the test."""
    s = EventStreams()
    yield s
    s.close()


@pytest.fixture
def ctx() -> Iterator[Any]:
    """A gevent-friendly ZeroMQ context for listener sources, destroyed at the end."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def zap(ctx: Any) -> Iterator[ZapAuthenticator]:
    """The ZAP handler of ``ctx`` that bind-mode sources register their publishers with."""
    auth = ZapAuthenticator(ctx)
    yield auth
    auth.close()


#: The key the fake Gemini API of :func:`fake` requires (``x-goog-api-key``).
GEMINI_KEY = "AIza-upstream-key"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeGeminiProcess]:
    """A fake Gemini API that requires :data:`GEMINI_KEY` and caches prompts of 100 tokens
    or more; stopped at the end."""
    started = FakeGeminiProcess(tmp_path, api_key=GEMINI_KEY, min_cache_tokens=100)
    yield started
    started.stop()
