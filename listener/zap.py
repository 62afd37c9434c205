"""A ZAP handler (ZeroMQ RFC 27) that admits only allowed publisher addresses.

One handler serves every bound SUB socket of one ZMQ context, keyed by ZAP domain; peers
outside a source's ``allowed_publishers`` never complete the handshake, so nothing of
theirs reaches the decoder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gevent
import zmq.green as zmq

__all__ = ["ZAP_ENDPOINT", "ZapAuthenticator"]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class ZapAuthenticator:
    """Answers ZAP requests for every bound source of one ZMQ context, by domain.

    Only one ZAP handler may exist per context; each source registers its own domain with
    its allowed IP addresses and is told about every peer it refused.
    """

    def __init__(self, context: Any) -> None:
        self._context = context
        self._domains: dict[bytes, tuple[frozenset[str], bool, Callable[[str], None]]] = {}
        self._socket: Any = None
        self._greenlet: gevent.Greenlet | None = None

    def register(self, domain: str, allowed: frozenset[str], *, any_local: bool,
                 on_reject: Callable[[str], None]) -> None:
        """Route requests of ``domain``: allow ``allowed`` addresses (and, with
        ``any_local``, peers without an IP address: ipc/inproc)."""
        self._domains[domain.encode()] = (allowed, any_local, on_reject)
        if self._socket is None:
            self._socket = self._context.socket(zmq.REP)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(ZAP_ENDPOINT)
            self._greenlet = gevent.spawn(self._serve)

    def unregister(self, domain: str) -> None:
        """Forget ``domain`` (its peers are refused from now on)."""
        self._domains.pop(domain.encode(), None)

    def _serve(self) -> None:
        while True:
            frames = self._socket.recv_multipart()
            try:
                reply = self.answer(frames)
            except Exception as exc:  # REP must answer every request, or ZAP stalls
                log.error("ZAP handler failed (%s); refusing the peer", type(exc).__name__)
                reply = [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"error",
                         b"", b""]
            self._socket.send_multipart(reply)

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: ``[version, request_id, status, text, user, meta]``."""
        if len(frames) < 6 or frames[0] != b"1.0":
            request_id = frames[1] if len(frames) > 1 else b""
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _identity, _mechanism = frames[:6]
        entry = self._domains.get(domain)
        peer = address.decode("utf-8", "replace")
        if entry is not None:
            allowed, any_local, on_reject = entry
            if peer in allowed or (any_local and not peer):
                return [b"1.0", request_id, b"200", b"OK", b"", b""]
            on_reject(peer)
        return [b"1.0", request_id, b"400", b"publisher not allowed", b"", b""]

    def close(self) -> None:
        """Stop answering (connections then get no ZAP handler); idempotent."""
        if self._greenlet is not None:
            self._greenlet.kill()
            self._greenlet = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
