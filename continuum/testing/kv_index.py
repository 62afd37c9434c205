"""The contract every KV cache index must meet, as a reusable pytest suite.

A plugin author runs it against their index in a few lines::

    from continuum.testing import KvIndexContract

    class TestMyIndex(KvIndexContract):
        def make_index(self, *, storage_offloading=False, treat_eviction_as_offload=True,
                       ttl=600):
            return MyIndex(...)

Hooks a subclass may override:

* :meth:`~KvIndexContract.make_index` (required): a new, empty index with the given
  ``storage_offloading`` settings and entry TTL in seconds, sharing no entries with the
  indexes made before it (a Redis-backed index uses a fresh key prefix).
* :meth:`~KvIndexContract.advance`: let ``seconds`` pass for the indexes of this test. The
  default sleeps; an in-memory index with a fake clock moves its clock instead.
* :attr:`~KvIndexContract.counts_entries`: False when ``stats()`` cannot know
  ``prefix_count``/``entry_count`` (it reports -1 then); the case checking them is then
  reported as skipped, with the reason.

A test class that wants no case skipped builds itself from the mixins instead:
:class:`KvIndexCases` (what every index must pass) plus :class:`EntryCountCases` when it
counts entries (:mod:`continuum.testing.contract`). Indexes made through
:meth:`~KvIndexCases.new_index` are closed after each test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

try:
    import pytest
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "continuum.testing needs pytest, which is a test extra: "
        "pip install 'continuum-router[test]'"
    ) from exc

from continuum.interfaces import (
    CACHE_CLEARED,
    CACHE_CREATED,
    CACHE_EVICTED,
    CACHE_OFFLOADED,
    TIER_GPU_HOT,
    TIER_STORAGE_WARM,
    ChainMatch,
    KvCacheIndex,
    KvHolding,
)
from continuum.testing.contract import Contract

#: Prefix hashes as the router makes them: 64 lowercase hex digits.
P1, P2, P3 = ("a" * 64, "0123456789abcdef" * 4, "f" * 63 + "0")

#: Backend names the config allows (``[A-Za-z0-9_-]``), awkward ones included.
ODD_BACKENDS: tuple[str, ...] = ("vllm-1", "vllm_1", "VLLM-1", "-", "_", "a" * 64, "0")


#: A chain of prefix keys as the router makes them (16 lowercase hex digits each).
CHAIN = tuple(f"{i:016x}" for i in range(0xc0ffee00, 0xc0ffee06))


def matches(found: Sequence[ChainMatch]) -> list[tuple[str, int, int, bool]]:
    """``[(backend, depth, token_count, approximate)]`` in the order given."""
    return [(m.backend, m.depth, m.token_count, m.approximate) for m in found]


def summary(holdings: Sequence[KvHolding]) -> list[tuple[str, int, str]]:
    """``[(backend, token_count, tier)]`` in the order given."""
    return [(h.backend, h.token_count, h.tier) for h in holdings]


class KvIndexCases(Contract):
    """The cases every index must pass, and the hooks; implement :meth:`make_index`."""

    #: Entry TTL of the expiry case, and the seconds it lets pass (Redis TTLs are whole
    #: seconds, so a little over one).
    expiry_ttl: ClassVar[int] = 1
    expiry_wait: ClassVar[float] = 1.1
    #: Whether ``stats()`` reports real ``prefix_count``/``entry_count``.
    counts_entries: ClassVar[bool] = True

    _indexes: list[KvCacheIndex]

    # -- hooks -----------------------------------------------------------------------

    def make_index(self, *, storage_offloading: bool = False,
                   treat_eviction_as_offload: bool = True, ttl: int = 600) -> KvCacheIndex:
        """A new, empty index sharing no entries with earlier ones; override this."""
        raise NotImplementedError("override make_index() to build the index under test")

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the indexes of this test (default: sleep)."""
        time.sleep(seconds)

    @classmethod
    def skipped_cases(cls) -> dict[str, str]:
        """The entry-count case, when the index does not count entries."""
        skipped = super().skipped_cases()
        if not cls.counts_entries:
            skipped.setdefault("test_stats_count_prefixes_and_entries",
                               "counts_entries is False: stats() reports no counts")
        return skipped

    # -- plumbing --------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _close_contract_indexes(self) -> Iterator[None]:
        self._indexes = []
        yield
        for index in self._indexes:
            index.close()

    def new_index(self, **settings: Any) -> KvCacheIndex:
        """An index from :meth:`make_index` with ``settings``, closed after the test."""
        index = self.make_index(**settings)
        self._indexes.append(index)
        return index

    def offloading(self, treat_eviction_as_offload: bool = True) -> KvCacheIndex:
        """An index with storage offloading on."""
        return self.new_index(storage_offloading=True,
                              treat_eviction_as_offload=treat_eviction_as_offload)

    # -- the contract ----------------------------------------------------------------

    def test_index_implements_the_interface(self) -> None:
        index = self.new_index()
        assert isinstance(index, KvCacheIndex)
        assert index.name, "an index class needs its config name in `name`"

    def test_unknown_prefix_has_no_holders(self) -> None:
        index = self.new_index()
        assert len(index.query_backends(P1)) == 0
        index.apply("b", CACHE_CREATED, P2, 10)
        assert list(index.query_backends(P1)) == []

    def test_holders_most_tokens_first_ties_by_name(self) -> None:
        index = self.new_index()
        for backend, tokens in [("c", 512), ("b", 2048), ("a", 512), ("d", 1024)]:
            index.apply(backend, CACHE_CREATED, P1, tokens)
        holdings = index.query_backends(P1)
        assert summary(holdings) == [("b", 2048, TIER_GPU_HOT), ("d", 1024, TIER_GPU_HOT),
                                     ("a", 512, TIER_GPU_HOT), ("c", 512, TIER_GPU_HOT)]
        assert all(isinstance(h, KvHolding) and h.updated_at >= 0 for h in holdings)

    def test_created_again_updates_the_token_count(self) -> None:
        index = self.new_index()
        index.apply("a", CACHE_CREATED, P1, 100)
        index.apply("b", CACHE_CREATED, P1, 200)
        index.apply("a", CACHE_CREATED, P1, 300)
        assert summary(index.query_backends(P1)) == [("a", 300, TIER_GPU_HOT),
                                                     ("b", 200, TIER_GPU_HOT)]
        index.apply("a", CACHE_CREATED, P1, 50)  # counts go down too
        assert [h.backend for h in index.query_backends(P1)] == ["b", "a"]

    def test_an_event_without_token_count_keeps_the_known_count(self) -> None:
        index = self.new_index()
        index.apply("a", CACHE_CREATED, P1, 700)
        index.apply("a", CACHE_CREATED, P1)
        index.apply("b", CACHE_CREATED, P1)
        assert summary(index.query_backends(P1)) == [("a", 700, TIER_GPU_HOT),
                                                     ("b", 0, TIER_GPU_HOT)]

    def test_without_offloading_evicted_and_offloaded_remove(self) -> None:
        index = self.new_index()
        for backend in "abc":
            index.apply(backend, CACHE_CREATED, P1, 100)
        index.apply("a", CACHE_EVICTED, P1)
        index.apply("b", CACHE_OFFLOADED, P1, 100)
        index.apply("z", CACHE_EVICTED, P1)  # never held: a no-op
        index.apply("z", CACHE_OFFLOADED, P2, 100)
        assert summary(index.query_backends(P1)) == [("c", 100, TIER_GPU_HOT)]
        assert list(index.query_backends(P2)) == []
        index.apply("c", CACHE_EVICTED, P1)
        assert list(index.query_backends(P1)) == []

    def test_offloading_created_is_gpu_hot_and_offloaded_is_storage_warm(self) -> None:
        index = self.offloading()
        index.apply("a", CACHE_CREATED, P1, 100)
        index.apply("b", CACHE_CREATED, P1, 200)
        index.apply("b", CACHE_OFFLOADED, P1)
        assert summary(index.query_backends(P1)) == [("b", 200, TIER_STORAGE_WARM),
                                                     ("a", 100, TIER_GPU_HOT)]
        index.apply("b", CACHE_CREATED, P1)  # loaded back onto the GPU
        assert index.query_backends(P1)[0].tier == TIER_GPU_HOT

    def test_offloaded_of_an_unknown_entry_adds_it_warm(self) -> None:
        index = self.offloading()
        index.apply("a", CACHE_OFFLOADED, P1, 300)
        assert summary(index.query_backends(P1)) == [("a", 300, TIER_STORAGE_WARM)]

    def test_eviction_as_offload_demotes_gpu_hot_then_removes_storage_warm(self) -> None:
        index = self.offloading(treat_eviction_as_offload=True)
        index.apply("a", CACHE_CREATED, P1, 100)
        index.apply("b", CACHE_CREATED, P1, 50)
        index.apply("a", CACHE_EVICTED, P1)
        assert summary(index.query_backends(P1)) == [("a", 100, TIER_STORAGE_WARM),
                                                     ("b", 50, TIER_GPU_HOT)]
        index.apply("a", CACHE_EVICTED, P1)  # evicted from storage too
        assert summary(index.query_backends(P1)) == [("b", 50, TIER_GPU_HOT)]
        index.apply("b", CACHE_OFFLOADED, P1)
        index.apply("b", CACHE_EVICTED, P1)
        index.apply("z", CACHE_EVICTED, P1)  # never held: nothing appears
        assert list(index.query_backends(P1)) == []

    def test_eviction_not_as_offload_removes(self) -> None:
        index = self.offloading(treat_eviction_as_offload=False)
        index.apply("a", CACHE_CREATED, P1, 100)
        index.apply("b", CACHE_CREATED, P1, 50)
        index.apply("b", CACHE_OFFLOADED, P1)
        index.apply("a", CACHE_EVICTED, P1)
        assert summary(index.query_backends(P1)) == [("b", 50, TIER_STORAGE_WARM)]
        index.apply("b", CACHE_EVICTED, P1)
        assert list(index.query_backends(P1)) == []

    @pytest.mark.parametrize("storage_offloading", [False, True])
    def test_cache_cleared_removes_only_that_backends_entries(
            self, storage_offloading: bool) -> None:
        index = self.new_index(storage_offloading=storage_offloading)
        for prefix in (P1, P2, P3):
            index.apply("gone", CACHE_CREATED, prefix, 100)
            index.apply("kept", CACHE_CREATED, prefix, 50)
        index.apply("gone", CACHE_OFFLOADED, P2)
        index.apply("gone", CACHE_CLEARED, "")  # the prefix hash is ignored
        for prefix in (P1, P2, P3):
            assert summary(index.query_backends(prefix)) == [("kept", 50, TIER_GPU_HOT)]
        index.apply("gone", CACHE_CLEARED, P1)  # nothing left to clear: a no-op
        index.apply("gone", CACHE_CREATED, P1, 10)  # and it can hold entries again
        assert [h.backend for h in index.query_backends(P1)] == ["kept", "gone"]

    def test_unknown_event_is_a_value_error_and_changes_nothing(self) -> None:
        index = self.new_index()
        index.apply("a", CACHE_CREATED, P1, 100)
        for event in ("cache_exploded", "", "CACHE_CREATED", "created"):
            with pytest.raises(ValueError, match="event"):
                index.apply("a", event, P1, 1)
        with pytest.raises(ValueError, match="token_count"):
            index.apply("a", CACHE_CREATED, P1, -1)
        assert summary(index.query_backends(P1)) == [("a", 100, TIER_GPU_HOT)]

    def test_entries_expire_after_their_ttl(self) -> None:
        index = self.new_index(ttl=self.expiry_ttl)
        index.apply("a", CACHE_CREATED, P1, 100)
        index.apply("b", CACHE_CREATED, P1, 200)
        index.apply("a", CACHE_CREATED, P2, 100)
        assert len(index.query_backends(P1)) == 2
        self.advance(self.expiry_wait)
        assert list(index.query_backends(P1)) == []
        assert list(index.query_backends(P2)) == []
        index.apply("a", CACHE_EVICTED, P1)  # an event for an expired entry is harmless
        index.apply("a", CACHE_CREATED, P1)  # and a new one starts from scratch
        assert summary(index.query_backends(P1)) == [("a", 0, TIER_GPU_HOT)]

    def test_clear_removes_everything_and_counts_entries(self) -> None:
        index, other = self.new_index(), self.new_index()
        for backend in ("a", "b"):
            for prefix in (P1, P2):
                index.apply(backend, CACHE_CREATED, prefix, 10)
        index.apply("c", CACHE_CREATED, P3, 10)
        other.apply("a", CACHE_CREATED, P1, 99)
        assert index.clear() == 5
        assert all(list(index.query_backends(p)) == [] for p in (P1, P2, P3))
        assert index.clear() == 0
        assert summary(other.query_backends(P1)) == [("a", 99, TIER_GPU_HOT)]
        index.apply("a", CACHE_CREATED, P1, 1)  # usable after a clear
        assert len(index.query_backends(P1)) == 1

    def test_stats_keys_and_hits(self) -> None:
        index = self.new_index()
        index.apply("a", CACHE_CREATED, P1, 10)
        index.query_backends(P1)
        index.query_backends(P1)
        index.query_backends(P2)  # a miss is not a hit
        stats = index.stats()
        assert {"prefix_count", "entry_count", "total_hits", "total_evictions"} <= set(stats)
        assert stats["total_hits"] == 2
        assert stats["total_evictions"] == 0

    def test_many_backends_and_prefixes(self) -> None:
        index = self.new_index()
        prefixes = [f"{i:064x}" for i in range(40)]
        backends = [f"backend-{j:02d}" for j in range(16)]
        for i, prefix in enumerate(prefixes):
            for j, backend in enumerate(backends):
                index.apply(backend, CACHE_CREATED, prefix, 16 * ((i + j) % 5))
        for i, prefix in enumerate(prefixes):
            got = [(h.backend, h.token_count) for h in index.query_backends(prefix)]
            expected = sorted(((b, 16 * ((i + j) % 5)) for j, b in enumerate(backends)),
                              key=lambda bt: (-bt[1], bt[0]))
            assert got == expected
        assert index.clear() == len(prefixes) * len(backends)

    def test_odd_backend_names_and_hex_prefixes_are_kept_apart(self) -> None:
        index = self.new_index(storage_offloading=True)
        for n, backend in enumerate(ODD_BACKENDS):
            index.apply(backend, CACHE_CREATED, P1, 100 + n)
            index.apply(backend, CACHE_CREATED, P2, 200 - n)
        assert [h.backend for h in index.query_backends(P1)] == list(reversed(ODD_BACKENDS))
        assert [h.backend for h in index.query_backends(P2)] == list(ODD_BACKENDS)
        index.apply("vllm-1", CACHE_CLEARED, "")
        index.apply("vllm_1", CACHE_OFFLOADED, P1)
        holders = {h.backend: h.tier for h in index.query_backends(P1)}
        assert "vllm-1" not in holders
        assert holders["vllm_1"] == TIER_STORAGE_WARM
        assert holders["VLLM-1"] == TIER_GPU_HOT
        assert len(holders) == len(ODD_BACKENDS) - 1

    # -- chains of prefix keys -------------------------------------------------------

    def hold_chain(self, index: KvCacheIndex, backend: str, depth: int,
                   tokens_per_key: int = 64, **options: Any) -> None:
        """``backend`` holds the first ``depth`` keys of :data:`CHAIN`."""
        index.apply_chain(backend, CACHE_CREATED,
                          [(key, tokens_per_key * (i + 1)) for i, key in
                           enumerate(CHAIN[:depth])], **options)

    def test_chain_longest_match_per_backend(self) -> None:
        index = self.new_index()
        assert list(index.query_chain(CHAIN)) == []
        self.hold_chain(index, "a", 3)
        self.hold_chain(index, "b", 5)
        self.hold_chain(index, "c", 1)
        assert matches(index.query_chain(CHAIN)) == [
            ("b", 5, 320, False), ("a", 3, 192, False), ("c", 1, 64, False)]
        # a request that shares only the first two keys matches two at most
        other = (*CHAIN[:2], "f" * 16, *CHAIN[3:])
        assert matches(index.query_chain(other)) == [
            ("a", 2, 128, False), ("b", 2, 128, False), ("c", 1, 64, False)]
        # a chain that starts elsewhere matches nothing, whatever keys follow
        assert list(index.query_chain(("e" * 16, *CHAIN[1:]))) == []

    def test_chain_eviction_of_a_middle_key_cuts_the_match_there(self) -> None:
        index = self.new_index()
        self.hold_chain(index, "a", 5)
        self.hold_chain(index, "b", 5)
        index.apply_chain("a", CACHE_EVICTED, [(CHAIN[2], 0)])
        assert matches(index.query_chain(CHAIN)) == [
            ("b", 5, 320, False), ("a", 2, 128, False)]
        index.apply_chain("a", CACHE_CREATED, [(CHAIN[2], 192)])  # stored again
        assert matches(index.query_chain(CHAIN)) == [
            ("a", 5, 320, False), ("b", 5, 320, False)]

    def test_chain_approximate_entries_expire_after_their_own_ttl(self) -> None:
        index = self.new_index()
        self.hold_chain(index, "a", 4, ttl=self.expiry_ttl)
        self.hold_chain(index, "b", 2)
        assert matches(index.query_chain(CHAIN)) == [
            ("a", 4, 256, True), ("b", 2, 128, False)]
        self.advance(self.expiry_wait)
        assert matches(index.query_chain(CHAIN)) == [("b", 2, 128, False)]

    def test_chain_events_confirm_and_evict_approximate_entries(self) -> None:
        index = self.new_index()
        self.hold_chain(index, "a", 3, tokens_per_key=10, ttl=600)
        index.apply_chain("a", CACHE_CREATED, [(CHAIN[0], 70), (CHAIN[1], 140)])
        index.apply_chain("a", CACHE_EVICTED, [(CHAIN[2], 0)])
        assert matches(index.query_chain(CHAIN)) == [("a", 2, 140, False)]
        # a later routed request never turns a confirmed entry back into a guess
        self.hold_chain(index, "a", 3, tokens_per_key=10, ttl=600)
        assert matches(index.query_chain(CHAIN)) == [("a", 3, 30, True)]
        assert matches(index.query_chain(CHAIN[:2])) == [("a", 2, 140, False)]

    def test_chain_cache_cleared_and_clear_remove_chain_entries(self) -> None:
        index = self.new_index()
        self.hold_chain(index, "a", 3)
        self.hold_chain(index, "b", 2, ttl=600)
        index.apply("a", CACHE_CLEARED, "")
        assert matches(index.query_chain(CHAIN)) == [("b", 2, 128, True)]
        assert index.clear() == 2
        assert list(index.query_chain(CHAIN)) == []

    def test_chain_seed_only_holders_match_at_depth_zero(self) -> None:
        index = self.new_index()
        index.apply("a", CACHE_CREATED, P1, 500)
        index.apply("b", CACHE_CREATED, P1, 900)
        self.hold_chain(index, "b", 2)
        assert matches(index.query_chain(CHAIN, P1)) == [
            ("a", 0, 500, False), ("b", 2, 128, False)]
        assert matches(index.query_chain(CHAIN)) == [("b", 2, 128, False)]

    def test_apply_event_is_apply_then_apply_chain(self) -> None:
        """What the KV consumer calls: an event with its chain groups, whole, against the
        same event as separate calls."""
        for offloading in (False, True):
            whole, parts = (self.new_index(storage_offloading=offloading) for _ in range(2))
            approximate = [("b", CACHE_CREATED, [(CHAIN[0], 64), (CHAIN[1], 128)])]
            for index in (whole, parts):  # a routed request's record, confirmed below
                for backend, event, entries in approximate:
                    index.apply_chain(backend, event, entries, ttl=600)
            Groups = list[tuple[str, list[tuple[str, int]]]]
            events: list[tuple[str, str, str, int, Groups]] = [
                ("a", CACHE_CREATED, P1, 300,
                 [(CACHE_CREATED, [(CHAIN[0], 64), (CHAIN[1], 128), (CHAIN[2], 192)])]),
                ("b", CACHE_CREATED, P1, 200, [(CACHE_CREATED, [(CHAIN[0], 64)])]),
                ("c", CACHE_CREATED, P2, 0, []),
                ("a", CACHE_EVICTED, P1, 0,
                 [(CACHE_EVICTED, [(CHAIN[2], 0)]), (CACHE_CREATED, [(CHAIN[3], 256)])]),
                ("b", CACHE_OFFLOADED, P1, 0, [(CACHE_OFFLOADED, [(CHAIN[0], 0)])]),
                ("c", CACHE_CLEARED, "", 0, []),
                ("c", CACHE_CREATED, P3, 50, [(CACHE_CREATED, [])]),
            ]
            for backend, event, prefix, tokens, chain in events:
                whole.apply_event(backend, event, prefix, tokens, chain)
                parts.apply(backend, event, prefix, tokens)
                for kind, entries in chain:
                    parts.apply_chain(backend, kind, entries)
                for prefix_hash in (P1, P2, P3):
                    assert summary(whole.query_backends(prefix_hash)) == summary(
                        parts.query_backends(prefix_hash)), (offloading, event, prefix_hash)
                for keys in (CHAIN, CHAIN[:2]):
                    assert matches(whole.query_chain(keys, P1)) == matches(
                        parts.query_chain(keys, P1)), (offloading, event, keys)
            assert whole.stats()["events"] == parts.stats()["events"]
            assert summary(whole.query_backends(P1)) == (
                [("a", 300, TIER_STORAGE_WARM), ("b", 200, TIER_STORAGE_WARM)] if offloading
                else [])
            assert summary(whole.query_backends(P3)) == [("c", 50, TIER_GPU_HOT)]

    def test_chain_bad_input_is_a_value_error_and_changes_nothing(self) -> None:
        index = self.new_index()
        self.hold_chain(index, "a", 2)
        with pytest.raises(ValueError, match="event"):
            index.apply_chain("a", "cache_exploded", [(CHAIN[0], 1)])
        with pytest.raises(ValueError, match="token_count"):
            index.apply_chain("a", CACHE_CREATED, [(CHAIN[2], 5), (CHAIN[3], -1)])
        with pytest.raises(ValueError, match="approximate"):
            index.apply_chain("a", CACHE_EVICTED, [(CHAIN[0], 1)], ttl=10)
        assert matches(index.query_chain(CHAIN)) == [("a", 2, 128, False)]

    def test_start_and_close_are_idempotent(self) -> None:
        index = self.make_index()
        index.start()
        index.start()
        index.apply("a", CACHE_CREATED, P1, 1)
        index.close()
        index.close()


class EntryCountCases(KvIndexCases):
    """For an index whose ``stats()`` counts prefixes and entries
    (:attr:`~KvIndexCases.counts_entries`)."""

    def test_stats_count_prefixes_and_entries(self) -> None:
        index = self.new_index()
        for backend in ("a", "b", "c"):
            index.apply(backend, CACHE_CREATED, P1, 10)
        index.apply("a", CACHE_CREATED, P2, 10)
        index.apply("b", CACHE_EVICTED, P1)
        stats = index.stats()
        assert (stats["prefix_count"], stats["entry_count"]) == (2, 3)
        index.apply("a", CACHE_CLEARED, "")
        stats = index.stats()
        assert (stats["prefix_count"], stats["entry_count"]) == (1, 1)


class KvIndexContract(EntryCountCases):
    """The whole contract: subclass as ``Test<Something>`` and implement
    :meth:`~KvIndexCases.make_index`; the cases of capabilities it lacks are skipped."""


class StartedIndexCases(KvIndexCases):
    """Put before a contract class (``class TestStarted(StartedIndexCases, TestMine)``) to
    run its cases on started indexes, as in a worker, for an index whose background work
    (a writer greenlet) must still answer as if every write were done at once."""

    def make_index(self, *, storage_offloading: bool = False,
                   treat_eviction_as_offload: bool = True, ttl: int = 600) -> KvCacheIndex:
        index = super().make_index(storage_offloading=storage_offloading,
                                   treat_eviction_as_offload=treat_eviction_as_offload, ttl=ttl)
        index.start()
        return index


KvIndexCases.full_contract = KvIndexContract
