"""``continuum-router demo --workers N --routers M``: the scale-out side of the demo.

Every router scenario runs on ``M`` routers of ``N`` gunicorn workers each; the load
generator spreads requests over the routers round-robin (client side). With more than one
worker or router the shared tiers move to one ``redis-server`` the demo starts (the
response cache and the KV index, under key prefixes of their own per scenario, so every
scenario starts empty), as a real fleet would run them. What is measured besides the
usual columns (docs/scale-out.md):

* the response-cache hit rate (hits / (hits + misses), summed over the routers' metrics);
* the listener's open ``/events`` subscriptions per backend (its
  ``continuum_kv_listener_subscribers`` gauge);
* Redis commands per request (``INFO commandstats`` before and after the replay);
* the routers' resident memory (VmRSS of each gunicorn master and its workers).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from continuum.devtools.fleet import merge, metric_sum, slug

if TYPE_CHECKING:
    import requests

    from continuum.devtools.procs import Child

CACHE_METRIC = "continuum_response_cache_requests_total"
DECISIONS_METRIC = "continuum_kv_index_routing_decisions_total"
SUBSCRIBERS_METRIC = "continuum_kv_listener_subscribers"
REDIS_LATENCY_METRIC = "continuum_cache_redis_latency_seconds"


def scale_config(config: dict[str, Any], workers: int, redis_url: str | None,
                 scenario: str, *, sharing: bool = True) -> dict[str, Any]:
    """``config`` with ``workers`` workers and, with ``redis_url``, its response cache and
    KV index on that Redis under prefixes unique to ``scenario``, and the fleet's load
    exchange and admin channel on it for every row (``fleet.use_redis``); ``sharing=False`` turns
    off the shared in-flight counts, the KV event lease and the shared health prober (the
    before of the comparison)."""
    config = merge(config, {"server": {"workers": workers}})
    if not sharing:
        config = merge(config, {"fleet": {"share_in_flight": False, "kv_event_lease": False,
                                           "share_health_checks": False}})
    if redis_url is None:
        return config
    tag = slug(scenario)
    # use_redis: rows with no Redis tier (RoundRobin, PrefixAwareHash) still share load
    # and admin actions across the routers, as a fleet of them would be run
    shared: dict[str, Any] = {"response_cache": {
        "redis": {"url": redis_url, "key_prefix": f"demo:{tag}:resp:"}},
        "fleet": {"use_redis": True}}
    if config.get("response_cache", {}).get("enabled"):
        shared["response_cache"]["backend"] = "redis"
    if config.get("kv_cache_index", {}).get("enabled"):
        shared["kv_cache_index"] = {"backend": "redis",
                                    "redis_key_prefix": f"demo:{tag}:kv:"}
    return merge(config, shared)


def subscribers(http: requests.Session, listener: str) -> dict[str, int]:
    """Open ``/events`` subscriptions of the listener, per backend."""
    text = http.get(listener + "/metrics", timeout=5).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith(SUBSCRIBERS_METRIC + "{"):
            labels, _, value = line.rpartition(" ")
            backend = labels.split('backend="', 1)[1].split('"', 1)[0]
            out[backend] = int(float(value))
    return out


def kv_decisions(metrics_texts: Sequence[str]) -> dict[str, int]:
    """The KV scorer's decisions (``kv_aware``, ``fallback``, ``total``) over every
    router's ``/metrics``: every worker's, where ``/admin/kv-index/stats`` answers one
    worker's."""
    counts = {d: int(sum(metric_sum(t, DECISIONS_METRIC, decision=d) for t in metrics_texts))
              for d in ("kv_aware", "fallback")}
    return {**counts, "total": counts["kv_aware"] + counts["fallback"]}


def cache_counts(metrics_texts: Sequence[str]) -> tuple[int, int]:
    """(hits, misses) of the response cache over every router's ``/metrics``."""
    hits = sum(metric_sum(t, CACHE_METRIC, result="hit") for t in metrics_texts)
    misses = sum(metric_sum(t, CACHE_METRIC, result="miss") for t in metrics_texts)
    return int(hits), int(misses)


def redis_command_calls(url: str | None) -> dict[str, int]:
    """Calls of each command Redis has run so far (``INFO commandstats``, INFO itself
    left out), by lower-case command name."""
    if url is None:
        return {}
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()
            if k != "cmdstat_info"}


def redis_commands(url: str | None) -> int:
    """Commands Redis has run so far (``INFO commandstats``, INFO itself left out)."""
    return sum(redis_command_calls(url).values())


def per_request(before: dict[str, int], after: dict[str, int],
                requests: int) -> dict[str, float]:
    """Each command's calls between ``before`` and ``after`` per request, most first."""
    diff = {name: (calls - before.get(name, 0)) / max(requests, 1)
            for name, calls in after.items()}
    return {name: round(v, 2) for name, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v}


def redis_round_trips(metrics_texts: Iterable[str]) -> float:
    """Redis calls the routers' workers have made so far, over their ``/metrics``: each
    ``RedisLink.execute`` is one round trip (a pipeline or a script call is one), counted in
    ``continuum_cache_redis_latency_seconds``. The fleet's background clients (leases,
    fleet actions) are not in it."""
    return sum(metric_sum(text, REDIS_LATENCY_METRIC + "_count") for text in metrics_texts)


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime and stime, fields 14 and 15 of stat(5) (11 and 12 after the command name)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_cpu_seconds(routers: Sequence[Child]) -> float:
    """CPU time the routers have used so far (user + system, each gunicorn master and its
    live workers), in seconds."""
    total = 0.0
    for router in routers:
        total += _cpu_seconds(router.pid) + sum(_cpu_seconds(c) for c in _children_of(router.pid))
    return total


def router_memory_mib(routers: Sequence[Child]) -> float:
    """Resident memory of the routers: each gunicorn master and its workers, in MiB."""
    total = 0
    for router in routers:
        pid = router.pid
        total += _rss_kib(pid) + sum(_rss_kib(child) for child in _children_of(pid))
    return round(total / 1024, 1)


__all__ = ["cache_counts", "kv_decisions", "per_request", "redis_command_calls",
           "redis_commands", "redis_round_trips", "router_cpu_seconds", "router_memory_mib",
           "scale_config", "subscribers"]
