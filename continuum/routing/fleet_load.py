"""In-flight counts shared by the routers of a fleet, through Redis, a moment late.

:mod:`continuum.routing.shared_load` makes the workers of one host decide on the host's
load; routers on other hosts (or other instances on this one) send to the same backends,
so each router alone still sees only its share. With ``fleet.share_in_flight_across_routers``
one worker per host (the holder of an ``flock`` on ``fleet-load.lock`` in the runtime
directory) runs a greenlet that, every ``fleet.fleet_load_interval_ms`` while the host has
requests in flight (and once more after, to publish its zeros), and every
:data:`IDLE_SECONDS` while it has none, makes one Redis call (a Lua script):

* it writes the host's counts (:meth:`~continuum.hostshm.HostSegment.workers_total`) to the
  hash ``<prefix><host id>`` with a TTL of four idle intervals, and the host id into the sorted
  set ``<prefix>hosts`` scored by the time;
* it reads the hashes of the other hosts seen within those four intervals and returns them.

It writes the sum per backend into the host segment's elsewhere row, which
:meth:`~continuum.hostshm.HostSegment.host_total` adds to the workers' counts: so
``Backend.in_flight`` and everything reading it (CHWBL's bound, the KV load guard) see the
fleet's load with no Redis call on the request path, at most about one interval old.
An idle host makes no decisions, so what it reads may be older; what it publishes (zeros)
does not change. A host that the last exchange found alone (no other live host: one router
with its tiers on Redis) exchanges every idle interval, busy or not: nobody reads its counts
soon, and a router that joins reads them at most an idle interval old and is seen by the
next exchange, after which both go every interval. The busy interval is short (25 ms)
because a request's time to its first token is of the order of the interval: at 250 ms the
other router's counts were as old as the requests they counted, and two routers'
placements piled onto the same engine.

With ``fleet.fleet_load_push_ms`` (off by default) the holder also pushes: it looks at the
host's counts every push interval and, when they changed, publishes them on the channel
``<prefix>counts``; every other holder subscribes and writes what it hears into its
elsewhere row at once, so a new request counts on the other routers a Redis hop later
rather than up to two intervals later. The exchange still says which hosts are live (a
pushed count of a host that stopped being live goes with it) and carries the pressure.
Each hash (field ``s:``) and each message carries when its host read the counts (its
``time.monotonic_ns()``: one clock for every worker of a host, so a new holder goes on
from the old one's); of a host's exchanged and pushed counts the later read wins. A host
that found itself alone publishes nothing until another host's message or exchange shows
up; a joining host publishes its zeros at once, which shows it to the others.

The same call names the host in its hash (the field ``r:<host id>``, whose value is the
turns it has taken in RoundRobin's cycle), and the holder writes the host's place among the
live hosts (sorted by id) into the segment: RoundRobin starts each router's cycle its
place's share of the way round the backends
(:meth:`~continuum.hostshm.HostSegment.take_turn`), so that routers taking requests in turn
do not send each backend two in a row. (Adding the other routers' turns to one count was
tried and is worse: the count is an interval or two old, so requests that two routers take
at about the same moment land on one backend, and each jump when the count is read skips
backends.)

With KV placement on (``kv_cache_index.placement``) the same call carries each backend's
KV pressure: the host's (:meth:`~continuum.hostshm.HostSegment.workers_pressure`, decayed
to now, in whole tokens) as the field ``p:<backend>`` beside the count (backend names
have no colon, so a router of an earlier version takes the field for a backend it does
not have and ignores it), and the other hosts' sum goes into the elsewhere pressure row,
which :meth:`~continuum.hostshm.HostSegment.host_pressure` decays and adds: new sessions
are placed on the fleet's picture of which caches are filling, not one router's share. A
router that stops (or dies) stops counting within four intervals. When Redis fails the
elsewhere row is zeroed: each router bounds its own share again, as before. If the holder
dies, the kernel drops its ``flock`` and another worker takes over within a second.

Keys: ``<response_cache.redis.key_prefix without its last colon>.load:`` (hash-tagged in
Redis Cluster, so the script's keys share a slot), outside the cache's prefix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

from continuum.hostshm import try_lock

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.hostshm import HostSegment
    from continuum.routing.backends import BackendPool

log = logging.getLogger(__name__)

LOCK_FILE = "fleet-load.lock"
#: How often a worker without the role tries for it.
TAKEOVER_SECONDS = 1.0
#: A host's counts live this many idle intervals without a refresh.
TTL_INTERVALS = 4
#: Seconds between exchanges while the host has nothing in flight (at least the interval).
IDLE_SECONDS = 0.25
#: The field of a backend's KV pressure in a host's hash: this prefix and its name.
PRESSURE_FIELD = "p:"
#: The field naming a host in its hash (this prefix and the host id; the value: the turns
#: it has taken in RoundRobin's cycle), from which each host learns its place among them.
TURNS_FIELD = "r:"
#: The field holding when the host read the counts in its hash (``time.monotonic_ns()``
#: on its machine): a pushed count and an exchanged one are ordered by it.
SEQ_FIELD = "s:"
#: The pub/sub channel's name after the key prefix (counts pushed when they change).
PUSH_CHANNEL = "counts"

#: KEYS[1]: the hosts' sorted set. ARGV: host id, now (ms), ttl (ms), hash key prefix,
#: then field, value pairs. Returns each other live host's id and its hash (flat pairs).
EXCHANGE_SCRIPT = """
local host, now, ttl, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local own = prefix .. host
redis.call('DEL', own)
if #ARGV > 4 then redis.call('HSET', own, unpack(ARGV, 5)) end
redis.call('PEXPIRE', own, ttl)
redis.call('ZADD', KEYS[1], now, host)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], ttl)
local out = {}
for _, other in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if other ~= host then
    out[#out + 1] = other
    out[#out + 1] = redis.call('HGETALL', prefix .. other)
  end
end
return out
"""


class FleetLoad:
    """Exchanges this host's in-flight counts with the other routers' (module docstring).

    Args:
        pool: the worker's backends (their columns in ``segment``).
        segment: the host segment.
        client: a Redis client (standalone, Cluster or Sentinel).
        key_prefix: where the keys go (``<prefix>hosts``, ``<prefix><host id>``).
        interval: seconds between exchanges while the host has requests in flight.
        pressure_window: ``kv_cache_index.placement.window_seconds`` when placement is on
            (the KV pressure is exchanged too); None: counts only.
        push_interval: seconds between looks at the host's counts, each change of which is
            published at once on ``<prefix>counts`` (0: counts go with the exchange only).
    """

    def __init__(self, pool: BackendPool, segment: HostSegment, client: Any, key_prefix: str,
                 interval: float, pressure_window: float | None = None,
                 push_interval: float = 0.0) -> None:
        self.pressure_window = pressure_window
        #: The other routers' KV pressure per backend as last read (tokens).
        self.elsewhere_pressure: dict[str, float] = {}
        self.pool = pool
        self.segment = segment
        self.client = client
        self.key_prefix = key_prefix
        self.interval = interval
        self.idle_interval = max(interval, IDLE_SECONDS)
        self.push_interval = push_interval
        self.channel = key_prefix + PUSH_CHANNEL
        self.ttl_ms = max(1, round(self.idle_interval * 1000 * TTL_INTERVALS))
        self._last_at = self._retry_at = -math.inf
        self._last_busy = False
        #: The last exchange found no other live host (a lone router).
        self.alone = False
        self.host = segment.host_id
        self.exchanges = self.failures = self.pushes = self.pushed_in = 0
        #: Each other live host's counts, and when it read them (its ``monotonic_ns``):
        #: from the exchange or a push, whichever that host read later.
        self._others: dict[str, tuple[int, dict[str, int]]] = {}
        self._pushed: dict[str, int] | None = None
        self._script = client.register_script(EXCHANGE_SCRIPT)
        self._lock_fd: int | None = None
        self._greenlets: list[Any] = []

    @classmethod
    def from_config(cls, config: RouterConfig, pool: BackendPool,
                    segment: HostSegment) -> FleetLoad | None:
        """The exchange for ``config``, or None: off, or no Redis to exchange through."""
        fleet, cache, kv = config.fleet, config.response_cache, config.kv_cache_index
        if not (fleet.share_in_flight and fleet.share_in_flight_across_routers
                and config.fleet_on_redis):
            return None
        from continuum.redis_topology import hash_tagged, make_client

        client = make_client(cache.redis)
        prefix = cache.redis.key_prefix.rstrip(":") + ".load:"
        if cache.redis.mode == "cluster":
            prefix = hash_tagged(prefix)
        placing = kv.enabled and kv.match == "chain" and kv.adaptive_placement
        return cls(pool, segment, client, prefix, fleet.fleet_load_interval_ms / 1000,
                   kv.placement.window_seconds if placing else None,
                   fleet.fleet_load_push_ms / 1000)

    @property
    def holder(self) -> bool:
        """Whether this worker does the exchange for the host."""
        return self._lock_fd is not None

    def start(self) -> None:
        """Start the greenlet (in the worker)."""
        if not self._greenlets:
            import gevent

            self._greenlets.append(gevent.spawn(self._run))

    def stop(self) -> None:
        """Stop exchanging; as holder, zero the elsewhere row and give the role up."""
        for greenlet in self._greenlets:
            greenlet.kill(block=False)
        self._greenlets = []
        if self._lock_fd is not None:
            self._others = {}
            self._set_elsewhere({}, {})
            os.close(self._lock_fd)
            self._lock_fd = None
        with contextlib.suppress(Exception):
            from continuum.redis_topology import disconnect

            disconnect(self.client)

    def _take_role(self) -> bool:
        self._lock_fd = try_lock(self.segment.directory / LOCK_FILE)
        return self._lock_fd is not None

    def _run(self) -> None:
        import gevent

        while not self._take_role():
            gevent.sleep(TAKEOVER_SECONDS)
        log.info("fleet load: this worker (pid %d) exchanges the host's in-flight counts",
                 os.getpid())
        if self.push_interval > 0:
            self._greenlets += [gevent.spawn(self._listen), gevent.spawn(self._watch)]
        while True:
            if self.due(time.monotonic()):
                self.exchange()
            gevent.sleep(self.interval)

    def due(self, now: float) -> bool:
        """Whether to exchange at ``now``: while the host has requests in flight, or the
        last exchange published some (so the zeros that follow go out at once), every
        interval; otherwise every idle interval (an idle host decides nothing, and the
        others already have its zeros), as when the last exchange found no other host.
        After a failed exchange, not again for an idle interval."""
        if now < self._retry_at:
            return False
        if self.alone:
            return now - self._last_at >= self.idle_interval
        if self._last_busy or now - self._last_at >= self.idle_interval:
            return True
        segment = self.segment
        return any(segment.workers_total(segment.column(b.name)) for b in self.pool)

    def exchange(self) -> dict[str, int]:
        """One exchange: publish the host's counts, read the other routers'; what they
        have in flight per backend (empty, and the row zeroed, when Redis failed)."""
        segment, window = self.segment, self.pressure_window
        now = time.monotonic()
        args: list[str | int] = [self.host, int(time.time() * 1000), self.ttl_ms,
                                 self.key_prefix, TURNS_FIELD + self.host, segment.turns,
                                 SEQ_FIELD, time.monotonic_ns()]
        busy = False
        for backend in self.pool:
            col = segment.column(backend.name)
            count = segment.workers_total(col)
            busy = busy or count > 0
            args += [backend.name, count]
            if window is not None:
                args += [PRESSURE_FIELD + backend.name,
                         round(segment.workers_pressure(col, now, window))]
        pressure: dict[str, float] = {}
        hosts = [self.host]
        try:
            reply = self._script(keys=[self.key_prefix + "hosts"], args=args)
            live: dict[str, tuple[int, dict[str, int]]] = {}
            for i in range(0, len(reply), 2):
                flat = reply[i + 1]
                if not flat:  # listed, but its hash expired
                    continue
                seq, counts = 0, {}
                for j in range(0, len(flat), 2):
                    name = _text(flat[j])
                    if name.startswith(PRESSURE_FIELD):
                        name = name[len(PRESSURE_FIELD):]
                        pressure[name] = pressure.get(name, 0.0) + float(flat[j + 1])
                    elif name == SEQ_FIELD:
                        seq = int(flat[j + 1])
                    elif not name.startswith(TURNS_FIELD):
                        counts[name] = int(flat[j + 1])
                other = _text(reply[i])
                hosts.append(other)
                known = self._others.get(other)  # a push may have come in since
                live[other] = known if known is not None and known[0] > seq else (seq, counts)
        except Exception as exc:  # Redis away or a bad reply: each router on its own share
            self.failures += 1
            log.debug("fleet load: exchange failed: %s", exc)
            live, pressure = {}, {}
            self._retry_at, busy = now + self.idle_interval, False
        else:
            self.exchanges += 1
            hosts.sort()
            segment.set_place(hosts.index(self.host), len(hosts))
        self._others = live
        self.alone = not live
        self._last_at, self._last_busy = now, busy
        elsewhere = self._elsewhere()
        self._set_elsewhere(elsewhere, pressure if window is not None else {})
        return elsewhere

    def push(self) -> bool:
        """Publish the host's counts if they changed since the last push (as holder, every
        ``push_interval``): the other routers have them a Redis hop later instead of at
        their next exchange. Whether anything went out."""
        segment = self.segment
        seq = time.monotonic_ns()
        counts = {b.name: segment.workers_total(segment.column(b.name)) for b in self.pool}
        if counts == self._pushed:
            return False
        message = json.dumps({"h": self.host, "s": seq, "c": counts}, separators=(",", ":"))
        self.client.publish(self.channel, message)
        self._pushed = counts
        self.pushes += 1
        return True

    def on_counts(self, data: bytes | str) -> bool:
        """Take another router's pushed counts (a message on the channel); whether they
        were newer than what this host had of that router."""
        try:
            doc = json.loads(data)
            host, seq = str(doc["h"]), int(doc["s"])
            counts = {str(name): int(n) for name, n in doc["c"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.debug("fleet load: unreadable push ignored")
            return False
        known = self._others.get(host)
        if host == self.host or (known is not None and known[0] >= seq):
            return False
        self._others[host] = (seq, counts)
        self.alone = False
        self.pushed_in += 1
        self._set_elsewhere(self._elsewhere())  # a push carries no pressure
        return True

    def _elsewhere(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for _, counts in self._others.values():
            for name, count in counts.items():
                total[name] = total.get(name, 0) + count
        return total

    def _watch(self) -> None:
        import gevent

        while True:
            if not self.alone and time.monotonic() >= self._retry_at:
                try:
                    self.push()
                except Exception as exc:  # Redis away: the exchange notices and backs off
                    log.debug("fleet load: push failed: %s", exc)
                    self._pushed = None
            gevent.sleep(self.push_interval)

    def _listen(self) -> None:
        from continuum.redis_topology import listen

        listen(self.client, self.channel, self.on_counts, TAKEOVER_SECONDS)

    def _set_elsewhere(self, elsewhere: dict[str, int],
                       pressure: dict[str, float] | None = None) -> None:
        """Write the other routers' counts (and, unless ``pressure`` is None, their KV
        pressure) into the host segment's elsewhere rows."""
        segment = self.segment
        now = time.monotonic()
        if pressure is not None:
            self.elsewhere_pressure = pressure
        for backend in self.pool:
            col = segment.column(backend.name)
            segment.set_elsewhere(col, max(0, elsewhere.get(backend.name, 0)))
            if pressure is not None:
                segment.set_elsewhere_pressure(
                    col, max(0.0, pressure.get(backend.name, 0.0)), now)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["EXCHANGE_SCRIPT", "IDLE_SECONDS", "FleetLoad"]
