"""Replay a :class:`~continuum.sim.workload.Workload` against an OpenAI-compatible server.

Each session starts at its arrival offset; its turns go out one after another, each after
the previous streamed reply has arrived and carrying it, so an engine's prefix cache can
hit on the whole conversation so far. Every request streams (``stream_options:
include_usage``) to measure time to first token and read ``prompt_tokens`` and
``prompt_tokens_details.cached_tokens`` from the final chunk.

Workers are ``threading`` threads and the HTTP client is ``requests``: in a process gevent
has monkey-patched (the demo) they are greenlets; elsewhere they are OS threads. Nothing
here opens a socket at import time.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import requests

from continuum.sim.workload import Session, Workload


@dataclass
class RequestRecord:
    """What one request did. ``start`` is seconds after the replay began."""

    session: str
    turn: int
    kind: str
    group: str
    start: float
    ttft: float | None = None
    latency: float | None = None
    status: int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    backend: str | None = None

    @property
    def ok(self) -> bool:
        """The request completed with a 200 and a final usage chunk."""
        return self.error is None


@dataclass
class ReplayResult:
    """Every request's record, the wall time, and how many turns were never sent."""

    records: list[RequestRecord]
    wall_seconds: float
    skipped: int = 0

    def summary(self) -> dict[str, Any]:
        """Aggregates: counts, requests/s, TTFT mean/p50/p99 (ms), client-side hit rate."""
        ok = [r for r in self.records if r.ok]
        ttfts = sorted(r.ttft * 1000 for r in ok if r.ttft is not None)
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        return {
            "requests": len(self.records),
            "ok": len(ok),
            "errors": len(self.records) - len(ok),
            "skipped": self.skipped,
            "wall_seconds": round(self.wall_seconds, 3),
            "requests_per_second": round(len(ok) / self.wall_seconds, 2)
            if self.wall_seconds > 0
            else 0.0,
            "ttft_ms_mean": round(sum(ttfts) / len(ttfts), 2) if ttfts else None,
            "ttft_ms_p50": percentile(ttfts, 50),
            "ttft_ms_p99": percentile(ttfts, 99),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "client_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        }

    def error_samples(self, limit: int = 5) -> list[str]:
        """The first few distinct error messages."""
        seen: list[str] = []
        for r in self.records:
            if r.error is not None and r.error not in seen:
                seen.append(r.error)
                if len(seen) == limit:
                    break
        return seen

    def to_dicts(self) -> list[dict[str, Any]]:
        """The records as plain dicts (for JSON)."""
        return [asdict(r) for r in self.records]


def percentile(ordered: list[float], pct: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not ordered:
        return None
    rank = max(int(-(-pct * len(ordered) // 100)), 1)  # ceil(pct/100 * n), at least 1
    return round(ordered[rank - 1], 2)


def chat_body(session: Session, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The streamed chat-completions request body for one turn."""
    body: dict[str, Any] = {
        "model": session.model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": session.temperature,
    }
    if session.max_tokens is not None:
        body["max_tokens"] = session.max_tokens
    return body


def send_streaming(
    http: requests.Session, url: str, body: dict[str, Any], record: RequestRecord, timeout: float
) -> str:
    """POST ``body`` to ``url``, stream the reply into ``record``; return the reply text."""
    started = time.perf_counter()
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        with http.post(url, json=body, stream=True, timeout=timeout) as resp:
            record.status = resp.status_code
            record.backend = resp.headers.get("X-Continuum-Backend")
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return ""
            for line in resp.iter_lines(chunk_size=None):
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return ""
                for choice in chunk.get("choices") or ():
                    if record.ttft is None:
                        record.ttft = time.perf_counter() - started
                    parts.append((choice.get("delta") or {}).get("content") or "")
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (requests.RequestException, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return ""
    record.latency = time.perf_counter() - started
    if usage is None:
        record.error = "stream ended without a usage chunk"
        return ""
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or 0)
    return "".join(parts)


def replay(
    base_url: str | Sequence[str],
    workload: Workload,
    *,
    concurrency: int = 32,
    max_seconds: float = 60.0,
    timeout: float = 30.0,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> ReplayResult:
    """Send every session of ``workload`` to ``base_url`` and measure each request.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8080`` (``/v1/chat/completions`` is
            appended); several roots (routers of one fleet) take the requests in turn.
        workload: what to send.
        concurrency: sessions in progress at once (a session waits for a free worker when
            all are busy, so it may start after its arrival offset).
        max_seconds: no turn starts later than this after the beginning; the turns left
            are counted as skipped.
        timeout: per-request connect/read timeout in seconds.
        on_record: called with each finished request's record (progress reporting).

    Returns:
        Records in start order, the wall time from start to the last reply, skipped turns.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    roots = [base_url] if isinstance(base_url, str) else list(base_url)
    urls = [root.rstrip("/") + "/v1/chat/completions" for root in roots]
    turn = itertools.count()
    pending: queue.Queue[Session] = queue.Queue()
    for session in sorted(workload.sessions, key=lambda s: s.arrival):
        pending.put(session)
    records: list[RequestRecord] = []
    skipped = [0]
    lock = threading.Lock()
    began = time.monotonic()
    deadline = began + max_seconds

    def skip(count: int) -> None:
        with lock:
            skipped[0] += count

    def run(http: requests.Session, session: Session) -> None:
        history: list[dict[str, str]] = []
        if session.system is not None:
            history.append({"role": "system", "content": session.system})
        for i, text in enumerate(session.turns):
            if i and session.think_seconds:
                time.sleep(session.think_seconds)
            if time.monotonic() >= deadline:
                skip(len(session.turns) - i)
                return
            history.append({"role": "user", "content": text})
            record = RequestRecord(session.id, i, session.kind, session.group,
                                   time.monotonic() - began)
            url = urls[next(turn) % len(urls)]  # client-side round-robin over the roots
            reply = send_streaming(http, url, chat_body(session, history), record, timeout)
            with lock:
                records.append(record)
            if on_record is not None:
                on_record(record)
            if not record.ok:  # without the reply the conversation cannot go on
                skip(len(session.turns) - i - 1)
                return
            history.append({"role": "assistant", "content": reply})

    def worker() -> None:
        with requests.Session() as http:
            http.trust_env = False  # 127.0.0.1 only: never through a proxy
            while True:
                try:
                    session = pending.get_nowait()
                except queue.Empty:
                    return
                wait = began + session.arrival - time.monotonic()
                if began + session.arrival >= deadline:
                    skip(len(session.turns))
                    continue
                if wait > 0:
                    time.sleep(wait)
                run(http, session)

    threads = [
        threading.Thread(target=worker, name=f"replay-{i}", daemon=True)
        for i in range(min(concurrency, max(len(workload.sessions), 1)))
    ]
    for thread in threads:
        thread.start()
    # After the deadline a worker starts no turn, so it ends within one request timeout;
    # bound the wait anyway so a server that trickles bytes cannot hang the caller.
    give_up = deadline + timeout + 5
    for thread in threads:
        thread.join(max(give_up - time.monotonic(), 0))
    wall = time.monotonic() - began
    with lock:
        done = sorted(records, key=lambda r: r.start)
        # Sessions never picked up (a join gave up) count as skipped too.
        left = sum(len(s.turns) for s in _drain(pending))
        return ReplayResult(done, wall, skipped[0] + left)


def _drain(pending: queue.Queue[Session]) -> list[Session]:
    drained = []
    while True:
        try:
            drained.append(pending.get_nowait())
        except queue.Empty:
            return drained
