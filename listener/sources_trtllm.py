"""Native TensorRT-LLM source: poll ``trtllm-serve``'s ``POST /kv_cache_events`` (§8).

The endpoint is a *destructive drain* — each call returns the events produced since the
previous call and removes them — so exactly one poller may exist per server; this source is
that poller. It posts every ``trtllm_poll_interval_ms`` (backing off to
:data:`MAX_ERROR_BACKOFF` while the server fails), with ``allow_redirects=False``: a 3xx is
an error, counted as ``poll_errors{kind="redirect"}`` and never followed (the URL host must
be in ``allowed_publishers``; a redirect could lead anywhere). Replies are decoded with
:func:`~listener.decode.decode_trtllm_events`.

**Event ids** are monotonic per event manager from 0, where ``created`` is the first event.
Under attention data parallelism each rank has its own event manager, so its own ids, and
rank 0 forwards the other ranks' events in its replies, each tagged ``attention_dp_rank``:
the table below is kept **per rank** (events without the field form one sequence of their
own, exactly as before ranks existed). With ``L`` the rank's last id applied and ``P`` its
first id in the previous reply that had events of it:

=====================================================  ===================================
event                                                  action
=====================================================  ===================================
``created`` (any id)                                   the server (re)started: reset
first event ever, id > 0, not ``created``              lost state (drained before we
                                                       started): reset, then apply
``id == L + 1``                                        apply
``P <= id <= L``                                       duplicate (a repeated reply): drop
``id < P``                                             ids went backwards, the server
                                                       restarted: reset, then apply
``id > L + 1``                                         gap (the server's buffer overflowed
                                                       or a reply was lost): reset, apply
``id == L + 1``, a malformed removal                   its removal is lost: reset
=====================================================  ===================================

``created`` itself is not passed to the processor (the reset already emits
``cache_cleared``). A reset for an event with an ``attention_dp_rank`` clears that rank's
blocks only (a batch of that rank holding ``AllBlocksCleared``; the processor keys blocks per
rank), since the other ranks' sequences are intact; only the first event the source ever
sees resets the whole backend, as does any reset for events without a rank. The table keeps
the ``limits.max_sequence_streams`` most recently used ranks (``pruned_streams``): each
attention-DP rank takes one of them, so the limit must be at least the engine's rank count
(trtllm config has no rank count to check it against; the first rank pruned logs a warning,
since it means the limit is below the ranks in use). Repeated losses of one rank collapse:
a rank already cleared, with nothing of it applied since, is not cleared again.

Consecutive applied events with the same attention-DP rank go to the processor as one
:class:`~continuum.kv_events.KvEventBatch` whose ``seq`` is the first event's id and whose
``data_parallel_rank`` is that rank; a cache-level ``updated`` carries the neutral events of
the move, a priority-only one and unknown kinds none (only counted). A malformed event costs
only itself (``malformed_events``, the first one's location logged once); its id still counts
when it can be read (:mod:`listener.decode_trtllm`). One whose ``data.type`` is ``removed``
or unreadable (:data:`~listener.decode.MALFORMED_REMOVAL`) lost a removal, which would leave
its blocks indexed for good: it is a gap of its rank (last table row; the events before it
are applied first).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import urlsplit

import gevent
import requests

from continuum.config.addresses import redact_url
from continuum.kv_events import KvEvent, KvEventBatch
from listener.config import LimitsConfig, SourceConfig
from listener.decode import MALFORMED_REMOVAL, DecodeError, TrtllmEvent, decode_trtllm_events
from listener.model import SourceProcessor
from listener.sources import EventSource

__all__ = ["MAX_ERROR_BACKOFF", "TrtllmSource"]

log = logging.getLogger(__name__)

#: Longest wait between polls while the server keeps failing (seconds).
MAX_ERROR_BACKOFF = 5.0
#: Connect timeout of one poll (seconds).
CONNECT_TIMEOUT = 2.0
#: Read timeout of one poll: trtllm-serve may wait up to 2 s on an empty queue.
READ_TIMEOUT = 10.0
#: Largest reply body read (bytes); a bigger one is an error.
MAX_BODY = 256 * 1024 * 1024


class _Sequence:
    """The id sequence of one event manager: one attention-DP rank, or the events without."""

    __slots__ = ("last", "previous_first")

    def __init__(self) -> None:
        self.last: int | None = None  # L: the last id applied
        self.previous_first: int | None = None  # P: its first id in the previous reply


class TrtllmSource(EventSource):
    """One ``trtllm-serve`` polled over HTTP (see the module docstring).

    Args:
        config: The source's config (``engine: trtllm``).
        processor: Its processor.
        session: HTTP session to use (default: a new one, closed by :meth:`stop`).
        limits: ``max_sequence_streams``, the most attention-DP ranks whose ids are kept
            (defaults when None).

    Raises:
        ValueError: No ``trtllm_endpoint``, or its host is not in ``allowed_publishers``.
    """

    transport = "http"

    def __init__(self, config: SourceConfig, processor: SourceProcessor, *,
                 session: requests.Session | None = None,
                 limits: LimitsConfig | None = None) -> None:
        super().__init__(config, processor)
        url = config.trtllm_endpoint
        if not url:
            raise ValueError(f"source {self.backend} has no trtllm_endpoint")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"source {self.backend}: trtllm_endpoint must be an http(s) URL")
        if parts.hostname not in config.allowed_publishers:
            raise ValueError(f"source {self.backend}: trtllm_endpoint host {parts.hostname} is "
                             "not in allowed_publishers")
        self.url = url
        self.host = parts.hostname
        self.interval = config.trtllm_poll_interval_ms / 1000
        self._session = session
        self._own_session = session is None
        #: The last event id applied, of whichever rank sent it.
        self.last_id: int | None = None
        self._sequences: OrderedDict[int | None, _Sequence] = OrderedDict()  # by rank, LRU
        self.max_ranks = (limits or LimitsConfig()).max_sequence_streams
        self.last_error: str | None = None

    def start(self) -> None:
        """Start polling in a greenlet."""
        if self._session is None:
            self._session = requests.Session()
            self._session.trust_env = False  # never send engine events through a proxy
        self.state = "connecting"
        log.info("%s: polling %s every %d ms", self.backend, self._safe_url(),
                 self.config.trtllm_poll_interval_ms)
        self._spawn(self._poll_loop)

    def stop(self) -> None:
        """Stop polling and close the session it made; idempotent."""
        super().stop()
        if self._own_session and self._session is not None:
            self._session.close()
            self._session = None

    def health(self) -> dict[str, Any]:
        """Polling state, the last event id and the last error kind."""
        doc = super().health()
        doc.update(endpoint=self._safe_url(), last_event_id=self.last_id,
                   last_error=self.last_error, polls=self.stats.polls)
        if any(rank is not None for rank in self._sequences):
            doc["last_event_ids"] = {str(rank): seq.last
                                     for rank, seq in self._sequences.items()}
        return doc

    def _safe_url(self) -> str:
        return redact_url(self.url)  # never show credentials

    def _poll_loop(self) -> None:
        delay = self.interval
        while not self._stopping:
            try:
                ok = self.poll_once()
            except Exception as exc:  # a bug must not silently end the source
                self.stats.processor_errors += 1
                log.error("%s: poll failed (%s); resetting", self.backend, type(exc).__name__)
                self._reset(f"internal error ({type(exc).__name__})")
                ok = False
            delay = self.interval if ok else min(max(delay * 2, self.interval),
                                                 max(MAX_ERROR_BACKOFF, self.interval))
            gevent.sleep(delay)

    def _error(self, kind: str, detail: str) -> bool:
        self.stats.poll_errors[kind] = self.stats.poll_errors.get(kind, 0) + 1
        self.last_error = kind
        self.state = "error"
        self._warn_once(f"poll:{kind}", "%s: polling %s failed: %s", self.backend,
                        self._safe_url(), detail)
        return False

    def poll_once(self) -> bool:
        """One ``POST`` and the processing of its reply; False when the poll failed."""
        if self._session is None:
            raise RuntimeError("poll_once() before start() or after stop()")
        self.stats.polls += 1
        try:
            resp = self._session.post(self.url, data=b"", allow_redirects=False, stream=True,
                                      timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
        except requests.RequestException as exc:
            return self._error("connect", type(exc).__name__)
        with resp:
            if resp.is_redirect or 300 <= resp.status_code < 400:
                return self._error("redirect", f"HTTP {resp.status_code} redirect refused "
                                   "(not followed)")
            if resp.status_code != 200:
                return self._error("status", f"HTTP {resp.status_code}")
            try:
                body = resp.raw.read(MAX_BODY + 1, decode_content=True)
            except (requests.RequestException, OSError, ValueError) as exc:
                return self._error("read", type(exc).__name__)
        if len(body) > MAX_BODY:
            return self._error("too_large", f"reply over {MAX_BODY} bytes")
        try:
            events = decode_trtllm_events(body)
        except DecodeError as exc:
            self.stats.decode_errors += 1
            return self._error("decode", f"malformed reply (at {exc.path})")
        if self.state != "connected":
            log.info("%s: polling %s", self.backend, "resumed" if self.last_error else "ok")
        self.state = "connected"
        self.last_error = None
        self.stats.skipped_events += events.skipped
        if events.malformed:
            self._malformed(events.malformed, events.malformed_at, "reply")
        self.handle_events(events)
        return True

    def handle_events(self, events: list[TrtllmEvent]) -> None:
        """Apply one reply's events by the id table, per rank (public for tests)."""
        if not events:
            return
        firsts: dict[int | None, int] = {}  # each rank's first id in this reply
        run: list[TrtllmEvent] = []  # applied events of one rank, for one batch
        rank = events[0].attention_dp_rank
        seq = self._sequence(rank)
        firsts[rank] = events[0].event_id
        for event in events:
            if event.attention_dp_rank != rank:  # ranks interleave: look up the other one
                self._flush(run)
                run = []
                rank = event.attention_dp_rank
                seq = self._sequence(rank)
                firsts.setdefault(rank, event.event_id)
            verdict = self._classify(event, seq)
            if verdict == "duplicate":
                self.stats.duplicates += 1
                continue
            if verdict != "apply" or event.kind == MALFORMED_REMOVAL:
                self._flush(run)
                run = []
                self._lost(verdict if verdict != "apply" else "removal", event, seq)
            seq.last = self.last_id = event.event_id
            if event.kind != "created" and event.kind != MALFORMED_REMOVAL:
                run.append(event)
        self._flush(run)
        for rank, first in firsts.items():
            kept = self._sequences.get(rank)
            if kept is not None:
                kept.previous_first = first

    def _sequence(self, rank: int | None) -> _Sequence:
        """The id sequence of ``rank``, now the most recently used; the least recently used
        beyond ``max_ranks`` are dropped (a dropped rank's next event starts it anew)."""
        sequences = self._sequences
        seq = sequences.get(rank)
        if seq is not None:
            sequences.move_to_end(rank)
            return seq
        seq = sequences[rank] = _Sequence()
        while len(sequences) > self.max_ranks:
            old, _ = sequences.popitem(last=False)
            self.stats.pruned_streams += 1
            self._warn_once("pruned-rank", "%s: dropped the event-id sequence of attention-DP "
                            "rank %s: limits.max_sequence_streams (%d) is below the ranks in "
                            "use (each rank needs one); raise it, or every dropped rank's next "
                            "event is lost state", self.backend, old, self.max_ranks)
        return seq

    @staticmethod
    def _classify(event: TrtllmEvent, seq: _Sequence) -> str:
        last, event_id = seq.last, event.event_id
        if event.kind == "created":
            return "created"
        if last is None:
            return "apply" if event_id == 0 else "start"
        if event_id == last + 1:
            return "apply"
        if event_id <= last:
            floor = seq.previous_first
            if floor is not None and event_id >= floor:
                return "duplicate"
            return "backwards"
        return "gap"

    def _lost(self, verdict: str, event: TrtllmEvent, seq: _Sequence) -> None:
        event_id, last = event.event_id, seq.last
        if verdict == "created":
            self.stats.restarts += 1
            reason = f"trtllm-serve (re)started (created event, id {event_id})"
        elif verdict == "start":
            self.stats.sequence_gaps += 1
            reason = f"first event id is {event_id}, not 0: earlier events were drained"
        elif verdict == "backwards":
            self.stats.restarts += 1
            reason = f"event ids went back from {last} to {event_id}: trtllm-serve restarted"
        elif verdict == "removal":
            reason = f"event {event_id} is a malformed removal: the blocks it removed are unknown"
        else:
            self.stats.sequence_gaps += 1
            assert last is not None
            reason = f"event id gap: expected {last + 1}, got {event_id} " \
                     f"({event_id - last - 1} lost)"
        if verdict != "removal":  # the ids themselves are intact after a lost removal
            seq.previous_first = None
        rank = event.attention_dp_rank
        if rank is None or self.last_id is None:
            self._reset(reason)  # no rank, or nothing seen yet: whatever was known goes
        else:
            self._clear_rank(rank, f"attention-DP rank {rank}: {reason}")

    def _flush(self, run: list[TrtllmEvent]) -> None:
        neutral: list[KvEvent] = [e for event in run for e in event.events]
        if not neutral:  # only priority updates, unknown or malformed: nothing to apply
            return
        batch = KvEventBatch(ts=time.time(), events=tuple(neutral),
                             data_parallel_rank=run[0].attention_dp_rank,
                             seq=run[0].event_id)
        self._apply(batch)
