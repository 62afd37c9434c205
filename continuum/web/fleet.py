"""Fleet-wide admin actions: every worker of the host, and every router sharing Redis.

An admin action (``/admin/response-cache/invalidate``, ``/admin/kv-index/clear``,
``/admin/gemini-context-cache/clear``, ``/admin/config/reload``,
``/admin/backends/{name}/drain`` and ``/undrain``) reaches one gunicorn worker. That
worker applies it, then spreads it:

* **to the workers of its host**: it writes the action to
  ``$CONTINUUM_RUNTIME_DIR/fleet/<generation>.json`` and bumps the generation in the host
  segment (:mod:`continuum.hostshm`), under the host lock. Every worker compares that
  generation with the one it applied **before each request** (one shared-memory read); a
  worker behind applies the actions it missed, in order, and records its generation in its
  slot. So once the action is published no worker of the host answers a request from the
  state before it. Idle workers hear of it at once: the sender sends a one-byte datagram
  to each other worker's ``fleet-kick-<pid>.sock`` in the runtime directory, on which a
  greenlet of each worker waits (no wake-ups while nothing happens; it also looks every
  ``POLL_SECONDS``, for a kick lost to a worker that was still starting).
* **to the other routers** (``fleet.redis_channel`` with a Redis response cache or KV
  index): it ``PUBLISH``es the action on ``<key_prefix>.fleet`` (the response cache's
  ``key_prefix`` without its last colon, so a clear never removes these keys); every worker
  of every router subscribes, applies what it has not applied yet, and acknowledges with
  ``SADD`` on ``<channel>:ack:<id>``. Workers announce themselves every few seconds in the
  ``<channel>:members`` sorted set, so the sender knows whom to wait for.

The sender waits up to ``fleet.ack_timeout_seconds`` for every live worker of the host and
every member router to report the action applied, and its reply says how many did:
``{"fleet": {"workers": 4, "workers_applied": 4, "routers": 2, "routers_applied": 2}}``.

``GET /admin/...?workers=all`` is a read-only action, ``snapshot``: every worker that
applies it leaves its answer to that admin view beside its counts, and the sender lists
them all.

Applying an action elsewhere is the same call as here (``clear_response_cache`` and so on):
a shared store (Redis) is cleared once per worker, which costs a few empty ``SCAN``\\ s and
keeps the code one path. Every action carries an id; a worker applies each id once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import falcon

    from continuum.config import RouterConfig
    from continuum.hostshm import HostSegment
    from continuum.service import RouterService
    from continuum.web.drain import DrainControl
    from continuum.web.reload import ConfigReloader

log = logging.getLogger(__name__)

#: Without a kick, how often a worker looks at the generation anyway.
POLL_SECONDS = 1.0
MEMBER_SECONDS = 5.0  # how often a worker renews its fleet membership
MEMBER_TTL = 3 * MEMBER_SECONDS
KEEP_FILES = 64  # spool files kept for workers that fall behind
#: The counts in an action's result that the reply sums over every worker that applied it
#: (the response cache's and the Gemini map's entries: each worker's own, or a shared
#: store's, which the first to clear it counts).
COUNTED = ("cleared_entries", "cleared_semantic_index_entries")
_SEEN_IDS = 512

ACTIONS = ("response_cache_clear", "kv_index_clear", "gemini_context_clear", "reload", "drain",
           "snapshot")


class FleetBus:
    """Spreads this worker's admin actions and applies everyone else's."""

    def __init__(self, service: RouterService, reloader: ConfigReloader | None,
                 segment: HostSegment | None, config: RouterConfig) -> None:
        self.service = service
        self.reloader = reloader
        self.segment = segment
        self.timeout = config.fleet.ack_timeout_seconds
        self.spool: Path | None = None
        self._seen_generation = 0
        if segment is not None:
            self.spool = segment.directory / "fleet"
            self.spool.mkdir(exist_ok=True)
            self._seen_generation = segment.applied
        self._applied: OrderedDict[str, None] = OrderedDict()
        self._lock: Any = None
        self._kicks: socket.socket | None = None  # this worker's kick socket (in _poll)
        self._kicker: socket.socket | None = None  # sends kicks to the others
        self._greenlets: list[Any] = []
        self.redis: Any = None
        self.channel = ""
        self.member = f"{segment.host_id if segment else uuid.uuid4().hex}:{os.getpid()}"
        cache = config.response_cache
        if config.fleet.redis_channel and config.fleet_on_redis:
            from continuum.redis_topology import make_client

            self.redis = make_client(cache.redis)
            # Beside the cache's keys, not under its prefix: a clear must not remove them.
            self.channel = cache.redis.key_prefix.rstrip(":") + ".fleet"
        self.applied_remote = 0
        #: The worker's drained set (:mod:`continuum.web.drain`), set by ``create_app``.
        self.drain: DrainControl | None = None
        #: The admin views a ``snapshot`` may ask for, by path (``GET /admin/...``): each
        #: returns this worker's answer with its ``worker_pid``. Set by ``create_app``.
        self.views: dict[str, Callable[[], dict[str, Any]]] = {}

    # --- falcon middleware: catch up before every request -------------------------------

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        segment = self.segment
        if segment is not None and segment.generation != self._seen_generation:
            self.catch_up()

    # --- applying ------------------------------------------------------------------------

    def _apply(self, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        service = self.service
        if action == "response_cache_clear":
            cleared, semantic = service.clear_response_cache()
            return {"cleared_entries": cleared, "cleared_semantic_index_entries": semantic}
        if action == "kv_index_clear":
            # Not counted: every worker's memory index is a copy of the same events (and a
            # Redis one is shared), so the worker that answered already counted the index.
            service.clear_kv_index()
            return {}
        if action == "gemini_context_clear":
            return {"cleared_entries": service.clear_gemini_context()}
        if action == "reload":
            if self.reloader is None:
                return {}
            return self.reloader.reload().as_dict()
        if action == "drain":
            if self.drain is not None:
                self.drain.follow(str(payload.get("backend")), payload.get("draining") is True)
            return {}
        if action == "snapshot":  # an admin view's answer in this worker, for the sender
            view = self.views.get(str(payload.get("view")))
            return {} if view is None else {"snapshot": view()}
        raise ValueError(f"unknown fleet action {action!r}")

    def _apply_once(self, action_id: str, action: str,
                    payload: dict[str, Any]) -> dict[str, Any] | None:
        """Apply an action once; what the sender gathers from it (its :data:`COUNTED`
        counts, or a ``snapshot``), None when it was applied before or failed."""
        if action_id in self._applied:
            return None
        self._remember(action_id)
        try:
            result = self._apply(action, payload)
            self.applied_remote += 1
        except Exception:  # one failed action must not stop the next
            log.exception("fleet action %s (%s) failed in this worker", action, action_id)
            return None
        kept: dict[str, Any] = {key: result[key] for key in COUNTED
                                if isinstance(result.get(key), int)}
        if isinstance(result.get("snapshot"), dict):
            kept["snapshot"] = result["snapshot"]
        return kept

    def _remember(self, action_id: str) -> None:
        self._applied[action_id] = None
        while len(self._applied) > _SEEN_IDS:
            self._applied.popitem(last=False)

    def _mutex(self) -> Any:
        if self._lock is None:
            from gevent.lock import RLock

            self._lock = RLock()
        return self._lock

    def catch_up(self) -> int:
        """Apply the host's actions this worker has not applied; the generation reached."""
        segment, spool = self.segment, self.spool
        if segment is None or spool is None:
            return 0
        with self._mutex():
            current = segment.generation
            for generation in range(self._seen_generation + 1, current + 1):
                try:
                    doc = json.loads((spool / f"{generation}.json").read_text())
                except (OSError, ValueError):
                    log.warning("fleet action %d is gone from %s; skipped", generation, spool)
                    continue
                counts = self._apply_once(doc["id"], doc["action"], doc.get("payload") or {})
                if counts:
                    self._report(spool, generation, counts)
            self._seen_generation = current
            segment.applied = current
            return current

    @staticmethod
    def _report(spool: Path, generation: int, counts: dict[str, Any]) -> None:
        """Leave this worker's counts of host action ``generation`` for its sender (written
        before the worker records the generation applied, which the sender waits for)."""
        path = spool / f"{generation}.{os.getpid()}.counts"
        tmp = spool / f".{generation}.{os.getpid()}.counts"
        try:
            tmp.write_text(json.dumps(counts))
            tmp.replace(path)
        except OSError as exc:
            log.warning("fleet action %d: counts not reported: %s", generation, exc)

    # --- sending -------------------------------------------------------------------------

    def spread(self, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """Spread ``action``, already applied in this worker, to the host's other workers
        and the other routers; wait for them; the ``fleet`` section of the reply, with
        ``elsewhere``: the :data:`COUNTED` counts of the workers that applied it besides
        this one, summed, and their ``snapshots`` (the caller adds them to its own and drops
        the key)."""
        if action not in ACTIONS:
            raise ValueError(f"unknown fleet action {action!r}")
        payload = payload or {}
        action_id = uuid.uuid4().hex
        self._remember(action_id)
        generation = self._publish_host(action_id, action, payload)
        expected = self._publish_redis(action_id, action, payload)
        return self._wait(action_id, generation, expected)

    def _publish_host(self, action_id: str, action: str, payload: dict[str, Any]) -> int:
        segment, spool = self.segment, self.spool
        if segment is None or spool is None:
            return 0
        doc = json.dumps({"id": action_id, "action": action, "payload": payload,
                          "origin": self.member}).encode()
        with segment.locked():
            generation = segment.generation + 1
            tmp = spool / f".{generation}.{os.getpid()}"
            tmp.write_bytes(doc)
            tmp.replace(spool / f"{generation}.json")
            segment.bump_generation()
            stale = spool / f"{generation - KEEP_FILES}.json"
            stale.unlink(missing_ok=True)
            for counts in spool.glob(f"{generation - KEEP_FILES}.*.counts"):
                counts.unlink(missing_ok=True)
        self._kick_others(segment)
        with self._mutex():
            # Everything up to ours is applied here (catch_up above, ours just now).
            if self._seen_generation == generation - 1:
                self._seen_generation = generation
                segment.applied = generation
        self.catch_up()
        return generation

    def _kick_path(self, segment: HostSegment, pid: int) -> Path:
        return segment.directory / f"fleet-kick-{pid}.sock"

    def _kick_others(self, segment: HostSegment) -> None:
        """Wake the host's other workers: one datagram each (a worker without its socket
        yet, or with a full buffer, finds the action by its poll or its next request)."""
        if self._kicker is None:
            self._kicker = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._kicker.setblocking(False)
        me = os.getpid()
        for _slot, pid, _applied in segment.live_workers():
            if pid != me:
                with contextlib.suppress(OSError):
                    self._kicker.sendto(b"k", str(self._kick_path(segment, pid)))

    def _publish_redis(self, action_id: str, action: str, payload: dict[str, Any]) -> set[str]:
        """PUBLISH the action; the members expected to acknowledge it."""
        if self.redis is None:
            return set()
        doc = json.dumps({"id": action_id, "action": action, "payload": payload,
                          "origin": self.member})
        try:
            now = time.time()
            members = {m.decode() if isinstance(m, bytes) else str(m) for m in
                       self.redis.zrangebyscore(self.channel + ":members", now - MEMBER_TTL,
                                                "+inf")}
            self.redis.sadd(self._ack_key(action_id), self.member)
            self.redis.expire(self._ack_key(action_id), 300)
            self.redis.publish(self.channel, doc)
        except Exception as exc:  # Redis down: the host still got it
            log.warning("fleet action %s not sent to other routers: %s", action, exc)
            return set()
        return members

    def _ack_key(self, action_id: str) -> str:
        return f"{self.channel}:ack:{action_id}"

    def _counts_key(self, action_id: str) -> str:
        return f"{self.channel}:counts:{action_id}"

    def _counts_elsewhere(self, action_id: str, generation: int, workers: list[Any],
                          acked: set[str]) -> dict[str, Any]:
        """What the host's other workers and the other routers' workers that applied the
        action counted (each worker's own store: memory stores hold separate entries, a
        shared one is emptied by the first and counts 0 for the rest), and the snapshots
        they took (``snapshots``, host workers first)."""
        totals: dict[str, Any] = {}

        def add(counts: Any) -> None:
            if isinstance(counts, dict):
                for key in COUNTED:
                    value = counts.get(key)
                    if isinstance(value, int):
                        totals[key] = totals.get(key, 0) + value
                if isinstance(counts.get("snapshot"), dict):
                    totals.setdefault("snapshots", []).append(counts["snapshot"])

        me = os.getpid()
        if self.spool is not None and generation:
            for _slot, pid, applied in workers:
                if pid != me and applied >= generation:
                    try:
                        add(json.loads((self.spool / f"{generation}.{pid}.counts").read_text()))
                    except (OSError, ValueError):
                        pass  # a worker that applied nothing countable
        others = acked - {self.member}
        if self.redis is not None and others:
            try:
                found = self.redis.hgetall(self._counts_key(action_id))
            except Exception:  # Redis went away meanwhile: count what the host knows
                found = {}
            for member, raw in found.items():
                name = member.decode() if isinstance(member, bytes) else str(member)
                if name in others:
                    with contextlib.suppress(ValueError):
                        add(json.loads(raw))
        return totals

    def _wait(self, action_id: str, generation: int, expected: set[str]) -> dict[str, Any]:
        import gevent

        deadline = time.monotonic() + self.timeout
        while True:
            workers = self.segment.live_workers() if self.segment is not None else []
            done = sum(1 for _slot, _pid, applied in workers if applied >= generation)
            acked: set[str] = set()
            if self.redis is not None and expected:
                try:
                    acked = {m.decode() if isinstance(m, bytes) else str(m)
                             for m in self.redis.smembers(self._ack_key(action_id))}
                except Exception:  # Redis went away meanwhile: report what we know
                    acked = set()
            complete = done >= len(workers) and expected <= acked | {self.member}
            if complete or time.monotonic() >= deadline:
                break
            gevent.sleep(0.01)
        routers = {m.split(":")[0] for m in expected | {self.member}}
        routers_applied = {m.split(":")[0] for m in (acked & expected) | {self.member}}
        host_workers = max(len(workers), 1)
        return {"workers": host_workers, "workers_applied": max(done, 1),
                "routers": len(routers), "routers_applied": len(routers_applied),
                "complete": complete,
                "elsewhere": self._counts_elsewhere(action_id, generation, workers,
                                                    acked & expected)}

    # --- background ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the poll greenlet and, with Redis, the subscriber (in the worker)."""
        import gevent

        if self._greenlets:
            return
        if self.segment is not None:
            self._greenlets.append(gevent.spawn(self._poll))
        if self.redis is not None:
            self._greenlets.append(gevent.spawn(self._subscribe))
            self._greenlets.append(gevent.spawn(self._announce))

    def _poll(self) -> None:
        import gevent

        segment = self.segment
        if segment is None:
            return
        path = self._kick_path(segment, os.getpid())
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        kicks = self._kicks = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        kicks.bind(str(path))
        kicks.settimeout(POLL_SECONDS)
        while True:
            try:
                kicks.recv(64)  # a kick, or POLL_SECONDS without one
            except TimeoutError:
                pass
            except OSError:  # closed by stop(), or broken: poll without kicks
                if self._kicks is None:
                    return
                gevent.sleep(POLL_SECONDS)
            try:
                if segment.generation != self._seen_generation:
                    self.catch_up()
            except Exception:
                log.exception("fleet poll failed")

    def _announce(self) -> None:
        import gevent

        while True:
            try:
                now = time.time()
                key = self.channel + ":members"
                self.redis.zadd(key, {self.member: now})
                self.redis.zremrangebyscore(key, "-inf", now - MEMBER_TTL)
                self.redis.expire(key, int(MEMBER_TTL * 4))
            except Exception as exc:
                log.debug("fleet membership not renewed: %s", exc)
            gevent.sleep(MEMBER_SECONDS)

    def _subscribe(self) -> None:
        from continuum.redis_topology import listen

        listen(self.redis, self.channel, self._on_message)

    def _on_message(self, data: bytes | str) -> None:
        try:
            doc = json.loads(data)
            action_id, action = str(doc["id"]), str(doc["action"])
        except (ValueError, KeyError, TypeError):
            log.warning("fleet: unreadable message ignored")
            return
        if action not in ACTIONS:
            return
        self.catch_up()  # a message from this host: its spool file is there already
        with self._mutex():
            counts = self._apply_once(action_id, action, doc.get("payload") or {})
        try:
            if counts:  # before the ack, which the sender waits for
                self.redis.hset(self._counts_key(action_id), self.member, json.dumps(counts))
                self.redis.expire(self._counts_key(action_id), 300)
            self.redis.sadd(self._ack_key(action_id), self.member)
        except Exception as exc:
            log.debug("fleet ack failed: %s", exc)

    def stop(self) -> None:
        """Stop the greenlets, close the kick sockets and the Redis client."""
        for greenlet in self._greenlets:
            greenlet.kill(block=False)
        self._greenlets = []
        kicks, self._kicks = self._kicks, None
        for sock in (kicks, self._kicker):
            if sock is not None:
                sock.close()
        self._kicker = None
        if kicks is not None and self.segment is not None:
            with contextlib.suppress(OSError):
                self._kick_path(self.segment, os.getpid()).unlink()
        if self.redis is not None:
            from continuum.redis_topology import disconnect

            disconnect(self.redis)


def fleet_of(service: RouterService) -> FleetBus | None:
    """The :class:`FleetBus` :func:`~continuum.web.app.create_app` gave ``service``."""
    fleet = getattr(service, "fleet", None)
    return fleet if isinstance(fleet, FleetBus) else None


__all__ = ["ACTIONS", "POLL_SECONDS", "FleetBus", "fleet_of"]
