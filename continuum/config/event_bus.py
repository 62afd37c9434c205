"""``dynamo.event_bus``: the router's TLS endpoint that KV listeners connect out to (push mode).

Kept apart from :mod:`continuum.config.schema` so the push-mode keys live in one place; the
schema only adds the ``dynamo`` section and the ``transport: event_bus`` rules of an event
source. docs/push-mode.md describes the protocol and where the bus runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from continuum.config.addresses import check_host_port
from continuum.config.fields import Issues, join, setting

#: Roles a bus credential may have. A ``kv_listener`` credential opens listener sessions
#: only; a ``broker`` credential never opens one (and a listener's never opens a broker's).
BUS_ROLES = ("kv_listener", "broker")
TOKEN_HASH = re.compile(r"sha256:[0-9a-f]{64}")
#: A broker id is also the DNS SAN its mTLS client certificate must carry.
BROKER_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
SOURCE_NAME = r"[A-Za-z0-9_-]{1,64}"

if TYPE_CHECKING:
    from continuum.config.schema import RouterConfig


@dataclass(frozen=True)
class EventBusTlsConfig:
    """``dynamo.event_bus.tls``: the bus's server certificate (the bus is TLS only)."""

    cert: str | None = setting(None, doc="PEM certificate chain of the bus", restart=True)
    key: str | None = setting(None, doc="PEM private key of that certificate", restart=True)
    client_ca: str | None = setting(
        None, doc="PEM CA bundle for mTLS client certificates (none: tokens only)",
        restart=True)

    def check(self, path: str, issues: Issues) -> None:
        for name in ("cert", "key", "client_ca"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                issues.error(join(path, name), "file does not exist", value)


@dataclass(frozen=True)
class BrokerConfig:
    """``dynamo.event_bus.brokers[]``: one credential allowed to connect to the bus."""

    id: str = setting(doc="the listener's event_bus.client_id (and its mTLS certificate's "
                      "DNS SAN)", pattern=BROKER_ID)
    role: str = setting(doc="what the credential may open", choices=BUS_ROLES)
    token_hash: str | None = setting(
        None, doc='"sha256:<64 lowercase hex>" of the bearer token (printf %s "$TOKEN" | '
        "sha256sum); none: mTLS only")
    backends: tuple[str, ...] = setting(
        default_factory=tuple, doc="the only backends this credential may announce; a hot "
        "reload that removes one ends the sessions announcing it with forbidden")

    def check(self, path: str, issues: Issues) -> None:
        if self.token_hash is not None and not TOKEN_HASH.fullmatch(self.token_hash):
            issues.error(join(path, "token_hash"), 'must be "sha256:" and 64 lowercase hex '
                         "digits", self.token_hash)
        for i, name in enumerate(self.backends):
            if not re.fullmatch(SOURCE_NAME, name):
                issues.error(f"{join(path, 'backends')}[{i}]", "must match "
                             f"{SOURCE_NAME}", name)
        if self.role == "kv_listener" and not self.backends:
            issues.warn(join(path, "backends"), "empty: this listener may announce nothing")


@dataclass(frozen=True)
class EventBusConfig:
    """``dynamo.event_bus``: where listeners push their event streams (push mode)."""

    enabled: bool = setting(False, doc="run the event bus (one process per router host)",
                            restart=True)
    listen: str = setting("0.0.0.0:9443", doc="host:port of the TLS endpoint",
                          restart=True)
    tls: EventBusTlsConfig = setting(default_factory=EventBusTlsConfig,
                                     doc="server certificate")
    brokers: tuple[BrokerConfig, ...] = setting(default_factory=tuple,
                                                doc="credentials allowed to connect")
    subscribe_timeout: float = setting(
        10.0, doc="how long a consumer's request waits for the listener to open the stream",
        min=0.1, max=300, duration=True, restart=True)

    def check(self, path: str, issues: Issues) -> None:
        check_host_port(join(path, "listen"), self.listen, issues, lowest_port=0)
        if self.enabled:
            for name in ("cert", "key"):
                if getattr(self.tls, name) is None:
                    issues.error(join(join(path, "tls"), name),
                                 "required when event_bus.enabled (the bus is TLS only)")
        seen: dict[str, int] = {}
        for i, broker in enumerate(self.brokers):
            if broker is None:
                continue
            if broker.id in seen:
                issues.error(f"{join(path, 'brokers')}[{i}].id",
                             f"duplicate broker id (also brokers[{seen[broker.id]}])",
                             broker.id)
            seen.setdefault(broker.id, i)
            if broker.token_hash is None and self.tls.client_ca is None:
                issues.error(f"{join(path, 'brokers')}[{i}].token_hash", "required without "
                             "tls.client_ca (no other way to authenticate this broker)")


@dataclass(frozen=True)
class DynamoConfig:
    """``dynamo``: fleet plumbing shared with other routers; today only the event bus."""

    event_bus: EventBusConfig = setting(default_factory=EventBusConfig,
                                        doc="push-mode event bus")


def check_event_bus_sources(config: RouterConfig, issues: Issues) -> None:
    """A ``transport: event_bus`` source needs the bus on, and is useless when no
    ``kv_listener`` credential may announce its backend."""
    bus = config.dynamo.event_bus
    allowed = {name for broker in bus.brokers if broker is not None
               and broker.role == "kv_listener" for name in broker.backends}
    for i, source in enumerate(config.kv_cache_index.event_sources):
        if source is None or source.transport != "event_bus":
            continue
        path = f"kv_cache_index.event_sources[{i}].transport"
        if not bus.enabled:
            issues.error(path, "needs dynamo.event_bus.enabled: true", source.transport)
        elif source.backend_name not in allowed:
            issues.warn(path, "no dynamo.event_bus.brokers[] kv_listener entry lists this "
                        "backend: no listener may announce it", source.backend_name)
