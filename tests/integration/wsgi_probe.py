"""A WSGI app for the worker tests: it answers with what the worker gave it (the environ's
HTTP fields, which response and request-parsing code served it, and the body it read; under
``/unread`` it reads none). ``/environ`` answers with every text value of the environ,
``/stream`` with a body of unknown length, ``/fail`` raises before answering, ``/gc`` with
the garbage collector's thresholds and frozen object count.

Loaded as a gunicorn config too (``-c python:tests.integration.wsgi_probe``): its hooks add
a field to every request before the environ is made and count the requests after."""

from __future__ import annotations

import gc
import json
import os
from typing import Any


def pre_request(worker: Any, req: Any) -> None:
    req.headers.append(("X-HOOK", f"{req.method} {req.path}"))


def post_request(worker: Any, req: Any, environ: Any, resp: Any) -> None:
    path = os.environ.get("PROBE_POST_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{req.method} {req.path} {getattr(resp, 'status', None)}\n")


def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    from gunicorn.http import wsgi
    from gunicorn.http.parser import RequestParser

    path = environ["PATH_INFO"]
    if path == "/fail":
        raise RuntimeError("the probe fails")
    length = environ.get("CONTENT_LENGTH")
    unread = path.startswith("/unread")  # leaves the body to the server
    stream = environ["wsgi.input"]
    if unread:
        body = b""
    elif path.startswith("/lines"):
        body = b"|".join(stream.readlines())
    else:
        body = stream.read(int(length)) if length else stream.read()
    answer = json.dumps({
        "create": f"{wsgi.create.__module__}.{wsgi.create.__name__}",
        "finish_body": RequestParser.finish_body.__module__,
        "response": type(getattr(start_response, "__self__", None)).__name__,
        "input": type(stream).__name__,
        "fields": {k: v for k, v in environ.items() if k.startswith("HTTP_X_")},
        "path": path,
        "body": body.decode(),
        "environ": {k: v for k, v in environ.items() if type(v) in (str, bool, tuple)}
        if path == "/environ" else None,
        "gc": {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}
        if path == "/gc" else None,
    }).encode()
    if path == "/stream":
        start_response("200 OK", [("Content-Type", "application/json"), ("X-Probe", "1")])
        return [answer[:5], answer[5:]]
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(answer))), ("X-Probe", "1")])
    return [answer]
