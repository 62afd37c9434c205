"""Request parsing, backend statistics, health transitions and the selection pipeline."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from continuum.config import BackendConfig, HealthCheckConfig
from continuum.errors import NoHealthyBackendError, RequestError
from continuum.interfaces import BackendScorer, SelectionStrategy
from continuum.request import CHAT, EMBEDDINGS, RequestContext, parse_request
from continuum.routing.backends import WAIT_SAMPLES, Backend, BackendPool
from continuum.routing.health import HealthMonitor, HealthTracker
from continuum.routing.selection import SelectionPipeline
from continuum.testing import make_backends, make_context


def _raw(**body: object) -> bytes:
    return json.dumps(body).encode()


def test_parse_request_reads_fields_once() -> None:
    ctx = parse_request(_raw(model="m", messages=[{"role": "user", "content": "x"}],
                             stream=True, temperature=0, top_p=0.5, max_tokens=7), CHAT,
                        tenant="t1")
    assert (ctx.model, ctx.stream, ctx.temperature, ctx.top_p, ctx.max_tokens, ctx.tenant) == (
        "m", True, 0.0, 0.5, 7, "t1")
    assert len(ctx.request_id) == 32 and ctx.prefix_hash is None


@pytest.mark.parametrize(("raw", "message"), [
    (b"{nope", "not valid JSON"),
    (b"[1]", "JSON object"),
    (_raw(messages=[]), "'model' is required"),
    (_raw(model=3), "'model' is required"),
    (_raw(model="m", messages=[{"role": "user", "content": "x"}], stream="yes"), "'stream'"),
    (_raw(model="m", messages=[{"role": "user", "content": "x"}], temperature="hot"),
     "'temperature' must be a number"),
    (_raw(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1.5),
     "'max_tokens'"),
    (_raw(model="m"), "'messages' is required"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_parse_request_rejects(raw: bytes, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse_request(raw, CHAT)
    assert err.value.status == 400


def test_embeddings_need_no_messages() -> None:
    assert parse_request(_raw(model="e", input="x"), EMBEDDINGS).model == "e"


def test_success_rate_window_and_latency_ewma() -> None:
    (b,) = make_backends(1)
    b2 = Backend(b.config, ewma_alpha=0.5, success_window=4)
    assert b2.success_rate == 1.0 and b2.latency_ewma is None
    for ok in (True, False, False, True, True, True):
        b2.record(ok, 1.0 if ok else None)
    assert b2.success_rate == 3 / 4  # window holds F, T, T, T
    b2.record(True, 3.0)
    assert b2.latency_ewma == 2.0


def test_the_wait_for_a_first_token_is_learned_by_in_flight_count() -> None:
    (b,) = make_backends(1)
    b2 = Backend(b.config, ewma_alpha=0.5)
    b2.in_flight = 3
    assert b2.queue_wait() == 0.0  # nothing learned
    # two slots: sent at 0 or 1 in flight, 30 ms to the first token; at 2, 130 ms
    for _ in range(WAIT_SAMPLES - 1):
        b2.first_piece(0, 0.03)
        b2.first_piece(1, 0.03)
        b2.first_piece(2, 0.13)
    assert b2.queue_wait() == 0.0  # one sample short at every count
    b2.first_piece(0, 0.03)
    b2.first_piece(2, 0.13)
    # 3 in flight: nothing learned at 3, never less than at 2
    assert b2.queue_wait() == pytest.approx(0.1)
    b2.in_flight = 1
    assert b2.queue_wait() == 0.0  # 1 is one sample short: as at 0
    b2.first_piece(1, 0.5)  # its fifth sample, slow: 265 ms, and counts above wait as long
    assert b2.queue_wait() == pytest.approx(0.235)
    b2.in_flight = 2
    assert b2.queue_wait() == pytest.approx(0.235)
    b2.in_flight = 200  # beyond the counts learned: as at the last one
    assert b2.queue_wait() == pytest.approx(0.235)


def test_pool_candidates_models_and_wildcard() -> None:
    cfgs = [BackendConfig(name="a", url="http://h:1", models=("m",)),
            BackendConfig(name="b", url="http://h:2"),
            BackendConfig(name="c", url="http://h:3", models=("m",), enabled=False),
            BackendConfig(name="d", url="http://h:4", models=("m", "x"), internal=True)]
    pool = BackendPool(Backend(c) for c in cfgs)
    assert [b.name for b in pool.candidates("m")] == ["a", "b"]  # b: not yet discovered
    pool.get("b").discovered_models = frozenset({"z"})  # type: ignore[union-attr]
    assert [b.name for b in pool.candidates("m")] == ["a"]
    assert pool.model_ids() == ["m", "z"]
    pool.get("a").healthy = False  # type: ignore[union-attr]
    assert pool.candidates("m") == [] and [b.name for b in pool.serving("m")] == ["a"]


def test_health_tracker_transition_table() -> None:
    (b,) = make_backends(1)
    t = HealthTracker(b, unhealthy_threshold=2, healthy_threshold=3)
    assert [t.observe(x) for x in (False, True, False, False)] == [None, None, None, False]
    assert b.healthy is False
    assert [t.observe(x) for x in (True, True, False, True, True, True)] == [
        None, None, None, None, None, True]
    assert b.healthy is True


def test_passive_failures_feed_the_monitor() -> None:
    backends = make_backends(2)
    monitor = HealthMonitor(BackendPool(backends), HealthCheckConfig(unhealthy_threshold=2))
    monitor.observe(backends[0], False)
    monitor.observe(backends[0], False)
    assert backends[0].healthy is False and backends[1].healthy is True
    monitor.stop()


class _Fixed(SelectionStrategy):
    name = "Fixed"

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        return candidates[-1]


class _Scores(BackendScorer):
    name = "Scores"

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores
        self.prepared = 0
        self.observed: list[tuple[str | None, float, str]] = []

    def prepare(self, ctx: RequestContext, candidates: Sequence[Backend]) -> None:
        self.prepared += 1

    def score(self, backend: Backend, ctx: RequestContext) -> float:
        return self.scores.get(backend.name, 0.0)

    def score_with_tier(self, backend: Backend, ctx: RequestContext) -> tuple[float, str]:
        return self.score(backend, ctx), "gpu_hot"

    def observe(self, ctx: RequestContext, chosen: Backend | None, score: float,
                tier: str) -> None:
        self.observed.append((chosen.name if chosen else None, score, tier))


def test_pipeline_threshold_is_strict() -> None:
    backends = make_backends(3)
    ctx = make_context(prefix=b"k")
    at_scorer = _Scores({"b0": 0.3})
    at = SelectionPipeline(_Fixed(), [at_scorer])
    assert at.select(backends, ctx).name == "b2"  # 0.3 is not > 0.3
    assert at_scorer.observed == [(None, 0.0, "none")]  # told the strategy decided
    above_scorer = _Scores({"b0": 0.31, "b1": 0.2})
    above = SelectionPipeline(_Fixed(), [above_scorer])
    ctx2 = make_context(prefix=b"k")
    assert above.select(backends, ctx2).name == "b0"
    assert above_scorer.observed == [("b0", 0.31, "gpu_hot")]


def test_pipeline_skips_scorers_without_prefix_and_rejects_empty() -> None:
    scorer = _Scores({"b0": 0.9})
    pipeline = SelectionPipeline(_Fixed(), [scorer])
    assert pipeline.select(make_backends(3), make_context()).name == "b2"
    assert scorer.prepared == 0
    with pytest.raises(NoHealthyBackendError):
        pipeline.select([], make_context())


class _ProbeSession:
    """Answers probes after ``delay`` seconds (a gevent sleep): 200 for the URLs in ``up``,
    a connection error for the rest."""

    def __init__(self, up: set[str], delay: float) -> None:
        self.up, self.delay, self.calls = up, delay, 0

    def get(self, url: str, **_: object) -> object:
        import gevent
        import requests

        self.calls += 1
        gevent.sleep(self.delay)
        if not any(url.startswith(u) for u in self.up):
            raise requests.ConnectionError("refused")
        return type("R", (), {"status_code": 200})()

    def close(self) -> None:
        pass


def test_a_started_monitor_trusts_no_backend_before_its_first_probe() -> None:
    cfgs = [BackendConfig(name=n, url=f"http://{n}:1", models=("m",)) for n in "ab"]
    pool = BackendPool(Backend(c) for c in cfgs)
    a, b = pool
    session = _ProbeSession({"http://a:1"}, delay=0.05)
    monitor = HealthMonitor(pool, HealthCheckConfig(interval_seconds=60, timeout_ms=1000),
                            session_factory=lambda: session)  # type: ignore[arg-type,return-value]
    # Not started (no probe is coming): nothing to wait for, the backends stay trusted.
    monitor.await_first_results([a, b])
    assert (a.state, b.state, session.calls) == ("healthy", "healthy", 0)
    monitor.start()
    try:
        assert (a.state, a.healthy, b.state, b.healthy) == ("unprobed", False, "unprobed", False)
        monitor.await_first_results([a, b])  # returns once a (the live one) is probed
        assert (a.state, b.state) == ("healthy", "unhealthy")
    finally:
        monitor.stop()


def test_a_request_finding_only_unprobed_backends_waits_for_their_first_probe() -> None:
    from continuum.metrics import RouterMetrics
    from continuum.routing.forwarder import Forwarder

    cfgs = [BackendConfig(name=n, url=f"http://{n}:1", models=("m",)) for n in "ab"]
    pool = BackendPool(Backend(c) for c in cfgs)
    monitor = HealthMonitor(pool, HealthCheckConfig(interval_seconds=60, timeout_ms=1000),
                            session_factory=lambda: _ProbeSession(  # type: ignore[arg-type,return-value]
                                {"http://b:1"}, delay=0.05))
    forwarder = Forwarder(pool, RouterMetrics(), await_probes=monitor.await_first_results)
    monitor.start()
    try:
        ctx = make_context(model="m")
        assert [x.name for x in forwarder.candidates(ctx)] == ["b"]
        # Every backend probed and none healthy: no more waiting, a clear 503.
        pool.get("b").healthy = False  # type: ignore[union-attr]
        with pytest.raises(NoHealthyBackendError):
            forwarder.candidates(ctx)
    finally:
        monitor.stop()
