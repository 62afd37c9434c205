"""Comparing a router's KV index with what a KV listener says a backend holds, and the
config of a router whose index those listeners feed."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stores.kv_memory import InMemoryKvIndex

if TYPE_CHECKING:
    from tests.integration.conftest import EventStreams

Snapshot = Callable[[], dict[str, int]]


def kv_router_config(ups: list[Any], streams: EventStreams, sections: dict[str, Any] | None = None,
                     **kv: Any) -> dict[str, Any]:
    """A router over ``ups`` with prefix routing and a KV index fed by ``streams``: the
    seed-literal index (``match: seed``, no approximate entries) unless ``kv`` says
    otherwise, so that the tests pin the seed's scoring; ``sections`` adds top-level
    sections (a strategy, the fleet's lease)."""
    kv = {"match": "seed", "approximate": {"enabled": False}, **kv}
    return {
        "backends": [{"name": u.name, "url": u.url, "models": ["m"]} for u in ups],
        "prefix_routing": {"enabled": True},
        "health_check": {"interval_seconds": 30},
        "kv_cache_index": {"enabled": True, "event_sources": [
            {"backend_name": u.name, "endpoint": streams.url(u.name),
             "reconnect_interval_ms": 100} for u in ups], **kv},
        **(sections or {}),
    }


def index_view(index: InMemoryKvIndex, prefixes: dict[str, int],
               backend: str = "vllm-1") -> dict[str, int]:
    """What ``index`` holds of ``prefixes`` on ``backend``: prefix → token_count."""
    return {prefix_hash: holding.token_count for prefix_hash in prefixes
            for holding in index.query_backends(prefix_hash) if holding.backend == backend}


def holds_exactly(index: InMemoryKvIndex, prefixes: dict[str, int],
                  backend: str = "vllm-1") -> bool:
    """``index`` holds ``prefixes`` on ``backend``, with their token counts, and nothing else."""
    return index_view(index, prefixes, backend) == prefixes and len(index) == len(prefixes)


class SettledMatch:
    """A ``wait_until`` condition: the listener's state has stopped changing (``settle``
    equal snapshots in a row) and the index holds exactly that state.

    A single snapshot taken once can be stale: a listener attributes replayed chains one
    ``/detokenize`` at a time and late events of earlier chats still arrive, so the index
    would then rightly hold more than it. :meth:`describe` says how they differ (for the
    timeout message); :attr:`state` is the last snapshot read.
    """

    def __init__(self, index: InMemoryKvIndex, snapshot: Snapshot, *, settle: int = 3,
                 backend: str = "vllm-1") -> None:
        self.index = index
        self.snapshot = snapshot
        self.settle = settle
        self.backend = backend
        self.state: dict[str, int] = {}
        self._seen: deque[dict[str, int]] = deque(maxlen=settle)

    def _settled(self) -> bool:
        return len(self._seen) == self.settle and all(s == self.state for s in self._seen)

    def __call__(self) -> bool:
        self.state = self.snapshot()
        self._seen.append(self.state)
        return self._settled() and holds_exactly(self.index, self.state, self.backend)

    def describe(self) -> str:
        held = index_view(self.index, self.state, self.backend)
        missing = sorted(set(self.state) - set(held))
        wrong = sorted(h for h in held if held[h] != self.state[h])
        return (f"the index to hold exactly the listener's settled state (listener: "
                f"{len(self.state)} prefixes, "
                f"{'settled' if self._settled() else 'still changing'}; "
                f"index: {len(self.index)} prefixes, missing {len(missing)} {missing[:3]}, "
                f"wrong token counts {wrong[:3]})")
