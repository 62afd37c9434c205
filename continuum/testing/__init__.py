"""Contract test suites for the plugin interfaces, shipped for plugin authors.

Each suite is a pytest base class holding the test methods every implementation must
pass; a test module subclasses it and says which plugin to test (dogpile.cache style)::

    from continuum.testing import StrategyContract

    class TestMyStrategy(StrategyContract):
        strategy_name = "MyStrategy"

A case that does not apply to the plugin (a hook it does not provide, a behaviour flag it
does not set, or a name in the class's ``unsupported`` mapping) is reported as skipped,
with the reason. The strategy, store and KV index suites are also split into ``*Cases``
mixins, so a test class can include only the cases that apply
(:mod:`continuum.testing.contract`). Real servers for end-to-end tests (a throwaway
``redis-server``, a scriptable upstream, the router under gunicorn) are in
:mod:`continuum.devtools`.

pytest is needed to use this package; it is in the ``test`` extra
(``pip install 'continuum-router[test]'``). Nothing in the router imports it.
"""

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
