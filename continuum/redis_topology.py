"""Redis clients for the three topologies of ``response_cache.redis.mode``.

* ``standalone``: one server at ``url`` (a ``BlockingConnectionPool``).
* ``cluster``: Redis Cluster through redis-py's own :class:`redis.cluster.RedisCluster`,
  seeded by ``nodes`` (or the url's host:port). It follows ``MOVED``/``ASK`` redirections,
  learns the new master after a failover and keeps one pool per node.
* ``sentinel``: redis-py's :class:`redis.sentinel.Sentinel` over ``nodes`` (the
  sentinels), with a client for the master named ``sentinel_master``; after a failover the
  next connection goes to the new master.

The url still carries the password, the db (standalone and sentinel only: a cluster has
db 0) and ``rediss://`` for TLS in every mode.

Keys in cluster mode: a command or Lua script that touches several keys needs them in one
hash slot. Users of several keys in one operation wrap a common part of their names in
``{...}`` (:func:`hash_tagged` builds such a prefix); commands over the whole keyspace
(``SCAN``) go to every master through :func:`scan_nodes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

if TYPE_CHECKING:
    from continuum.config import RedisConfig

log = logging.getLogger(__name__)


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host.strip("[]"), int(port)


def _node(node: str) -> ClusterNode:
    return ClusterNode(*_host_port(node))  # type: ignore[no-untyped-call]


def _url_parts(config: RedisConfig) -> dict[str, Any]:
    parts = urlsplit(config.url)
    out: dict[str, Any] = {}
    if parts.password:
        out["password"] = unquote(parts.password)
    if parts.username:
        out["username"] = unquote(parts.username)
    db = parts.path.strip("/")
    if db.isdigit():
        out["db"] = int(db)
    if config.tls or parts.scheme == "rediss":
        out["ssl"] = True
    return out


def make_client(config: RedisConfig, **overrides: Any) -> Any:
    """A redis-py client for ``config`` (``overrides``: extra connection keyword args).

    Returns a ``redis.Redis`` for standalone and sentinel, a ``RedisCluster`` for cluster;
    both offer the same commands, ``pipeline()``, ``register_script`` and ``pubsub()``.
    """
    timeouts: dict[str, Any] = {
        "socket_connect_timeout": config.connect_timeout_ms / 1000,
        "socket_timeout": config.command_timeout_ms / 1000,
        "health_check_interval": 30,
    }
    timeouts.update(overrides)
    if config.mode == "cluster":
        parts = _url_parts(config)
        parts.pop("db", None)
        seeds = list(config.nodes) or [f"{urlsplit(config.url).hostname}:"
                                       f"{urlsplit(config.url).port or 6379}"]
        return RedisCluster(
            startup_nodes=[_node(n) for n in seeds],
            max_connections=config.pool_size,
            # After a failover the old master is gone: re-learn the slots at once.
            reinitialize_steps=1,
            **parts, **timeouts)
    if config.mode == "sentinel":
        parts = _url_parts(config)
        sentinel: Any = Sentinel(  # type: ignore[no-untyped-call]
            [_host_port(n) for n in config.nodes],
                            socket_connect_timeout=timeouts["socket_connect_timeout"],
                            socket_timeout=timeouts["socket_timeout"])
        return sentinel.master_for(config.sentinel_master, max_connections=config.pool_size,
                                   **parts, **timeouts)
    url = config.url
    if config.tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://"):]
    kwargs = dict(timeouts, max_connections=config.pool_size,
                  timeout=config.command_timeout_ms / 1000)
    pool = redis.BlockingConnectionPool.from_url(url, **kwargs)
    return redis.Redis(connection_pool=pool)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a Redis Cluster client."""
    return isinstance(client, RedisCluster)


def hash_tagged(prefix: str) -> str:
    """``prefix`` with its name in a hash tag, so every key under it shares one slot:
    ``cr:kvidx:`` becomes ``{cr:kvidx}:``. A prefix that already has a tag is kept."""
    if "{" in prefix and "}" in prefix.split("{", 1)[1]:
        return prefix
    stem = prefix.rstrip(":")
    return "{" + stem + "}" + prefix[len(stem):]


def scan_nodes(client: Any) -> Iterator[Any]:
    """The clients to ``SCAN`` for a keyspace walk: every master of a cluster (each node's
    own ``redis.Redis``), else ``client`` itself."""
    if is_cluster(client):
        for node in client.get_primaries():
            yield client.get_redis_connection(node)
    else:
        yield client


def disconnect(client: Any) -> None:
    """Close every connection ``client`` holds (all nodes of a cluster)."""
    if is_cluster(client):
        client.close()
    else:
        client.connection_pool.disconnect()


def listen(client: Any, channel: str, handle: Callable[[bytes], Any],
           retry_seconds: float = 1.0) -> None:
    """Subscribe to ``channel`` and call ``handle`` with each message's data, forever (a
    greenlet's body: it ends when killed). When Redis goes away it subscribes again
    ``retry_seconds`` later; what was published meanwhile is not delivered."""
    import gevent

    while True:
        pubsub = None
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(channel)
            while True:
                message = pubsub.get_message(timeout=1.0)
                if message is not None and message.get("type") == "message":
                    handle(message["data"])
        except Exception as exc:  # Redis away: subscribe again later
            log.debug("subscriber of %s: %s; subscribing again", channel, exc)
            gevent.sleep(retry_seconds)
        finally:
            if pubsub is not None:
                try:
                    pubsub.close()
                except Exception:
                    log.debug("closing the subscription of %s failed", channel,
                              exc_info=True)


def pool_stats(client_or_pool: Any) -> dict[str, int]:
    """Connections in use and idle of a connection pool, or summed over a cluster
    client's nodes."""
    pools = [client_or_pool.get_redis_connection(n).connection_pool
             for n in client_or_pool.get_nodes() if n.redis_connection is not None] \
        if is_cluster(client_or_pool) else [client_or_pool]
    in_use = created = 0
    for pool in pools:
        busy = len(getattr(pool, "_in_use_connections", ()))
        in_use += busy
        if hasattr(pool, "_available_connections"):  # ConnectionPool: idle ones listed apart
            created += busy + len(pool._available_connections)
        else:  # BlockingConnectionPool: every connection it made
            created += len(getattr(pool, "_connections", ()))
    return {"active": in_use, "idle": max(created - in_use, 0)}


__all__ = ["disconnect", "hash_tagged", "is_cluster", "listen", "make_client", "pool_stats",
           "scan_nodes"]
