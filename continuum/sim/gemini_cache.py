"""The server-side state of the fake Gemini API: ``cachedContents`` and implicit caching.

What Google does, as far as a client can see it:

* ``cachedContents/{id}`` resources hold a model, a ``systemInstruction`` and ``contents``;
  they live until ``expireTime`` (from ``ttl`` or ``expireTime`` at creation, moved by
  ``PATCH``) and are gone after it, exactly as if deleted: every later use is refused.
* Creation is refused (400 ``INVALID_ARGUMENT``, "Cached content is too small.
  total_token_count=N, min_total_token_count=M") below a per-model minimum.
* Storage is billed per token and hour from creation to deletion or expiry;
  :meth:`CachedContents.storage_token_seconds` adds it up for a cost report.
* Implicit caching (Gemini 2.5+): a request whose system instruction the model saw
  recently (and which is long enough to be cached) reports those tokens as
  ``cachedContentTokenCount`` without any resource.

Times are wall-clock seconds from ``clock`` (``time.time`` plus the fake's configured
offset), because ``expireTime`` is an absolute timestamp a client compares with its own.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

#: How long an implicitly cached prefix stays warm after its last use (Google does not say;
#: minutes, like the other providers' prompt caches).
IMPLICIT_TTL_SECONDS = 300.0
#: Prefixes remembered for implicit caching (oldest forgotten first).
IMPLICIT_CAPACITY = 4096
DEFAULT_TTL_SECONDS = 3600.0
_DURATION = re.compile(r"^(\d+(?:\.\d{1,9})?)s$")


class GeminiApiError(Exception):
    """An error answer in Google's shape: ``{"error": {"code", "message", "status"}}``."""

    STATUSES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
                500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE",
                504: "DEADLINE_EXCEEDED"}

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def document(self) -> dict[str, Any]:
        """The JSON body Google sends."""
        return {"error": {"code": self.code, "message": self.message,
                          "status": self.STATUSES.get(self.code, "UNKNOWN")}}


def min_cache_tokens(model: str) -> int:
    """Google's smallest explicit cache for ``model`` (the seed's figures: about 2,048
    tokens for the 2.5 family, 4,096 for 3.x; 1,024 for older Flash models)."""
    name = model.removeprefix("models/")
    if name.startswith("gemini-3"):
        return 4096
    if name.startswith("gemini-2.5"):
        return 2048
    return 1024


def rfc3339(epoch: float) -> str:
    """``epoch`` as Google writes timestamps: UTC, ``Z``, nanosecond digits."""
    whole = int(epoch)
    nanos = round((epoch - whole) * 1e9)
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, nanos - 1_000_000_000
    stamp = datetime.fromtimestamp(whole, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{nanos:09d}Z"


def parse_rfc3339(text: str) -> float:
    """Epoch seconds of an RFC 3339 timestamp (``Z`` or an offset, 0-9 fraction digits).

    Raises:
        ValueError: not a timestamp.
    """
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$",
                     text)
    if match is None:
        raise ValueError(f"not an RFC 3339 timestamp: {text!r}")
    base, frac, zone = match.groups()
    tz = "+00:00" if zone == "Z" else zone
    moment = datetime.fromisoformat(base + tz)
    return moment.timestamp() + (int(frac.ljust(9, "0")) / 1e9 if frac else 0.0)


def parse_duration(text: Any, field_name: str) -> float:
    """A ``google.protobuf.Duration`` in JSON (``"600s"``, ``"1.5s"``) as seconds.

    Raises:
        GeminiApiError: 400, naming the field, for anything else.
    """
    match = _DURATION.match(text) if isinstance(text, str) else None
    if match is None:
        raise GeminiApiError(400, f"Invalid value at '{field_name}' (type.googleapis.com/"
                             f"google.protobuf.Duration), Field '{field_name}', Illegal "
                             f"duration format; duration must end with 's'")
    return float(match.group(1))


@dataclass
class CachedContent:
    """One ``cachedContents`` resource."""

    name: str
    model: str
    display_name: str
    system_text: str
    contents_text: str
    tokens: int
    create_time: float
    update_time: float
    expire_time: float
    #: Set when deleted or found expired: storage billing stops here.
    ended_at: float | None = None

    def document(self) -> dict[str, Any]:
        """The resource as ``GET`` returns it (contents are input only, never returned)."""
        doc: dict[str, Any] = {
            "name": self.name, "model": self.model,
            "createTime": rfc3339(self.create_time), "updateTime": rfc3339(self.update_time),
            "expireTime": rfc3339(self.expire_time),
            "usageMetadata": {"totalTokenCount": self.tokens},
        }
        if self.display_name:
            doc["displayName"] = self.display_name
        return doc


@dataclass
class CacheCounters:
    """What happened to the fake's caches, for tests and the cost report."""

    created: int = 0
    refused: int = 0
    deleted: int = 0
    expired: int = 0
    patched: int = 0
    explicit_hits: int = 0
    implicit_hits: int = 0
    cached_tokens: int = 0
    uses_of_missing: int = 0
    ended_token_seconds: float = 0.0
    by_method: dict[str, int] = field(default_factory=dict)


class CachedContents:
    """Every resource of one fake API, and its implicit cache."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 min_tokens: Callable[[str], int] = min_cache_tokens) -> None:
        self.clock = clock
        self.min_tokens = min_tokens
        self._live: dict[str, CachedContent] = {}
        self._implicit: OrderedDict[bytes, float] = OrderedDict()
        self.counters = CacheCounters()

    def reset(self) -> None:
        """Forget every resource, the implicit cache and the counters."""
        self._live.clear()
        self._implicit.clear()
        self.counters = CacheCounters()

    def _end(self, entry: CachedContent, at: float) -> None:
        entry.ended_at = at
        self.counters.ended_token_seconds += entry.tokens * max(0.0, at - entry.create_time)
        self._live.pop(entry.name, None)

    def _sweep(self) -> None:
        now = self.clock()
        for entry in [e for e in self._live.values() if e.expire_time <= now]:
            self.counters.expired += 1
            self._end(entry, entry.expire_time)

    def create(self, model: str, display_name: str, system_text: str, contents_text: str,
               tokens: int, ttl: float | None, expire_time: float | None) -> CachedContent:
        """Create a resource.

        Raises:
            GeminiApiError: 400 below the model's minimum token count.
        """
        self._sweep()
        minimum = self.min_tokens(model)
        if tokens < minimum:
            self.counters.refused += 1
            raise GeminiApiError(400, f"Cached content is too small. total_token_count="
                                 f"{tokens}, min_total_token_count={minimum}")
        now = self.clock()
        expiry = expire_time if expire_time is not None else \
            now + (ttl if ttl is not None else DEFAULT_TTL_SECONDS)
        name = "cachedContents/" + secrets.token_hex(16)
        entry = CachedContent(name, model, display_name, system_text, contents_text, tokens,
                              now, now, expiry)
        self._live[name] = entry
        self.counters.created += 1
        return entry

    def get(self, name: str) -> CachedContent:
        """The live resource ``name``.

        Raises:
            GeminiApiError: 403 when there is none (deleted, expired or never created): the
                API does not tell a missing cache from someone else's.
        """
        self._sweep()
        entry = self._live.get(name)
        if entry is None:
            raise GeminiApiError(403, "CachedContent not found (or permission denied)")
        return entry

    def list_page(self, page_size: int, page_token: str | None) -> dict[str, Any]:
        """One page of ``GET /v1beta/cachedContents`` (oldest first)."""
        self._sweep()
        start = 0
        if page_token:
            try:
                start = int(base64.urlsafe_b64decode(page_token.encode()).decode())
            except (ValueError, UnicodeDecodeError):
                raise GeminiApiError(400, "Invalid page token.") from None
        ordered = sorted(self._live.values(), key=lambda e: (e.create_time, e.name))
        page = ordered[start:start + page_size]
        doc: dict[str, Any] = {"cachedContents": [e.document() for e in page]}
        if start + page_size < len(ordered):
            doc["nextPageToken"] = base64.urlsafe_b64encode(
                str(start + page_size).encode()).decode()
        return doc

    def update_expiry(self, name: str, ttl: float | None, expire_time: float | None) -> \
            CachedContent:
        """``PATCH``: a new expiry from now + ``ttl`` or at ``expire_time``."""
        entry = self.get(name)
        now = self.clock()
        entry.expire_time = expire_time if expire_time is not None else now + (ttl or 0.0)
        entry.update_time = now
        self.counters.patched += 1
        return entry

    def delete(self, name: str) -> None:
        """``DELETE``: billing stops now."""
        entry = self.get(name)
        self.counters.deleted += 1
        self._end(entry, self.clock())

    def expire_now(self, name: str) -> bool:
        """Test control: end ``name`` as if its TTL had run out (False: no such cache)."""
        entry = self._live.get(name)
        if entry is None:
            return False
        entry.expire_time = self.clock()
        self._sweep()
        return True

    def use(self, name: str, model: str) -> CachedContent:
        """A generate request referencing ``name`` with ``model``.

        Raises:
            GeminiApiError: 403 for a missing or expired cache, 400 for another model's.
        """
        try:
            entry = self.get(name)
        except GeminiApiError:
            self.counters.uses_of_missing += 1
            raise
        if entry.model != model:
            raise GeminiApiError(400, f"Model used by GenerateContent request ({model}) and "
                                 f"CachedContent ({entry.model}) has to be the same.")
        self.counters.explicit_hits += 1
        self.counters.cached_tokens += entry.tokens
        return entry

    def implicit(self, model: str, system_text: str, system_tokens: int) -> int:
        """Tokens of ``system_text`` served from the implicit cache (0 on a first sight or
        below the model's minimum); the prefix is remembered either way."""
        if not system_text or system_tokens < self.min_tokens(model):
            return 0
        key = hashlib.sha256(model.encode() + b"\x00" + system_text.encode()).digest()
        now = self.clock()
        seen = self._implicit.pop(key, None)
        self._implicit[key] = now
        while len(self._implicit) > IMPLICIT_CAPACITY:
            self._implicit.popitem(last=False)
        if seen is None or now - seen > IMPLICIT_TTL_SECONDS:
            return 0
        self.counters.implicit_hits += 1
        self.counters.cached_tokens += system_tokens
        return system_tokens

    def storage_token_seconds(self) -> float:
        """Token-seconds of storage billed so far (ended resources plus live ones to now)."""
        self._sweep()
        now = self.clock()
        live = sum(e.tokens * max(0.0, now - e.create_time) for e in self._live.values())
        return self.counters.ended_token_seconds + live

    def live_count(self) -> int:
        """Resources alive now."""
        self._sweep()
        return len(self._live)
