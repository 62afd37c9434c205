"""The Gemini context-cache manager: ``cachedContents`` for large, repeated system prompts.

Built only with ``gemini_context_cache.enabled`` (otherwise nothing here is allocated and no
greenlet runs). For each chat request to a ``type: gemini`` backend, in the seed's order:

1. The key is the backend's name and ``SHA256(model ++ 0x00 ++ "S" ++ system)``, the Tier 1
   prefix key's structure over the **whole** system prompt (never truncated). A request
   without a plain-text system prompt of at least ``min_prefix_bytes`` is ``ineligible``.
2. A live entry: a ``hit`` returns its ``cachedContents/…`` name. With ``extend_on_hit``, a
   hit that finds at most 20% of ``ttl`` left starts a background ``PATCH …?updateMask=ttl``
   (one at a time per entry).
3. No entry: a ``miss``; the request goes unchanged and one greenlet creates the resource
   (``POST /v1beta/cachedContents`` with ``model``, ``systemInstruction``, ``ttl``) unless one
   is already creating it (single-flight).
4. The create is refused, in a way that no retry soon would change (:func:`refused`): a 4xx
   (too few tokens, a model without caching, 403 permission denied, 404/405 from an
   endpoint without ``cachedContents``) or a 501 Not Implemented (a proxy or self-hosted
   endpoint that mimics the API but not its ``cachedContents``): a negative entry for
   ``negative_ttl_seconds``; lookups of it count ``negative``. A 5xx but 501, a 401, 408,
   409, 429 or a timeout backs off the same way for at most 10 s.
5. Past ``max_entries`` (negative entries included), expired entries go first, then the least
   recently used; an evicted resource gets a best-effort ``DELETE`` (its storage is billed
   until then), and so does every resource on :meth:`GeminiContextCache.clear`.
6. Google says a referenced cache does not exist: :meth:`invalidate` drops the entry (the
   dispatcher retries without it; the next request creates a new one).

Sharing (beyond the seed): with a shared response-cache store (``response_cache.backend:
redis``) the map and the single-flight lock live there too, under ``gctx:`` and
``gctx-lock:`` keys: the lock is ``SET NX EX`` (``CacheStore.add``), and a worker that wins it
checks the map once more before creating, so the whole fleet creates one resource per
(backend, model, prompt). Each worker keeps a local LRU copy of what it has seen. Without a
shared store every worker has its own map and creates its own resources.

Invariants: an entry is either positive (a name and Google's ``expireTime``) or negative (an
expiry only); at most one create and one extend per key run in a worker at a time; store
failures degrade to the local map, never to an error for the client.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import requests

from continuum.errors import StoreError
from continuum.prefix import SYSTEM_TAG, prefix_key_from_text

if TYPE_CHECKING:
    from continuum.config import GeminiContextCacheConfig
    from continuum.interfaces import CacheStore
    from continuum.routing.backends import Backend
    from continuum.routing.gemini_dispatch import GeminiMetrics

log = logging.getLogger(__name__)

MAP_PREFIX = "gctx:"
LOCK_PREFIX = "gctx-lock:"
#: Fraction of ``ttl`` left at which a hit extends the resource (the seed's 20%).
EXTEND_AT = 0.2
#: Longest back-off after a create that failed without a refusal (5xx but 501, 429, timeout).
TRANSIENT_BACKOFF_SECONDS = 10.0
#: 4xx statuses that are not a refusal: back off briefly, try again later. 401
#: (UNAUTHENTICATED: a credential that can be refreshed, an expired OAuth token), 408, 409
#: (ABORTED, a concurrent change) and 429 (RESOURCE_EXHAUSTED: a quota that refills).
#: 403 (PERMISSION_DENIED) is not among them: on a create it means this key or project may
#: not create caches (the API not enabled for the project, a key restricted to other
#: methods, a model the key cannot use, a gateway in front that forbids the path), which no
#: retry within seconds changes and only an operator does; retried every 10 s it only
#: multiplies calls and log lines for every prompt. A negative entry bounds the wait to
#: ``negative_ttl_seconds``, and the requests themselves go uncached meanwhile, as they do
#: during a back-off.
_TRANSIENT = frozenset({401, 408, 409, 429})
#: 5xx statuses that are a refusal: 501 Not Implemented (GoogleAPIs' UNIMPLEMENTED) says the
#: endpoint has no ``cachedContents`` at all (a proxy or self-hosted endpoint that mimics the
#: Generative Language API without it), which a retry cannot change; every other 5xx is an
#: outage that may end in seconds.
_REFUSED_5XX = frozenset({501})


def refused(status: int) -> bool:
    """Whether a create that failed with HTTP ``status`` is refused for good (a negative
    entry for ``negative_ttl_seconds``) rather than failed for now (a 10 s back-off)."""
    return (400 <= status < 500 and status not in _TRANSIENT) or status in _REFUSED_5XX


COUNTERS = ("hits", "misses", "ineligible", "negative", "creates", "create_failures",
            "evictions", "cached_tokens")


@dataclass
class Entry:
    """One prompt's state: a resource (``name``) or a refusal (``name`` None)."""

    backend: str
    model: str
    name: str | None
    expire_at: float
    tokens: int = 0

    @property
    def negative(self) -> bool:
        """A refusal (no resource)."""
        return self.name is None


def _delete_key(key: str, store: CacheStore) -> None:
    store.delete(key)


#: RFC 3339 as Google writes ``expireTime``: seconds, 0-9 fraction digits, ``Z`` or an offset.
_RFC3339 = re.compile(
    r"(\d{4}-\d\d-\d\d)[Tt](\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?([Zz]|[+-]\d\d:\d\d)")


def parse_expire_time(text: Any) -> float | None:
    """Epoch seconds of Google's ``expireTime`` (RFC 3339, up to 9 fraction digits); None
    for anything else. The same on every Python the router supports (3.10's
    ``fromisoformat`` takes neither ``Z`` nor more than 6 digits) and in every local time
    zone (the offset is always kept)."""
    if not isinstance(text, str):
        return None
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    day, clock, fraction, zone = match.groups()
    offset = "+00:00" if zone in ("Z", "z") else zone
    try:
        seconds = datetime.fromisoformat(f"{day}T{clock}{offset}").timestamp()
    except ValueError:  # a day or time out of range
        return None
    return seconds + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def duration_text(seconds: float) -> str:
    """``seconds`` as a protobuf ``Duration`` in JSON (``"600s"``, ``"1.5s"``): decimal
    seconds, at most nine fractional digits. Not ``f"{seconds:g}s"``, which writes a TTL
    of a million seconds or more as ``"1e+06s"`` (Google refuses it: the create fails)
    and rounds any to six significant digits."""
    text = f"{seconds:.9f}".rstrip("0").rstrip(".")
    return f"{text}s"


def entry_key(backend: str, model: str, system: str) -> str:
    """The map key of a prompt: backend name and the hex digest of model and system."""
    digest = prefix_key_from_text(model, SYSTEM_TAG, system,
                                  max_prefix_length=len(system) * 4 + 4)
    return f"{backend}:{digest.hex()}"


class GeminiContextCache:
    """The map, its lifecycle and the calls to Google (see the module doc)."""

    def __init__(
        self,
        settings: GeminiContextCacheConfig,
        metrics: GeminiMetrics,
        *,
        shared: Callable[[], CacheStore | None] | None = None,
        clock: Callable[[], float] = time.time,
        session: requests.Session | None = None,
        spawn: Callable[..., Any] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._shared = shared or (lambda: None)
        self._clock = clock
        self._session = session or requests.Session()
        if spawn is None:
            import gevent

            spawn = gevent.spawn
        self._spawn = spawn
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._creating: set[str] = set()
        self._extending: set[str] = set()
        self._greenlets: set[Any] = set()
        self._backends: dict[str, dict[str, int]] = {}
        #: name -> (url, api key) of the Gemini backends, for DELETEs of evicted entries.
        self._backend_configs: dict[str, tuple[str, str | None]] = {}

    # --- the request path ---------------------------------------------------------------

    def _bump(self, backend: str, counter: str, amount: int = 1) -> None:
        row = self._backends.get(backend)
        if row is None:
            row = self._backends[backend] = dict.fromkeys(COUNTERS, 0)
        row[counter] += amount

    def _lookup_result(self, backend: str, counter: str, result: str) -> None:
        self._bump(backend, counter)
        self.metrics.lookup(backend, result)

    def reference(self, backend: Backend, model: str, system: str | None) -> str | None:
        """The resource to reference for this prompt, or None (see the module doc)."""
        name = backend.name
        if system is None or len(system.encode("utf-8", "surrogatepass")) < \
                self.settings.min_prefix_bytes:
            self._lookup_result(name, "ineligible", "ineligible")
            return None
        key = entry_key(name, model, system)
        now = self._clock()
        entry = self._entries.get(key) or self._load_shared(key)
        if entry is not None and entry.expire_at <= now:
            self._entries.pop(key, None)
            entry = None
        if entry is None:
            self._lookup_result(name, "misses", "miss")
            self._start_create(key, backend, model, system)
            return None
        self._entries.move_to_end(key)
        if entry.negative:
            self._lookup_result(name, "negative", "negative")
            return None
        self._lookup_result(name, "hits", "hit")
        if self.settings.extend_on_hit and \
                entry.expire_at - now <= EXTEND_AT * self.settings.ttl:
            self._start_extend(key, backend, entry)
        return entry.name

    def invalidate(self, backend: Backend, model: str, system: str, name: str) -> None:
        """Google does not know ``name`` (any more): drop its entry here and in the shared
        map (when it still names that resource), and start creating a new one."""
        key = entry_key(backend.name, model, system)
        entry = self._entries.get(key)
        if entry is not None and entry.name == name:
            del self._entries[key]
        shared = self._load_shared(key, insert=False)
        if shared is not None and shared.name == name:
            self._store_call(partial(_delete_key, MAP_PREFIX + key))
        # The prompt is in use right now: create its replacement at once.
        self._start_create(key, backend, model, system)

    def observe_cached_tokens(self, backend: str, count: int) -> None:
        """Cached tokens an answer from ``backend`` reported."""
        self._bump(backend, "cached_tokens", count)

    # --- shared map -----------------------------------------------------------------------

    def _store_call(self, call: Callable[[CacheStore], Any]) -> Any:
        store = self._shared()
        if store is None:
            return None
        try:
            return call(store)
        except StoreError as exc:
            log.warning("gemini context cache: shared store failed (%s); using the local map",
                        exc)
            return None

    def _load_shared(self, key: str, *, insert: bool = True) -> Entry | None:
        raw = self._store_call(lambda s: s.get(MAP_PREFIX + key))
        if not raw:
            return None
        try:
            entry = Entry(**json.loads(raw))
        except (ValueError, TypeError):
            return None
        if insert and entry.expire_at > self._clock():
            self._insert(key, entry, share=False)
        return entry

    def _share(self, key: str, entry: Entry) -> None:
        ttl = entry.expire_at - self._clock()
        if ttl > 0:
            value = json.dumps(asdict(entry)).encode()
            self._store_call(lambda s: s.set(MAP_PREFIX + key, value, ttl))

    # --- the map --------------------------------------------------------------------------

    def _insert(self, key: str, entry: Entry, *, share: bool = True) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        if share:
            self._share(key, entry)
        if len(entries) <= self.settings.max_entries:
            return
        now = self._clock()
        for stale in [k for k, e in entries.items() if e.expire_at <= now and k != key]:
            del entries[stale]
        while len(entries) > self.settings.max_entries:
            old_key, victim = entries.popitem(last=False)
            self._bump(victim.backend, "evictions")
            self.metrics.operation(victim.backend, "eviction")
            if victim.name is not None:
                self._store_call(partial(_delete_key, MAP_PREFIX + old_key))
                self._background(self._delete_remote, victim.backend, victim.name)

    # --- calls to Google ------------------------------------------------------------------

    def _background(self, fn: Callable[..., Any], *args: Any) -> Any:
        greenlet = self._spawn(fn, *args)
        self._greenlets.add(greenlet)
        link = getattr(greenlet, "link", None)
        if link is not None:
            link(self._greenlets.discard)
        return greenlet

    def _urls(self, backend: str) -> tuple[str, dict[str, str]] | None:
        found = self._backend_configs.get(backend)
        if found is None:
            return None
        url, key = found
        return url, ({"x-goog-api-key": key} if key else {})

    def register_backends(self, backends: Iterable[Backend]) -> None:
        """Remember where each Gemini backend is (for deletes of evicted entries)."""
        self._backend_configs = {b.name: (b.url, b.config.resolved_api_key())
                                 for b in backends}

    def _start_create(self, key: str, backend: Backend, model: str, system: str) -> None:
        if key in self._creating:
            return
        self._creating.add(key)
        self._background(self._create, key, backend, model, system)

    def _create(self, key: str, backend: Backend, model: str, system: str) -> None:
        locked = False
        try:
            store = self._shared()
            if store is not None:
                lock_ttl = self.settings.create_timeout_ms / 1000 * 2 + 1
                locked = bool(self._store_call(
                    lambda s: s.add(LOCK_PREFIX + key, b"1", lock_ttl)))
                if not locked or self._load_shared(key) is not None:
                    return  # another worker is creating it, or just did
            self._post_create(key, backend, model, system)
        except Exception:  # a bug here must not kill the worker's hub
            log.exception("gemini context cache: creating a cache for %s failed", backend.name)
        finally:
            self._creating.discard(key)
            if locked:
                self._store_call(lambda s: s.delete(LOCK_PREFIX + key))

    def _post_create(self, key: str, backend: Backend, model: str, system: str) -> None:
        settings, name = self.settings, backend.name
        doc = {"model": "models/" + model.removeprefix("models/"),
               "systemInstruction": {"parts": [{"text": system}]},
               "ttl": duration_text(settings.ttl)}
        api_key = backend.config.resolved_api_key()
        headers = {"x-goog-api-key": api_key} if api_key else {}
        try:
            resp = self._session.post(backend.url + "/v1beta/cachedContents", json=doc,
                                      headers=headers,
                                      timeout=settings.create_timeout_ms / 1000)
        except requests.RequestException as exc:
            log.warning("gemini context cache: create on %s failed: %s", name, exc)
            self._failed(key, backend, model, TRANSIENT_BACKOFF_SECONDS)
            return
        if resp.status_code == 200:
            try:
                body = resp.json()
                resource = str(body["name"])
            except (ValueError, KeyError, TypeError):
                self._failed(key, backend, model, TRANSIENT_BACKOFF_SECONDS)
                return
            expire = parse_expire_time(body.get("expireTime")) or \
                self._clock() + settings.ttl
            tokens = int((body.get("usageMetadata") or {}).get("totalTokenCount") or 0)
            self._insert(key, Entry(name, model, resource, expire, tokens))
            self._bump(name, "creates")
            self.metrics.operation(name, "create")
            return
        final = refused(resp.status_code)
        log.info("gemini context cache: %s %s the create (%d): %.200s", name,
                 "refused" if final else "failed", resp.status_code, resp.text)
        self._failed(key, backend, model, settings.negative_ttl_seconds if final
                     else TRANSIENT_BACKOFF_SECONDS)

    def _failed(self, key: str, backend: Backend, model: str, backoff: float) -> None:
        seconds = min(float(backoff), float(self.settings.negative_ttl_seconds))
        self._insert(key, Entry(backend.name, model, None, self._clock() + seconds))
        self._bump(backend.name, "create_failures")
        self.metrics.operation(backend.name, "create_failure")

    def _start_extend(self, key: str, backend: Backend, entry: Entry) -> None:
        if key in self._extending:
            return
        self._extending.add(key)
        self._background(self._extend, key, backend, entry)

    def _extend(self, key: str, backend: Backend, entry: Entry) -> None:
        try:
            api_key = backend.config.resolved_api_key()
            headers = {"x-goog-api-key": api_key} if api_key else {}
            resp = self._session.patch(
                f"{backend.url}/v1beta/{entry.name}", params={"updateMask": "ttl"},
                json={"ttl": duration_text(self.settings.ttl)}, headers=headers,
                timeout=self.settings.create_timeout_ms / 1000)
            if resp.status_code == 200:
                expire = parse_expire_time(resp.json().get("expireTime"))
                entry.expire_at = expire or self._clock() + self.settings.ttl
                self._share(key, entry)
                self.metrics.operation(backend.name, "extend")
            elif resp.status_code in (403, 404):
                self._entries.pop(key, None)
        except (requests.RequestException, ValueError) as exc:
            log.warning("gemini context cache: extending %s failed: %s", entry.name, exc)
        finally:
            self._extending.discard(key)

    def _delete_remote(self, backend: str, name: str) -> bool:
        target = self._urls(backend)
        if target is None:
            return False
        url, headers = target
        try:
            resp = self._session.delete(f"{url}/v1beta/{name}", headers=headers,
                                        timeout=self.settings.create_timeout_ms / 1000)
        except requests.RequestException as exc:
            log.warning("gemini context cache: DELETE %s failed: %s", name, exc)
            return False
        self.metrics.operation(backend, "delete")
        return resp.status_code < 300

    # --- admin ----------------------------------------------------------------------------

    def clear(self, wait: float = 10.0) -> int:
        """Drop every entry of this worker's map (and its shared copies); DELETE every
        resource it names, waiting up to ``wait`` seconds for those calls. How many
        entries were dropped."""
        entries = list(self._entries.items())
        self._entries.clear()
        calls = []
        for key, entry in entries:
            self._store_call(partial(_delete_key, MAP_PREFIX + key))
            if entry.name is not None:
                calls.append(self._background(self._delete_remote, entry.backend, entry.name))
        waiting = [c for c in calls if hasattr(c, "join")]
        if waiting:
            import gevent

            gevent.joinall(waiting, timeout=wait)
        return len(entries)

    def stats(self) -> dict[str, Any]:
        """``GET /admin/gemini-context-cache/stats``: this worker's view."""
        s = self.settings
        now = self._clock()
        live = [e for e in self._entries.values() if e.expire_at > now]
        totals = dict.fromkeys(COUNTERS, 0)
        for row in self._backends.values():
            for counter, value in row.items():
                totals[counter] += value
        return {
            "enabled": True,
            "config": {"min_prefix_bytes": s.min_prefix_bytes, "ttl_seconds": s.ttl,
                       "extend_on_hit": s.extend_on_hit, "max_entries": s.max_entries,
                       "create_timeout_ms": s.create_timeout_ms,
                       "negative_ttl_seconds": s.negative_ttl_seconds,
                       "prefer_native_api": s.prefer_native_api},
            "shared": self._shared() is not None,
            "entries": sum(1 for e in live if not e.negative),
            "negative_entries": sum(1 for e in live if e.negative),
            "in_flight": len(self._creating),
            "backends": {name: dict(row) for name, row in sorted(self._backends.items())},
            **totals,
        }

    def close(self) -> None:
        """Stop background calls (a process shutting down lets its resources expire)."""
        for greenlet in list(self._greenlets):
            kill = getattr(greenlet, "kill", None)
            if kill is not None:
                kill(block=False)
        self._greenlets.clear()
        self._session.close()
