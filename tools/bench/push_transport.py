"""What HTTP/2 costs push mode, against HTTP/1.1 chunked streaming, both over TLS.

Run: ``python -m tools.bench.push_transport [--records 20000] [--json]`` (needs the test
extras: the certificate is made with ``cryptography``).

One sender thread pushes SSE records (the listener's real record format, ~190 bytes) to one
receiver thread over a TLS connection on 127.0.0.1, the way push mode does:

* ``h2``: the ``h2`` library over blocking sockets — the sender ``send_data`` per chunk on
  one stream (respecting flow control), the receiver acknowledges what it read (credit back);
* ``http1``: chunked transfer encoding, one ``<hex>\\r\\n…\\r\\n`` frame per chunk; the
  receiver parses the frames.

Each is run with one record per chunk (events trickling in: the hub yields each at once)
and 64 records per chunk (a busy backend: the hub joins what queued). Reported per record:
sender and receiver CPU (``time.thread_time``), wire bytes (TLS plaintext, i.e. framing
overhead) and throughput. The numbers and the decision are in docs/push-mode.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events

RECORD = (b'id: 66f0c1a2b3c4-123456\nevent: cache_created\ndata: {"event":"cache_created",'
          b'"prefix_hash":"' + b"ab" * 32 + b'","token_count":1024}\n\n')


def _cert(tmp: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .sign(key, hashes.SHA256()))
    (tmp / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                  serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return str(tmp / "c.pem"), str(tmp / "k.pem")


def _pair(cert: str, key: str, alpn: str) -> tuple[ssl.SSLSocket, ssl.SSLSocket]:
    listener = socket.create_server(("127.0.0.1", 0))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server_ctx.set_alpn_protocols([alpn])
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE
    client_ctx.set_alpn_protocols([alpn])
    accepted: list[ssl.SSLSocket] = []

    def accept() -> None:
        raw, _ = listener.accept()
        accepted.append(server_ctx.wrap_socket(raw, server_side=True))

    thread = threading.Thread(target=accept)
    thread.start()
    client = client_ctx.wrap_socket(socket.create_connection(listener.getsockname()))
    thread.join()
    listener.close()
    for sock in (client, accepted[0]):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, accepted[0]


def _h2(client: ssl.SSLSocket, server: ssl.SSLSocket, chunks: list[bytes]) -> dict[str, Any]:
    total = sum(map(len, chunks))
    out: dict[str, Any] = {}
    window = threading.Condition()

    def receive() -> None:
        start = time.thread_time()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        server.sendall(conn.data_to_send())
        got = wire = 0
        while got < total:
            data = server.recv(65536)
            wire += len(data)
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    got += len(event.data)
                    conn.acknowledge_received_data(event.flow_controlled_length,
                                                   event.stream_id)
            pending = conn.data_to_send()
            if pending:
                server.sendall(pending)
        out["receiver_cpu"] = time.thread_time() - start
        out["wire"] = wire

    def sender_reader(conn: h2.connection.H2Connection, lock: threading.Lock,
                      stop: threading.Event) -> None:
        client.settimeout(0.2)
        while not stop.is_set():
            try:
                data = client.recv(65536)
            except (TimeoutError, ssl.SSLError, OSError):
                continue
            if not data:
                return
            with lock:
                conn.receive_data(data)
                pending = conn.data_to_send()
                if pending:
                    client.sendall(pending)
            with window:
                window.notify_all()

    receiver = threading.Thread(target=receive)
    receiver.start()
    start_wall = time.perf_counter()
    start = time.thread_time()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    lock = threading.Lock()
    stop = threading.Event()
    with lock:
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":path", "/bus/v1/streams/x"),
                              (":scheme", "https"), (":authority", "bench")])
        client.sendall(conn.data_to_send())
    reader = threading.Thread(target=sender_reader, args=(conn, lock, stop))
    reader.start()
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            with lock:
                size = min(conn.local_flow_control_window(1), conn.max_outbound_frame_size,
                           len(view))
                if size > 0:
                    conn.send_data(1, view[:size].tobytes())
                    client.sendall(conn.data_to_send())
                    view = view[size:]
                    continue
            with window:
                window.wait(0.05)
    out["sender_cpu"] = time.thread_time() - start
    receiver.join()
    out["seconds"] = time.perf_counter() - start_wall
    stop.set()
    reader.join()
    return out


def _http1(client: ssl.SSLSocket, server: ssl.SSLSocket, chunks: list[bytes]) -> dict[str, Any]:
    total = sum(map(len, chunks))
    out: dict[str, Any] = {}

    def receive() -> None:
        start = time.thread_time()
        buf = b""
        got = wire = 0
        head_done = False
        while got < total:
            data = server.recv(65536)
            wire += len(data)
            buf += data
            if not head_done:
                if b"\r\n\r\n" not in buf:
                    continue
                buf = buf.partition(b"\r\n\r\n")[2]
                head_done = True
            while True:
                head, sep, rest = buf.partition(b"\r\n")
                if not sep:
                    break
                size = int(head, 16)
                if len(rest) < size + 2:
                    break
                got += size
                buf = rest[size + 2:]
        out["receiver_cpu"] = time.thread_time() - start
        out["wire"] = wire

    receiver = threading.Thread(target=receive)
    receiver.start()
    start_wall = time.perf_counter()
    start = time.thread_time()
    client.sendall(b"POST /bus/v1/streams/x HTTP/1.1\r\nHost: bench\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
    for chunk in chunks:
        client.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    out["sender_cpu"] = time.thread_time() - start
    receiver.join()
    out["seconds"] = time.perf_counter() - start_wall
    return out


def run(records: int) -> list[dict[str, Any]]:
    """Every (protocol, records per chunk) case: per-record CPU, wire bytes, throughput."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = _cert(Path(tmp))
        for per_chunk in (1, 64):
            chunks = [RECORD * per_chunk] * (records // per_chunk)
            n = len(chunks) * per_chunk
            for name, fn, alpn in (("h2", _h2, "h2"), ("http1", _http1, "http/1.1")):
                client, server = _pair(cert, key, alpn)
                try:
                    result = fn(client, server, chunks)
                finally:
                    client.close()
                    server.close()
                rows.append({
                    "protocol": name, "records_per_chunk": per_chunk, "records": n,
                    "sender_us_per_record": round(result["sender_cpu"] / n * 1e6, 2),
                    "receiver_us_per_record": round(result["receiver_cpu"] / n * 1e6, 2),
                    "wire_bytes_per_record": round(result["wire"] / n, 1),
                    "records_per_s": round(n / result["seconds"]),
                })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(min(args.records, 1_000_000))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"record: {len(RECORD)} bytes of SSE")
    print(f"{'protocol':8} {'rec/chunk':>9} {'send us/rec':>11} {'recv us/rec':>11} "
          f"{'wire B/rec':>10} {'rec/s':>9}")
    for r in rows:
        print(f"{r['protocol']:8} {r['records_per_chunk']:>9} {r['sender_us_per_record']:>11}"
              f" {r['receiver_us_per_record']:>11} {r['wire_bytes_per_record']:>10} "
              f"{r['records_per_s']:>9}")


if __name__ == "__main__":
    main()
