"""The event bus's bookkeeping: who may connect, which sessions announce which sources.

Push mode (docs/push-mode.md): a KV listener connects out to the router's event bus, opens
one session (``POST /bus/v1/session`` with a hello naming its role and the sources it
announces) and, whenever a router consumer asks for one of those sources, pushes the exact
SSE bytes of its ``GET /events/<backend>`` on ``POST /bus/v1/streams/<id>``. This module
holds the part of that which knows nothing of sockets or HTTP/2: authentication against
``dynamo.event_bus.brokers[]``, the live sessions, and the choice of a session for a
consumer. :mod:`continuum.kv.bus_server` is the transport.

Invariants:
  * A session exists only after its credential passed :meth:`BusRegistry.admit`: a bearer
    token whose SHA-256 equals the entry's ``token_hash`` (compared in constant time), or an
    mTLS client certificate with a DNS SAN equal to the entry's ``id``; the hello's role
    equals the entry's role; every announced source is in the entry's ``backends``.
  * After :meth:`BusRegistry.update_brokers` no session stays that the new entries would
    refuse: :meth:`update_brokers` returns them, and the caller ends each with
    ``forbidden`` at once.
  * :meth:`BusRegistry.pick` never returns a draining session; among the others it returns
    the oldest, so every worker's consumer of one backend reads the same listener while it
    lives (and all move together on ``draining``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from continuum.config.event_bus import BrokerConfig
from continuum.errors import ContinuumError

KV_LISTENER = "kv_listener"
#: Why a session was refused or ended (metric label values; a fixed set).
UNAUTHENTICATED, WRONG_ROLE, UNLISTED_BACKEND, BAD_HELLO, FORBIDDEN = (
    "unauthenticated", "wrong_role", "unlisted_backend", "bad_hello", "forbidden")
REFUSALS = (UNAUTHENTICATED, WRONG_ROLE, UNLISTED_BACKEND, BAD_HELLO)
_SOURCE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Most sources one hello may announce.
MAX_SOURCES = 1024


class BusRefused(ContinuumError, PermissionError):
    """A session the bus will not open: ``status`` (401/403/400) and ``reason``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message, status=status, reason=reason)
        self.status = status
        self.reason = reason
        self.message = message


def token_digest(token: str) -> str:
    """``sha256:<hex>`` of a bearer token, the form of ``brokers[].token_hash``."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class Hello:
    """The first message of a session: ``{"type": "hello", "role", "client_id", "sources"}``."""

    role: str
    client_id: str
    sources: tuple[str, ...]

    @classmethod
    def parse(cls, doc: Any) -> Hello:
        """Validate a decoded hello.

        Raises:
            BusRefused: 400 ``bad_hello``, naming the field.
        """
        if not isinstance(doc, dict) or doc.get("type") != "hello":
            raise BusRefused(400, BAD_HELLO, "the first message must be a hello object")
        role, client_id, sources = doc.get("role"), doc.get("client_id"), doc.get("sources")
        if not isinstance(role, str) or not isinstance(client_id, str) or not client_id:
            raise BusRefused(400, BAD_HELLO, "hello needs string role and client_id")
        if (not isinstance(sources, list) or len(sources) > MAX_SOURCES
                or not all(isinstance(s, str) and _SOURCE.fullmatch(s) for s in sources)):
            raise BusRefused(400, BAD_HELLO, f"hello.sources must be a list of up to "
                             f"{MAX_SOURCES} source names ([A-Za-z0-9_-]{{1,64}})")
        return cls(role, client_id, tuple(dict.fromkeys(sources)))


@dataclass(eq=False)
class Session:
    """One listener's session; ``link`` is the transport's handle (sends and closes)."""

    id: str
    broker_id: str
    role: str
    sources: tuple[str, ...]
    #: What authenticated it: ``sha256:<hex>`` of its token, or None (its certificate).
    digest: str | None
    cert_names: frozenset[str]
    link: Any = None
    draining: bool = False
    opened: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _check(broker: BrokerConfig | None, role: str, sources: Sequence[str], digest: str | None,
           cert_names: frozenset[str], client_id: str) -> None:
    if broker is None:
        raise BusRefused(401, UNAUTHENTICATED, f"unknown client_id {client_id!r} or wrong "
                         "credential")
    token_ok = (digest is not None and broker.token_hash is not None
                and hmac.compare_digest(digest.encode(), broker.token_hash.encode()))
    if not token_ok and broker.id not in cert_names:
        raise BusRefused(401, UNAUTHENTICATED, f"unknown client_id {client_id!r} or wrong "
                         "credential")
    if broker.role != role:
        raise BusRefused(403, WRONG_ROLE, f"a {broker.role} credential cannot open a "
                         f"{role} session")
    if role != KV_LISTENER:
        raise BusRefused(403, WRONG_ROLE, f"this bus serves {KV_LISTENER} sessions only")
    unlisted = [s for s in sources if s not in broker.backends]
    if unlisted:
        raise BusRefused(403, UNLISTED_BACKEND, f"{client_id!r} may not announce "
                         f"{', '.join(unlisted)} (dynamo.event_bus.brokers[].backends)")


class BusRegistry:
    """The brokers' entries and the live sessions (one bus process holds one).

    Args:
        brokers: ``dynamo.event_bus.brokers``.
    """

    def __init__(self, brokers: Iterable[BrokerConfig]) -> None:
        self.brokers = {b.id: b for b in brokers}
        self.sessions: list[Session] = []
        self._ids = itertools.count(1)

    def admit(self, hello: Hello, bearer: str | None, cert_names: frozenset[str],
              link: Any = None) -> Session:
        """Authenticate and register a session.

        Args:
            hello: The session's hello.
            bearer: The ``Authorization: Bearer`` token, if any.
            cert_names: DNS SANs of the verified client certificate (empty: none).
            link: The transport's handle, kept on the session.

        Raises:
            BusRefused: 401 (credential), 403 (role, unlisted backend).
        """
        digest = token_digest(bearer) if bearer else None
        broker = self.brokers.get(hello.client_id)
        _check(broker, hello.role, hello.sources, digest, cert_names, hello.client_id)
        n = next(self._ids)
        session = Session(id=f"s{n}", broker_id=hello.client_id, role=hello.role,
                          sources=hello.sources, digest=digest, cert_names=cert_names,
                          link=link, opened=n)
        self.sessions.append(session)
        return session

    def remove(self, session: Session) -> None:
        """Forget ``session`` (its connection ended)."""
        if session in self.sessions:
            self.sessions.remove(session)

    def pick(self, backend: str) -> Session | None:
        """The oldest non-draining session announcing ``backend`` (None: ``no_session``)."""
        for session in self.sessions:
            if not session.draining and backend in session.sources:
                return session
        return None

    def announced(self) -> dict[str, int]:
        """Active (non-draining) sessions per announced backend."""
        counts: dict[str, int] = {}
        for session in self.sessions:
            if not session.draining:
                for source in session.sources:
                    counts[source] = counts.get(source, 0) + 1
        return counts

    def update_brokers(self, brokers: Iterable[BrokerConfig]) -> list[tuple[Session, str]]:
        """Replace the entries; return each session they no longer allow, with why.

        The sessions returned are removed from the registry; the caller sends them
        ``forbidden`` and closes them.
        """
        self.brokers = {b.id: b for b in brokers}
        ended: list[tuple[Session, str]] = []
        for session in list(self.sessions):
            try:
                _check(self.brokers.get(session.broker_id), session.role, session.sources,
                       session.digest, session.cert_names, session.broker_id)
            except BusRefused as exc:
                ended.append((session, exc.message))
                self.sessions.remove(session)
        return ended
