"""ZeroMQ KV-event sources (vLLM, SGLang): a SUB socket feeding one backend's processor.

``docs/kv-events.md`` §1: each message is ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
counter from 0 per publisher. The source binds (engines connect to it) or connects, per
``zmq_mode``; it keeps polling its socket from a greenlet (a bound SUB's subscription only
reaches a connecting PUB once the SUB is serviced, §1.4). Sockets come from ``zmq.green``.

**Publishers.** ``allowed_publishers`` is enforced. In bind mode the SUB socket carries a
``ZMQ_ZAP_DOMAIN`` and a :class:`ZapAuthenticator` greenlet answers the ZAP requests of its
context (``inproc://zeromq.zap.01``, RFC 27): ``200`` only for a peer whose IP address is
listed, ``400`` otherwise, so other peers never complete the handshake and nothing of theirs
reaches the decoder (counted as ``rejected_publishers``). ``ipc://``/``inproc://`` peers have
no IP address; the socket's file permissions guard them. In connect mode the endpoint's host
must itself be listed (:func:`zmq_source_issues`, checked by ``--check`` and at start).

**Data parallelism** (``data_parallel_size`` N > 1, ``docs/kv-events.md`` §1.1): a vLLM or
SGLang engine with N data-parallel ranks behind one HTTP endpoint is one backend whose cache
is the union of its ranks' caches, but each rank publishes its own stream, rank ``r`` on
``zmq_endpoint`` offset by ``r`` (``tcp://`` port + r, ``inproc://`` name + ``_dp<r>``;
:func:`~listener.config.offset_endpoint`). The source's one SUB socket binds (bind mode) or
connects to (connect mode) all N endpoints, so the ZAP domain, ``ZMQ_MAXMSGSIZE`` and the
topic filter apply to every rank alike. The engines offset ``replay_endpoint`` by the same
rule (each rank's ROUTER replays that rank's buffer), so rank ``r``'s gaps are replayed from
rank ``r``'s replay endpoint and the start-up replay asks every rank's, up to
:data:`STARTUP_REPLAYS_AT_ONCE` at a time (each reply applied and let go as it comes: at most
that many ranks' replies are held; ranks that do not answer cost :data:`REPLAY_TIMEOUT` once
per that many).
Blocks are keyed per rank (:mod:`listener.processor`), and state lost on one rank (a gap
that cannot be replayed, a restart) clears that rank's blocks only, once: a rank cleared
with nothing of it applied since is not cleared again (as two resets collapse); only while
nothing has been applied yet, or for a batch without a rank, is it a reset of the backend.
With N = 1 nothing of this applies: one endpoint, one replay endpoint, keys without the rank.

**Sequence numbers** are tracked per ``(topic, data-parallel rank)``. Decisions, with ``E``
the next expected number (none before the first message), ``L`` the payload of the batch
``E - 1`` last applied, and ``R`` the batches the stream's last replay applied (number and
payload), kept while their live copies may still arrive, that is until a live batch
numbered ``E`` or more is applied; "lost" is a reset (N > 1: that rank's blocks cleared):

=========================================  ==================================================
received ``seq``                           action
=========================================  ==================================================
``== E`` (or ``0`` before the first)       apply
``> E`` (or ``> 0`` before the first)      without ``replay_endpoint``: lost; apply.
                                           With it: before the first, or ``L`` unknown,
                                           replay from ``E`` (0); else replay from ``E - 1``
                                           and compare its first batch with ``L`` (next
                                           rows). Then apply it unless the replay did; a
                                           replay that fails: lost, apply
replay's first is ``E - 1``, bytes ``L``   the same publisher: drop that overlap batch,
                                           apply the rest (a hole in it: lost)
replay's first is ``E - 1``, other bytes   the publisher restarted (``restarts``): lost,
                                           then apply its history from 0 (replayed again
                                           from 0, unless ``E - 1`` was 0)
replay's first is above ``E - 1``, or      buffer wrapped: a gap cannot be told from a
the replay is empty                        restart: lost, apply the replay from its start
``< E``, in ``R`` with the same bytes      the live copy of a replayed batch: drop it
``< E``, ``ts`` no newer than ``L``'s,     a late batch of the same publisher (queued during
a replay from the oldest batch kept        the start-up replay but older than its window,
(``R`` or ``L``) matches what was applied  or an old process's straggler): drop it; a higher
                                           one after it too, until ``E`` moves
``< E`` otherwise                          the publisher restarted (``restarts``): lost,
                                           then as before the first message
=========================================  ==================================================

Why ``R`` holds the bytes: a publisher that restarts after a replay (the start-up one, or
one that found a restart: a crash loop) numbers from 0 again, within the replayed range,
while no live batch may have gone past it yet (the engine was idle). A number alone would
read its batches as duplicates of the old process's, drop them, and leave the old blocks
indexed for good. Bounded: one fingerprint (see below) per batch of one replay per stream
(a replay is at most :data:`REPLAY_MAX_BATCHES`), each taken by its live copy, all dropped
with the first live batch past the replay, on a restart, or with the stream.

Why the overlap: a restarted engine numbers from 0 again with an empty cache (§1.2). When
the listener misses its first batches and then gets one numbered above ``E``, a replay
from ``E`` would be answered by the *new* process's buffer just as contiguously as by the
old one's, and the old process's blocks would stay in the index for good. A replay
returns the very payload bytes that were published (the engines buffer what they send),
and every payload carries the engine's wall-clock ``ts`` (§2), so batch ``E - 1`` of the
same process replays byte for byte while another process's batch ``E - 1`` does not. What
is kept of ``L`` is cheap on the hot path and bounded: a reference to the received bytes
up to :data:`INLINE_PAYLOAD_BYTES`, else their BLAKE2b-128 digest (about 1-2 % of the
batch's decoding), one per stream in the table. Batches applied from any replay (start-up
included) set ``L`` too; :meth:`ZmqSource.handle_batch` without the payload leaves it
unknown, and the next gap is then replayed from ``E`` unchecked. Not covered: a restarted
engine whose first batch the listener gets is numbered exactly ``E`` (it looks in order,
and no replay is asked), and a restart with no replay endpoint whose first seen number is
above ``E`` (lost anyway: reset).

Why late batches are checked: a batch numbered below ``E`` and in no replay is not always
a restart. Live batches queue in the SUB socket while the start-up replay runs; when the
engine's buffer has moved past the oldest of them by the time it answers, they arrive
numbered below ``E``, in no replay. And after a restart found by a replay, the old process's
last batches may still arrive on their own connection. Either would otherwise clear the
stream and replay it again, once per batch. A restarted publisher's batch is newer (its
``ts``) than the last one applied, so only older ones are checked, by one replay; a failed
or non-matching one is a restart as before.

A replay (§1.3, both reply layouts) is asked from a fresh DEALER socket (one that cannot be
made fails the replay like any other error); its batches are applied in order, duplicates
dropped. At start-up every rank's buffer is replayed from 0 and applied from where it
begins (nothing is known yet, so nothing to compare). A reply in the old layout names no
topic: its batches are keyed by the configured ``zmq_topic`` until the rank's first live
batch, whose key takes that state over (:meth:`ZmqSource._adopt`). A malformed message is
counted (``decode_errors``) and skipped; the hole it leaves is then a gap like any other. A
malformed event in a readable batch costs only itself (``malformed_events``): the batch's
other events are applied and its sequence number counts; but a malformed removal (tag
``BlockRemoved`` or unreadable: :class:`~listener.decode.RemovalLostBatch`) lost blocks
the index may hold, so after its batch the stream's state is lost (a reset; N > 1: that
rank's blocks cleared), as for TensorRT-LLM. A reset calls
:meth:`~listener.model.SourceProcessor.reset`, which emits ``cache_cleared``; two resets
with nothing applied in between collapse into one. The table keeps the
``limits.max_sequence_streams`` most recently used keys, with their ``L`` (counted in
``pruned_streams`` when one is dropped): a key seen again after that starts over as a
first message.

**Message size.** The SUB socket has ``ZMQ_MAXMSGSIZE`` = ``limits.max_message_bytes``:
libzmq refuses a larger message part from its length header, before allocating it, and
drops that publisher's connection (the engine reconnects at once). libzmq gives no reason
for a disconnect, so it is counted with every other one in ``publisher_disconnects``; the
lost batch then shows up as a sequence gap. Every replay's DEALER socket has the same
limit: a replayed batch above it drops the replay's connection, which fails the replay
(``replay_failures``) at once instead of at :data:`REPLAY_TIMEOUT`.

**Peers.** The socket's monitor counts, per rank's endpoint, the publishers whose
handshake succeeded and that have not disconnected (:class:`_Links`: open connections less
those still handshaking or refused, exact whatever order two handshakes end in, never
negative); ``/health`` shows the total and, with N > 1, each rank's endpoint, peers and
next expected sequence number.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import gevent.pool
import zmq.green as zmq
from zmq.utils.monitor import parse_monitor_message

from continuum.errors import ConfigIssue
from continuum.kv_events import KvEventBatch
from listener.config import LimitsConfig, SourceConfig, rank_endpoints
from listener.decode import (
    DecodeError,
    RemovalLostBatch,
    decode_zmq_frames,
    decode_zmq_payload,
)
from listener.model import SourceProcessor
from listener.sources import EventSource, SourceStats
from listener.zap import ZAP_ENDPOINT, ZapAuthenticator

__all__ = [
    "ZAP_ENDPOINT",
    "EventSource",
    "SourceStats",
    "ZapAuthenticator",
    "ZmqSource",
    "fetch_replay",
    "zmq_endpoint_host",
    "zmq_source_issues",
]

log = logging.getLogger(__name__)

#: Replay end marker: sequence number -1 (§1.3).
END_SEQ = b"\xff" * 8
#: Seconds a replay may take before it counts as failed (the state is then reset).
REPLAY_TIMEOUT = 5.0
#: Batches one replay may return (engines keep ``buffer_steps``, 10000 by default).
REPLAY_MAX_BATCHES = 1_000_000
#: Start-up replays asked at once for a source with several data-parallel ranks: each reply
#: is held until it is applied, and a rank that does not answer costs REPLAY_TIMEOUT.
STARTUP_REPLAYS_AT_ONCE = 4
#: Refused publishers' addresses a source names in a warning each (then one warning for all
#: later ones, which are logged at debug level): what it keeps of them is bounded.
REFUSED_PEERS_NAMED = 16
#: Receive high-water mark: the engines' default send HWM.
RCVHWM = 100_000
_POLL_MS = 500
#: Seconds a replay waits for the rest of its reply once its connection dropped (libzmq
#: reports the disconnect before it hands over the messages read just before it).
_DROP_GRACE = 0.1
#: Payloads up to this size are kept as they are to compare with a replay (a reference to
#: the received bytes: nothing to compute per batch); larger ones as a BLAKE2b-128 digest.
#: At most this much (plus a digest) per sequence stream, ``limits.max_sequence_streams``.
INLINE_PAYLOAD_BYTES = 4096
#: Monitor events the peer count follows.
_MONITORED = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def zmq_endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint (brackets removed), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    rest = rest.rsplit(";", 1)[-1]  # "source;destination" syntax: the destination counts
    host = rest.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def zmq_source_issues(source: SourceConfig, path: str) -> list[ConfigIssue]:
    """Checks of a ZMQ source that the config table cannot express (connect-mode hosts).

    In connect mode the listener reaches out, so the engine's host must be in
    ``allowed_publishers``; a replay endpoint is always connected to and so must name an
    allowed host too.
    """
    issues: list[ConfigIssue] = []
    if source.engine == "trtllm" or not source.zmq_endpoint:
        return issues
    checks = [("replay_endpoint", source.replay_endpoint)]
    if source.zmq_mode == "connect":
        checks.insert(0, ("zmq_endpoint", source.zmq_endpoint))
    for key, endpoint in checks:
        if not endpoint:
            continue
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            issues.append(ConfigIssue(f"{path}.{key}", "must be a tcp://, ipc:// or inproc:// "
                                      "endpoint", endpoint))
            continue
        host = zmq_endpoint_host(endpoint)
        if host is None:
            continue
        if host in ("*", "", "0.0.0.0", "::"):
            issues.append(ConfigIssue(f"{path}.{key}", "the listener connects here: name the "
                                      "engine's address, not a wildcard", endpoint))
        elif host not in source.allowed_publishers:
            issues.append(ConfigIssue(
                f"{path}.{key}", f"host {host} is not in allowed_publishers (the listener "
                "connects to it, so it must be listed)", endpoint))
    return issues


def _port_of(endpoint: str) -> int | None:
    """The port of a ``tcp://`` endpoint (the destination's), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isascii() and port.isdigit() else None


def fetch_replay(context: Any, endpoint: str, start_seq: int, *,
                 timeout: float | None = None, max_message_bytes: int | None = None
                 ) -> list[tuple[bytes | None, int, bytes]] | None:
    """Ask an engine's ROUTER replay socket for every batch from ``start_seq`` (§1.3).

    Args:
        context: The ``zmq.green`` context to make the DEALER socket in.
        endpoint: The engine's replay endpoint.
        start_seq: The first sequence number wanted.
        timeout: Seconds for the whole replay (default :data:`REPLAY_TIMEOUT`).
        max_message_bytes: The DEALER's ``ZMQ_MAXMSGSIZE`` (the source passes
            ``limits.max_message_bytes``, its SUB socket's): libzmq refuses a larger part
            from its length header, before allocating it, and drops the connection.

    Returns:
        ``(topic or None, seq, payload)`` per batch up to the end marker, or None when the
        replay timed out, could not be sent (nor its socket made), was too long (more than
        :data:`REPLAY_MAX_BATCHES`), or its connection dropped before the end marker (a
        message over ``max_message_bytes``, or the engine went away): a dropped connection
        fails the replay within :data:`_DROP_GRACE` rather than at the timeout.
    """
    sock: Any = None
    monitor: Any = None
    out: list[tuple[bytes | None, int, bytes]] = []
    try:
        # inside the try: no socket to be had (EMFILE, a terminated context) fails the
        # replay like any other error, rather than escaping to the caller
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")], zmq.NOBLOCK)
        deadline = time.monotonic() + (REPLAY_TIMEOUT if timeout is None else timeout)
        while len(out) <= REPLAY_MAX_BATCHES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready = dict(poller.poll(int(remaining * 1000) + 1))
            if sock not in ready:
                if monitor in ready:  # dropped: what was read before it may still come
                    monitor.recv_multipart()
                    poller.unregister(monitor)
                    deadline = min(deadline, time.monotonic() + _DROP_GRACE)
                continue
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 2:  # vLLM ≤0.25, SGLang ≤0.5.21: [seq, payload]
                topic, seq, payload = None, frames[0], frames[1]
            elif len(frames) == 3:  # newer: [topic, seq, payload]
                topic, seq, payload = frames
            else:
                continue
            if seq == END_SEQ:
                return out
            if len(seq) == 8:
                out.append((topic, int.from_bytes(seq, "big"), payload))
        return None
    except zmq.ZMQError:
        return None
    finally:
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)


_Key = tuple[bytes, "int | None"]


class _Links:
    """The connections of one rank's endpoint, counted from the socket monitor's events.

    libzmq reports every connection in this order: it opens (``ACCEPTED``/``CONNECTED``,
    value: its fd), gets one handshake outcome (``HANDSHAKE_SUCCEEDED`` or
    ``HANDSHAKE_FAILED_*``; a connection dropped while handshaking fails too), then closes
    (``DISCONNECTED``, its fd). An outcome names no connection (its value is 0 or an error
    code), so none is pinned on an fd: with a refused publisher reconnecting beside the
    engine, the two handshakes may end in either order. Counted instead: the open fds,
    ``pending`` (opened, no outcome yet) and ``failed`` (failed, not closed yet); the peers
    are the open connections that are neither. A refused connection closes right after its
    failure, so a close takes a failed one first (were it an established one, the count is
    one too high until the failed one closes, its next event). Both counts stay within the
    open fds, so the peers never go negative, and all is 0 once no fd is open: the count
    converges after disconnects even if events were lost.
    """

    __slots__ = ("failed", "fds", "pending")

    def __init__(self) -> None:
        self.fds: set[int] = set()
        self.pending = 0
        self.failed = 0

    @property
    def peers(self) -> int:
        """Open connections whose handshake succeeded."""
        return len(self.fds) - self.pending - self.failed

    def opened(self, fd: int) -> None:
        """A connection opened (an fd still open: its close was missed)."""
        if fd in self.fds:
            self.closed(fd)
        self.fds.add(fd)
        self.pending += 1

    def settled(self, succeeded: bool) -> None:
        """A handshake ended (an outcome without a pending connection is ignored)."""
        if self.pending:
            self.pending -= 1
            self.failed += not succeeded

    def closed(self, fd: int) -> bool:
        """The connection ``fd`` closed (an unknown fd is ignored); whether none is open."""
        if fd in self.fds:
            self.fds.discard(fd)
            if self.failed:
                self.failed -= 1
            self.pending = min(self.pending, len(self.fds))
            self.failed = min(self.failed, len(self.fds) - self.pending)
        return not self.fds


class ZmqSource(EventSource):
    """One vLLM/SGLang ZMQ source (see the module docstring).

    Args:
        config: The source's config.
        processor: Its processor.
        context: A ``zmq.green`` context (one per listener).
        zap: The context's ZAP authenticator (required in bind mode).
        limits: ``max_message_bytes`` and ``max_sequence_streams`` (defaults when None).
    """

    transport = "zmq"

    def __init__(self, config: SourceConfig, processor: SourceProcessor, *, context: Any,
                 zap: ZapAuthenticator | None = None,
                 limits: LimitsConfig | None = None) -> None:
        super().__init__(config, processor)
        if not config.zmq_endpoint:
            raise ValueError(f"source {self.backend} has no zmq_endpoint")
        issues = zmq_source_issues(config, f"sources[{self.backend}]")
        if issues:
            raise ValueError("; ".join(issue.render("config") for issue in issues))
        if config.zmq_mode == "bind" and zap is None:
            raise ValueError("bind mode needs a ZapAuthenticator to enforce allowed_publishers")
        #: Data-parallel ranks whose streams this source takes (``data_parallel_size``).
        self.ranks = config.data_parallel_size
        try:
            #: Every rank's PUB endpoint, rank 0 first (bound ones resolved by start()).
            self.endpoints = rank_endpoints(config.zmq_endpoint, self.ranks)
            #: Every rank's replay endpoint (empty without replay).
            self.replay_endpoints = ([] if not config.replay_endpoint else
                                     rank_endpoints(config.replay_endpoint, self.ranks))
        except ValueError as exc:
            raise ValueError(f"source {self.backend}: {exc}") from None
        self.endpoint = self.endpoints[0]
        self._context = context
        self._zap = zap
        self._domain = f"continuum-kv/{self.backend}"
        self._socket: Any = None
        self._monitor: Any = None
        # Connections per rank (an endpoint the ranks do not know: per endpoint), see
        # on_monitor_event.
        self._links: dict[int | bytes, _Links] = {}
        # Refused publishers' addresses already warned about (at most REFUSED_PEERS_NAMED).
        self._refused: set[str] = set()
        limits = limits or LimitsConfig()
        self.max_message_bytes = limits.max_message_bytes
        self.max_streams = limits.max_sequence_streams
        self._expected: OrderedDict[_Key, int] = OrderedDict()  # least recently used first
        # The batches the last replay of a stream applied, while their live copies may still
        # arrive (until a live batch numbered E or more is applied): seq → (size, digest) (see
        # _digest: never the bytes, which an idle stream would keep for good), at most one
        # replay's batches per stream in ``_expected``.
        self._replayed: dict[_Key, dict[int, tuple[int, bytes]]] = {}
        # The last applied batch of each stream in ``_expected``: (seq, size, payload or its
        # digest, see _fingerprint, its ts); a gap's replay compares it to tell a restart.
        self._last: dict[_Key, tuple[int, int, bytes, float]] = {}
        # Streams whose late batches (numbered below E, older than the last applied one) a
        # replay showed to be the same publisher's: the last such number; a higher one is
        # late too (one publisher's batches arrive in order). Dropped when E moves.
        self._late: dict[_Key, int] = {}
        # Per rank, the key its start-up replay's batches got when the reply had no topic
        # (the [seq, payload] layout, §1.3): the configured topic, a guess; the rank's first
        # live key takes that state over (see _adopt).
        self._topicless: dict[int | None, _Key] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Open the SUB socket (bind or connect) and start receiving."""
        sock = self._context.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.setsockopt(zmq.SUBSCRIBE, self.config.zmq_topic.encode())
            self._monitor = sock.get_monitor_socket(_MONITORED)
            if self.config.zmq_mode == "bind":
                assert self._zap is not None
                local = self.endpoint.startswith(("ipc://", "inproc://"))
                # The domain is the socket's: every rank's endpoint is bound behind it.
                self._zap.register(self._domain, frozenset(self.config.allowed_publishers),
                                   any_local=local, on_reject=self._rejected)
                sock.setsockopt(zmq.ZAP_DOMAIN, self._domain.encode())
                for rank, endpoint in enumerate(self.endpoints):
                    self._open(sock.bind, rank, endpoint)
                    self.endpoints[rank] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self.state = "listening"
            else:
                for rank, endpoint in enumerate(self.endpoints):
                    self._open(sock.connect, rank, endpoint)
                self.state = "connecting"
            self.endpoint = self.endpoints[0]
        except BaseException:
            self._socket = sock
            self._close_sockets()
            raise
        self._socket = sock
        log.info("%s: %s %s (topic %r)", self.backend,
                 "bound" if self.config.zmq_mode == "bind" else "connecting to",
                 ", ".join(self.endpoints), self.config.zmq_topic)
        self._spawn(self._receive_loop)
        self._spawn(self._monitor_loop)

    def _open(self, how: Any, rank: int, endpoint: str) -> None:
        """Bind or connect ``endpoint`` (data-parallel rank ``rank``), naming it on failure."""
        try:
            how(endpoint)
        except zmq.ZMQError as exc:
            which = f" (data-parallel rank {rank})" if self.ranks > 1 else ""
            log.error("%s: cannot %s %s%s: %s", self.backend, how.__name__, endpoint, which,
                      exc)
            raise

    def stop(self) -> None:
        """Stop receiving and close the sockets; idempotent."""
        super().stop()
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._zap is not None:
            self._zap.unregister(self._domain)
        if self._socket is not None and not self._socket.closed:
            if self._monitor is not None:
                try:
                    self._socket.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._socket.close(linger=0)
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.close(linger=0)

    def health(self) -> dict[str, Any]:
        """Connection state, peers and the number of sequence streams; with several
        data-parallel ranks also each rank's endpoint, peers and next sequence number."""
        doc = super().health()
        doc.update(mode=self.config.zmq_mode, endpoint=self.endpoint, peers=self.peers(),
                   rejected_publishers=self.stats.rejected_publishers,
                   sequence_streams=len(self._expected))
        if self.ranks > 1:
            peers = [self.peers(rank) for rank in range(self.ranks)]
            following: dict[int | None, int] = {}
            for (_topic, rank), seq in reversed(self._expected.items()):  # most recent first
                following.setdefault(rank, seq)
            doc.update(data_parallel_size=self.ranks, ranks={
                str(rank): {"endpoint": endpoint, "peers": peers[rank],
                            "next_seq": following.get(rank)}
                for rank, endpoint in enumerate(self.endpoints)})
        return doc

    def peers(self, rank: int | None = None) -> int:
        """Publishers connected with a completed handshake: all, or ``rank``'s."""
        if rank is not None:
            links = self._links.get(rank)
            return 0 if links is None else links.peers
        return sum(links.peers for links in self._links.values())

    def _rank_of(self, endpoint: bytes) -> int | None:
        """The rank whose endpoint a monitor event names (tcp: by port, the address of a
        connection accepted on a wildcard being the interface's), or None."""
        text = endpoint.decode("utf-8", "replace")
        port = _port_of(text)
        for rank, own in enumerate(self.endpoints):
            if own == text or (port is not None and _port_of(own) == port):
                return rank
        return None

    def _rejected(self, peer: str) -> None:
        """A publisher was refused (ZAP): counted; each of the first
        :data:`REFUSED_PEERS_NAMED` addresses is named in one warning, any later one at debug
        level after a single warning saying so (a memory bounded whatever peers try)."""
        self.stats.rejected_publishers += 1
        shown = peer or "<no address>"
        if peer in self._refused:
            log.debug("%s: refused a publisher from %s again", self.backend, shown)
        elif len(self._refused) < REFUSED_PEERS_NAMED:
            self._refused.add(peer)
            log.warning("%s: refused a publisher from %s (not in allowed_publishers)",
                        self.backend, shown)
        else:
            self._warn_once("reject", "%s: refused a publisher from %s (not in "
                            "allowed_publishers); %d refusals so far: the addresses of more "
                            "than %d refused publishers are logged at debug level only",
                            self.backend, shown, self.stats.rejected_publishers,
                            REFUSED_PEERS_NAMED)

    def _monitor_loop(self) -> None:
        while not self._stopping:
            if not self._monitor.poll(_POLL_MS):
                continue
            self.on_monitor_event(parse_monitor_message(self._monitor.recv_multipart()))

    def on_monitor_event(self, event: Mapping[str, Any]) -> None:
        """Follow one socket monitor event by the rank its endpoint names (see
        :class:`_Links`): a connection opens (accepted, connected: its fd), completes or
        fails its handshake (no fd), or closes (its fd)."""
        kind, value, endpoint = event["event"], event["value"], event["endpoint"]
        rank = self._rank_of(endpoint)
        where: int | bytes = endpoint if rank is None else rank
        links = self._links.get(where)
        if kind in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
            if links is None:
                links = self._links[where] = _Links()
            links.opened(value)
        elif kind == zmq.EVENT_DISCONNECTED:
            self.stats.publisher_disconnects += 1
            if links is not None and links.closed(value):
                del self._links[where]
        elif links is not None and kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            links.settled(True)
        elif links is not None and kind & _HANDSHAKE_FAILED:
            links.settled(False)
        idle = "listening" if self.config.zmq_mode == "bind" else "connecting"
        self.state = "connected" if self.peers() else idle

    def _receive_loop(self) -> None:
        if self.replay_endpoints:
            # Catch up before the first live message: an engine that stays idle after a
            # listener (re)start would otherwise be missing from the index until it
            # publishes again. Live messages queue in the socket meanwhile; the sequence
            # table drops the ones the replay already applied.
            try:
                self.catch_up()
            except Exception as exc:  # the live stream (and its gap handling) still works
                self.stats.processor_errors += 1
                log.error("%s: start-up replay failed (%s)", self.backend, type(exc).__name__)
        while not self._stopping:
            if not self._socket.poll(_POLL_MS, zmq.POLLIN):
                continue
            frames = self._socket.recv_multipart()
            try:
                self.handle_frames(frames)
            except Exception as exc:  # a bug must not silently end the source
                self.stats.processor_errors += 1
                log.error("%s: failed on a message (%s); resetting", self.backend,
                          type(exc).__name__)
                self._reset(f"internal error ({type(exc).__name__})")

    # -- messages --------------------------------------------------------------------------

    def handle_frames(self, frames: list[bytes]) -> None:
        """Decode one live message and apply it by the sequence table."""
        try:
            batch = decode_zmq_frames(frames)
        except DecodeError as exc:
            self.stats.decode_errors += 1
            # the location only: the reason could quote token values
            self._warn_once("decode", "%s: skipping a malformed message (at %s)",
                            self.backend, exc.path)
            return
        self.handle_batch(batch, frames[2])

    def handle_batch(self, batch: KvEventBatch, payload: bytes | None = None) -> None:
        """Apply one decoded live batch (``seq`` set) by the sequence table.

        ``payload`` is the batch's payload frame as received: kept (or its digest) as the
        stream's last applied batch, so that a later gap's replay can tell the same publisher
        from a restarted one. Without it the next gap is replayed from ``E`` unchecked.
        """
        assert batch.seq is not None
        key: _Key = (batch.topic or b"", batch.data_parallel_rank)
        if self._topicless:
            self._adopt(key)
        seq = batch.seq
        expected = self._expected.get(key)
        if expected is not None and seq < expected:
            if self._duplicate(key, seq, payload) or self._late_copy(key, seq, batch.ts):
                self.stats.duplicates += 1
                return
            self.stats.restarts += 1
            self._lost(key, f"publisher restarted: sequence went back from {expected} to {seq}")
            self._replayed.pop(key, None)
            self._last.pop(key, None)
            self._late.pop(key, None)
            expected = None
        start = 0 if expected is None else expected
        if seq > start:
            self.stats.sequence_gaps += 1
            what = (f"first sequence number is {seq}, not 0" if expected is None else
                    f"sequence gap: expected {expected}, got {seq} ({seq - expected} lost)")
            log.warning("%s: %s%s", self.backend, what, self._of_rank(key))
            replay = self._replay_endpoint(key[1])
            cleared = False
            answer = self._replay(key, start, replay) if replay else None
            if answer is not None:
                start, cleared = answer
                if seq < start:  # the replay included this batch
                    self.stats.duplicates += 1
                    return
            if seq > start and not cleared:
                self._lost(key, what)
        self._apply(batch)
        self._set_expected(key, seq + 1, payload, batch.ts)
        self._replayed.pop(key, None)

    def _apply(self, batch: KvEventBatch) -> None:
        """Apply one batch (live or replayed); a batch with a malformed removal then loses
        its rank's state (:class:`~listener.decode.RemovalLostBatch`)."""
        super()._apply(batch)
        if type(batch) is RemovalLostBatch:
            # The blocks it removed are unknown: were it skipped like a bad store, they
            # would stay indexed for good. Its sequence number still counts (no gap).
            self._lost((batch.topic or b"", batch.data_parallel_rank),
                       f"batch {batch.seq} has {batch.lost_removals} malformed removal(s) "
                       "(malformed-removal): the blocks it removed are unknown")

    def _duplicate(self, key: _Key, seq: int, payload: bytes | None) -> bool:
        """Whether a live batch numbered below ``E`` is the live copy of a batch the
        stream's last replay applied: that number with the same bytes (each copy is taken
        once; without the payload, the number alone). Any other is a restarted publisher's
        (one that restarted after a replay numbers from 0 again, within the replayed range)."""
        replayed = self._replayed.get(key)
        if replayed is None:
            return False
        fingerprint = replayed.get(seq)
        if fingerprint is None or (payload is not None and _digest(payload) != fingerprint):
            return False  # kept: a late batch of another publisher takes no one's copy
        del replayed[seq]
        return True

    def _late_copy(self, key: _Key, seq: int, ts: float) -> bool:
        """Whether a live batch numbered below ``E`` that is no replayed batch's live copy is
        a late batch of the publisher whose batches were applied, not a restarted one's:
        live batches queued while the start-up replay ran that are older than its window
        (the engine's buffer had moved on), or an old process's last batches arriving after
        its successor's (another connection). Only one no newer than the last applied batch
        (its ``ts``, the engine's clock) can be: a restarted publisher's is newer. Then the
        stream is replayed from its oldest batch kept (the last replay's, ``L``), and when
        every one of them the replay returns has the bytes applied, the publisher is the
        same: the batch is late, dropped. A higher number after a late one is late too
        (one publisher's batches arrive in order), until ``E`` moves."""
        last = self._last.get(key)
        if last is None or ts > last[3]:
            return False
        late = self._late.get(key)
        if late is not None and seq > late:
            self._late[key] = seq
            return True
        endpoint = self._replay_endpoint(key[1])
        if endpoint is None:
            return False
        kept = self._replayed.get(key, {})
        since = min(last[0], min(kept)) if kept else last[0]
        got = self._fetch(key, since, endpoint)
        if got is None:
            return False
        matched = False
        for wire_topic, number, payload in got:
            if wire_topic is not None and wire_topic != key[0]:
                continue
            if number == last[0]:
                same = _fingerprint(payload) == last[1:3]
            elif number in kept:
                same = _digest(payload) == kept[number]
            else:
                continue
            if not same:
                return False  # another publisher's batch: a restart
            matched = True
        if matched:
            log.info("%s: batch %d came late (the publisher's replay from %d matches what "
                     "was applied): dropped%s", self.backend, seq, since, self._of_rank(key))
            self._late[key] = seq
        return matched

    def _adopt(self, key: _Key) -> None:
        """The first live batch of a rank whose start-up replay had no topic: when its key
        differs from the one the replay's batches were given (the configured topic, e.g. an
        empty filter for engine topic ``kv``), that state becomes this key's, so the live
        stream goes on from it instead of starting over (a reset, a replay)."""
        old = self._topicless.pop(key[1], None)
        if old is None or old == key or key in self._expected or old not in self._expected:
            return
        self._expected[key] = self._expected.pop(old)
        if old in self._replayed:
            self._replayed[key] = self._replayed.pop(old)
        if old in self._last:
            self._last[key] = self._last.pop(old)
        if old in self._late:
            self._late[key] = self._late.pop(old)

    def _of_rank(self, key: _Key) -> str:
        """`` (data-parallel rank r)`` for a log line of a source with several ranks."""
        return f" (data-parallel rank {key[1]})" if self.ranks > 1 else ""

    def _replay_endpoint(self, rank: int | None) -> str | None:
        """The replay endpoint of ``rank``'s stream: the configured one with one rank; with
        several, that rank's (offset like its PUB endpoint); None without replay or for a
        rank outside ``0..data_parallel_size-1``."""
        if self.ranks == 1:
            return self.config.replay_endpoint
        if rank is None or not self.replay_endpoints or rank >= self.ranks:
            return None
        return self.replay_endpoints[rank]

    def _lost(self, key: _Key, reason: str) -> None:
        """The stream ``key`` lost state. With several ranks, clear that rank's blocks (the
        other ranks' streams are intact), unless nothing was applied yet or the batch has no
        rank; otherwise reset the backend."""
        rank = key[1]
        if self.ranks > 1 and rank is not None and self.stats.batches:
            self._clear_rank(rank, f"data-parallel rank {rank}: {reason}")
        else:
            self._reset(reason)

    def _set_expected(self, key: _Key, following: int, payload: bytes | None,
                      ts: float) -> None:
        """Record the next number of ``key`` as its most recent use, and the payload (None:
        unknown) and ``ts`` of the batch ``following - 1`` just applied; drop the least
        recently used key beyond ``max_sequence_streams``."""
        expected = self._expected
        expected[key] = following
        expected.move_to_end(key)
        if self._late:
            self._late.pop(key, None)
        if payload is None:
            self._last.pop(key, None)
        else:
            self._last[key] = (following - 1, *_fingerprint(payload), ts)
        while len(expected) > self.max_streams:
            old, _ = expected.popitem(last=False)
            self._replayed.pop(old, None)
            self._last.pop(old, None)
            self._late.pop(old, None)
            if self._topicless.get(old[1]) == old:
                del self._topicless[old[1]]
            self.stats.pruned_streams += 1

    def catch_up(self) -> int:
        """Replay the engine's whole buffer at start; return how many batches were applied.

        With several data-parallel ranks at most :data:`STARTUP_REPLAYS_AT_ONCE` ranks' replay
        endpoints are asked at a time, and each reply is applied (and let go) as it comes,
        so at most that many replies are held, and ranks that do not answer cost
        :data:`REPLAY_TIMEOUT` per that many of them, not each. The stream key (topic, rank)
        is learned from the replayed batches; a buffer that no longer reaches back to 0 is
        applied from where it starts (the tracker is empty anyway, so nothing stale
        remains).
        """
        assert self.replay_endpoints

        def fetch(rank: int) -> tuple[int, list[tuple[bytes | None, int, bytes]] | None]:
            return rank, fetch_replay(self._context, self.replay_endpoints[rank], 0,
                                      max_message_bytes=self.max_message_bytes)

        applied = 0
        pool = gevent.pool.Pool(STARTUP_REPLAYS_AT_ONCE)
        for rank, got in pool.imap_unordered(fetch, range(len(self.replay_endpoints))):
            self.stats.replays += 1
            if got is None:
                self.stats.replay_failures += 1
                log.info("%s: no start-up replay from %s%s", self.backend,
                         self.replay_endpoints[rank], self._of_rank((b"", rank)))
                continue
            applied += self._apply_start_up(got)
            del got
        log.info("%s: start-up replay applied %d batch(es)", self.backend, applied)
        return applied

    def _apply_start_up(self, got: list[tuple[bytes | None, int, bytes]]) -> int:
        """Apply one start-up replay's batches by the sequence table; how many were."""
        applied = 0
        for wire_topic, seq, payload in got:
            try:
                batch = decode_zmq_payload(payload, seq=seq,
                                           topic=wire_topic or self.config.zmq_topic.encode())
            except DecodeError as exc:
                self.stats.decode_errors += 1
                self._warn_once("decode", "%s: skipping a malformed replayed batch (at %s)",
                                self.backend, exc.path)
                continue
            key: _Key = (batch.topic or b"", batch.data_parallel_rank)
            expected = self._expected.get(key)
            if expected is not None and seq < expected:
                continue
            if expected is not None and seq > expected:
                self._lost(key, f"start-up replay has no batches {expected}..{seq - 1}")
            self._apply(batch)
            self._set_expected(key, seq + 1, payload, batch.ts)
            if wire_topic is None:
                self._topicless[key[1]] = key
            replayed = self._replayed.get(key)
            if replayed is None:
                replayed = self._replayed[key] = {}
            replayed[seq] = _digest(payload)
            applied += 1
        return applied

    def _replay(self, key: _Key, start: int, endpoint: str) -> tuple[int, bool] | None:
        """Replay ``key``'s stream from ``start`` (asked at ``endpoint``) and apply it.

        When the payload of the batch ``start - 1`` last applied is known, the replay is asked
        from ``start - 1`` and its first batch compared with it: the same bytes are the same
        publisher (the overlap is dropped, the rest applied); other bytes are a restarted
        publisher (a restart: the stream's state is lost, and the new publisher's buffer is
        applied from 0, asked again unless this replay already began at 0); a replay that
        does not reach back to ``start - 1`` cannot tell, so the state counts as lost and the
        replay is applied from where it begins.

        Returns:
            ``(next expected number, cleared)`` when the replay answered (its batches are
            applied; ``cleared``: the stream's state was dropped and nothing was lost since),
            None when it did not.
        """
        last = self._last.get(key)
        check = last is not None and start > 0 and last[0] == start - 1
        ask = start - 1 if check else start
        got = self._fetch(key, ask, endpoint)
        if got is None:
            return None
        batches = self._stream_batches(key, got, ask)
        following, cleared, floor = start, False, ask
        if check:
            assert last is not None
            first = next(batches, None)
            if first is not None and first[0] == ask and _fingerprint(first[2]) == last[1:3]:
                first = None  # the same publisher: the overlap batch, applied already
            elif first is not None and first[0] == ask:
                self.stats.restarts += 1
                self._lost(key, f"publisher restarted: its batch {ask} is not the one applied "
                           f"(seen in a replay from {ask})")
                if ask > 0:  # the new publisher's earlier batches: ask from 0
                    first, floor = None, 0
                    got = self._fetch(key, 0, endpoint)
                    batches = self._stream_batches(key, got or [], 0)
                following, cleared = 0, True
            else:
                begins = "nothing" if first is None else f"batch {first[0]}"
                self._lost(key, f"replay from {ask} begins with {begins}: cannot tell a gap "
                           "from a restart")
                following, cleared = 0, True
            if first is not None:
                batches = itertools.chain([first], batches)
        replayed: dict[int, tuple[int, bytes]] = {}
        last_payload: bytes | None = None
        last_ts = 0.0
        for seq, batch, payload in batches:
            if seq < following:
                continue
            if seq > following and not (cleared and not replayed):
                self._lost(key, f"replay has no batches {following}..{seq - 1}")
            self._apply(batch)
            replayed[seq] = _digest(payload)
            following = seq + 1
            last_payload, last_ts = payload, batch.ts
        log.info("%s: replayed %d batch(es) from %d%s", self.backend, len(replayed), floor,
                 self._of_rank(key))
        if replayed:
            self._set_expected(key, following, last_payload, last_ts)
            self._replayed[key] = replayed
        return following, cleared and not replayed

    def _fetch(self, key: _Key, start: int,
               endpoint: str) -> list[tuple[bytes | None, int, bytes]] | None:
        """Ask ``endpoint`` for ``key``'s stream from ``start``, counting the replay (and its
        failure); the answer, or None."""
        self.stats.replays += 1
        got = fetch_replay(self._context, endpoint, start,
                           max_message_bytes=self.max_message_bytes)
        if got is None:
            self.stats.replay_failures += 1
            log.warning("%s: replay from %d failed (no answer within %.0f s)%s", self.backend,
                        start, REPLAY_TIMEOUT, self._of_rank(key))
        return got

    def _stream_batches(self, key: _Key, got: list[tuple[bytes | None, int, bytes]],
                        since: int) -> Iterator[tuple[int, KvEventBatch, bytes]]:
        """``(seq, batch, payload)`` of the replayed batches of ``key``'s stream from
        ``since`` on, decoded one at a time (a malformed one is counted and skipped)."""
        topic, rank = key
        for wire_topic, seq, payload in got:
            if seq < since or (wire_topic is not None and wire_topic != topic):
                continue
            try:
                batch = decode_zmq_payload(payload, seq=seq, topic=wire_topic or topic)
            except DecodeError as exc:
                self.stats.decode_errors += 1
                self._warn_once("decode", "%s: skipping a malformed replayed batch (at %s)",
                                self.backend, exc.path)
                continue
            if batch.data_parallel_rank == rank:
                yield seq, batch, payload


def _fingerprint(payload: bytes) -> tuple[int, bytes]:
    """What identifies a batch's payload bytes: their length and, up to
    :data:`INLINE_PAYLOAD_BYTES`, the bytes themselves (a reference, nothing computed), else
    their BLAKE2b-128 digest."""
    size = len(payload)
    if size <= INLINE_PAYLOAD_BYTES:
        return size, payload if type(payload) is bytes else bytes(payload)
    return _digest(payload)


def _digest(payload: bytes) -> tuple[int, bytes]:
    """A payload's length and BLAKE2b-128 digest: what is kept of each batch a replay
    applied (up to :data:`REPLAY_MAX_BATCHES` of them, for as long as the stream stays idle,
    so never the bytes themselves)."""
    return len(payload), hashlib.blake2b(payload, digest_size=16).digest()
