"""An incremental Server-Sent Events parser with hard memory caps.

It follows the WHATWG "event stream interpretation" rules (lines end in CRLF, LF or CR; a
leading BOM is dropped; ``:`` lines are comments; ``data:`` lines join with ``\\n``; one
optional space after the colon is stripped; a record ends at a blank line; a record without
``data`` dispatches nothing; a partial record at end of stream is discarded), but unlike a
browser it refuses to buffer without bound: a line, or the accumulated ``data`` of one
record, longer than :data:`MAX_SSE_BUFFER_SIZE` raises :class:`SseOverflowError` before the
excess is stored. A stream that sends ``data:`` forever without a newline (or without a blank
line) therefore costs at most one cap of memory per buffer, and the caller reconnects from
its last event id.

The parser works on bytes (``\\r`` and ``\\n`` never occur inside a UTF-8 multi-byte
sequence) and decodes each complete line as UTF-8 with replacement, so a chunk boundary may
fall anywhere, even inside a character, a CRLF pair or the BOM.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection

from continuum.errors import ContinuumError

#: Cap on the unterminated line buffer and on the accumulated ``data`` of one record.
MAX_SSE_BUFFER_SIZE = 1 << 20

#: TCP keepalive for long-lived event streams: a dead peer is noticed in about two minutes
#: without a read timeout that would churn quiet but healthy streams.
KEEPALIVE_OPTIONS: tuple[tuple[int, int, int], ...] = (
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *((socket.IPPROTO_TCP, getattr(socket, name), value)
      for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6))
      if hasattr(socket, name)),
)
READ_SIZE = 64 * 1024

_BOM = b"\xef\xbb\xbf"
_EOL = re.compile(rb"[\r\n]")


class StreamOverflowError(ContinuumError, BufferError):
    """A line, record or message went over its cap; the stream must be dropped.

    Shared by the SSE parser and the WebSocket client (:mod:`continuum.wire.websocket`).
    """

    def __init__(self, message: str, *, what: str, size: int, limit: int) -> None:
        super().__init__(message, what=what, size=size, limit=limit)
        self.what = what
        self.size = size
        self.limit = limit


SseOverflowError = StreamOverflowError


@dataclass(frozen=True, slots=True)
class SseRecord:
    """One dispatched record.

    Attributes:
        event: The ``event:`` field, or None when the record had none (or an empty one).
        data: The ``data:`` lines joined with ``\\n``; None when the record had no ``data``
            field (then only ``id`` is meaningful: the spec still moves the last event id).
        id: The ``id:`` field of this record, None when it had none. An empty string means
            "forget the last event id" (spec behaviour).
    """

    event: str | None
    data: str | None
    id: str | None


class SseParser:
    """Feed raw bytes, get complete records back.

    Attributes:
        retry_ms: The last valid ``retry:`` value seen (milliseconds), or None.
        line_high_water: The longest unterminated line ever buffered (bytes, <= ``limit``).
        data_high_water: The most record data ever accumulated (bytes, <= ``limit``).
            Tests read both to prove the caps hold.
    """

    __slots__ = ("_bom_checked", "_data", "_data_size", "_event", "_failed", "_has_data", "_id",
                 "_line", "_skip_lf", "data_high_water", "limit", "line_high_water", "retry_ms")

    def __init__(self, limit: int = MAX_SSE_BUFFER_SIZE) -> None:
        self.limit = limit
        self.retry_ms: int | None = None
        self.line_high_water = 0
        self.data_high_water = 0
        self._line = bytearray()
        self._data: list[str] = []
        self._data_size = 0
        self._event: str | None = None
        self._id: str | None = None
        self._has_data = False
        self._bom_checked = False
        self._skip_lf = False  # the previous chunk ended in CR: a leading LF completes a CRLF
        self._failed = False

    @property
    def buffered_bytes(self) -> int:
        """Bytes held right now: the unterminated line plus the current record's data."""
        return len(self._line) + self._data_size

    def feed(self, chunk: bytes) -> list[SseRecord]:
        """Consume ``chunk``; return the records it completed, in order.

        Raises:
            SseOverflowError: a line or a record's data went over the cap. The parser is
                unusable afterwards (every later call raises too).
        """
        if self._failed:
            raise SseOverflowError("SSE parser already overflowed", what="stream",
                                   size=0, limit=self.limit)
        if not self._bom_checked:
            chunk = self._strip_bom(chunk)
            if not self._bom_checked:
                return []
        records: list[SseRecord] = []
        pos = 0
        if self._skip_lf and chunk[:1] == b"\n":
            pos = 1
        self._skip_lf = False
        while True:
            match = _EOL.search(chunk, pos)
            if match is None:
                self._hold(len(self._line) + len(chunk) - pos, "line")
                self._line += chunk[pos:]
                self._note()
                return records
            end = match.start()
            if self._line:
                self._hold(len(self._line) + end - pos, "line")
                raw = bytes(self._line) + chunk[pos:end]
                self._line.clear()
            else:
                self._hold(end - pos, "line")
                raw = chunk[pos:end]
            pos = end + 1
            if chunk[end:end + 1] == b"\r":
                if pos < len(chunk):
                    if chunk[pos:pos + 1] == b"\n":
                        pos += 1
                else:
                    self._skip_lf = True
            record = self._line_done(raw.decode("utf-8", "replace"))
            if record is not None:
                records.append(record)

    def _strip_bom(self, chunk: bytes) -> bytes:
        # The BOM may itself be split across chunks: hold bytes until it can be decided.
        held = bytes(self._line) + chunk
        if len(held) < len(_BOM) and _BOM.startswith(held):
            self._line = bytearray(held)
            return b""
        self._bom_checked = True
        self._line.clear()
        return held[len(_BOM):] if held.startswith(_BOM) else held

    def _hold(self, size: int, what: str) -> None:
        if size > self.limit:
            self._fail(what, size)

    def _fail(self, what: str, size: int) -> None:
        self._failed = True
        self._line.clear()
        self._data.clear()
        self._data_size = 0
        raise SseOverflowError(f"SSE {what} over {self.limit} bytes ({size})", what=what,
                               size=size, limit=self.limit)

    def _note(self) -> None:
        self.line_high_water = max(self.line_high_water, len(self._line))
        self.data_high_water = max(self.data_high_water, self._data_size)

    def _line_done(self, line: str) -> SseRecord | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None
        field, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if field == "data":
            # Each data line costs its value plus the joining newline.
            size = self._data_size + len(value.encode("utf-8", "replace")) + 1
            if size - 1 > self.limit:
                self._fail("record data", size - 1)
            self._data.append(value)
            self._data_size = size
            self._has_data = True
            self._note()
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\x00" not in value:
                self._id = value
        elif field == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SseRecord | None:
        event, record_id = self._event or None, self._id
        data = "\n".join(self._data) if self._has_data else None
        self._event = self._id = None
        self._data = []
        self._data_size = 0
        self._has_data = False
        if data is None and record_id is None:
            return None
        return SseRecord(event=event, data=data, id=record_id)


class StreamOpenError(ContinuumError, ConnectionError):
    """The server answered, but not with an event stream (status or content type)."""


class _KeepAliveAdapter(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["socket_options"] = [*HTTPConnection.default_socket_options, *KEEPALIVE_OPTIONS]
        super().init_poolmanager(*args, **kwargs)


class SseTransport:
    """One ``GET`` of an SSE endpoint through ``requests``, parsed by :class:`SseParser`."""

    def __init__(self, session: requests.Session, response: requests.Response,
                 limit: int = MAX_SSE_BUFFER_SIZE) -> None:
        self._session = session
        self._response = response
        self.parser = SseParser(limit)

    @classmethod
    def open(cls, url: str, last_event_id: str | None, connect_timeout: float,
             read_timeout: float | None,
             headers: Mapping[str, str] | None = None) -> SseTransport:
        """Connect, sending ``Last-Event-ID`` when resuming and ``headers`` (such as
        ``Authorization``) always.

        Raises:
            StreamOpenError: a status other than 200 or a non-``text/event-stream`` body.
            requests.RequestException: the connection failed.
        """
        session = requests.Session()
        adapter = _KeepAliveAdapter()
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        sent = {"Accept": "text/event-stream", "Cache-Control": "no-cache", **(headers or {})}
        if last_event_id:
            sent["Last-Event-ID"] = last_event_id
        try:
            response = session.get(url, headers=sent, stream=True,
                                   timeout=(connect_timeout, read_timeout))
        except BaseException:
            session.close()
            raise
        transport = cls(session, response)
        content_type = response.headers.get("Content-Type", "")
        if response.status_code != 200 or not content_type.startswith("text/event-stream"):
            transport.close()
            raise StreamOpenError(f"{url} answered {response.status_code} {content_type!r}",
                                  url=url, status=response.status_code)
        return transport

    @property
    def retry_ms(self) -> int | None:
        """The stream's last ``retry:`` value."""
        return self.parser.retry_ms

    @property
    def high_water(self) -> int:
        """The most bytes the parser ever held in one buffer."""
        return max(self.parser.line_high_water, self.parser.data_high_water)

    def records(self) -> Iterator[tuple[str | None, str | None, str | None]]:
        """``(event, data, id)`` per record until the server ends the stream.

        Raises:
            SseOverflowError: a line or record went over the cap.
        """
        raw: Any = self._response.raw
        # read1 returns what has arrived (urllib3 >= 2); read(n) would wait for n bytes.
        read = getattr(raw, "read1", None) or raw._fp.read1
        while chunk := read(READ_SIZE):
            for record in self.parser.feed(chunk):
                yield record.event, record.data, record.id

    def shutdown(self) -> None:
        """Wake a read blocked in another thread or greenlet."""
        raw: Any = self._response.raw
        try:
            raw.shutdown()  # urllib3 >= 2.3
        except (OSError, TypeError):
            # the loop closed the connection meanwhile (urllib3 clears the socket's
            # shutdown between its check and its call): nothing left to wake
            pass
        except (AttributeError, ValueError, RuntimeError):
            sock = getattr(getattr(raw, "connection", None), "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Close the response and its session."""
        self._response.close()
        self._session.close()
