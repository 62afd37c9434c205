"""A fast path for reading the common HTTP/1.x request head, in front of gunicorn's parser.

gunicorn's request parser checks every rule of RFC 9110/9112 line by line, through several
copies of the buffer; on a small proxied request that is about a tenth of the router's CPU.
:class:`FastRequest` is gunicorn's own ``Request`` whose ``parse`` first tries two strict
patterns over a head that arrived whole (one for the request line, one for all the field
lines at once), and accepts it only when gunicorn would accept it *and* build exactly the
same request from it:

* a request line ``METHOD /target HTTP/1.0|1.1`` within ``limit_request_line``, with an
  upper-case well-known method and a target of printable ASCII without a fragment;
* header lines ``token: value`` (no ``_`` in the name, no control characters in the
  value), at most ``limit_request_fields`` of them, each within
  ``limit_request_field_size``, the whole head within gunicorn's header buffer limit;
* none of the fields with rules of their own: ``Expect``, ``Transfer-Encoding``, the
  ``secure_scheme_headers``, and no second ``Host`` or ``Content-Type``.

Anything else — a head still incomplete, a PROXY protocol preamble, obsolete line folding,
a bare LF, a limit exceeded, a malformed line — goes to gunicorn's parser untouched (the
bytes read are handed back first), which accepts or refuses it as it always did (the
router's worker writes its refusals in JSON: :func:`continuum.gunicorn_worker._write_refusal`).
The body reader, keep-alive and pipelining are gunicorn's in both cases; for a head it took,
the fast path answers gunicorn's questions about it from what it found while parsing (the
``Connection`` field, a plain ``Content-Length``) instead of reading the headers again, and
leaves any other ``Content-Length`` to gunicorn's own checks.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from gunicorn.http.body import Body, LengthReader
from gunicorn.http.message import Request
from gunicorn.http.parser import RequestParser

#: gunicorn's own ``Parser.finish_body``, for every body :func:`finish_body` cannot vouch for.
_gunicorn_finish_body = RequestParser.finish_body

#: The request line of the fast path; anything else is left to gunicorn.
_REQUEST_LINE = re.compile(
    r"(GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) (/[\x21-\x22\x24-\x7e]*) HTTP/1\.([01])")
#: Every header line of the head at once (its bytes), each ``name:value`` and its CRLF: a token
#: without ``_`` for the name, and a value without the characters gunicorn refuses
#: there (RFC 9110 5.5: controls but HTAB, and DEL). One match for the whole block; each
#: line is then split at its first colon and its value stripped of blanks, as gunicorn
#: strips them.
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*")
#: Fields gunicorn gives rules of their own: always left to it.
_SPECIAL = frozenset(("EXPECT", "TRANSFER-ENCODING"))
#: Fields that may appear once (gunicorn refuses a second one).
_SINGLETONS = frozenset(("HOST", "CONTENT-TYPE"))


def _count(headers: list[tuple[str, str]], name: str) -> int:
    """How many of ``headers`` are named ``name`` (for a head that repeats a name)."""
    return [field for field, _ in headers].count(name)


def _body_length(headers: list[tuple[str, str]], fields: dict[str, str]) -> int | None:
    """The length gunicorn's ``set_body_reader`` finds for a head without Transfer-Encoding:
    0 without Content-Length, its number when it has one plain one; None for anything else
    (a second one, a sign, blanks inside, other digits), which gunicorn's method judges."""
    value = fields.get("CONTENT-LENGTH")
    if value is None:
        return 0  # gunicorn's Request reads no body then (not until EOF)
    # ASCII digits only: gunicorn's isnumeric() also admits "²", which its int() refuses; and
    # few enough to stay clear of int()'s limit on digits
    if not (len(value) <= 18 and value.isascii() and value.isdigit()):
        return None
    if len(fields) < len(headers) and _count(headers, "CONTENT-LENGTH") > 1:
        return None
    return int(value)


def _targets_anthropic(data: bytes) -> bool:
    """Whether the request line starting ``data`` (however long, or cut short) asks for a
    path under ``/anthropic/``."""
    space = data.find(b" ", 0, 32)  # after the method
    return space > 0 and data.startswith(b"/anthropic/", space + 1)


def length_left(body: Any) -> int | None:
    """How many bytes of a request body of known length (gunicorn's ``Body`` over a
    ``LengthReader``) the application has not read yet, when none of what it read is held
    back in the body's own buffer; None for any other body."""
    if type(body) is not Body:
        return None
    reader = body.reader
    if type(reader) is not LengthReader or body.buf.tell():
        return None
    left: int = reader.length
    return left


def finish_body(parser: Any, deadline: float | None = None,
                max_bytes: int | None = None) -> bool:
    """gunicorn's ``Parser.finish_body`` (drain what the application left unread of the
    current request's body before reading the next request): True at once when the body
    is of known length and was read to its end, which is what gunicorn's drain finds there
    after a read of nothing, its socket timeout set and put back; gunicorn's method for
    anything else. The router's worker installs it on gunicorn's ``RequestParser``."""
    body: Any = getattr(parser.mesg, "body", None)
    if length_left(body) == 0 and not body.failed:
        return True
    return _gunicorn_finish_body(parser, deadline, max_bytes)  # type: ignore[no-any-return]


class FastRequest(Request):  # type: ignore[misc]
    """gunicorn's ``Request``, parsed by the strict fast path when the head allows it."""

    #: For a head the fast path parsed: what its ``Connection`` field and version say of
    #: closing after this request (``should_close`` is asked three times per request).
    _close: bool | None = None

    #: For a head the fast path parsed: the body length gunicorn's ``set_body_reader`` would
    #: find, when it is a plain one (None: its method finds it, or refuses the head).
    _length: int | None = None

    def set_body_reader(self) -> None:
        """gunicorn's body reader; for a plain length, made without reading the headers
        again."""
        length = self._length
        if length is None:
            super().set_body_reader()
        else:
            self.body = Body(LengthReader(self.unreader, length))

    def should_close(self) -> bool:
        """gunicorn's answer: ``must_close``, else what the head says."""
        close = self._close
        if close is None:
            return super().should_close()  # type: ignore[no-any-return]
        return bool(self.must_close) or close

    def parse(self, unreader: Any) -> bytes:
        """Parse the head; the bytes read past it (gunicorn's contract)."""
        mode = getattr(self.cfg, "proxy_protocol", "off")
        if mode and mode != "off" and self.req_number == 1:
            return super().parse(unreader)  # type: ignore[no-any-return]
        data = unreader.read()
        if not data:
            raise StopIteration()  # as gunicorn: the client closed between requests
        end = data.find(b"\r\n\r\n")
        if end < 0 or not self._parse_strict(data, end):
            unreader.unread(data)  # gunicorn's parser starts from the same bytes
            try:
                return super().parse(unreader)  # type: ignore[no-any-return]
            except Exception as exc:
                # A head refused before it had a path (a request line or headers over the
                # limits): say which API it was for, so the refusal takes that API's shape.
                exc.continuum_anthropic = _targets_anthropic(data)  # type: ignore[attr-defined]
                raise
        return data[end + 4:]  # type: ignore[no-any-return]

    def _parse_strict(self, data: bytes, end: int) -> bool:
        """Set method, target, version, headers, ``_close`` and ``_length`` from
        ``data[:end]`` and return True, or return False (nothing set) when gunicorn's parser
        must judge the head."""
        head = parse_head(data, end, HeadRules(
            self.max_buffer_headers, self.limit_request_line, self.limit_request_fields,
            self.limit_request_field_size, self.cfg.secure_scheme_headers))
        if head is None:
            return False
        method, target, minor, path, query, headers, close, length = head
        self._close = close
        self._length = length
        self.method, self.uri, self.version = method, target, (1, minor)
        self.path, self.query, self.fragment = path, query, ""
        self.headers = headers
        return True


class HeadRules(NamedTuple):
    """gunicorn's limits on a request head, as its ``Request`` sets them from the config
    (:func:`head_rules`), and the names of its ``secure_scheme_headers``."""

    max_head: int  #: ``max_buffer_headers``: the whole head with its blank line
    line_limit: int  #: ``limit_request_line`` (0: none)
    max_fields: int  #: ``limit_request_fields``
    field_limit: int  #: ``limit_request_field_size``, a line with its CRLF
    secure_headers: Any  #: ``secure_scheme_headers`` (upper-case names)


#: A head :func:`parse_head` took: method, target, minor version (0 or 1), path, query,
#: the ``(NAME, value)`` fields, whether it asks to close after the answer, and its body
#: length (None: a ``Content-Length`` gunicorn must judge).
Head = tuple[str, str, int, str, str, list[tuple[str, str]], bool, "int | None"]


def head_rules(cfg: Any) -> HeadRules:
    """The :class:`HeadRules` gunicorn's ``Request`` derives from ``cfg`` (its own
    ``__init__`` computes them, on a request that reads nothing)."""

    class _Limits(Request):  # type: ignore[misc]
        def parse(self, unreader: Any) -> bytes:
            return b""

        def set_body_reader(self) -> None:
            return None

    class _Nothing:
        def unread(self, data: bytes) -> None:
            return None

    probe = _Limits(cfg, _Nothing(), ("", 0))
    return HeadRules(probe.max_buffer_headers, probe.limit_request_line,
                     probe.limit_request_fields, probe.limit_request_field_size,
                     cfg.secure_scheme_headers)


def parse_head(data: bytes, end: int, rules: HeadRules) -> Head | None:
    """The request head ``data[:end]`` (``end``: where its blank line starts) when it is on
    the fast path (see the module doc) and gunicorn would read it the same way; None when
    gunicorn's parser must judge it."""
    if end + 4 > rules.max_head:
        return None
    head = data[:end + 2].decode("latin-1")  # every line with its CRLF
    eol = head.find("\r\n")  # the request line's end
    limit = rules.line_limit
    if limit > 0 and eol > limit:
        return None
    match = _REQUEST_LINE.fullmatch(head, 0, eol)
    if match is None:
        return None
    method, target, minor = match.groups()
    if target.startswith("//"):  # urlsplit would read an authority there
        return None
    # The field lines with their CRLFs. Once they match _FIELDS, no line of the head has
    # a bare CR or LF (the request line has neither, by _REQUEST_LINE).
    start, stop = eol + 2, end + 2
    if _FIELDS.fullmatch(data, start, stop) is None:
        return None
    lines = head[start:end].split("\r\n") if end > eol else []
    if len(lines) > rules.max_fields:
        return None
    # gunicorn counts a line with its CRLF; no line of a block within the limit exceeds it
    field_limit = rules.field_limit
    if stop - start > field_limit and max(map(len, lines)) + 2 > field_limit:
        return None
    headers = []
    for line in lines:
        name, _, value = line.partition(":")
        headers.append((name.upper(), value.strip(" \t")))
    fields = dict(reversed(headers))  # each name once, with its first value
    names = fields.keys()
    if not names.isdisjoint(_SPECIAL) or not names.isdisjoint(rules.secure_headers):
        return None
    if len(fields) < len(headers) and any(_count(headers, name) > 1 for name in _SINGLETONS):
        return None  # gunicorn refuses a second one
    close = minor == "0"  # no Connection field: HTTP/1.0 closes, 1.1 keeps alive
    connection = fields.get("CONNECTION")  # the first one decides, as gunicorn reads it
    if connection is not None:
        token = connection.lower()  # stripped already
        if token == "close":
            close = True
        elif token == "keep-alive":
            close = False
    path, _, query = target.partition("?")
    return (method, target, int(minor), path, query, headers, close,
            _body_length(headers, fields))
