"""A WSGI app for the worker tests: it answers with what the worker gave it (the environ's
HTTP fields, which response and request-parsing code served it, and the body it read; under
``/unread`` it reads none)."""

from __future__ import annotations

import json
from typing import Any


def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    from gunicorn.http import wsgi
    from gunicorn.http.parser import RequestParser

    length = int(environ.get("CONTENT_LENGTH") or 0)
    unread = environ["PATH_INFO"].startswith("/unread")  # leaves the body to the server
    body = environ["wsgi.input"].read(length) if length and not unread else b""
    answer = json.dumps({
        "create": f"{wsgi.create.__module__}.{wsgi.create.__name__}",
        "finish_body": RequestParser.finish_body.__module__,
        "response": type(getattr(start_response, "__self__", None)).__name__,
        "fields": {k: v for k, v in environ.items() if k.startswith("HTTP_X_")},
        "path": environ["PATH_INFO"],
        "body": body.decode(),
    }).encode()
    start_response("200 OK", [("Content-Type", "application/json"),
                              ("Content-Length", str(len(answer))), ("X-Probe", "1")])
    return [answer]
