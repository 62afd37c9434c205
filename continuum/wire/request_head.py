"""A fast path for reading the common HTTP/1.x request head, in front of gunicorn's parser.

gunicorn's request parser checks every rule of RFC 9110/9112 line by line, through several
copies of the buffer; on a small proxied request that is about a tenth of the router's CPU.
:class:`FastRequest` is gunicorn's own ``Request`` whose ``parse`` first tries one strict
pattern per line over a head that arrived whole, and accepts it only when gunicorn would
accept it *and* build exactly the same request from it:

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
The body reader, keep-alive and pipelining are gunicorn's in both cases.
"""

from __future__ import annotations

import re
from typing import Any

from gunicorn.http.message import Request

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


def _targets_anthropic(data: bytes) -> bool:
    """Whether the request line starting ``data`` (however long, or cut short) asks for a
    path under ``/anthropic/``."""
    space = data.find(b" ", 0, 32)  # after the method
    return space > 0 and data.startswith(b"/anthropic/", space + 1)


class FastRequest(Request):  # type: ignore[misc]
    """gunicorn's ``Request``, parsed by the strict fast path when the head allows it."""

    #: For a head the fast path parsed: what its ``Connection`` field and version say of
    #: closing after this request (``should_close`` is asked three times per request).
    _close: bool | None = None

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
        """Set method, target, version and headers from ``data[:end]`` and return True, or
        return False (nothing set) when gunicorn's parser must judge the head."""
        if end + 4 > self.max_buffer_headers:
            return False
        head = data[:end].decode("latin-1")
        lines = head.split("\r\n")
        if data.count(b"\n", 0, end) != len(lines) - 1 or \
                data.count(b"\r", 0, end) != len(lines) - 1:
            return False  # a bare CR or LF
        line = lines[0]
        limit = self.limit_request_line
        if limit > 0 and len(line) > limit:
            return False
        match = _REQUEST_LINE.fullmatch(line)
        if match is None:
            return False
        method, target, minor = match.groups()
        if target.startswith("//"):  # urlsplit would read an authority there
            return False
        if len(lines) - 1 > self.limit_request_fields:
            return False
        fields = lines[1:]
        # the field lines with their CRLFs: from the request line's end to the blank line
        if fields and _FIELDS.fullmatch(data, len(line) + 2, end + 2) is None:
            return False
        field_limit = self.limit_request_field_size
        secure = self.cfg.secure_scheme_headers
        headers = []
        seen = set()
        for line in fields:
            if len(line) + 2 > field_limit:
                return False
            name, _, value = line.partition(":")
            name = name.upper()
            value = value.strip(" \t")
            if name in _SPECIAL or name in secure:
                return False
            if name in _SINGLETONS:
                if name in seen:
                    return False
                seen.add(name)
            headers.append((name, value))
        path, _, query = target.partition("?")
        close = minor == "0"  # no Connection field: HTTP/1.0 closes, 1.1 keeps alive
        for name, value in headers:
            if name == "CONNECTION":  # the first one decides, as gunicorn reads it
                token = value.lower().strip(" \t")
                if token == "close":
                    close = True
                elif token == "keep-alive":
                    close = False
                break
        self._close = close
        self.method, self.uri, self.version = method, target, (1, int(minor))
        self.path, self.query, self.fragment = path, query, ""
        self.headers = headers
        return True
