"""Tier 2's third path: the semantic cache, tried after an exact-cache miss.

A request takes it when it is a ``/v1/chat/completions`` request with ``temperature: 0``
whose last message is a user turn of text within ``max_input_bytes`` (every other request
is a skip, counted by reason). Its last user text is embedded with one ``POST
/v1/embeddings`` to the configured backend within ``embedding_timeout_ms``; a failure or
timeout is a plain miss. The vector is searched inside the request's *partition* only:

    SHA256(compact sorted JSON of [tenant, model, embedding model, every body field but
    ``messages``, ``stream``, ``stream_options`` and those that cannot change the answer,
    forwarded headers, the messages before the last one])

so a different API key (tenant), system prompt, tool list, ``response_format``, sampling
parameter, seed or earlier turn never shares an entry. ``stream`` and ``stream_options``
change the answer's shape, not its content: a streamed and a non-streamed request share
entries, and :mod:`continuum.caching.semantic_replay` answers in the shape asked for
(a stream always ending with a usage chunk). A cosine at or above ``threshold`` that the
false-hit gate (:mod:`continuum.caching.false_hit_gate`) lets through is served with
``X-Cache: HIT`` and ``X-Cache-Mode: semantic``; otherwise the answer is indexed under the
vector once it is complete (streams included).

Storage: bodies live in the response-cache store (sharing ``response_cache.capacity``)
under ``sem:e:<partition>:<id>``, each value carrying its text, vector and expiry besides
the response, so any router on the same store (Redis) can rebuild the entry. The vector
index is in memory per worker (:mod:`continuum.caching.vector_index`). Sharing is
*eventually consistent*: each partition has a directory value ``sem:d:<partition>`` (the
latest :data:`DIRECTORY_SIZE` ``<key> <expires_at>`` lines, updated read-modify-write, so
two routers writing the same partition at once can drop one line from it); on a miss of its
local index a router reads the directory and pulls the entries (or newer versions of
entries) it has not seen yet. A cleared or expired body makes its index row a miss that is
dropped; a rewritten one (a new ``expires_at``) is pulled again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from continuum.caching.cache_key import IGNORED_FIELDS
from continuum.caching.false_hit_gate import refusal
from continuum.caching.response_cache import CachedResponse, decode_entry, encode_entry
from continuum.caching.semantic_replay import adapt
from continuum.caching.vector_index import Matrix, VectorIndex, unit
from continuum.interfaces import rate_text
from continuum.request import CHAT
from continuum.wire import http_client

if TYPE_CHECKING:
    import ssl

    from continuum.config import (
        BackendConfig,
        ResponseCacheConfig,
        RouterConfig,
        SemanticCacheConfig,
    )
    from continuum.interfaces import CacheStore
    from continuum.metrics import RouterMetrics
    from continuum.request import RequestContext

log = logging.getLogger(__name__)

SEMANTIC = "semantic"
#: Ids a partition directory keeps (the newest).
DIRECTORY_SIZE = 256
#: Entries pulled from the store per lookup (bounds the work of one miss).
MAX_PULL = 64
_MAGIC = b"SEv1"
_HEADER = struct.Struct(">I")
_MAX_EMBEDDING_BODY = 16 * 1024 * 1024
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, sort_keys=True).encode
#: Body fields left out of the partition: they shape the answer, not its content.
SHAPE_FIELDS = frozenset({"messages", "stream", "stream_options"})


class EmbeddingError(Exception):
    """The embedding call failed; ``kind`` is the metric label, ``detail`` what the log says
    of it (never the text embedded, nor a message the backend wrote: it could quote it)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail or kind


#: The least time between two warnings about failing embeddings: a misnamed model or a
#: down embedder fails every eligible request, and each is a plain miss.
EMBEDDING_WARNING_SECONDS = 60.0


def _status_detail(status: int, model: str, data: bytes) -> str:
    """What the log says of an embedding answer with ``status``: the status, the OpenAI
    error's ``type``/``code`` when the body has them, and what to check."""
    detail = f"HTTP {status}"
    try:
        doc = json.loads(data)
        error = doc.get("error") if doc.get("object") != "error" else doc  # OpenAI's, vLLM's
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        named = [f"{key} {error[key]}" for key in ("type", "code")
                 if isinstance(error.get(key), (str, int)) and len(str(error[key])) <= 64]
        if named:
            detail += f" ({', '.join(named)})"
    if status == 404:
        detail += (f"; does the backend serve the model {model!r} "
                   "(response_cache.semantic.embedding_model) at /v1/embeddings?")
    elif status in (401, 403):
        detail += "; check the backend's api_key_env"
    return detail


class EmbeddingClient:
    """``POST /v1/embeddings`` to one backend over the hand-written keep-alive client, every
    send and receive bounded by ``timeout`` seconds and the whole call by a gevent
    timeout of the same length (a backend trickling bytes cannot hold a request)."""

    def __init__(self, backend: BackendConfig, model: str, timeout: float) -> None:
        parts = urlsplit(backend.url)
        https = parts.scheme == "https"
        tls: ssl.SSLContext | None = None
        if https:
            import ssl as _ssl

            tls = _ssl.create_default_context()
        self.model, self.timeout = model, timeout
        self.path = (parts.path.rstrip("/") or "") + "/v1/embeddings"
        self.pool = http_client.ConnectionPool(
            parts.hostname or "127.0.0.1", parts.port or (443 if https else 80),
            connect_timeout=min(timeout, backend.connect_timeout_ms / 1000),
            read_timeout=timeout, tls=tls, maxsize=16)
        key = backend.resolved_api_key()
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def embed(self, text: str) -> list[float]:
        """The embedding of ``text``.

        Raises:
            EmbeddingError: kind ``timeout``, ``connect``, ``status`` or ``invalid``.
        """
        import gevent

        body = json.dumps({"model": self.model, "input": text,
                           "encoding_format": "float"}).encode()
        try:
            with gevent.Timeout(self.timeout):
                response = self.pool.request("POST", self.path, body, self.headers)
                data = response.read(_MAX_EMBEDDING_BODY)
        except (gevent.Timeout, http_client.ReadTimeout):
            raise EmbeddingError("timeout", f"no answer within {self.timeout * 1000:.0f} ms "
                                 "(response_cache.semantic.embedding_timeout_ms)") from None
        except http_client.ConnectError as exc:
            raise EmbeddingError("connect", f"cannot connect: {exc}") from None
        except (http_client.HTTPClientError, OSError) as exc:
            raise EmbeddingError("protocol", type(exc).__name__) from None
        if response.status != 200:
            raise EmbeddingError("status", _status_detail(response.status, self.model, data))
        invalid = "the answer is not an OpenAI embedding list (data[0].embedding)"
        try:
            vector = json.loads(data)["data"][0]["embedding"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EmbeddingError("invalid", invalid) from None
        if not isinstance(vector, list):
            raise EmbeddingError("invalid", invalid)
        return vector

    def close(self) -> None:
        self.pool.clear()


@dataclass(slots=True)
class Probe:
    """A request on the semantic path: where it was looked up, kept so that its answer is
    indexed under the same vector; on a hit, the answer in the request's shape."""

    partition: str
    text: str
    vector: Matrix | None
    stream: bool = False
    messages: list[Any] | None = None
    entry: CachedResponse | None = None
    score: float = 0.0
    answer: tuple[str, bytes | None, Iterator[bytes] | None] | None = None


def last_user_text(ctx: RequestContext) -> str | None:
    """The text of the last message when it is a user turn (a string, or text parts)."""
    messages = ctx.messages
    if not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def partition_digest(ctx: RequestContext, embedding_model: str) -> str:
    """The partition of ``ctx`` (see the module docstring)."""
    rest = {k: v for k, v in ctx.body.items()
            if k not in SHAPE_FIELDS and k not in IGNORED_FIELDS}
    doc = [ctx.tenant, ctx.model, embedding_model, rest, ctx.forward_headers or {},
           (ctx.messages or [])[:-1], ctx.endpoint]
    return hashlib.sha256(_ENCODE(doc).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _token(key: str, expires_at: float) -> str:
    """A directory line: an entry's key and the version (expiry) it was written with."""
    return f"{key} {expires_at:.6f}"


def encode_value(text: str, vector: Matrix, expires_at: float, entry: bytes) -> bytes:
    """A ``sem:e:`` value: ``SEv1 ‖ u32 header length ‖ header JSON ‖ float32 vector ‖
    response envelope``."""
    raw = vector.astype("<f4").tobytes()
    header = json.dumps({"text": text, "dims": int(vector.shape[0]),
                         "expires_at": expires_at}).encode()
    return _MAGIC + _HEADER.pack(len(header)) + header + raw + entry


@dataclass(frozen=True, slots=True)
class StoredEntry:
    text: str
    vector: Matrix
    expires_at: float
    response: CachedResponse


def decode_value(value: bytes) -> StoredEntry | None:
    """Unwrap a ``sem:e:`` value; None for anything that is not one."""
    if len(value) < 8 or value[:4] != _MAGIC:
        return None
    (length,) = _HEADER.unpack_from(value, 4)
    try:
        header = json.loads(value[8:8 + length])
        text, dims, expires = header["text"], int(header["dims"]), float(header["expires_at"])
    except (ValueError, KeyError, TypeError):
        return None
    start = 8 + length
    end = start + 4 * dims
    if dims < 1 or end > len(value) or not isinstance(text, str):
        return None
    vector = np.frombuffer(value[start:end], dtype="<f4").astype(np.float32)
    response = decode_entry(value[end:])
    if response is None:
        return None
    return StoredEntry(text, vector, expires, response)


class SemanticCache:
    """One worker's semantic path: eligibility, embedding, index, store, counters."""

    def __init__(self, config: ResponseCacheConfig, backend: BackendConfig,
                 store: Callable[[], CacheStore], metrics: RouterMetrics) -> None:
        sem = config.semantic
        self.config = config
        self.settings: SemanticCacheConfig = sem
        self.metrics = metrics
        self._store = store
        self.backend = backend
        self.client = EmbeddingClient(backend, sem.embedding_model or "",
                                      sem.embedding_timeout_ms / 1000)
        self.index = VectorIndex(sem.max_entries)
        #: Directory lines (key and version) this worker has indexed or pulled (newest
        #: last, bounded): never pulled again, so an entry evicted here stays evicted here
        #: until some router writes it anew.
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.counts: dict[str, int] = {"hit": 0, "miss": 0, "skip": 0}
        self.skips: dict[str, int] = {}
        self.refusals: dict[str, int] = {}
        self.embedding_errors: dict[str, int] = {}
        self._warn_after = 0.0  # monotonic time before which failures are not logged again
        self._unwarned = 0  # failures since the last warning

    @property
    def ttl(self) -> float:
        return self.settings.ttl if self.settings.ttl is not None else self.config.ttl

    # --- counting ---------------------------------------------------------------------------

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        self.metrics.child(self.metrics.semantic_requests, result).inc()

    def _skip(self, reason: str) -> None:
        self.skips[reason] = self.skips.get(reason, 0) + 1
        self._count("skip")
        self.metrics.child(self.metrics.semantic_skips, reason).inc()

    def _entries_changed(self, before: int) -> None:
        self.metrics.semantic_entries.inc(len(self.index) - before)

    # --- the path ---------------------------------------------------------------------------

    def text_of(self, ctx: RequestContext) -> str | None:
        """The text to embed, or None (a skip counted by reason)."""
        if ctx.endpoint != CHAT:
            self._skip("endpoint")
            return None
        if ctx.temperature != 0:
            self._skip("not_deterministic")
            return None
        text = last_user_text(ctx)
        if text is None:
            self._skip("last_turn_not_user_text")
            return None
        if len(text.encode("utf-8", "surrogatepass")) > self.settings.max_input_bytes:
            self._skip("too_long")
            return None
        return text

    def lookup(self, ctx: RequestContext) -> Probe | None:
        """Look ``ctx`` up after an exact miss: a probe with ``entry`` set on a hit, a probe
        without to index the answer under, or None when the request skips the path."""
        text = self.text_of(ctx)
        if text is None:
            return None
        probe = Probe(partition_digest(ctx, self.client.model), text, self._embed(text),
                      bool(ctx.stream), ctx.messages)
        if probe.vector is None:
            self._count("miss")
            return probe
        before = len(self.index)
        found = self._search(probe)
        if found is None and self._pull(probe.partition):
            found = self._search(probe)
        self._entries_changed(before)
        if found is None:
            self._count("miss")
            return probe
        (probe.entry, probe.answer), probe.score = found
        self._count("hit")
        return probe

    def _warn(self, exc: EmbeddingError) -> None:
        """Log a failed embedding: the first at once, then at most one warning every
        :data:`EMBEDDING_WARNING_SECONDS`, counting the failures in between."""
        self._unwarned += 1
        now = time.monotonic()
        if now < self._warn_after:
            return
        since = ("" if self._unwarned == 1
                 else f" ({self._unwarned} failures since the last warning)")
        log.warning("semantic cache: embedding by backend %s (model %s) failed: %s; the "
                    "request went on as a plain miss%s", self.backend.name,
                    self.client.model, exc.detail, since)
        self._warn_after = now + EMBEDDING_WARNING_SECONDS
        self._unwarned = 0

    def _embed(self, text: str) -> Matrix | None:
        started = time.perf_counter()
        try:
            vector = unit(self.client.embed(text))
            if vector is None:
                raise EmbeddingError("invalid", "the embedding is not a list of finite "
                                     "numbers, or is empty or all zeros")
        except EmbeddingError as exc:
            self.embedding_errors[exc.kind] = self.embedding_errors.get(exc.kind, 0) + 1
            self.metrics.child(self.metrics.semantic_embedding_errors, exc.kind).inc()
            self._warn(exc)
            return None
        finally:
            self.metrics.semantic_embedding_latency.observe(time.perf_counter() - started)
        return vector

    def _search(self, probe: Probe) -> tuple[
            tuple[CachedResponse, tuple[str, bytes | None, Iterator[bytes] | None]],
            float] | None:
        assert probe.vector is not None
        match = self.index.search(probe.partition, probe.vector)
        if match is None or match.score < self.settings.threshold:
            return None
        if self.settings.false_hit_gate:
            reason = refusal(probe.text, match.text)
            if reason is not None:
                self.refusals[reason] = self.refusals.get(reason, 0) + 1
                self.metrics.child(self.metrics.semantic_gate_refusals, reason).inc()
                return None
        stored = self._get(match.key)
        if stored is None:
            self.index.remove(probe.partition, match.key)
            return None
        answer = adapt(stored.response, probe.stream, probe.messages)
        if answer is None:  # not a chat completion we can answer in the asked shape
            return None
        return (stored.response, answer), match.score

    def _get(self, key: str) -> StoredEntry | None:
        try:
            value = self._store().get(key)
        except Exception as exc:  # a store failure is a miss, never a 500
            log.debug("semantic get failed (%s)", type(exc).__name__)
            return None
        return None if value is None else decode_value(value)

    def _pull(self, partition: str) -> bool:
        """Index the entries of ``partition``'s directory this worker has not seen in that
        version (written by other workers or routers); whether any was added."""
        lines = self._directory(partition)
        seen = self._seen
        added = False
        now = time.time()
        for line in [t for t in lines if t not in seen][-MAX_PULL:]:
            self._saw(line)
            key = line.split(" ", 1)[0]
            stored = self._get(key)
            if stored is None or stored.expires_at <= now:
                continue
            self._saw(_token(key, stored.expires_at))
            vector = unit(stored.vector)
            if vector is not None:
                self.index.add(partition, key, vector, stored.text, stored.expires_at - now)
                added = True
        return added

    def _saw(self, key: str) -> None:
        seen = self._seen
        seen[key] = None
        seen.move_to_end(key)
        while len(seen) > 4 * self.settings.max_entries + DIRECTORY_SIZE:
            seen.popitem(last=False)

    def _directory(self, partition: str) -> list[str]:
        try:
            value = self._store().get(f"sem:d:{partition}")
        except Exception:
            return []
        if not value:
            return []
        return [k for k in value.decode("utf-8", "replace").split("\n") if k]

    def store(self, probe: Probe, kind: str, content_type: str, payload: bytes) -> None:
        """Index a complete answer of a probed request under its vector."""
        if probe.vector is None or probe.entry is not None:
            return
        ttl = self.ttl
        entry_id = hashlib.sha256(probe.text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        key = f"sem:e:{probe.partition}:{entry_id}"
        expires_at = time.time() + ttl
        value = encode_value(probe.text, probe.vector, expires_at,
                             encode_entry(kind, content_type, payload))
        token = _token(key, expires_at)
        store = self._store()
        try:
            store.set(key, value, ttl)
            lines = [t for t in self._directory(probe.partition)
                     if t.split(" ", 1)[0] != key]
            lines = [*lines, token][-DIRECTORY_SIZE:]
            store.set(f"sem:d:{probe.partition}", "\n".join(lines).encode(), ttl)
        except Exception as exc:
            log.debug("semantic set failed (%s); not indexed", type(exc).__name__)
            return
        before = len(self.index)
        self._saw(token)
        self.index.add(probe.partition, key, probe.vector, probe.text, ttl)
        self._entries_changed(before)

    def store_body(self, probe: Probe, status: int, content_type: str, body: bytes) -> None:
        """Index a non-streamed answer when it is a 200 within ``max_response_size``."""
        if status == 200 and len(body) <= self.config.max_response_size:
            self.store(probe, "body", content_type, body)

    def stream_done(self, probe: Probe, content_type: str) -> Callable[[bytes], None]:
        """What the exact cache's stream tee calls with a complete stream."""
        return lambda payload: self.store(probe, "sse", content_type, payload)

    def replay(self, probe: Probe) -> tuple[dict[str, str], bytes | None, Iterator[bytes] | None]:
        """Headers and body or stream of a hit, in the shape the request asked for."""
        assert probe.answer is not None
        content_type, body, stream = probe.answer
        headers = {"Content-Type": content_type, "X-Cache": "HIT",
                   "X-Cache-Mode": SEMANTIC, "X-Cache-Similarity": f"{probe.score:.4f}"}
        if stream is not None:
            headers["Cache-Control"] = "no-cache"
        return headers, body, stream

    # --- admin ------------------------------------------------------------------------------

    def clear(self) -> int:
        """Drop the local index (the store's ``sem:`` space is cleared with the store)."""
        before = len(self.index)
        cleared = self.index.clear()
        self._seen.clear()
        self._entries_changed(before)
        return cleared

    def stats(self) -> dict[str, Any]:
        """The ``semantic`` section of ``/admin/response-cache/stats`` (this worker)."""
        counts = self.counts
        looked_up = counts["hit"] + counts["miss"]
        sem = self.settings
        return {
            "enabled": True,
            "index_entries": len(self.index),
            "partitions": self.index.partitions(),
            "evictions": self.index.evictions,
            "requests": {**counts, "total": looked_up + counts["skip"]},
            "hit_rate": rate_text(counts["hit"], looked_up),
            "skips": dict(self.skips),
            "gate_refusals": dict(self.refusals),
            "embedding_errors": dict(self.embedding_errors),
            "config": {"backend": sem.backend, "embedding_model": sem.embedding_model,
                       "threshold": sem.threshold, "max_entries": sem.max_entries,
                       "ttl": self.ttl, "embedding_timeout_ms": sem.embedding_timeout_ms,
                       "max_input_bytes": sem.max_input_bytes,
                       "false_hit_gate": sem.false_hit_gate},
        }

    def reconfigure(self, new: RouterConfig) -> bool:
        """Apply a reloaded config, keeping the index; False when this cache cannot carry
        over (the path is now off, or the embedding backend or model changed: vectors of
        another model are not comparable) and the caller builds a new one.

        Threshold, gate, ``ttl`` (new entries), ``max_input_bytes`` apply at once;
        ``max_entries`` evicts the oldest entries down to the new bound; a changed
        ``embedding_timeout_ms`` or backend connection setting gets a new embedding client.
        """
        cache, sem = new.response_cache, new.response_cache.semantic
        old = self.settings
        if not (cache.enabled and sem.enabled) or sem.backend != old.backend \
                or sem.embedding_model != old.embedding_model:
            return False
        backend = next((b for b in new.backends if b.name == sem.backend), None)
        if backend is None:
            return False
        if backend != self.backend or sem.embedding_timeout_ms != old.embedding_timeout_ms:
            self.client.close()
            self.client = EmbeddingClient(backend, sem.embedding_model or "",
                                          sem.embedding_timeout_ms / 1000)
            self.backend = backend
        self.config, self.settings = cache, sem
        before = len(self.index)
        self.index.resize(sem.max_entries)
        self._entries_changed(before)
        return True

    def close(self) -> None:
        """Close the embedding client; this worker's index size leaves the gauge."""
        self.metrics.semantic_entries.dec(len(self.index))
        self.index.clear()
        self.client.close()
