"""Connections a worker's plugins share, held without the core knowing what they are.

A cache store and a KV index that talk to the same server should share one connection
pool per worker: one credential set, one view of whether the server is up. The service
gives every plugin it builds the same :class:`WorkerResources`; a plugin acquires what it
connects to under a key of its own choosing (the connection settings, say). The first
acquirer creates the resource, later ones share it, and the last one to release it closes
it. So when a reload replaces a store, the old store's connection stays open exactly as
long as another plugin still uses it. The service starts the held resources with the
worker and closes whatever is left when it stops.

Acquire and release run on the worker's control paths (construction, reload, stop), never
per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar, cast

log = logging.getLogger(__name__)


class WorkerResource(Protocol):
    """What a shared resource must offer: start in the worker, close when unused."""

    def start(self) -> None:
        """Start background work (called in the worker after the fork; idempotent)."""

    def close(self) -> None:
        """Release everything the resource holds."""


R = TypeVar("R", bound=WorkerResource)


class Lease(Generic[R]):
    """One user's hold on a shared resource; :meth:`release` hands it back (once)."""

    __slots__ = ("_release", "resource")

    def __init__(self, resource: R, release: Callable[[], None]) -> None:
        self.resource = resource
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Give the resource back; the last user's release closes it. Idempotent, so a
        plugin closed twice never drops another user's hold."""
        release, self._release = self._release, None
        if release is not None:
            release()


class _Held:
    __slots__ = ("resource", "users")

    def __init__(self, resource: WorkerResource) -> None:
        self.resource = resource
        self.users = 0


class WorkerResources:
    """One worker's shared resources, by key, with a count of their users."""

    def __init__(self) -> None:
        self._held: dict[Hashable, _Held] = {}
        self._started = False

    def acquire(self, key: Hashable, factory: Callable[[], R]) -> Lease[R]:
        """The resource under ``key``, made by ``factory()`` if nobody holds one yet
        (and started at once when the worker already runs), with one more user."""
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(factory())
            if self._started:
                held.resource.start()
        held.users += 1
        return Lease(cast("R", held.resource), lambda: self._release(key, held))

    def _release(self, key: Hashable, held: _Held) -> None:
        held.users -= 1
        if held.users <= 0 and self._held.get(key) is held:
            del self._held[key]
            held.resource.close()

    def users(self, key: Hashable) -> int:
        """How many leases on ``key`` are outstanding (0: none held)."""
        held = self._held.get(key)
        return held.users if held is not None else 0

    def __len__(self) -> int:
        return len(self._held)

    def start(self) -> None:
        """Start every held resource, and each one acquired from now on."""
        self._started = True
        for held in list(self._held.values()):
            held.resource.start()

    def close(self) -> None:
        """Close every resource still held, leases outstanding or not (worker shutdown)."""
        self._started = False
        held, self._held = list(self._held.values()), {}
        for item in held:
            try:
                item.resource.close()
            except Exception:  # one failing close must not keep the others open
                log.exception("closing a shared worker resource failed")
