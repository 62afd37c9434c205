"""Push-mode test plumbing: a throwaway PKI, the bus process, listeners, engines, chats."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import signal
import sys
import time
from pathlib import Path
from typing import Any

import requests
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from continuum.devtools.procs import Child, free_port, wait_http, wait_until
from continuum.kv.bus_process import read_bus_file

MODEL = "sim-model"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class Pki:
    """A CA made for one test, and certificates it signs (EC P-256, one day)."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "pki"
        self.dir.mkdir(exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name("test-ca"))
                     .issuer_name(_name("test-ca")).public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_file = self._write("ca.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    def _write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)

    def issue(self, name: str, dns: list[str], ips: list[str] = (),  # type: ignore[assignment]
              client: bool = False) -> tuple[str, str]:
        """``(cert file, key file)`` for ``dns``/``ips`` SANs."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        usage = x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH if client else \
            x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name("test-ca"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName(sans), False)
                .add_extension(x509.ExtendedKeyUsage([usage]), False)
                .sign(self.key, hashes.SHA256()))
        cert_file = self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
        key_file = self._write(f"{name}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        return cert_file, key_file


def token_hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def bus_section(pki: Pki, port: int, brokers: list[dict[str, Any]],
                mtls: bool = False) -> dict[str, Any]:
    cert, key = pki.issue("bus", ["localhost"], ["127.0.0.1"])
    tls: dict[str, Any] = {"cert": cert, "key": key}
    if mtls:
        tls["client_ca"] = pki.ca_file
    return {"event_bus": {"enabled": True, "listen": f"127.0.0.1:{port}", "tls": tls,
                          "brokers": brokers, "subscribe_timeout": "5s"}}


def router_config(pki: Pki, bus_port: int, brokers: list[dict[str, Any]],
                  backends: dict[str, str] | None = None, mtls: bool = False,
                  interval_ms: int = 100) -> dict[str, Any]:
    backends = backends or {"vllm-1": "http://127.0.0.1:9"}
    return {
        "server": {"watch_interval_seconds": 0.2},
        "backends": [{"name": n, "url": u, "models": [MODEL]} for n, u in backends.items()],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "kv_cache_index": {"enabled": True, "event_sources": [
            {"backend_name": n, "transport": "event_bus", "reconnect_interval_ms": interval_ms}
            for n in backends]},
        "dynamo": bus_section(pki, bus_port, brokers, mtls),
    }


class BusProcess:
    """``python -m continuum.kv.bus_process`` for a router config (without gunicorn)."""

    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "bus") -> None:
        self.runtime = tmp / f"runtime-{name}"
        self.runtime.mkdir(exist_ok=True)
        self.config_path = tmp / f"{name}.yaml"
        self.write(config)
        self.proc = Child([sys.executable, "-m", "continuum.kv.bus_process", "--config",
                           str(self.config_path), "--runtime-dir", str(self.runtime)],
                          log=tmp / f"{name}-{time.monotonic_ns()}.log")
        wait_until(lambda: read_bus_file(str(self.runtime)) is not None, "the bus process",
                   20, children=[self.proc])

    def write(self, config: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.config_path)

    def health(self) -> dict[str, Any]:
        found = read_bus_file(str(self.runtime))
        assert found is not None
        url, token = found
        doc: dict[str, Any] = requests.get(url + "/health", timeout=5, headers={
            "Authorization": f"Bearer {token}"}).json()
        return doc

    def stop(self) -> None:
        self.proc.stop()


def listener_config(port: int, sources: dict[str, tuple[int, int]],
                    bus: dict[str, Any] | None, replay: int | None = None) -> dict[str, Any]:
    """``sources``: backend → (zmq port, sim port); ``replay``: the engine's replay port."""
    doc: dict[str, Any] = {"listen": f"127.0.0.1:{port}", "log_level": "debug", "sources": [
        {"backend_name": name, "engine": "vllm", "model": MODEL,
         "zmq_endpoint": f"tcp://127.0.0.1:{zmq}", "zmq_mode": "bind",
         "detokenize_endpoint": f"http://127.0.0.1:{sim}/detokenize",
         "allowed_publishers": ["127.0.0.1"],
         **({"replay_endpoint": f"tcp://127.0.0.1:{replay}"} if replay else {})}
        for name, (zmq, sim) in sources.items()]}
    if bus is not None:
        doc["event_bus"] = bus
    return doc


def bus_client(pki: Pki, bus_port: int, client_id: str, *, token_file: Path | None = None,
               cert: tuple[str, str] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"url": f"https://127.0.0.1:{bus_port}", "client_id": client_id,
                           "ca_file": pki.ca_file, "reconnect_backoff": {"initial": "0.2s",
                                                                         "max": "1s"},
                           "drain_deadline": "3s", "connect_timeout": "5s"}
    if token_file is not None:
        doc["credential_file"] = str(token_file)
    if cert is not None:
        doc["client_cert_file"], doc["client_key_file"] = cert
    return doc


class ListenerProcess:
    """``continuum-kv-listener`` as a child process."""

    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "listener") -> None:
        self.config = config
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.url = "http://" + config["listen"]
        self.proc = Child([sys.executable, "-m", "listener.cli", "--config",
                           str(self.config_path)], log=tmp / f"{name}-{time.monotonic_ns()}.log")
        try:
            wait_http(self.url + "/health", children=[self.proc])
        except BaseException:
            self.proc.stop(signal.SIGKILL)
            raise

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=5).text

    def bus_connected(self) -> bool:
        return "continuum_kv_listener_bus_connected 1.0" in self.metrics()

    def health(self) -> dict[str, Any]:
        doc: dict[str, Any] = requests.get(self.url + "/health", timeout=5).json()
        return doc


class Engine:
    """A simulated vLLM engine publishing KV events to a listener's ZMQ port."""

    def __init__(self, tmp: Path, zmq_port: int, name: str = "sim",
                 replay_port: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        replay = ["--zmq-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"] \
            if replay_port else []
        self.proc = Child([sys.executable, "-m", "continuum.sim.cli", "--fast", "--port",
                           str(self.port), "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
                           "--zmq-connect", *replay], log=tmp / f"{name}.log")
        wait_http(self.url + "/health", children=[self.proc])

    def chat(self, n: int) -> None:
        system = (f"You are assistant number {n} of the Continuum push-mode test. Your "
                  "instructions are long enough to fill several KV-cache blocks of sixteen "
                  "tokens each, which is what the listener needs.")
        resp = requests.post(self.url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"question {n}"}]})
        resp.raise_for_status()
