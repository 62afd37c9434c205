"""The contract every cache store must meet, as a reusable pytest suite.

A plugin author runs it against their store in a few lines::

    from continuum.testing import CacheStoreContract

    class TestMyStore(CacheStoreContract):
        def make_store(self):
            return MyStore(capacity=100)

Hooks a subclass may override:

* :meth:`~CacheStoreContract.make_store` (required): a new, empty store that shares no
  entries with the stores made before it (a Redis-backed store uses a fresh key prefix).
* :meth:`~CacheStoreContract.advance`: let ``seconds`` pass for the store. The default
  sleeps; an in-memory store with a fake clock moves its clock instead.
* :meth:`~CacheStoreContract.put_foreign` and :meth:`~CacheStoreContract.get_foreign`:
  write and read a key of the same backend that the store does not own (a Redis key
  outside the prefix), to show ``clear`` leaves it alone.
* :meth:`~CacheStoreContract.make_broken_store`: a store whose backing service fails, to
  show that only :class:`~continuum.errors.StoreError` escapes it.

A case whose optional hooks are not overridden is reported as skipped, with the reason.
A test class that wants none skipped builds itself from the mixins instead:
:class:`CacheStoreCases` (what every store must pass) plus :class:`ForeignKeyCases` and
:class:`BrokenStoreCases` where it provides those hooks (:mod:`continuum.testing.contract`).
Stores made through :meth:`~CacheStoreCases.new_store` are closed after each test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import ClassVar

try:
    import pytest
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "continuum.testing needs pytest, which is a test extra: "
        "pip install 'continuum-router[test]'"
    ) from exc

from continuum.errors import StoreError
from continuum.interfaces import CacheStore
from continuum.testing.contract import Contract

#: Values every store must give back byte for byte.
AWKWARD_VALUES: dict[str, bytes] = {
    "empty": b"",
    "nul": b"\x00",
    "nuls-inside": b"a\x00b\x00\x00c",
    "all-bytes": bytes(range(256)),
    "not-utf8": b"\xff\xfe\xc3\x28garbage",
    "one-mib": bytes(range(256)) * 4096,
}

#: Keys every store must keep apart and give back.
AWKWARD_KEYS: tuple[str, ...] = (
    "plain",
    "with space",
    "with:colons:inside",
    "ünïcödé-ключ-鍵",
    "emoji-🎉",
    "glob*?[chars]\\",
    "tab\tand\nnewline",
    "a" * 512,
)

#: A TTL long enough that no test run outlives it.
LONG_TTL = 3600.0


class CacheStoreCases(Contract):
    """The cases every store must pass, and the hooks; implement :meth:`make_store`."""

    #: Seconds :meth:`test_entry_expires_after_its_ttl` lets pass after a ``ttl=1`` set;
    #: a little over one second because Redis rounds TTLs up to whole seconds.
    expiry_wait: ClassVar[float] = 1.1

    _stores: list[CacheStore]

    # -- hooks -----------------------------------------------------------------------

    def make_store(self) -> CacheStore:
        """A new, empty store sharing no entries with earlier ones; override this."""
        raise NotImplementedError("override make_store() to build the store under test")

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the stores of this test (default: sleep)."""
        time.sleep(seconds)

    def put_foreign(self, key: str, value: bytes) -> None:
        """Write ``key`` to the backend outside any store's namespace (optional hook)."""
        raise NotImplementedError

    def get_foreign(self, key: str) -> bytes | None:
        """Read a key written by :meth:`put_foreign` (optional hook)."""
        raise NotImplementedError

    def make_broken_store(self) -> CacheStore:
        """A store whose backing service fails on every command (optional hook)."""
        raise NotImplementedError

    @classmethod
    def skipped_cases(cls) -> dict[str, str]:
        """The optional hooks' cases, when the hooks are not overridden."""
        skipped = super().skipped_cases()
        base = CacheStoreCases
        if cls.put_foreign is base.put_foreign or cls.get_foreign is base.get_foreign:
            skipped.setdefault("test_clear_leaves_foreign_keys_alone",
                               "put_foreign() and get_foreign() are not overridden")
        if cls.make_broken_store is base.make_broken_store:
            skipped.setdefault("test_failing_store_raises_only_store_error",
                               "make_broken_store() is not overridden")
        return skipped

    # -- plumbing --------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _close_contract_stores(self) -> Iterator[None]:
        self._stores = []
        yield
        for store in self._stores:
            store.close()

    def new_store(self, factory: Callable[[], CacheStore] | None = None) -> CacheStore:
        """A store from ``factory`` (default :meth:`make_store`), closed after the test."""
        store = (factory or self.make_store)()
        self._stores.append(store)
        return store

    # -- the contract ----------------------------------------------------------------

    def test_store_implements_the_interface(self) -> None:
        store = self.new_store()
        assert isinstance(store, CacheStore)
        assert store.name, "a store class needs its config name in `name`"

    def test_missing_key_is_none(self) -> None:
        assert self.new_store().get("never-set") is None

    @pytest.mark.parametrize("value", AWKWARD_VALUES.values(), ids=AWKWARD_VALUES.keys())
    def test_value_round_trips_byte_for_byte(self, value: bytes) -> None:
        store = self.new_store()
        store.set("k", value, LONG_TTL)
        got = store.get("k")
        assert type(got) is bytes
        assert got == value

    def test_set_overwrites(self) -> None:
        store = self.new_store()
        store.set("k", b"first", LONG_TTL)
        store.set("k", b"second", LONG_TTL)
        assert store.get("k") == b"second"

    def test_add_stores_only_an_absent_key(self) -> None:
        store = self.new_store()
        assert store.add("lock", b"first", LONG_TTL) is True
        assert store.add("lock", b"second", LONG_TTL) is False
        assert store.get("lock") == b"first"
        store.delete("lock")
        assert store.add("lock", b"third", LONG_TTL) is True

    def test_delete_removes_only_that_key(self) -> None:
        store = self.new_store()
        store.set("gone", b"1", LONG_TTL)
        store.set("kept", b"2", LONG_TTL)
        store.delete("gone")
        store.delete("never-set")  # deleting a missing key is a no-op
        assert store.get("gone") is None
        assert store.get("kept") == b"2"

    def test_entry_expires_after_its_ttl(self) -> None:
        store = self.new_store()
        store.set("short", b"s", 1)
        store.set("long", b"l", LONG_TTL)
        self.advance(self.expiry_wait)
        assert store.get("short") is None
        assert store.get("long") == b"l"

    @pytest.mark.parametrize("ttl", [0, -1.5])
    def test_non_positive_ttl_leaves_nothing_stored(self, ttl: float) -> None:
        store = self.new_store()
        store.set("k", b"old", LONG_TTL)
        store.set("k", b"new", ttl)
        assert store.get("k") is None

    def test_clear_removes_everything_and_counts_it(self) -> None:
        store = self.new_store()
        for i in range(3):
            store.set(f"k{i}", b"v", LONG_TTL)
        assert store.clear() == 3
        assert all(store.get(f"k{i}") is None for i in range(3))
        assert store.clear() == 0

    def test_clear_leaves_other_stores_alone(self) -> None:
        mine, other = self.new_store(), self.new_store()
        mine.set("k", b"mine", LONG_TTL)
        other.set("k", b"other", LONG_TTL)
        other.set("k2", b"other", LONG_TTL)
        assert mine.clear() == 1
        assert mine.get("k") is None
        assert other.get("k") == b"other"
        assert other.get("k2") == b"other"

    def test_stats_count_hits_and_misses(self) -> None:
        store = self.new_store()
        assert store.get("k") is None
        store.set("k", b"v", LONG_TTL)
        assert store.get("k") == b"v"
        assert store.get("k") == b"v"
        stats = store.stats()
        assert stats.backend == store.name
        assert (stats.hits, stats.misses) == (2, 1)

    def test_awkward_keys_are_kept_apart(self) -> None:
        store = self.new_store()
        for i, key in enumerate(AWKWARD_KEYS):
            store.set(key, str(i).encode(), LONG_TTL)
        for i, key in enumerate(AWKWARD_KEYS):
            assert store.get(key) == str(i).encode(), key
        store.delete(AWKWARD_KEYS[0])
        assert store.clear() == len(AWKWARD_KEYS) - 1

    def test_similar_keys_are_distinct(self) -> None:
        store = self.new_store()
        keys = ["a", "A", "a ", " a", "a:", "a*"]
        for key in keys:
            store.set(key, key.encode(), LONG_TTL)
        assert [store.get(key) for key in keys] == [key.encode() for key in keys]

    def test_close_is_idempotent(self) -> None:
        store = self.make_store()
        store.close()
        store.close()


class ForeignKeyCases(CacheStoreCases):
    """For a store that overrides :meth:`~CacheStoreCases.put_foreign` and
    :meth:`~CacheStoreCases.get_foreign`."""

    def test_clear_leaves_foreign_keys_alone(self) -> None:
        store = self.new_store()
        store.set("k", b"mine", LONG_TTL)
        self.put_foreign("foreign:k", b"theirs")
        assert store.clear() == 1
        assert self.get_foreign("foreign:k") == b"theirs"


class BrokenStoreCases(CacheStoreCases):
    """For a store that overrides :meth:`~CacheStoreCases.make_broken_store`."""

    def test_failing_store_raises_only_store_error(self) -> None:
        store = self.new_store(self.make_broken_store)
        operations: list[Callable[[], object]] = [
            lambda: store.set("k", b"v", LONG_TTL),
            lambda: store.get("k"),
            lambda: store.delete("k"),
            store.clear,
        ]
        for operation in operations:
            # Not raising is allowed too: a broken store may degrade to misses and no-ops,
            # or serve from a fallback. Anything but StoreError fails the test.
            try:
                operation()
            except StoreError:
                pass
        assert store.stats().backend == store.name  # stats never fail


class CacheStoreContract(ForeignKeyCases, BrokenStoreCases):
    """The whole contract: subclass as ``Test<Something>`` and implement
    :meth:`~CacheStoreCases.make_store`; the cases of hooks it does not override are
    skipped."""


CacheStoreCases.full_contract = CacheStoreContract
