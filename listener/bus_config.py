"""The listener's ``event_bus`` section: push mode, connecting out to the router's event bus.

With this section the listener also dials ``url`` over TLS and pushes the same per-backend
SSE streams it serves at ``/events/<backend>`` (see :mod:`listener.bus_client`); its local
SSE server keeps running either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from continuum.config.addresses import check_url
from continuum.config.fields import (
    Issues,
    check_secret_source,
    join,
    secret_from_file_or_env,
    setting,
)

CLIENT_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


@dataclass(frozen=True)
class ReconnectBackoffConfig:
    """``event_bus.reconnect_backoff``: delays between session attempts (doubling)."""

    initial: float = setting(1.0, doc="first delay after a failed or ended session",
                             min=0.01, max=3600, duration=True)
    max: float = setting(60.0, doc="longest delay", min=0.01, max=86400, duration=True)

    def check(self, path: str, issues: Issues) -> None:
        if self.max < self.initial:
            issues.error(join(path, "max"), "must be >= reconnect_backoff.initial", self.max)


@dataclass(frozen=True)
class BusClientConfig:
    """``event_bus``: the router's event bus this listener pushes to (push mode)."""

    url: str = setting(doc="https://host[:port] of the router's dynamo.event_bus (port "
                       "443 when omitted); https only")
    client_id: str = setting(doc="the router's dynamo.event_bus.brokers[].id for this "
                             "listener", pattern=CLIENT_ID)
    ca_file: str | None = setting(None, doc="PEM CA bundle that signed the bus's certificate "
                                  "(none: the system's public roots)")
    credential: str | None = setting(None, doc="never inline (an error): use "
                                     "credential_file or credential_env", secret=True)
    credential_file: str | None = setting(None, doc="file holding the bearer token")
    credential_env: str | None = setting(None, doc="environment variable holding the "
                                         "bearer token")
    tls_server_name: str | None = setting(None, doc="name the bus's certificate must carry "
                                          "(SNI too); default: the url's host")
    client_cert_file: str | None = setting(None, doc="PEM client certificate for mTLS (its "
                                           "DNS SAN must equal client_id)")
    client_key_file: str | None = setting(None, doc="PEM private key of client_cert_file")
    reconnect_backoff: ReconnectBackoffConfig = setting(
        default_factory=ReconnectBackoffConfig, doc="session reconnect delays")
    drain_deadline: float = setting(5.0, doc="on SIGTERM: how long the pushed streams get to "
                                    "deliver draining before the session closes", min=0,
                                    max=600, duration=True)
    connect_timeout: float = setting(10.0, doc="TCP connect plus TLS handshake plus welcome",
                                     min=0.1, max=600, duration=True)

    def resolved_credential(self) -> str | None:
        """The bearer token, read now (None: mTLS only)."""
        return secret_from_file_or_env(self.credential_file, self.credential_env)

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of ``url``; port 443 when omitted."""
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or 443

    def check(self, path: str, issues: Issues) -> None:
        parts = check_url(join(path, "url"), self.url, issues, ("https",),
                          "an https://host[:port] URL (the bus is TLS only)")
        if parts is not None and (parts.path not in ("", "/") or parts.query
                                  or parts.username or parts.password):
            issues.error(join(path, "url"), "must be https://host[:port] only (no path, "
                         "query or user)", self.url)
        check_secret_source(path, issues, "credential", inline=self.credential,
                            file=self.credential_file, env_name=self.credential_env)
        has_token = self.credential_file is not None or self.credential_env is not None
        if (self.client_cert_file is None) != (self.client_key_file is None):
            issues.error(join(path, "client_key_file" if self.client_key_file is None
                              else "client_cert_file"),
                         "client_cert_file and client_key_file go together")
        if not has_token and self.client_cert_file is None and self.credential is None:
            issues.error(join(path, "credential_file"), "set credential_file, "
                         "credential_env or client_cert_file + client_key_file")
        for name in ("ca_file", "client_cert_file", "client_key_file"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                issues.error(join(path, name), "file does not exist", value)
        if self.tls_server_name is not None and not re.fullmatch(r"[A-Za-z0-9.*-]{1,253}",
                                                                 self.tls_server_name):
            issues.error(join(path, "tls_server_name"), "must be a DNS name",
                         self.tls_server_name)
