"""``continuum-router demo --push``: the listener pushes to the router's event bus.

A throwaway CA and a certificate for ``127.0.0.1`` are made with the ``openssl`` command
(the demo needs no test extras), a random bearer token goes into a file, and both sides'
config sections are built from them: the listener's ``event_bus`` and the router's
``dynamo.event_bus`` with one ``kv_listener`` broker allowed every engine. Each scenario's
router starts its own bus process on the same port; the listener's session reconnects to
it within ``reconnect_backoff.max`` (1 s here).
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum.devtools.procs import free_port

CLIENT_ID = "demo-listener"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class PushSetup:
    """Certificates, token and port of one demo run's event bus."""

    port: int
    ca_file: str
    cert_file: str
    key_file: str
    token_file: str
    token_hash: str

    @classmethod
    def create(cls, workdir: Path) -> PushSetup:
        """Make the CA, the bus certificate (SAN IP 127.0.0.1) and the token in
        ``workdir/push``."""
        pki = workdir / "push"
        pki.mkdir(parents=True, exist_ok=True)
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
                 "-subj", "/CN=continuum-demo-ca", cwd=pki)
        _openssl("req", *ec, "-keyout", "bus.key", "-out", "bus.csr", "-subj", "/CN=127.0.0.1",
                 cwd=pki)
        (pki / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", "bus.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "bus.crt", "-days", "2", "-extfile", "san.ext",
                 cwd=pki)
        token = secrets.token_urlsafe(24)
        (pki / "token").write_text(token)
        (pki / "token").chmod(0o600)
        return cls(port=free_port(), ca_file=str(pki / "ca.pem"),
                   cert_file=str(pki / "bus.crt"), key_file=str(pki / "bus.key"),
                   token_file=str(pki / "token"),
                   token_hash="sha256:" + hashlib.sha256(token.encode()).hexdigest())

    def listener_section(self) -> dict[str, Any]:
        """The listener's ``event_bus``."""
        return {"url": f"https://127.0.0.1:{self.port}", "client_id": CLIENT_ID,
                "ca_file": self.ca_file, "credential_file": self.token_file,
                "reconnect_backoff": {"initial": "100ms", "max": "1s"}}

    def router_overrides(self, backends: list[str]) -> dict[str, Any]:
        """The router's ``dynamo`` section and ``transport: event_bus`` sources."""
        return {
            "dynamo": {"event_bus": {
                "enabled": True, "listen": f"127.0.0.1:{self.port}",
                "tls": {"cert": self.cert_file, "key": self.key_file},
                "brokers": [{"id": CLIENT_ID, "role": "kv_listener",
                             "token_hash": self.token_hash, "backends": backends}]}},
            "kv_cache_index": {"event_sources": [
                {"backend_name": name, "transport": "event_bus", "reconnect_interval_ms": 200}
                for name in backends]},
        }
