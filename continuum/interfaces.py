"""The plugin interfaces: selection strategies, backend scorers, cache stores, KV indexes.

These names are public API. Third-party distributions implement them and register the
implementation under the matching entry-point group (see :mod:`continuum.registry`); the
core finds its own built-ins the same way.

Scorers, cache stores and KV indexes are built with ``from_config(config, **collaborators)``.
What the router passes: ``metrics`` (:class:`continuum.metrics.RouterMetrics`) and
``resources`` (the worker's :class:`continuum.resources.WorkerResources`: lease a shared
connection there, keyed by its settings, and release the lease in ``close``); scorers also
get ``index``. A plugin takes what it needs and ignores the rest, so a new collaborator
never breaks a plugin.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from continuum.config import RouterConfig
    from continuum.request import RequestContext
    from continuum.routing.backends import Backend


@dataclass(frozen=True, slots=True)
class PrefixRoutingSettings:
    """The ``prefix_routing`` parameters a prefix-routing strategy works with."""

    max_prefix_length: int
    load_factor_epsilon: float
    virtual_nodes: int
    anthropic_cache_control_injection: bool


def rate_text(part: float, whole: float) -> str:
    """``part / whole`` with four decimals (0 when ``whole`` is 0): how the admin API shows
    its rates (``hit_rate``, ``overflow_rate``)."""
    return f"{(part / whole if whole else 0.0):.4f}"


@dataclass(frozen=True, slots=True)
class PrefixRoutingDecisions:
    """How a prefix-routing strategy decided: on the key's owner, on the next backend under
    the load bound, or without a prefix key."""

    total: int = 0
    prefix_hash: int = 0
    overflow: int = 0
    fallback: int = 0
    #: ``overflow / total`` with four decimals (a string, as the admin API shows it).
    overflow_rate: str = "0.0000"


@dataclass(frozen=True, slots=True)
class PrefixRoutingStats:
    """What a prefix-routing strategy reports to ``/admin/prefix-routing/stats``."""

    config: PrefixRoutingSettings
    routing_decisions: PrefixRoutingDecisions
    unique_prefixes: int


class SelectionStrategy(abc.ABC):
    """Picks one backend from the healthy candidates for a request.

    ``select`` must be synchronous, do no I/O and allocate little: it runs on every request.
    Instances are built from the router config; ``reconfigure`` is called on hot reload.
    """

    #: Config name under which the strategy is registered (``selection_strategy: <name>``).
    name: ClassVar[str] = ""
    #: True when ``select`` itself reads :attr:`RequestContext.spill_at_slots
    #: <continuum.request.RequestContext.spill_at_slots>` (PrefixAwareHash walks its ring
    #: for a free slot). Otherwise, with that flag set, the pipeline passes ``select`` only
    #: the candidates with a free slot when some have one.
    spills_at_slots: ClassVar[bool] = False

    def __init__(self, config: RouterConfig | None = None, **collaborators: Any) -> None:
        self.config = config

    @abc.abstractmethod
    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return one of ``candidates``.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """

    def reconfigure(self, config: RouterConfig) -> list[str]:
        """Apply a reloaded config; return the key paths that need a restart to change."""
        self.config = config
        return []

    def stats(self) -> dict[str, Any]:
        """Strategy-specific statistics for the admin API."""
        return {}

    def prefix_routing_stats(self) -> PrefixRoutingStats | None:
        """A strategy that routes by prefix key reports its decisions here (they are
        ``/admin/prefix-routing/stats``); None, the default, for any other strategy."""
        return None


#: A scorer's best score must be strictly above this for it to pick the backend (the seed's
#: ``DEFAULT_SCORER_THRESHOLD``); otherwise the selection strategy decides. Here rather than
#: in the pipeline so that a scorer can place its scores relative to it.
SCORER_THRESHOLD = 0.3

#: The tier of the KV data a backend holds for a prefix.
TIER_NONE = "none"
TIER_GPU_HOT = "gpu_hot"
TIER_STORAGE_WARM = "storage_warm"


class BackendScorer(abc.ABC):
    """Scores backends before the selection strategy runs (Tier 4 and friends).

    ``prepare`` may do I/O (it runs once per request); ``score`` and ``score_with_tier``
    are synchronous reads of what ``prepare`` fetched.

    Scorers are listed by config name in ``scorers`` and loaded from the
    ``continuum.scorers`` entry-point group; they run only on requests with a prefix key
    (``prefix_routing.enabled``). The highest score above the pipeline's threshold picks
    the backend; otherwise the selection strategy decides.
    """

    #: Config name under which the scorer is registered (``scorers: [<name>]``).
    name: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: RouterConfig, **collaborators: Any) -> BackendScorer | None:
        """Build the scorer for ``config``, or None when this config leaves it off (the
        KV overlap scorer without a KV index, say).

        Collaborators the router passes: ``metrics``, ``resources`` (see the module
        docstring) and ``index`` (the worker's :class:`KvCacheIndex`, or None when
        ``kv_cache_index.enabled`` is off).
        """
        return cls()

    def start(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Start background work (called in the worker after the fork); default: none."""

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Release resources; default: nothing to release."""

    @abc.abstractmethod
    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        """Fetch whatever scoring ``ctx`` needs."""

    @abc.abstractmethod
    def score(self, backend: Backend, ctx: RequestContext) -> float:
        """Composite score of ``backend`` for ``ctx`` in [0, 1]."""

    def score_with_tier(self, backend: Backend, ctx: RequestContext) -> tuple[float, str]:
        """Score and the tier it was computed from, read together."""
        return self.score(backend, ctx), TIER_NONE

    def observe(  # noqa: B027 - optional hook, deliberately a no-op
        self, ctx: RequestContext, chosen: Backend | None, score: float, tier: str
    ) -> None:
        """Called once per scoring pass with the outcome (``chosen`` None: the strategy
        decided). Default: nothing."""


@dataclass(frozen=True, slots=True)
class CacheStoreStats:
    """Counters every cache store reports."""

    backend: str
    entries: int
    capacity: int | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    size_bytes: int = 0
    extra: dict[str, Any] | None = None


class CacheStore(abc.ABC):
    """A byte-valued key/value store with TTLs (Tier 2/3 response cache storage).

    Implementations wrap their own failures in :class:`continuum.errors.StoreError`.
    """

    name: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: RouterConfig, **collaborators: Any) -> CacheStore:
        """Build the store for ``config.response_cache``.

        Collaborators the router passes: ``metrics`` and ``resources`` (see the module
        docstring). Plugins take what they need and ignore the rest.
        """
        return cls()

    def reconfigure(self, config: RouterConfig, **collaborators: Any) -> CacheStore | None:
        """Apply a reloaded config (``collaborators`` as for :meth:`from_config`).

        Return a replacement store when the change needs one (new connection settings):
        the router starts it, swaps it in and closes this store. Return None to keep this
        store, adjusted in place or not. Default: None.
        """
        return None

    def start(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Start background work (called in the worker after the fork); default: none."""

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Release resources; default: nothing to release."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None when absent or expired."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes, ttl: float) -> None:
        """Store ``value`` under ``key`` for ``ttl`` seconds."""

    def add(self, key: str, value: bytes, ttl: float) -> bool:
        """Store ``value`` under ``key`` for ``ttl`` seconds only if ``key`` is absent;
        whether it was stored. A shared store makes this atomic across processes (Redis:
        ``SET NX EX``): it is the Gemini context cache's single-flight lock. The default
        (get, then set) is atomic only within one gevent worker."""
        if self.get(key) is not None:
            return False
        self.set(key, value, ttl)
        return True

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every entry this store owns; return how many were removed."""

    @abc.abstractmethod
    def stats(self) -> CacheStoreStats:
        """Current counters."""


@dataclass(frozen=True, slots=True)
class KvHolding:
    """What one backend holds for one prefix."""

    backend: str
    token_count: int
    tier: str = TIER_GPU_HOT
    updated_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ChainMatch:
    """How far one backend's cache goes into a request's chain of prefix keys
    (:mod:`continuum.prefix_chain`).

    ``depth`` counts the chain's keys the backend holds up to its deepest one (key
    ``depth - 1`` is held); ``token_count`` is what that key covers on the backend.
    ``approximate``: recorded by the router when it routed there, not confirmed by an
    engine event (it expires after its own TTL).
    """

    backend: str
    depth: int
    token_count: int
    tier: str = TIER_GPU_HOT
    approximate: bool = False
    updated_at: float = 0.0


#: Event types on a listener's per-backend stream.
CACHE_CREATED = "cache_created"
CACHE_EVICTED = "cache_evicted"
CACHE_OFFLOADED = "cache_offloaded"
CACHE_CLEARED = "cache_cleared"
KV_EVENT_TYPES = (CACHE_CREATED, CACHE_EVICTED, CACHE_OFFLOADED, CACHE_CLEARED)


class KvCacheIndex(abc.ABC):
    """``prefix_hash -> {backend -> (token_count, tier, updated_at)}``, fed by engine KV
    events (Tier 4).

    Tier transitions (``storage_offloading.enabled``): ``cache_created`` → GpuHot;
    ``cache_offloaded`` → StorageWarm; ``cache_evicted`` → StorageWarm when the entry was
    GpuHot and ``treat_eviction_as_offload`` is on, else the entry is removed. With storage
    offloading off, every holding is GpuHot and offload/evict remove it. ``cache_cleared``
    removes every entry of the backend (``prefix_hash`` is ignored).

    Implementations are safe to call from several greenlets and threads.
    """

    name: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: RouterConfig, **collaborators: Any) -> KvCacheIndex:
        """Build the index for ``config.kv_cache_index``.

        Collaborators the router passes: ``metrics`` and ``resources`` (see the module
        docstring). ``kv_cache_index`` needs a restart to change, so an index is never
        rebuilt on reload.
        """
        return cls()

    def start(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Start background work (expiry sweeps…) in the worker; default: none."""

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Release resources; default: nothing to release."""

    @abc.abstractmethod
    def apply(self, backend: str, event: str, prefix_hash: str, token_count: int = 0) -> None:
        """Apply one event (one of :data:`KV_EVENT_TYPES`) from ``backend``.

        Raises:
            ValueError: unknown event type.
            StoreError: the index's storage failed (the caller counts and drops the event).
        """

    @abc.abstractmethod
    def query_backends(self, prefix_hash: str) -> Sequence[KvHolding]:
        """Unexpired holders of ``prefix_hash``, most tokens first (ties by name)."""

    def apply_chain(  # noqa: B027 - optional, an index without chains ignores them
        self, backend: str, event: str, entries: Sequence[tuple[str, int]],
        *, ttl: float | None = None,
    ) -> None:
        """Apply one event to chain keys (:mod:`continuum.prefix_chain`) of ``backend``:
        ``entries`` are ``(key hex, token_count)``; the transitions are those of
        :meth:`apply`, and ``cache_cleared`` through :meth:`apply` removes chain entries too.

        ``ttl`` set: an *approximate* entry that the router records when it routes a
        request (``cache_created`` only). It expires ``ttl`` seconds after it was recorded
        and never replaces an entry an engine event confirmed; an event for the same key
        confirms it (``cache_created``) or removes it (``cache_evicted``).

        Default: chain keys are ignored (an index that predates chains).

        Raises:
            ValueError: unknown event type, negative token count, or ``ttl`` with an event
                other than ``cache_created``.
        """

    def apply_event(self, backend: str, event: str, prefix_hash: str, token_count: int = 0,
                    chain: Sequence[tuple[str, Sequence[tuple[str, int]]]] = ()) -> None:
        """One engine event as the KV consumer receives it: its seed key
        (:meth:`apply`), then each ``(event type, entries)`` group of its chain keys
        (:meth:`apply_chain`), in order.

        Default: exactly those calls. An index on a remote store overrides it to write the
        whole event in one round trip, with the same result.

        Raises:
            ValueError: as :meth:`apply` and :meth:`apply_chain`.
            StoreError: the index's storage failed (the caller counts and drops the event).
        """
        self.apply(backend, event, prefix_hash, token_count)
        for kind, entries in chain:
            self.apply_chain(backend, kind, entries)

    def query_chain(self, keys: Sequence[str],
                    prefix_hash: str | None = None) -> Sequence[ChainMatch]:
        """Each backend's longest match of ``keys`` (a chain, shortest prefix first), most
        tokens first (ties by name).

        A backend's match is the longest run of keys from the first that it holds
        unexpired, as an engine's prefix cache can only use a prefix whose every block it
        holds: a backend that lost a middle key matches up to the key before it. With
        ``prefix_hash`` (the seed key), a backend that holds none of ``keys`` but holds that
        prefix is returned with ``depth`` 0 and the seed entry's tokens and tier (engines
        whose prompts the listener cannot recover report only the seed key).

        Default: ``prefix_hash``'s holders at depth 0 (an index that predates chains).
        """
        if prefix_hash is None:
            return ()
        return tuple(ChainMatch(h.backend, 0, h.token_count, h.tier, False, h.updated_at)
                     for h in self.query_backends(prefix_hash))

    @abc.abstractmethod
    def clear(self) -> int:
        """Drop every entry; return how many (prefix, backend) entries were dropped."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """``{"prefix_count", "entry_count", "total_hits", "total_evictions", …}``."""


#: Entry-point group → the interface its plugins must implement.
PLUGIN_GROUPS: dict[str, type] = {
    "continuum.strategies": SelectionStrategy,
    "continuum.scorers": BackendScorer,
    "continuum.cache_stores": CacheStore,
    "continuum.kv_indexes": KvCacheIndex,
}
