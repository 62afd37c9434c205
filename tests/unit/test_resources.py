"""WorkerResources: shared per-worker resources, created once per key, closed by the last user."""

from __future__ import annotations

import pytest

from continuum.resources import WorkerResources


class Connection:
    """A resource that records what was done to it."""

    made = 0

    def __init__(self, name: str, *, fail_close: bool = False) -> None:
        Connection.made += 1
        self.name = name
        self.starts = 0
        self.closes = 0
        self.fail_close = fail_close

    def start(self) -> None:
        self.starts += 1

    def close(self) -> None:
        self.closes += 1
        if self.fail_close:
            raise OSError(f"{self.name}: close failed")


def test_one_resource_per_key_shared_by_every_user() -> None:
    resources = WorkerResources()
    first = resources.acquire(("db", "a"), lambda: Connection("a"))
    second = resources.acquire(("db", "a"), lambda: Connection("a again"))
    other = resources.acquire(("db", "b"), lambda: Connection("b"))
    assert second.resource is first.resource
    assert first.resource.name == "a"
    assert other.resource is not first.resource
    assert resources.users(("db", "a")) == 2
    assert resources.users(("db", "b")) == 1
    assert len(resources) == 2


def test_the_last_release_closes_and_a_double_release_counts_once() -> None:
    resources = WorkerResources()
    index = resources.acquire("k", lambda: Connection("shared"))
    store = resources.acquire("k", lambda: Connection("unused"))
    store.release()
    store.release()  # a store closed twice must not drop the index's hold
    assert resources.users("k") == 1
    assert index.resource.closes == 0
    index.release()
    assert index.resource.closes == 1
    assert resources.users("k") == 0
    assert len(resources) == 0
    fresh = resources.acquire("k", lambda: Connection("new"))
    assert fresh.resource is not index.resource  # a closed resource is never handed out


def test_start_starts_held_and_later_resources_once() -> None:
    resources = WorkerResources()
    early = resources.acquire("early", lambda: Connection("early"))
    assert early.resource.starts == 0  # not before the worker starts
    resources.start()
    assert early.resource.starts == 1
    late = resources.acquire("late", lambda: Connection("late"))  # e.g. built on reload
    assert late.resource.starts == 1
    again = resources.acquire("late", lambda: Connection("unused"))
    assert again.resource.starts == 1


def test_close_closes_everything_left_even_when_one_close_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resources = WorkerResources()
    broken = resources.acquire("broken", lambda: Connection("broken", fail_close=True))
    kept = resources.acquire("kept", lambda: Connection("kept"))
    resources.close()
    assert broken.resource.closes == 1
    assert kept.resource.closes == 1
    assert "closing a shared worker resource failed" in caplog.text
    assert len(resources) == 0
    kept.release()  # a plugin closed after the worker's resources: nothing left to close
    assert kept.resource.closes == 1


def test_factory_runs_only_for_a_new_key() -> None:
    resources = WorkerResources()
    before = Connection.made
    for _ in range(3):
        resources.acquire("once", lambda: Connection("once"))
    assert Connection.made == before + 1
