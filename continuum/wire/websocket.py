"""A minimal RFC 6455 WebSocket client: just enough to read a listener's event stream.

Scope: one text (or binary) message at a time, read-mostly. The client does the opening
handshake (random ``Sec-WebSocket-Key``, checks ``Sec-WebSocket-Accept``), masks every frame
it sends, answers pings with pongs, echoes a close, reassembles fragmented messages, and
fails the connection on protocol violations (masked or RSV-flagged server frames, oversized
or fragmented control frames, stray continuations). No extensions, no subprotocols.

Like the SSE parser, it refuses to buffer without bound: a message whose payload would go
over ``max_message`` bytes, or that takes more than ``max_frames`` frames (control frames
between its fragments included: empty continuation frames cost memory and time but no
payload bytes), raises :class:`~continuum.wire.sse.StreamOverflowError` before the payload is
read. Plain :mod:`socket`/:mod:`ssl` is used, so under gevent's monkey patching
every read yields to the hub.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import ssl
import struct
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

from continuum.errors import ContinuumError
from continuum.wire.sse import KEEPALIVE_OPTIONS, MAX_SSE_BUFFER_SIZE, StreamOverflowError

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_HANDSHAKE_SIZE = 16 * 1024
#: Frames one message may take; listener events are one frame, a fragmenting proxy a few.
MAX_MESSAGE_FRAMES = 1024

OP_CONTINUATION, OP_TEXT, OP_BINARY = 0x0, 0x1, 0x2
OP_CLOSE, OP_PING, OP_PONG = 0x8, 0x9, 0xA


class WebSocketError(ContinuumError, ConnectionError):
    """The handshake failed or the server broke the protocol; the connection is unusable."""


def accept_key(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` value a server must answer ``key`` with."""
    digest = hashlib.sha1((key + WS_GUID).encode("ascii")).digest()  # RFC 6455 mandates SHA-1
    return base64.b64encode(digest).decode("ascii")


def mask(key: bytes, payload: bytes) -> bytes:
    """XOR ``payload`` with the 4-byte ``key`` repeated (masking and unmasking alike)."""
    n = len(payload)
    if not n:
        return b""
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


def encode_frame(opcode: int, payload: bytes, *, masked: bool = True, fin: bool = True) -> bytes:
    """One frame on the wire; clients mask (``masked=True``), servers must not."""
    head = bytearray([(0x80 if fin else 0) | opcode])
    bit = 0x80 if masked else 0
    n = len(payload)
    if n < 126:
        head.append(bit | n)
    elif n < 1 << 16:
        head.append(bit | 126)
        head += struct.pack("!H", n)
    else:
        head.append(bit | 127)
        head += struct.pack("!Q", n)
    if not masked:
        return bytes(head) + payload
    key = os.urandom(4)
    return bytes(head) + key + mask(key, payload)


class WebSocketClient:
    """An open client connection; build it with :meth:`connect`.

    Attributes:
        close_code: The status code of the server's close frame, once received.
        high_water: The largest message ever assembled (bytes, <= ``max_message``).
    """

    def __init__(self, sock: socket.socket, *, buffered: bytes = b"",
                 max_message: int = MAX_SSE_BUFFER_SIZE,
                 max_frames: int = MAX_MESSAGE_FRAMES) -> None:
        self._sock = sock
        self._buf = bytearray(buffered)
        self.max_message = max_message
        self.max_frames = max_frames
        self.close_code: int | None = None
        self.high_water = 0
        self._close_sent = False

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        query: Mapping[str, str] | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        socket_options: tuple[tuple[int, int, int], ...] = (),
        max_message: int = MAX_SSE_BUFFER_SIZE,
        headers: Mapping[str, str] | None = None,
    ) -> WebSocketClient:
        """Open ``url`` (``ws://`` or ``wss://``), adding ``query`` to its query string and
        ``headers`` to the handshake request.

        Raises:
            WebSocketError: the server did not complete a valid RFC 6455 handshake.
            OSError: the TCP or TLS connection failed.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise WebSocketError(f"not a ws:// or wss:// URL: {url!r}", url=url)
        secure = parts.scheme == "wss"
        port = parts.port or (443 if secure else 80)
        target = parts.path or "/"
        extra = urlencode(dict(query or {}))
        query_string = "&".join(q for q in (parts.query, extra) if q)
        if query_string:
            target += "?" + query_string
        sock = socket.create_connection((parts.hostname, port), timeout=connect_timeout)
        try:
            for level, option, value in socket_options:
                sock.setsockopt(level, option, value)
            if secure:
                context = ssl_context or ssl.create_default_context()
                sock = context.wrap_socket(sock, server_hostname=parts.hostname)
            key = base64.b64encode(os.urandom(16)).decode("ascii")
            host = parts.netloc.rpartition("@")[2]
            pairs = list((headers or {}).items())
            if any(ch in f"{name}{value}" for name, value in pairs for ch in "\r\n"):
                raise WebSocketError("CR or LF inside a handshake header")
            extra_headers = "".join(f"{name}: {value}\r\n" for name, value in pairs)
            request = (f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                       f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                       f"Sec-WebSocket-Version: 13\r\n{extra_headers}\r\n")
            sock.sendall(request.encode("ascii"))
            head, rest = _read_handshake(sock)
            _check_handshake(head, key)
            sock.settimeout(read_timeout)
        except BaseException:
            sock.close()
            raise
        return cls(sock, buffered=rest, max_message=max_message)

    def recv(self) -> str | None:
        """The next data message, decoded as UTF-8; None once the server has closed.

        Binary messages are decoded too, and invalid UTF-8 becomes U+FFFD: the caller's JSON
        validation then rejects the message as malformed instead of the whole connection.

        Raises:
            StreamOverflowError: the message is larger than ``max_message`` or takes more
                than ``max_frames`` frames.
            WebSocketError: protocol violation, or the connection ended without a close.
        """
        parts: list[bytes] = []
        size = 0
        frames = 0
        in_message = False
        while True:
            fin, opcode, length = self._frame_header()
            if in_message:
                frames += 1
                if frames >= self.max_frames:
                    raise StreamOverflowError(
                        f"WebSocket message over {self.max_frames} frames", what="frames",
                        size=frames + 1, limit=self.max_frames)
            if opcode >= OP_CLOSE:
                if not fin or length > 125:
                    raise WebSocketError("fragmented or oversized control frame")
                payload = self._read(length)
                if opcode == OP_PING:
                    self._send(OP_PONG, payload)
                elif opcode == OP_CLOSE:
                    self.close_code = struct.unpack("!H", payload[:2])[0] if length >= 2 else 1005
                    self.close(1000 if self.close_code == 1005 else self.close_code)
                    return None
                elif opcode != OP_PONG:
                    raise WebSocketError(f"unknown control opcode {opcode:#x}")
                continue
            if opcode == OP_CONTINUATION and not in_message:
                raise WebSocketError("continuation frame outside a message")
            if opcode in (OP_TEXT, OP_BINARY) and in_message:
                raise WebSocketError("new message before the previous one finished")
            if opcode not in (OP_CONTINUATION, OP_TEXT, OP_BINARY):
                raise WebSocketError(f"unknown data opcode {opcode:#x}")
            in_message = True
            size += length
            self.high_water = max(self.high_water, min(size, self.max_message + 1))
            if size > self.max_message:
                raise StreamOverflowError(f"WebSocket message over {self.max_message} bytes",
                                          what="message", size=size, limit=self.max_message)
            parts.append(self._read(length))
            if fin:
                return b"".join(parts).decode("utf-8", "replace")

    def close(self, code: int = 1000) -> None:
        """Send a close frame (once, best effort) and close the socket."""
        if not self._close_sent:
            self._close_sent = True
            try:
                self._send(OP_CLOSE, struct.pack("!H", code))
            except OSError:
                pass
        self._sock.close()

    def shutdown(self) -> None:
        """Wake a ``recv`` blocked in another thread or greenlet (it then fails)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, opcode: int, payload: bytes) -> None:
        self._sock.sendall(encode_frame(opcode, payload))

    def _frame_header(self) -> tuple[bool, int, int]:
        b0, b1 = self._read(2)
        if b0 & 0x70:
            raise WebSocketError("RSV bits set without a negotiated extension")
        if b1 & 0x80:
            raise WebSocketError("server frames must not be masked")
        length = b1 & 0x7F
        if length == 126:
            length = struct.unpack("!H", self._read(2))[0]
        elif length == 127:
            length = struct.unpack("!Q", self._read(8))[0]
            if length >> 63:
                raise WebSocketError("frame length has its most significant bit set")
        return bool(b0 & 0x80), b0 & 0x0F, length

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self._sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                raise WebSocketError("connection closed without a close frame")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


class WebSocketTransport:
    """A listener stream over WebSocket: each text message is one JSON event with an ``id``."""

    retry_ms: int | None = None

    def __init__(self, client: WebSocketClient) -> None:
        self.client = client

    @classmethod
    def open(cls, url: str, last_event_id: str | None, connect_timeout: float,
             read_timeout: float | None,
             headers: Mapping[str, str] | None = None) -> WebSocketTransport:
        """Connect, passing the resume point as ``?last_event_id=<id>`` and ``headers``
        (such as ``Authorization``) with the handshake."""
        query = {"last_event_id": last_event_id} if last_event_id else None
        return cls(WebSocketClient.connect(url, query=query, connect_timeout=connect_timeout,
                                           read_timeout=read_timeout,
                                           socket_options=KEEPALIVE_OPTIONS, headers=headers))

    @property
    def high_water(self) -> int:
        """The largest message the client ever assembled."""
        return self.client.high_water

    def records(self) -> Iterator[tuple[None, str | dict[str, Any], str | None]]:
        """``(None, event, id)`` per message: the decoded object, or the raw text when it is
        not a JSON object (the consumer counts that as malformed)."""
        while (message := self.client.recv()) is not None:
            try:
                payload = json.loads(message)
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                yield None, message, None
                continue
            raw_id = payload.get("id")
            valid = isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool)
            yield None, payload, str(raw_id) if valid else None

    def shutdown(self) -> None:
        """Wake a blocked read."""
        self.client.shutdown()

    def close(self) -> None:
        """Close the connection (with a close frame when still possible)."""
        self.client.close()


def _read_handshake(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HANDSHAKE_SIZE:
            raise WebSocketError("handshake response headers too large")
        chunk = sock.recv(4096)
        if not chunk:
            raise WebSocketError("connection closed during the handshake")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _check_handshake(head: bytes, key: str) -> None:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or fields[1] != "101":
        raise WebSocketError(f"handshake refused: {status_line!r}", status=status_line)
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("upgrade", "").lower() != "websocket":
        raise WebSocketError("handshake response lacks Upgrade: websocket")
    if "upgrade" not in headers.get("connection", "").lower():
        raise WebSocketError("handshake response lacks Connection: Upgrade")
    if headers.get("sec-websocket-accept") != accept_key(key):
        raise WebSocketError("handshake response has a wrong Sec-WebSocket-Accept")
