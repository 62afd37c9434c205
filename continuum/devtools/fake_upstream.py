"""A scriptable OpenAI-compatible upstream for router tests (real HTTP on 127.0.0.1).

Run: ``python -m continuum.devtools.fake_upstream PORT [NAME]``, or start it with
:class:`continuum.devtools.servers.FakeUpstream`. It answers ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/embeddings`` with OpenAI's JSON bodies and streams chat
completions as OpenAI's SSE chunks ending in ``data: [DONE]``. Requests steer it with an
``x_test`` object in the JSON body (the router forwards bodies unchanged):

* ``chunks`` (int), ``delay`` (seconds between stream chunks)
* ``status`` (int): answer with this status and an OpenAI error body
* ``hang`` (seconds): sleep before answering
* ``break_after`` (int): drop the connection after this many stream chunks

``/v1/embeddings`` embeds with the simulator's deterministic embedder
(:mod:`continuum.sim.embedder`, 64 dimensions) when the model's name starts with
``embed``; other models get ``[0.1, 0.2]``; ``/_test/embed_delay?seconds=S`` makes every
embedding answer S seconds late (a slow embedding backend), ``/_test/embed_status?code=N``
makes it answer status N with an OpenAI error body (0: answer again), and
``/_test/embed_garbage?on=1`` answers 200 with strings for numbers (``on=0``: numbers again).

``GET /_test/stats`` reports what it saw: request count, the last request's headers and
body, streams started, finished and aborted by the client, health probes
(``health_probes``). ``/_test/sick`` and
``/_test/well`` make ``/health`` answer 503 or 200.

Run as a program it monkey-patches itself for gevent first; importing it patches nothing.
"""

from __future__ import annotations

if __name__ == "__main__":  # before anything below imports socket
    from gevent import monkey

    monkey.patch_all()

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import gevent
from gevent.pywsgi import WSGIHandler, WSGIServer

from continuum.sim import embedder

StartResponse = Callable[..., Any]

STATS: dict[str, Any] = {"requests": 0, "streams_started": 0, "streams_finished": 0,
                         "streams_aborted": 0, "last_headers": {}, "last_body": None,
                         "healthy": True, "embeddings": 0, "embed_delay": 0.0,
                         "embed_status": 0, "embed_garbage": False,
                         "health_probes": 0}
NAME = "up"


class _Handler(WSGIHandler):  # type: ignore[misc]  # gevent has no type hints
    def handle(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().handle()


class _Broken(Exception):
    pass


def _json(start: StartResponse, status: int, doc: Any) -> list[bytes]:
    body = json.dumps(doc).encode()
    start(f"{status} X", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def _completion(model: str, text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def _stream(model: str, n: int, delay: float, break_after: int | None) -> Iterator[bytes]:
    STATS["streams_started"] += 1
    finished = False
    try:
        for i in range(n):
            if break_after is not None and i == break_after:
                raise _Broken()
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                     "model": model, "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                                  "finish_reason": None}]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if delay:
                gevent.sleep(delay)
        yield b"data: [DONE]\n\n"
        finished = True
        STATS["streams_finished"] += 1
    finally:
        if not finished:
            STATS["streams_aborted"] += 1


def _embeddings(start: StartResponse, model: str, body: dict[str, Any]) -> list[bytes]:
    STATS["embeddings"] += 1
    if STATS["embed_delay"]:
        gevent.sleep(STATS["embed_delay"])
    if STATS["embed_status"]:
        return _json(start, STATS["embed_status"], {"error": {
            "message": f"The model `{model}` does not exist.", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}})
    if STATS["embed_garbage"]:
        return _json(start, 200, {"object": "list", "model": model, "data": [
            {"object": "embedding", "index": 0, "embedding": ["0.1", "zero"]}]})
    text = body.get("input")
    vector = embedder.embed(text, 64) if model.startswith("embed") and isinstance(text, str) \
        else [0.1, 0.2]
    return _json(start, 200, {"object": "list", "model": model, "data": [
        {"object": "embedding", "index": 0, "embedding": vector}],
        "usage": {"prompt_tokens": 1, "total_tokens": 1}})


def app(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
    """The WSGI app."""
    path = environ["PATH_INFO"]
    if path == "/health":
        STATS["health_probes"] += 1
        return _json(start, 200 if STATS["healthy"] else 503, {"ok": STATS["healthy"],
                                                                "pid": os.getpid()})
    if path == "/_test/stats":
        return _json(start, 200, STATS)
    if path == "/_test/sick":
        STATS["healthy"] = False
        return _json(start, 200, {})
    if path == "/_test/well":
        STATS["healthy"] = True
        return _json(start, 200, {})
    if path == "/_test/embed_garbage":
        STATS["embed_garbage"] = environ.get("QUERY_STRING", "on=0") == "on=1"
        return _json(start, 200, {})
    if path == "/_test/embed_status":
        STATS["embed_status"] = int(environ.get("QUERY_STRING", "code=0").split("=")[1])
        return _json(start, 200, {})
    if path == "/_test/embed_delay":
        STATS["embed_delay"] = float(environ.get("QUERY_STRING", "seconds=0").split("=")[1])
        return _json(start, 200, {})
    if path == "/v1/models":
        return _json(start, 200, {"object": "list", "data": [
            {"id": "m", "object": "model", "created": 0, "owned_by": NAME}]})
    length = int(environ.get("CONTENT_LENGTH") or 0)
    raw = environ["wsgi.input"].read(length)
    STATS["requests"] += 1
    STATS["last_headers"] = {k[5:]: v for k, v in environ.items() if k.startswith("HTTP_")}
    body = json.loads(raw or b"{}")
    STATS["last_body"] = body
    knobs = body.get("x_test") or {}
    if knobs.get("hang"):
        gevent.sleep(knobs["hang"])
    if knobs.get("status"):
        return _json(start, knobs["status"], {"error": {
            "message": f"scripted {knobs['status']}", "type": "test_error", "code": "scripted"}})
    model = body.get("model", "m")
    if path == "/v1/embeddings":
        return _embeddings(start, model, body)
    if body.get("stream"):
        start("200 OK", [("Content-Type", "text/event-stream")])
        return _stream(model, int(knobs.get("chunks", 3)), float(knobs.get("delay", 0)),
                       knobs.get("break_after"))
    if path == "/v1/completions":
        doc = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": model,
               "choices": [{"index": 0, "text": f"hello from {NAME}", "finish_reason": "stop"}]}
        return _json(start, 200, doc)
    return _json(start, 200, _completion(model, f"hello from {NAME}"))


def main(argv: list[str] | None = None) -> None:
    """``PORT [NAME]``: serve on 127.0.0.1:PORT until killed."""
    global NAME
    args = sys.argv[1:] if argv is None else argv
    port = int(args[0])
    NAME = args[1] if len(args) > 1 else "up"
    WSGIServer(("127.0.0.1", port), app, handler_class=_Handler, log=None).serve_forever()


if __name__ == "__main__":
    main()
