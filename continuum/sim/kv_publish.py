"""Publishers the simulated engine sends its KV events through (``docs/kv-events.md`` §1, §8).

* :class:`ZmqKvPublisher`: a vLLM/SGLang-style PUB socket, one 3-frame message
  ``[topic, seq, payload]`` per batch, payloads encoded for one wire profile
  (:mod:`continuum.sim.kv_wire`), plus an optional ROUTER replay socket.
* :class:`TrtllmEventQueue`: the buffer behind ``trtllm-serve``'s ``POST /kv_cache_events``,
  drained destructively as JSON-able envelopes.

Both implement :class:`~continuum.kv_events.KvEventSink` and have ``close()``. Sockets come
from ``zmq.green``, which cooperates with gevent (the simulator runs under it) and also works
in a plain thread without monkey patching. Nothing here creates a socket at import time.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import gevent
import zmq.green as zmq

from continuum.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent
from continuum.sim.kv_wire import (
    WireProfile,
    encode_zmq_payload,
    get_profile,
    trtllm_created_data,
    trtllm_removed_data,
    trtllm_stored_data,
)

__all__ = ["END_SEQ", "TrtllmEventQueue", "ZmqKvPublisher", "offset_endpoint", "should_bind"]

log = logging.getLogger(__name__)

#: Replay end marker: sequence number -1 as 8 bytes (§1.3).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def should_bind(endpoint: str, profile: WireProfile) -> bool:
    """The engines' bind-or-connect rule for the PUB socket (§1.1)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    return profile.binds_any_address and "0.0.0.0" in endpoint


def offset_endpoint(endpoint: str, rank: int, profile: WireProfile) -> str:
    """The endpoint of data-parallel rank ``rank``: ``tcp`` port + rank, ``inproc`` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit() and not (port == "0" and profile.keeps_port_zero):
            return f"{host}:{int(port) + rank}"
    return endpoint


class ZmqKvPublisher:
    """Publish KV-event batches on a ZMQ PUB socket the way vLLM and SGLang do.

    Sequence numbers start at 0 and go up by one per published batch (a fresh publisher is
    a restarted engine). With ``replay_endpoint``, the last ``buffer_steps`` batches are kept
    and a ROUTER socket answers replay requests; requests are served on every ``publish()``,
    by :meth:`serve_replay`, or continuously by a greenlet from :meth:`start_replay_server`.

    Args:
        profile: Wire profile name (``"vllm-0.22"``, ``"vllm-0.33"``, ``"sglang-0.5.9"``,
            ``"sglang-0.5.18"``, ``"sglang-0.5.22"``).
        endpoint: PUB endpoint before the per-rank offset.
        bind: Bind (True) or connect (False); None applies the engines' rule (§1.1).
        topic: Topic frame (str is UTF-8 encoded).
        replay_endpoint: ROUTER endpoint (always bound), offset per rank like ``endpoint``.
        dp_rank: Data-parallel rank: offsets the endpoints and goes into every batch.
        buffer_steps: How many recent batches replay can return.
        hwm: PUB send high-water mark; beyond it messages are dropped silently.
        context: ZMQ context (default: the shared ``zmq.green`` instance).
        clock: Batch timestamp source.
    """

    def __init__(
        self,
        profile: str,
        endpoint: str,
        *,
        bind: bool | None = None,
        topic: bytes | str = b"",
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.profile = get_profile(profile)
        self.topic = topic.encode("utf-8") if isinstance(topic, str) else bytes(topic)
        self.dp_rank = dp_rank
        self._clock = clock
        self._seq = itertools.count()
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        self._closed = False
        self._server: gevent.Greenlet | None = None
        ctx = context if context is not None else zmq.Context.instance()
        self.endpoint = offset_endpoint(endpoint, dp_rank, self.profile)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._router: Any = None
        try:
            if should_bind(self.endpoint, self.profile) if bind is None else bind:
                self._pub.bind(self.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self.endpoint)
            if replay_endpoint is not None:
                self._router = ctx.socket(zmq.ROUTER)
                # Room for a whole replay plus its end marker (what vLLM ≥0.33 sets).
                self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._router.bind(offset_endpoint(replay_endpoint, dp_rank, self.profile))
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint (port 0 resolved), or None without replay."""
        if self._router is None:
            return None
        endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        return endpoint

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Send ``events`` as one batch with the next sequence number.

        Raises:
            RuntimeError: The publisher is closed.
        """
        if self._closed:
            raise RuntimeError("publish() on a closed ZmqKvPublisher")
        payload = encode_zmq_payload(events, self.profile, ts=self._clock(), dp_rank=self.dp_rank)
        seq = next(self._seq).to_bytes(8, "big")
        # PUB never blocks: past the high-water mark libzmq drops the message, as upstream.
        self._pub.send_multipart((self.topic, seq, payload))
        if self._router is not None:
            self._buffer.append((seq, payload))
            if self._server is None:  # else the server greenlet owns the ROUTER socket
                self.serve_replay(0.0)

    def serve_replay(self, timeout: float = 0.0) -> int:
        """Answer the replay requests that arrive within ``timeout`` seconds.

        A request is ``[identity, b"", start_seq]``; the reply is one message per buffered batch
        with ``seq >= start_seq`` and then the end marker, in the profile's layout (§1.3).

        Returns:
            How many requests were answered.
        """
        if self._router is None or self._closed:
            return 0
        answered = 0
        if not self._router.poll(int(timeout * 1000), zmq.POLLIN):
            return 0
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            if len(frames) != 3:
                log.warning("ignoring replay request with %d frames (expected 3)", len(frames))
                continue
            identity, _, start = frames
            self._replay(identity, int.from_bytes(start, "big"))
            answered += 1

    def _replay(self, identity: bytes, start_seq: int) -> None:
        head = [identity, b""]
        topic = [self.topic] if self.profile.topic_in_replay else []
        for seq, payload in list(self._buffer):
            if int.from_bytes(seq, "big") >= start_seq:
                self._router.send_multipart([*head, *topic, seq, payload])
        end = [b""] if self.profile.topic_in_replay else []
        self._router.send_multipart([*head, *end, END_SEQ, b""])

    def start_replay_server(self) -> gevent.Greenlet:
        """Serve replay requests from a greenlet until :meth:`close`."""
        if self._server is None:
            self._server = gevent.spawn(self._serve_forever)
        return self._server

    def _serve_forever(self) -> None:
        while not self._closed:
            self.serve_replay(0.5)

    def close(self) -> None:
        """Stop the replay greenlet and close both sockets without lingering; idempotent."""
        self._closed = True
        if self._server is not None:
            self._server.kill()
            self._server = None
        for sock in (self._pub, self._router):
            if sock is not None and not sock.closed:
                sock.close(linger=0)


class TrtllmEventQueue:
    """The event buffer behind ``trtllm-serve``'s ``POST /kv_cache_events`` (§8).

    Event ids start at 0 with a ``created`` event and go up by one per event. At most
    ``max_events`` undrained events are kept: when more arrive the *oldest* are discarded (as
    TensorRT-LLM's event manager does), so the next drain starts with an id jump, and
    ``dropped`` counts them. Neutral events map as follows: ``BlockStored`` → ``stored``
    (blocks of ``block_size`` tokens, the last possibly partial; ``medium`` → ``cache_level``);
    consecutive ``BlockRemoved`` in one ``publish()`` → one ``removed`` (TensorRT-LLM merges
    removals within a step); ``AllBlocksCleared`` → one ``removed`` listing every block still
    stored, since TensorRT-LLM has no "all cleared" event. Media are not reconciled: a
    ``BlockRemoved`` becomes a ``removed`` whatever its medium (real TensorRT-LLM reports an
    offload as ``updated``, which neutral events cannot express).

    Args:
        max_events: Buffer size (``KvCacheConfig.event_buffer_max_size``); must be positive.
        window_size: Attention window of the pool, on every envelope; None omits the key
            (older builds).
        num_blocks_per_cache_level: Reported by the ``created`` event.
        attention_dp_rank: Added to every envelope when set.
    """

    def __init__(
        self,
        max_events: int = 1024,
        *,
        window_size: int | None = None,
        num_blocks_per_cache_level: Sequence[int] = (0, 0),
        attention_dp_rank: int | None = None,
    ) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.window_size = window_size
        self.attention_dp_rank = attention_dp_rank
        self.dropped = 0
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._live: dict[BlockHash, set[str | None]] = {}
        self._closed = False
        self.restart(num_blocks_per_cache_level)

    def restart(self, num_blocks_per_cache_level: Sequence[int] = (0, 0)) -> None:
        """Behave like a restarted server: empty buffer, ids from 0, a fresh ``created``."""
        self._events.clear()
        self._live.clear()
        self._next_id = 0
        self._enqueue(trtllm_created_data(num_blocks_per_cache_level))

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Queue the events of one scheduler step.

        Raises:
            RuntimeError: The queue is closed.
            ValueError: A ``BlockStored`` has ``extra_keys`` that are not ``mm_keys`` pairs.
        """
        if self._closed:
            raise RuntimeError("publish() on a closed TrtllmEventQueue")
        step: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, BlockStored):
                step.append(trtllm_stored_data(event))
                for h in event.block_hashes:
                    self._live.setdefault(h, set()).add(event.medium)
            elif isinstance(event, (BlockRemoved, AllBlocksCleared)):
                if isinstance(event, BlockRemoved):
                    hashes = self._forget(event.block_hashes, event.medium)
                else:
                    hashes, self._live = list(self._live), {}
                if not hashes:
                    continue
                if step and step[-1]["type"] == "removed":
                    step[-1]["block_hashes"].extend(trtllm_removed_data(hashes)["block_hashes"])
                else:
                    step.append(trtllm_removed_data(hashes))
        for data in step:
            self._enqueue(data)

    def _forget(self, hashes: Sequence[BlockHash], medium: str | None) -> list[BlockHash]:
        for h in hashes:
            media = self._live.get(h)
            if media is not None:
                media.discard(medium)
                if not media or medium is None:
                    del self._live[h]
        return list(hashes)

    def _enqueue(self, data: dict[str, Any]) -> None:
        envelope: dict[str, Any] = {"event_id": self._next_id, "data": data}
        if self.window_size is not None:
            envelope["window_size"] = self.window_size
        if self.attention_dp_rank is not None:
            envelope["attention_dp_rank"] = self.attention_dp_rank
        self._next_id += 1
        if len(self._events) == self._events.maxlen:
            self.dropped += 1  # the deque discards the oldest on append
        self._events.append(envelope)

    def drain(self) -> list[dict[str, Any]]:
        """Return and remove every queued envelope (``[]`` when there is none)."""
        drained = list(self._events)
        self._events.clear()
        return drained

    def close(self) -> None:
        """Refuse further events; a final :meth:`drain` still returns what is queued."""
        self._closed = True
