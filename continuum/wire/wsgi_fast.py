"""The WSGI environ and response of a request, with less Python per request than gunicorn's.

gunicorn builds both for every request in ``gunicorn.http.wsgi.create``: a fresh base
environ, the header fields one by one through several branches, and a ``Response`` that
checks each header the application gives with two patterns, lower-cases its name and asks
whether it is hop-by-hop, then formats the head from a list of pieces. On a small proxied
request that is about an eighth of the router's Python bytecodes
(``tools.bench.instructions``). This module does the same work for the common case:

* :func:`create` builds the environ of a request the strict fast path of
  :class:`~continuum.wire.request_head.FastRequest` parsed, reached over TCP, with no
  PROXY protocol, no ``SCRIPT_NAME`` and no repeated field, from a per-worker template and
  a cache of field names; anything else goes to gunicorn's ``create`` unchanged.
* :class:`FastResponse` is gunicorn's ``Response``; a header whose name has been seen
  before and whose value needs no stripping is accepted without the per-header checks,
  the head is formatted in one step, and a body within its ``Content-Length`` or a
  chunked stream's piece is sent without the bookkeeping around it. Everything else is
  gunicorn's code path.
* :func:`read_held` takes a request body of known length that arrived with the head
  (gunicorn already holds all of it) without a timer or Falcon's stream around the read:
  nothing can wait.

The router's worker installs :func:`create` as ``gunicorn.http.wsgi.create`` in its own
process (:meth:`continuum.gunicorn_worker.GeventWorker.init_process`).
``tests/unit/test_wsgi_fast.py`` checks that both give the same environ and write the same
bytes (or raise the same error) for typical, unusual and randomly varied requests and
responses.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from gunicorn import SERVER_SOFTWARE
from gunicorn import util as gunicorn_util
from gunicorn.http import wsgi as gunicorn_wsgi

from continuum.wire.request_head import FastRequest, length_left

#: gunicorn's own ``create``, for everything outside the fast path.
_gunicorn_create = gunicorn_wsgi.create


#: A header value gunicorn keeps as it is: its characters (RFC 9110 5.5) with no blank
#: at either end (gunicorn strips those, and a value that needs it takes its path).
_PLAIN_VALUE = re.compile(
    r"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?").fullmatch

#: The most field names each cache below remembers; a name past it takes the long way.
_NAMES_KEPT = 512

#: Response header name -> its lower-case form, for names that are tokens and not
#: hop-by-hop (the only ones the short way takes).
_RESPONSE_NAMES: dict[str, str] = {}

#: Request field name (upper case, as the parser gives it) -> its environ key.
_ENVIRON_KEYS: dict[str, str] = {"CONTENT-TYPE": "CONTENT_TYPE",
                                  "CONTENT-LENGTH": "CONTENT_LENGTH"}

_PROTOCOLS = {(1, 0): "HTTP/1.0", (1, 1): "HTTP/1.1"}


def _early_hints(req: Any, sock: Any, resp: Any, headers: Any) -> None:
    """``wsgi.early_hints``: gunicorn's callback, made only when it is called."""
    gunicorn_wsgi._make_early_hints_callback(req, sock, resp)(headers)


@functools.lru_cache(maxsize=4)
def _template(multiprocess: bool) -> dict[str, Any]:
    """The environ keys that are the same for every request of a worker."""
    return {
        "wsgi.version": (1, 0),
        "wsgi.multithread": False,
        "wsgi.multiprocess": multiprocess,
        "wsgi.run_once": False,
        "wsgi.file_wrapper": gunicorn_wsgi.FileWrapper,
        "wsgi.input_terminated": True,
        "SERVER_SOFTWARE": SERVER_SOFTWARE,
        "SCRIPT_NAME": "",
    }


def create(req: Any, sock: Any, client: Any, server: Any, cfg: Any,
           response_class: Any = None, response_args: tuple[Any, ...] = (),
           ) -> tuple[Any, dict[str, Any]]:
    """``gunicorn.http.wsgi.create``: the (response, environ) pair of a request."""
    if response_class is not None or response_args:
        return _gunicorn_create(req, sock, client, server, cfg, response_class, response_args)  # type: ignore[no-any-return]
    environ = _fields_environ(req, client, server, cfg)
    if environ is None:
        return _gunicorn_create(req, sock, client, server, cfg, FastResponse)  # type: ignore[no-any-return]
    path = req.path
    resp = FastResponse(req, sock, cfg)
    environ.update({
        "wsgi.errors": gunicorn_wsgi.WSGIErrorsWrapper(cfg),
        "wsgi.input": req.body,
        "gunicorn.socket": sock,
        "REQUEST_METHOD": req.method,
        "QUERY_STRING": req.query,
        "RAW_URI": req.uri,
        "SERVER_PROTOCOL": _PROTOCOLS[req.version],
        "wsgi.url_scheme": req.scheme,
        "REMOTE_ADDR": client[0],
        "REMOTE_PORT": str(client[1]),
        "SERVER_NAME": server[0],
        "SERVER_PORT": str(server[1]),
        "PATH_INFO": gunicorn_util.unquote_to_wsgi_str(path) if "%" in path else path,
        "wsgi.early_hints": functools.partial(_early_hints, req, sock, resp),
    })
    return resp, environ


def _fields_environ(req: Any, client: Any, server: Any, cfg: Any) -> dict[str, Any] | None:
    """The worker's template with the request's fields, for a request of the fast path
    (see the module doc); None when gunicorn's ``create`` must build the environ."""
    if (type(req) is not FastRequest or req._close is None or req.proxy_protocol_info
            or type(server) is not tuple or type(client) is not tuple
            or os.environ.get("SCRIPT_NAME")):
        return None
    environ = _template(cfg.workers > 1).copy()
    keys = _ENVIRON_KEYS
    for name, value in req.headers:
        key = keys.get(name)
        if key is None:
            key = "HTTP_" + name.replace("-", "_")
            if len(keys) < _NAMES_KEPT:
                keys[name] = key
        if key in environ:  # a repeated field: gunicorn joins them
            return None
        environ[key] = value
    return environ


class FastResponse(gunicorn_wsgi.Response):  # type: ignore[misc]
    """gunicorn's ``Response`` with short ways for the common headers, head and body."""

    def process_headers(self, headers: Any) -> None:
        """Keep the application's headers as gunicorn does: a header seen before (a token
        name, not hop-by-hop) with a plain value is kept as it is; any other goes through
        gunicorn's checks, one header at a time, in order."""
        names = _RESPONSE_NAMES
        kept = self.headers
        for name, value in headers:
            lower = names.get(name) if type(name) is str else None
            if lower is None or type(value) is not str or _PLAIN_VALUE(value) is None:
                super().process_headers(((name, value),))  # raises unless name is a token
                if lower is None and type(name) is str and len(names) < _NAMES_KEPT \
                        and not gunicorn_util.is_hoppish(name):
                    names[name] = name.lower()
                continue
            if lower == "content-length":
                self.response_length = int(value)
            kept.append((name, value))

    def send_headers(self) -> None:
        """The head in one piece: gunicorn's ``default_headers`` and the application's."""
        if self.headers_sent:  # type: ignore[has-type]
            return
        if self.upgrade:
            super().send_headers()
            return
        major, minor = self.req.version
        connection = "close" if self.should_close() else "keep-alive"
        chunked = "Transfer-Encoding: chunked\r\n" if self.chunked else ""
        fields = "".join(map("%s: %s\r\n".__mod__, self.headers))  # each header a pair
        head = (f"HTTP/{major}.{minor} {self.status}\r\nServer: {self.version}\r\n"
                f"Date: {gunicorn_util.http_date()}\r\nConnection: {connection}\r\n"
                f"{chunked}{fields}\r\n")
        self.sock.sendall(head.encode("latin-1"))
        self.headers_sent = True

    def write(self, arg: Any) -> None:
        """gunicorn's ``write``; bytes that fit within a known ``Content-Length``, and a
        stream's pieces, are sent straight away."""
        if not self.headers_sent:
            self.send_headers()
        if type(arg) is bytes and arg and not self._omits_body:
            length = self.response_length
            if length is not None and self.sent + len(arg) <= length:
                self.sent += len(arg)
                self.sock.sendall(arg)
                return
            if self.chunked:  # a stream's piece, framed as gunicorn's write_chunk frames it
                self.sent += len(arg)
                self.sock.sendall(b"%X\r\n%b\r\n" % (len(arg), arg))
                return
        super().write(arg)


def read_held(stream: Any, length: int) -> bytes | None:
    """The whole body of ``length`` bytes from gunicorn's ``wsgi.input`` ``stream`` when
    gunicorn already holds all of it and none has been read, read as ``stream.read`` would
    read it (the same bytes, the reader left at the body's end); None otherwise, when
    reading could wait for the client."""
    if length_left(stream) != length:
        return None
    reader = stream.reader
    if reader.unreader.buf.seek(0, os.SEEK_END) < length:
        return None
    data: bytes = reader.read(length)
    return data
