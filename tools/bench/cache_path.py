"""Response-cache paths end to end: HIT against MISS against BYPASS, through gunicorn.

    python -m tools.bench.cache_path              # memory store
    python -m tools.bench.cache_path --redis      # Redis store (starts its own redis-server)

The router (one gevent worker) fronts the fast bench upstream with ``response_cache``
enabled. At concurrency 1 over one kept-alive connection it measures, per path:

* ``hit``: the same deterministic request again and again (answered by the router);
* ``miss``: deterministic requests that are all different (looked up, forwarded, stored);
* ``bypass``: temperature 0.7 (not cacheable: forwarded without lookup or store).

Printed: p50/p99 latency (ms) and router CPU per request (ms) for each path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from continuum.devtools.procs import Child
from continuum.devtools.redis_server import RedisServer
from tools.bench.overhead import (
    MODEL,
    Conn,
    children_of,
    cpu_seconds,
    percentile,
    start_router,
    start_upstream,
)


def _payload(port: int, question: str, temperature: float) -> bytes:
    body = json.dumps({
        "model": MODEL, "temperature": temperature, "max_tokens": 16,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": question}],
    }).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def _phase(conn: Conn, payloads: list[bytes], workers: list[int]) -> dict[str, float]:
    cpu0 = sum(cpu_seconds(pid) for pid in workers)
    latencies = []
    for payload in payloads:
        started = time.perf_counter()
        status, _headers, _ttfc = conn.request(payload)
        if status != 200:
            raise RuntimeError(f"status {status}")
        latencies.append(time.perf_counter() - started)
    cpu1 = sum(cpu_seconds(pid) for pid in workers)
    latencies.sort()
    return {"p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
            "router_cpu_ms": (cpu1 - cpu0) / len(payloads) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="requests per path")
    parser.add_argument("--redis", action="store_true", help="use the Redis store")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    children: list[Child] = []
    redis: RedisServer | None = None
    try:
        cache: dict[str, Any] = {"enabled": True, "capacity": 100_000}
        if args.redis:
            try:
                redis = RedisServer()
            except RuntimeError as exc:
                raise SystemExit(str(exc)) from None
            cache.update(backend="redis", redis={"url": redis.url})
        upstream, upstream_port = start_upstream(tmp, chunks=8, chunk_delay_ms=0)
        children.append(upstream)
        router, port = start_router(tmp, upstream_port, 1, str(Path.cwd()),
                                    {"response_cache": cache})
        children.append(router)
        workers = children_of(router.pid)
        conn = Conn(port, timeout=30)
        n = args.requests
        hit = [_payload(port, "Say hello.", 0.0)] * n
        miss = [_payload(port, f"Say hello #{i}.", 0.0) for i in range(n)]
        bypass = [_payload(port, "Say hello.", 0.7)] * n
        _phase(conn, hit[:200] + bypass[:200], workers)  # warm up (and store the hit)
        results = {"hit": _phase(conn, hit, workers), "miss": _phase(conn, miss, workers),
                   "bypass": _phase(conn, bypass, workers)}
        conn.close()
    finally:
        for child in reversed(children):
            child.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    store = "redis" if args.redis else "memory"
    print(f"response cache paths ({store} store, concurrency 1, {args.requests} requests each)")
    print(f"{'path':<8} {'p50 ms':>8} {'p99 ms':>8} {'router cpu ms/req':>18}")
    for name, row in results.items():
        print(f"{name:<8} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {row['router_cpu_ms']:18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
