"""A stream whose upstream breaks in the middle of a record, through real gunicorn -k gevent,
driven by the official SDKs: the client gets the router's error event, which its SDK
raises as an API error, and never the cut record (which no SDK can parse, nor the error
record glued to it)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import openai
import pytest
import requests

from continuum.routing.forwarder import MAX_HELD_BYTES, _whole_records

pytestmark = pytest.mark.e2e

MODEL = "cut-model"
ANTHROPIC_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
    b'"type":"message","role":"assistant","content":[],"model":"cut-model",'
    b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":10,'
    b'"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n')
ANTHROPIC_CUT = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,' \
    b'"delta":{"type":"text_delta","text":"Hel'
OPENAI_START = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,' \
    b'"model":"cut-model","choices":[{"index":0,"delta":{"role":"assistant",' \
    b'"content":"Hel"},"finish_reason":null}]}\r\n\r\n'
OPENAI_CUT = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"cut'
#: A stream that is not SSE (lines of JSON, no blank line): nothing is held back.
LINES_START = b'{"text": "Hel"}\n'
LINES_CUT = b'{"text": "l'


class _CutEngine(BaseHTTPRequestHandler):
    """Streams whole records, then the start of one, then drops the connection."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        whole, cut = {"/v1/messages": (ANTHROPIC_START, ANTHROPIC_CUT),
                      "/v1/completions": (LINES_START, LINES_CUT)}.get(
                          self.path, (OPENAI_START, OPENAI_CUT))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for data in (whole, cut):  # two chunks: the cut record arrives on its own
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True


@pytest.fixture
def cut_engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CutEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _router(router_factory: Callable[..., Any], url: str) -> Any:
    router = router_factory({
        "backends": [{"name": "cut", "url": url, "models": [MODEL],
                      "anthropic_messages": True}],
        "health_check": {"interval_seconds": 0.5}})
    router.wait_healthy()
    return router


def test_the_anthropic_sdk_gets_the_routers_error_not_a_cut_record(
    cut_engine: str, router_factory: Callable[..., Any]
) -> None:
    router = _router(router_factory, cut_engine)
    raw = requests.post(router.url + "/anthropic/v1/messages", timeout=10, json={
        "model": MODEL, "max_tokens": 8, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]})
    assert raw.status_code == 200
    assert raw.content.startswith(ANTHROPIC_START)
    assert b"Hel" not in raw.content[len(ANTHROPIC_START):]  # the cut record is not sent
    tail = raw.content[len(ANTHROPIC_START):]
    assert tail.startswith(b"event: error\ndata: ") and tail.endswith(b"\n\n")
    client = anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="k",
                                 max_retries=0)
    try:
        with pytest.raises(anthropic.APIStatusError) as broke, client.messages.stream(
                model=MODEL, max_tokens=8,
                messages=[{"role": "user", "content": "hi"}]) as stream:
            stream.get_final_message()
    finally:
        client.close()
    assert "the upstream stream broke off" in str(broke.value)


def test_the_openai_sdk_gets_the_routers_error_not_a_cut_record(
    cut_engine: str, router_factory: Callable[..., Any]
) -> None:
    router = _router(router_factory, cut_engine)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    try:
        chunks = client.chat.completions.create(
            model=MODEL, stream=True, messages=[{"role": "user", "content": "hi"}])
        texts = []
        with pytest.raises(openai.APIError) as broke:
            for chunk in chunks:
                texts.append(chunk.choices[0].delta.content)
    finally:
        client.close()
    assert texts == ["Hel"]
    assert "the upstream stream broke off" in str(broke.value)


def test_a_stream_without_blank_lines_is_relayed_as_it_comes(
    cut_engine: str, router_factory: Callable[..., Any]
) -> None:
    """Only a stream that has shown SSE framing has its unfinished record held back: one
    that never sends a blank line reaches the client as it comes, cut record included."""
    router = _router(router_factory, cut_engine)
    raw = requests.post(router.url + "/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": "hi", "stream": True})
    assert raw.status_code == 200
    assert raw.content.startswith(LINES_START + LINES_CUT)
    assert b"the upstream stream broke off" in raw.content[len(LINES_START + LINES_CUT):]


@pytest.mark.parametrize(("piece", "whole", "held"), [
    (b"data: a\n\ndata: b", b"data: a\n\n", b"data: b"),
    (b"data: a\r\n\r\ndata: b\r\n", b"data: a\r\n\r\n", b"data: b\r\n"),
    (b"data: a\n\ndata: b\r\n\r\ndata: c", b"data: a\n\ndata: b\r\n\r\n", b"data: c"),
    (b"data: b", b"", b"data: b"),  # all of it held, to be completed by the next piece
    (b"\n\ndata: b", b"\n\n", b"data: b"),
])
def test_whole_records_are_sent_and_the_unfinished_one_held(piece: bytes, whole: bytes,
                                                            held: bytes) -> None:
    assert _whole_records(piece) == (whole, held)


def test_a_stream_that_is_no_sse_is_not_held_beyond_the_record_limit() -> None:
    """A backend that streams something else (no blank lines), or one record above the SSE
    parsers' own limit, goes on as it comes rather than filling the router's memory."""
    endless = b"x" * (MAX_HELD_BYTES + 1)
    assert _whole_records(endless) == (endless, b"")
    after = b"data: a\n\n" + endless
    assert _whole_records(after) == (after, b"")
    assert _whole_records(b"x" * MAX_HELD_BYTES) == (b"", b"x" * MAX_HELD_BYTES)
