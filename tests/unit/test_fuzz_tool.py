"""``python -m tools.fuzz``: seeded, bounded, and loud about a 5xx (real upstream process)."""

from __future__ import annotations

import itertools

import pytest

from continuum.request import RequestContext
from continuum.service import ProxyResult, RouterService
from tools.fuzz import main, run
from tools.fuzz_inputs import PATHS, HostileInputs


def _bodies(seed: int, n: int) -> list[bytes]:
    inputs = HostileInputs(seed)
    return [inputs.case().body for _ in range(n)]


def test_the_generator_is_seeded_and_covers_every_kind() -> None:
    assert _bodies(3, 200) == _bodies(3, 200)
    assert _bodies(3, 200) != _bodies(4, 200)
    inputs = HostileInputs(5)
    cases = [inputs.case() for _ in range(500)]
    assert {case.kind for case in cases} == {kind for kind, _ in inputs.kinds}
    assert {case.endpoint for case in cases} == set(PATHS)  # the Gemini native ones too


def test_a_run_is_clean_and_bounded() -> None:
    report = run(400, seed=7, max_seconds=120)
    assert report.inputs == 400 and not report.stopped_by_time
    assert sum(report.by_status.values()) == 400
    assert report.by_status[400] > 0 and report.by_status[200] > 0  # refused and forwarded
    assert report.server_errors == report.crashes == report.guarded == 0
    assert report.final_status == 200 and not report.failed
    # inputs went through the Gemini translation to the fake Gemini API and back
    assert report.by_endpoint["gemini"][200] > 0
    assert report.by_endpoint["gemini_responses"][200] > 0
    cut = run(10**9, seed=7, max_seconds=0.5)
    assert cut.stopped_by_time and 0 < cut.inputs < 10**9


def test_a_5xx_fails_the_run_and_shows_its_input(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    original = RouterService.proxy
    calls = itertools.count()

    def flaky(self: RouterService, ctx: RequestContext, path: str) -> ProxyResult:
        if next(calls) % 7 == 3:
            raise KeyError("a bug")
        return original(self, ctx, path)

    monkeypatch.setattr(RouterService, "proxy", flaky)
    assert main(["--count", "150", "--seed", "2"]) == 1
    out = capsys.readouterr().out
    assert "5xx: 0" not in out and "unhandled errors logged: 0" not in out
    assert "example [" in out and "-> 500" in out and out.rstrip().endswith("FAILED")
