"""The listener's engine client against a real HTTP engine on 127.0.0.1: the reply cap and
no proxies from the environment."""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests

from continuum.devtools.procs import refused_port
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.processor import DefaultSourceProcessor
from listener.recovery import EngineClient, PromptRecovery

MIB = 1024 * 1024
#: Bytes of ``prompt`` an oversize reply offers.
OFFERED = 64 * MIB


class Engine(ThreadingHTTPServer):
    """``POST /detokenize``: ``{"prompt": ...}`` of ``size`` characters, sized or chunked."""

    daemon_threads = True

    def __init__(self, size: int, chunked: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.size, self.chunked = size, chunked
        self.sent = 0
        self.requests = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/detokenize"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Engine

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests += 1
        engine = self.server
        head, tail = b'{"prompt": "', b'"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if not engine.chunked:
            self.send_header("Content-Length", str(len(head) + engine.size + len(tail)))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        piece = b"a" * 65536
        parts = [head] + [piece] * (engine.size // len(piece)) + [
            b"a" * (engine.size % len(piece)), tail]
        deadline = time.monotonic() + 30
        try:
            for part in parts:
                if time.monotonic() > deadline:
                    break
                if engine.chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if part else b"")
                else:
                    self.wfile.write(part)
                engine.sent += len(part)
            if engine.chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client stopped reading
        self.close_connection = True


@pytest.fixture
def engines() -> Iterator[Any]:
    started: list[Engine] = []

    def start(size: int, chunked: bool = False) -> Engine:
        engine = Engine(size, chunked)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.shutdown()
        engine.server_close()


def _recovery(url: str, max_response_bytes: int) -> tuple[PromptRecovery, EngineClient]:
    source = SourceConfig(backend_name="b1", engine="vllm", model="m",
                          zmq_endpoint="tcp://127.0.0.1:1", detokenize_endpoint=url,
                          allowed_publishers=("127.0.0.1",), template="chatml")
    client = EngineClient(max_response_bytes)
    detok = DetokenizeConfig(max_response_bytes=max_response_bytes)
    return PromptRecovery(source, detok, client), client


@pytest.mark.parametrize("chunked", [False, True])
def test_oversize_reply_is_a_counted_failure_read_no_further(engines: Any,
                                                             chunked: bool) -> None:
    engine = engines(OFFERED, chunked)
    recovery, client = _recovery(engine.url, 64 * 1024)
    tracemalloc.start()
    try:
        assert recovery.detokenize([1, 2, 3], "m") is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        client.close()
    assert (recovery.calls, recovery.errors, recovery.too_large) == (1, 1, 1)
    assert recovery.paused  # like any failure: the next calls wait
    assert peak < 2 * MIB, peak
    assert engine.sent < OFFERED


def test_reply_within_the_cap_is_used(engines: Any) -> None:
    engine = engines(1000)
    recovery, client = _recovery(engine.url, 64 * 1024)
    try:
        assert recovery.detokenize([1, 2, 3], "m") == "a" * 1000
    finally:
        client.close()
    assert (recovery.errors, recovery.too_large) == (0, 0)


def test_proxy_variables_are_ignored_for_the_engine(engines: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engines(5)
    dead_proxy = f"http://127.0.0.1:{refused_port()}"  # nothing listens there
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    with pytest.raises(requests.exceptions.ProxyError):  # what an ordinary session does
        requests.post(engine.url, json={}, timeout=5)
    assert engine.requests == 0
    processor = DefaultSourceProcessor(
        SourceConfig(backend_name="b1", engine="vllm", model="m",
                     zmq_endpoint="tcp://127.0.0.1:1", detokenize_endpoint=engine.url,
                     allowed_publishers=("127.0.0.1",), template="chatml"),
        LimitsConfig(), DetokenizeConfig(), emit=lambda event: None, salt_secret=None)
    try:
        assert processor.recovery.detokenize([1, 2, 3], "m") == "aaaaa"
    finally:
        processor.close()
    assert engine.requests == 1
    assert processor.stats()["detokenize_too_large"] == 0


def test_processor_stats_count_oversize_replies(engines: Any) -> None:
    engine = engines(OFFERED, chunked=True)
    processor = DefaultSourceProcessor(
        SourceConfig(backend_name="b1", engine="vllm", model="m",
                     zmq_endpoint="tcp://127.0.0.1:1", detokenize_endpoint=engine.url,
                     allowed_publishers=("127.0.0.1",), template="chatml"),
        LimitsConfig(), DetokenizeConfig(max_response_bytes=4096), emit=lambda event: None,
        salt_secret=None)
    try:
        assert processor.recovery.detokenize([1], "m") is None
    finally:
        processor.close()
    stats = processor.stats()
    assert (stats["detokenize_errors"], stats["detokenize_too_large"]) == (1, 1)
