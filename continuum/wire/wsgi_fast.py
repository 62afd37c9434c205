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

from continuum.wire.plain import HeldInput, PlainRequest
from continuum.wire.request_head import FastRequest, length_left

#: gunicorn's own ``create``, for everything outside the fast path.
_gunicorn_create = gunicorn_wsgi.create


#: A header value gunicorn keeps as it is: its characters (RFC 9110 5.5) with no blank
#: at either end (gunicorn strips those, and a value that needs it takes its path).
_PLAIN_VALUE = re.compile(
    r"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?").fullmatch

#: Any number of plain values (:data:`_PLAIN_VALUE`), each followed by a LF (which no plain
#: value contains): all the values of an answer's headers checked at once (with a count of
#: the LFs, so that no value brought one of its own).
_PLAIN_VALUES = re.compile(
    r"(?:(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?\n)*"
).fullmatch

#: The most field names each cache below remembers; a name past it takes the long way.
_NAMES_KEPT = 512

#: Response header name -> its lower-case form, for names that are tokens and not
#: hop-by-hop (the only ones the short way takes).
_RESPONSE_NAMES: dict[str, str] = {}

#: The names of a header list whose every name is in :data:`_RESPONSE_NAMES` -> the
#: position of its last ``Content-Length`` (-1: none).
_NAME_LISTS: dict[tuple[str, ...], int] = {}

#: Request field name (upper case, as the parser gives it) -> its environ key.
_ENVIRON_KEYS: dict[str, str] = {"CONTENT-TYPE": "CONTENT_TYPE",
                                  "CONTENT-LENGTH": "CONTENT_LENGTH"}

_PROTOCOLS = {(1, 0): "HTTP/1.0", (1, 1): "HTTP/1.1"}

#: Status lines gunicorn's ``start_response`` accepted -> their code, for codes whose
#: answers have a body (200-599 but 204 and 304); another status takes gunicorn's way.
_STATUSES: dict[str, int] = {}


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
    return _with_request(environ, req, sock, client, server, cfg), environ


def _fields_environ(req: Any, client: Any, server: Any, cfg: Any) -> dict[str, Any] | None:
    """The worker's template with the request's fields, for a request of the fast path
    (see the module doc); None when gunicorn's ``create`` must build the environ."""
    if (type(req) is not FastRequest or req._close is None or req.proxy_protocol_info
            or type(server) is not tuple or type(client) is not tuple
            or os.environ.get("SCRIPT_NAME")):
        return None
    return _headers_environ(req.headers, cfg)


def _headers_environ(headers: list[tuple[str, str]], cfg: Any) -> dict[str, Any] | None:
    """The worker's template with ``headers`` (upper-case names), or None for a repeated
    field (gunicorn joins them)."""
    environ = _template(cfg.workers > 1).copy()
    if not headers:
        return environ
    names, values = zip(*headers, strict=True)
    try:
        keys = list(map(_ENVIRON_KEYS.__getitem__, names))
    except KeyError:  # a name not seen before
        keys = [_environ_key(name) for name in names]
    size = len(environ) + len(keys)
    environ.update(zip(keys, values, strict=True))
    # a repeated field (gunicorn joins them) adds fewer keys than fields
    return environ if len(environ) == size else None


def _environ_key(name: str) -> str:
    """The environ key of a request field (remembered for the next time)."""
    key = _ENVIRON_KEYS.get(name)
    if key is None:
        key = "HTTP_" + name.replace("-", "_")
        if len(_ENVIRON_KEYS) < _NAMES_KEPT:
            _ENVIRON_KEYS[name] = key
    return key


def create_plain(req: PlainRequest, sock: Any, client: tuple[Any, ...],
                 server: tuple[Any, ...], cfg: Any) -> tuple[Any, dict[str, Any]]:
    """What :func:`create` makes for a request of the worker's own loop (a TCP client
    and listener, no PROXY protocol, no ``SCRIPT_NAME``: the loop's conditions), with
    ``wsgi.multithread`` as gunicorn's worker sets it after."""
    environ = _headers_environ(req.headers, cfg)
    if environ is None:  # a repeated field: gunicorn joins them
        resp, environ = _gunicorn_create(req, sock, client, server, cfg, FastResponse)
    else:
        resp = _with_request(environ, req, sock, client, server, cfg)
    environ["wsgi.multithread"] = True
    return resp, environ


def _with_request(environ: dict[str, Any], req: Any, sock: Any, client: tuple[Any, ...],
                  server: tuple[Any, ...], cfg: Any) -> FastResponse:
    """Add the request's own keys to ``environ`` (the template with its fields); its
    response."""
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
    return resp


class FastResponse(gunicorn_wsgi.Response):  # type: ignore[misc]
    """gunicorn's ``Response`` with short ways for the common headers, head and body."""

    def process_headers(self, headers: Any) -> None:
        """Keep the application's headers as gunicorn does. A list of ``(name, value)``
        pairs whose names all were seen before (tokens, not hop-by-hop), in that order,
        with plain values, is kept as it is, its values checked in one match; otherwise
        a header seen before with a plain value is kept as it is, and any other goes
        through gunicorn's checks, one header at a time, in order."""
        if type(headers) is list:
            try:
                at = _NAME_LISTS.get(tuple([name for name, _ in headers]))
                if at is not None:
                    values = "\n".join([value for _, value in headers]) + "\n"
                    # as many LFs as values: none of them brought one of its own
                    if values.count("\n") == len(headers) and _PLAIN_VALUES(values):
                        if at >= 0:
                            self.response_length = int(headers[at][1])
                        self.headers.extend(map(tuple, headers))
                        return
            except (TypeError, ValueError):  # not pairs, unhashable names, values not text
                pass
        self._process_each(headers)

    def _process_each(self, headers: Any) -> None:
        names = _RESPONSE_NAMES
        kept = self.headers
        listed: list[str] | None = []  # the names, while all are known (for _NAME_LISTS)
        for name, value in headers:
            lower = names.get(name) if type(name) is str else None
            if lower is None or type(value) is not str or _PLAIN_VALUE(value) is None:
                super().process_headers(((name, value),))  # raises unless name is a token
                if lower is None and type(name) is str and len(names) < _NAMES_KEPT \
                        and not gunicorn_util.is_hoppish(name):
                    names[name] = lower = name.lower()
            else:
                if lower == "content-length":
                    self.response_length = int(value)
                kept.append((name, value))
            if lower is None or type(name) is not str:
                listed = None
            elif listed is not None:
                listed.append(name)
        if listed is not None and len(_NAME_LISTS) < _NAMES_KEPT:
            lowers = [names[name] for name in listed]
            at = len(lowers) - 1 - lowers[::-1].index("content-length") \
                if "content-length" in lowers else -1
            _NAME_LISTS[tuple(listed)] = at

    def start_response(self, status: Any, headers: Any, exc_info: Any = None) -> Any:
        """gunicorn's ``start_response``; for a status seen before whose answer has a body,
        to a request other than HEAD, without gunicorn's checks of the status line."""
        code = _STATUSES.get(status) if type(status) is str else None
        started = self.status is not None  # type: ignore[has-type]
        if code is None or exc_info is not None or started or self.req.method == "HEAD":
            write = super().start_response(status, headers, exc_info)
            code = self.status_code  # type: ignore[has-type]
            if type(code) is int and 200 <= code < 600 and code not in (204, 304) \
                    and len(_STATUSES) < _NAMES_KEPT:
                _STATUSES[status] = code
            return write
        self.status = status
        self.status_code = code
        self.process_headers(headers)
        # the answer has a body (no HEAD, 1xx, 204 or 304): gunicorn's is_chunked
        self.chunked = self.response_length is None and self.req.version > (1, 0) \
            and getattr(self.cfg, "protocol", "http") != "uwsgi"
        return self.write

    def _head(self) -> bytes:
        """gunicorn's ``default_headers`` and the application's, in one piece."""
        major, minor = self.req.version
        connection = "close" if self.should_close() else "keep-alive"
        chunked = "Transfer-Encoding: chunked\r\n" if self.chunked else ""
        fields = "".join(map("%s: %s\r\n".__mod__, self.headers))  # each header a pair
        return (f"HTTP/{major}.{minor} {self.status}\r\nServer: {self.version}\r\n"
                f"Date: {gunicorn_util.http_date()}\r\nConnection: {connection}\r\n"
                f"{chunked}{fields}\r\n").encode("latin-1")

    def send_headers(self) -> None:
        """The head in one piece: gunicorn's ``default_headers`` and the application's."""
        if self.headers_sent:  # type: ignore[has-type]
            return
        if self.upgrade:
            super().send_headers()
            return
        self.sock.sendall(self._head())
        self.headers_sent = True

    def write(self, arg: Any) -> None:
        """gunicorn's ``write``; bytes that fit within a known ``Content-Length``, and a
        stream's pieces, are sent straight away; a whole body written at once goes with
        the head, in one send."""
        if type(arg) is bytes and arg and not self._omits_body:
            length = self.response_length
            if not self.headers_sent:  # type: ignore[has-type]
                if length != len(arg) or self.upgrade:
                    self.send_headers()
                else:  # the whole body: with the head
                    data = self._head() + arg
                    self.headers_sent = True
                    self.sent = length
                    getattr(self.sock, "send_whole", self.sock.sendall)(data)
                    return
            if length is not None and self.sent + len(arg) <= length:
                self.sent += len(arg)
                self.sock.sendall(arg)
                return
            if self.chunked:  # a stream's piece, framed as gunicorn's write_chunk frames it
                self.sent += len(arg)
                self.sock.sendall(b"%X\r\n%b\r\n" % (len(arg), arg))
                return
        elif not self.headers_sent:  # type: ignore[has-type]
            self.send_headers()
        super().write(arg)


def read_held(stream: Any, length: int) -> bytes | None:
    """The whole body of ``length`` bytes from gunicorn's ``wsgi.input`` ``stream`` when
    gunicorn already holds all of it and none has been read, read as ``stream.read`` would
    read it (the same bytes, the reader left at the body's end); None otherwise, when
    reading could wait for the client."""
    if type(stream) is HeldInput:
        return stream.whole(length)
    if length_left(stream) != length:
        return None
    reader = stream.reader
    if reader.unreader.buf.seek(0, os.SEEK_END) < length:
        return None
    data: bytes = reader.read(length)
    return data
