"""Prompt recovery: block chain tokens → engine ``/detokenize`` → the router's prefix key.

A :class:`RecoveryJob` is one unattributed chain, root first: the block hashes, each block's
chain length and the concatenated tokens. :meth:`PromptRecovery.search` finds the
*shallowest* block whose chain text decides the anchor (:func:`listener.templates.find_anchor`
is monotone along a chain: once decided, every longer chain decides the same key), so later
chains that branch off below that block inherit the key without another call. For a
chain that branches off undecided blocks it first checks the branch's first block (the usual
decider when requests share a system prompt); then the tip, then the block where the tip's
text puts the anchor's end and its neighbours, then it bisects: about ``3 + log2 n`` calls at
worst for ``n`` new blocks, usually 3.

Calls are bounded per source by a semaphore of ``detokenize.max_concurrent`` (``threading``
primitives, which gevent's monkey patching turns into greenlet ones), time out after
``detokenize.timeout_ms`` and never follow redirects. Outcomes (a prefix key, "pending" or
"never"), not texts, are remembered in an LRU of ``detokenize.cache_entries`` keyed by the
chain's last block hash, so a chain stored again (re-announced, reloaded after eviction,
another KV group) costs nothing. Errors are not cached; after a failure, calls pause (0.5 s,
doubling up to 30 s while failures continue) so that a down or slow engine does not stall
the source's event loop. ``calls`` counts every ``/detokenize`` request, template probes
included.

:class:`EngineClient`, the real client, reads at most ``detokenize.max_response_bytes`` of a
reply (a longer one is a failed call, counted in ``too_large``) and ignores proxy variables
such as ``HTTP_PROXY``: the engine is a neighbour on the internal network, and a proxy would
see the prompts.

Nothing here logs or keeps prompt text, token ids or response bodies: failures are logged
as an HTTP status or an exception type name.
"""

from __future__ import annotations

import json as jsonlib
import logging
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import requests

from continuum.prefix import prefix_key_from_text, truncate_utf8
from listener.config import DetokenizeConfig, SourceConfig
from listener.templates import (
    BUILTIN_TEMPLATES,
    NEVER,
    PENDING,
    PROBE_SYSTEM_CHAT,
    PROBE_USER_CHAT,
    ChatMarkers,
    TemplateError,
    find_anchor,
    learn_markers,
    tokenize_url,
)

log = logging.getLogger(__name__)

#: Seconds before ``template: auto`` tries again after failing to learn the template.
LEARN_RETRY_SECONDS = 60.0
#: After ``n`` failed calls in a row, no call is made for ``min(MAX_PAUSE, BASE * 2**(n-1))``
#: seconds, so an engine whose /detokenize is down or slow does not stall the source.
PAUSE_BASE_SECONDS = 0.5
PAUSE_MAX_SECONDS = 30.0


class HttpResponse(Protocol):
    """The part of ``requests.Response`` the recovery uses."""

    status_code: int

    def json(self) -> Any:
        """The body parsed as JSON."""


class HttpClient(Protocol):
    """The part of ``requests.Session`` the recovery uses."""

    def post(self, url: str, *, json: Any, timeout: float, allow_redirects: bool) -> Any:
        """POST ``json``; return an :class:`HttpResponse`."""


class ReplyTooLarge(ValueError):
    """An engine reply longer than ``detokenize.max_response_bytes`` (not read further)."""


class _Reply:
    """A fully read, size-checked engine reply: what :class:`HttpResponse` asks for."""

    __slots__ = ("body", "status_code")

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code = status_code
        self.body = body

    def json(self) -> Any:
        """The body parsed as JSON."""
        return jsonlib.loads(self.body)


class EngineClient:
    """The :class:`HttpClient` of a source's ``/tokenize`` and ``/detokenize`` calls.

    A ``requests.Session`` with ``trust_env = False`` (no proxy, ``.netrc`` or CA-bundle
    variables from the environment), whose replies are read as a stream and cut off after
    ``max_response_bytes``.

    Args:
        max_response_bytes: Largest reply body read; a longer one raises
            :class:`ReplyTooLarge`.
    """

    def __init__(self, max_response_bytes: int) -> None:
        self.max_response_bytes = max_response_bytes
        self.session = requests.Session()
        self.session.trust_env = False

    def post(self, url: str, *, json: Any, timeout: float, allow_redirects: bool) -> _Reply:
        """POST ``json`` and read the reply, at most ``max_response_bytes`` of it.

        Raises:
            ReplyTooLarge: The reply is longer (the connection is then closed).
            requests.RequestException: The call failed.
        """
        limit = self.max_response_bytes
        with self.session.post(url, json=json, timeout=timeout, stream=True,
                               allow_redirects=allow_redirects) as resp:
            length = resp.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > limit:
                raise ReplyTooLarge(f"reply of {length} bytes")
            body = resp.raw.read(limit + 1, decode_content=True)
        if len(body) > limit:
            raise ReplyTooLarge(f"reply over {limit} bytes")
        return _Reply(resp.status_code, body)

    def close(self) -> None:
        """Close the session's connections."""
        self.session.close()


@dataclass(frozen=True)
class RecoveryJob:
    """One chain to attribute, root first.

    Attributes:
        hashes: Block hashes from the root to the tip.
        ends: Chain length in tokens at the end of each block.
        tokens: The chain's tokens (at least ``ends[-1]``).
        lo: Index of the first block not known to be undecided.
        model: Model name for ``/detokenize`` and the prefix key.
        group: Jobs with the same group run one after another (they share blocks, so the
            later ones hit the outcome cache).
    """

    hashes: tuple[int, ...]
    ends: tuple[int, ...]
    tokens: Sequence[int]
    lo: int
    model: str
    group: object = None


@dataclass(frozen=True)
class RecoveryResult:
    """What a search learned about its job's blocks (indices into ``job.hashes``).

    Attributes:
        decided_at: The shallowest block whose chain decides ``prefix_hash``, if any.
        prefix_hash: The prefix key (64 lowercase hex) of that block and all deeper ones.
        pending_upto: Blocks up to this index are known undecided (-1: none).
        never_from: From this block on, no text will ever decide (not a chat prompt).
        failed: A call failed; what is unknown stays unknown (and may be retried).
    """

    decided_at: int | None = None
    prefix_hash: str | None = None
    pending_upto: int = -1
    never_from: int | None = None
    failed: bool = False


def _decided_at(text: str, content: str, markers: ChatMarkers, max_prefix_length: int) -> float:
    """Where in ``text`` (as a fraction of its length) ``content`` became decisive: once it
    held ``max_prefix_length`` bytes, or else where the next turn began."""
    kept = truncate_utf8(content, max_prefix_length)
    start = text.find(content)
    if len(kept) < len(content.encode("utf-8", "surrogatepass")):
        offset = start + len(kept.decode("utf-8", "surrogatepass"))
    else:
        offset = start + len(content) + len(markers.sep)
    return offset / max(len(text), 1)


class PromptRecovery:
    """``/detokenize`` client, outcome cache and template of one source.

    Args:
        source: The source (``detokenize_endpoint``, ``model``, ``template``,
            ``max_prefix_length``).
        detok: Timeouts, concurrency and cache size.
        client: HTTP session (``requests.Session`` or anything with its ``post``).
        clock: Monotonic seconds, for the template-learning retry delay.
    """

    def __init__(self, source: SourceConfig, detok: DetokenizeConfig, client: HttpClient,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.url = source.detokenize_endpoint
        self.client = client
        self.clock = clock
        self.timeout = detok.timeout_ms / 1000.0
        self.max_concurrent = detok.max_concurrent
        self.cache_entries = detok.cache_entries
        self.calls = self.errors = self.cache_hits = self.too_large = 0
        self._semaphore = threading.BoundedSemaphore(detok.max_concurrent)
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, str] = OrderedDict()
        self._markers: ChatMarkers | None = BUILTIN_TEMPLATES.get(source.template)
        self._learn_after = 0.0
        self._failures = 0
        self._paused_until = 0.0

    @property
    def available(self) -> bool:
        """Whether this source can recover prompts at all (it has a /detokenize URL)."""
        return self.url is not None

    def clear(self) -> None:
        """Forget cached outcomes and a learned template (the engine may have restarted)."""
        with self._lock:
            self._cache.clear()
        if self.source.template == "auto":
            self._markers = None
            self._learn_after = 0.0

    # -- HTTP ------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """Whether calls are held back after failures (see :data:`PAUSE_BASE_SECONDS`)."""
        return self.clock() < self._paused_until

    def _post(self, url: str, body: dict[str, Any], what: str) -> Any:
        """POST and parse JSON; None (counted, logged without bodies) on any failure."""
        with self._semaphore:
            reason = None
            too_large = False
            try:
                resp = self.client.post(url, json=body, timeout=self.timeout,
                                        allow_redirects=False)
                try:
                    if resp.status_code != 200:
                        reason = f"HTTP {resp.status_code}"
                    else:
                        doc = resp.json()
                        with self._lock:
                            self._failures = 0
                        return doc
                finally:
                    close = getattr(resp, "close", None)
                    if close is not None:
                        close()
            except Exception as exc:  # timeouts, refused connections, bad JSON, ...
                reason = type(exc).__name__
                too_large = isinstance(exc, ReplyTooLarge)
            with self._lock:
                self.errors += 1
                self.too_large += too_large
                self._failures += 1
                pause = min(PAUSE_MAX_SECONDS,
                            PAUSE_BASE_SECONDS * 2 ** min(self._failures - 1, 16))
                self._paused_until = max(self._paused_until, self.clock() + pause)
                first = self._failures == 1
            (log.warning if first else log.debug)(
                "kv-listener source %s: %s failed (%s); chains stay unattributed, no call for "
                "%.1fs", self.source.backend_name, what, reason, pause)
            return None

    def detokenize(self, tokens: Sequence[int], model: str) -> str | None:
        """The engine's text for ``tokens``; None when the call failed or calls are paused."""
        if self.paused:
            return None
        with self._lock:
            self.calls += 1
        doc = self._post(str(self.url), {"model": model, "tokens": list(tokens)}, "/detokenize")
        prompt = doc.get("prompt") if isinstance(doc, dict) else None
        if doc is not None and not isinstance(prompt, str):
            with self._lock:
                self.errors += 1
            log.debug("kv-listener source %s: /detokenize answered without a prompt",
                      self.source.backend_name)
        return prompt if isinstance(prompt, str) else None

    # -- template --------------------------------------------------------------------------

    def markers(self) -> ChatMarkers | None:
        """The template markers, learning them first for ``template: auto`` (may do I/O).

        Call from the source's greenlet before :meth:`run`, not from the workers.
        """
        if (self._markers is not None or self.url is None or self.paused
                or self.clock() < self._learn_after):
            return self._markers
        url = tokenize_url(self.url)
        reason = "the detokenize_endpoint does not end in /detokenize"
        texts: list[str] = []
        if url is not None:
            for chat in (PROBE_SYSTEM_CHAT, PROBE_USER_CHAT):
                body = {"model": self.source.model, "messages": list(chat),
                        "add_generation_prompt": False}
                doc = self._post(url, body, "/tokenize")
                tokens = doc.get("tokens") if isinstance(doc, dict) else None
                text = self.detokenize(tokens, self.source.model) if isinstance(
                    tokens, list) and all(isinstance(t, int) for t in tokens) else None
                if text is None:
                    reason = "the probe could not be tokenized and detokenized"
                    break
                texts.append(text)
        if len(texts) == 2:
            try:
                self._markers = learn_markers(*texts)
                log.info("kv-listener source %s: learned the engine's chat template",
                         self.source.backend_name)
                return self._markers
            except TemplateError as exc:
                reason = str(exc)
        self._learn_after = self.clock() + LEARN_RETRY_SECONDS
        log.warning("kv-listener source %s: cannot learn the chat template (%s); chains stay "
                    "unattributed, retrying in %ds", self.source.backend_name, reason,
                    LEARN_RETRY_SECONDS)
        return None

    # -- search ----------------------------------------------------------------------------

    def _outcome(self, job: RecoveryJob, index: int, markers: ChatMarkers
                 ) -> tuple[str | None, float | None]:
        """Prefix key hex, PENDING or NEVER for the chain ending at block ``index`` (None:
        the call failed), and, when the text was fetched and decided, where in it (as a
        fraction of its length) the anchor was decided."""
        block_hash = job.hashes[index]
        with self._lock:
            known = self._cache.get(block_hash)
            if known is not None:
                self._cache.move_to_end(block_hash)
                self.cache_hits += 1
                return known, None
        text = self.detokenize(job.tokens[:job.ends[index]], job.model)
        if text is None:
            return None, None
        anchor = find_anchor(text, markers, self.source.max_prefix_length)
        where = None
        if isinstance(anchor, str):
            outcome = anchor
        else:
            outcome = prefix_key_from_text(job.model, anchor.tag, anchor.text,
                                           self.source.max_prefix_length).hex()
            where = _decided_at(text, anchor.text, markers, self.source.max_prefix_length)
        if self.cache_entries:
            with self._lock:
                self._cache[block_hash] = outcome
                if len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
        return outcome, where

    def search(self, job: RecoveryJob, markers: ChatMarkers) -> RecoveryResult:
        """Find the shallowest deciding block of ``job`` (see the module docstring)."""
        lo, last = job.lo, len(job.hashes) - 1
        low = lo  # blocks before ``low`` are known undecided
        if lo > 0 or lo == last:  # a branch off undecided blocks: its first block, likely
            first, _ = self._outcome(job, lo, markers)
            if first is None:
                return RecoveryResult(pending_upto=lo - 1, failed=True)
            if first == NEVER:
                return RecoveryResult(pending_upto=lo - 1, never_from=lo)
            if first != PENDING:
                return RecoveryResult(lo, first, lo - 1)
            if lo == last:
                return RecoveryResult(pending_upto=lo)
            low = lo + 1
        tip, where = self._outcome(job, last, markers)
        if tip is None or tip == NEVER:
            return RecoveryResult(pending_upto=low - 1, failed=tip is None,
                                  never_from=last if tip == NEVER else None)
        if tip == PENDING:
            return RecoveryResult(pending_upto=last)
        # Bisect for the first deciding block in [low, last], starting with the block where
        # the tip's text says the anchor ends (text and tokens grow roughly in proportion)
        # and its neighbours, which usually settles it in two calls.
        high, found = last, tip
        guess = (low + high) // 2 if where is None else bisect_left(
            job.ends, where * job.ends[last])
        probes = [guess, guess - 1, guess + 1]
        while low < high:
            mid = next((p for p in probes if low <= p < high), (low + high) // 2)
            outcome, _ = self._outcome(job, mid, markers)
            if outcome is None:
                return RecoveryResult(pending_upto=low - 1, failed=True)
            if outcome in (PENDING, NEVER):
                low = mid + 1
            else:
                high, found = mid, outcome
        return RecoveryResult(high, found, high - 1)

    def run(self, jobs: Sequence[RecoveryJob], markers: ChatMarkers) -> list[RecoveryResult]:
        """Search every job; groups in parallel (at most ``max_concurrent`` calls in flight).

        Returns:
            One result per job, in order.
        """
        results: list[RecoveryResult] = [RecoveryResult(failed=True)] * len(jobs)
        groups: dict[object, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.group if job.group is not None else ("job", i), []).append(i)
        pending = list(groups.values())

        def work() -> None:
            while True:
                with self._lock:
                    if not pending:
                        return
                    members = pending.pop(0)
                for i in members:
                    try:
                        results[i] = self.search(jobs[i], markers)
                    except Exception as exc:  # a bug must not kill the source
                        log.error("kv-listener source %s: prompt recovery failed (%s)",
                                  self.source.backend_name, type(exc).__name__)

        workers = min(self.max_concurrent, len(pending))
        if workers <= 1:
            work()
            return results
        threads = [threading.Thread(target=work, daemon=True,
                                    name=f"detokenize-{self.source.backend_name}-{n}")
                   for n in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results
