"""Test support shipped for plugin authors: contract suites and real local servers.

Each contract suite is a pytest base class holding the test methods every implementation
must pass; a test module subclasses it and says which plugin to test (dogpile.cache style)::

    from continuum.testing import StrategyContract

    class TestMyStrategy(StrategyContract):
        strategy_name = "MyStrategy"

A case that does not apply to the plugin (a hook it does not provide, a behaviour flag it
does not set, or a name in the class's ``unsupported`` mapping) is reported as skipped,
with the reason. The strategy, store and KV index suites are also split into ``*Cases``
mixins, so a test class can include only the cases that apply
(:mod:`continuum.testing.contract`).

Servers for end-to-end tests, as child processes on free ports of 127.0.0.1, stopped by
PID: :mod:`continuum.testing.redis_server` (a throwaway ``redis-server``) and
:mod:`continuum.testing.servers` (a scriptable OpenAI-compatible upstream, and the router
under gunicorn).

The contract suites need pytest, which is in the ``test`` extra
(``pip install 'continuum-router[test]'``); the servers do not. Nothing in the router
imports this package. Names are loaded on first use, so that running a server module
(``python -m continuum.testing.fake_upstream``) imports neither pytest nor the suites.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from continuum.testing.kv_index import KvIndexContract
    from continuum.testing.scorers import ScorerContract
    from continuum.testing.stores import CacheStoreContract
    from continuum.testing.strategies import StrategyContract, make_backends, make_context

__all__ = [
    "CacheStoreContract",
    "KvIndexContract",
    "ScorerContract",
    "StrategyContract",
    "make_backends",
    "make_context",
]

_HOMES = {
    "CacheStoreContract": "continuum.testing.stores",
    "KvIndexContract": "continuum.testing.kv_index",
    "ScorerContract": "continuum.testing.scorers",
    "StrategyContract": "continuum.testing.strategies",
    "make_backends": "continuum.testing.strategies",
    "make_context": "continuum.testing.strategies",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
