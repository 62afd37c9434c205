"""Fuzz the router's request path with hostile bodies: no input may get a 5xx.

Run (about 40 s per 100,000 inputs on 2 CPUs; ``tools/README.md`` explains the report)::

    python -m tools.fuzz --count 100000 --seed 1 [--max-seconds 900] [--json]

A seeded generator (:mod:`tools.fuzz_inputs`; same seed, same inputs) builds hostile requests for
``/v1/chat/completions``, ``/v1/completions`` and ``/anthropic/v1/messages``: random JSON
values, valid requests with known fields set to hostile values (huge integers, ``NaN``,
``Infinity``, ``1e400``, wrong types, nesting), nesting around and far beyond
``server.max_json_depth`` with decoy brackets and escaped quotes in strings, byte-level
mutations of valid requests, random bytes and non-UTF-8 encodings, odd request ids. Each
goes through the real WSGI app (``continuum.web.app.create_app``, called in this process with
``falcon.testing``), configured with every tier that derives something from the body
(prefix keys and ``PrefixAwareHash``, the response cache, KV scoring and cache salts),
in front of a real local upstream (``tools.bench.upstream`` on a free port of 127.0.0.1,
stopped by PID at the end) that answers whatever gets through.

It prints the inputs run, the answers by status and by kind of input, the number of 5xx
with one example per (endpoint, status), and how many inputs got past the explicit checks
but raised while their keys were derived (the admission guard turned those into a 400:
each is a check worth adding). Exit status 1 on any 5xx, any exception out of the app, any
router error body not in the client's shape or any answer without ``X-Request-Id``, or when
a valid request no longer gets a 200 at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import falcon.testing

from continuum.config import parse_config
from continuum.devtools.gemini_fake import FakeGeminiProcess
from continuum.registry import PluginRegistry
from continuum.request import DEFAULT_MAX_JSON_DEPTH
from continuum.web.app import create_app
from tools.bench.overhead import MODEL, start_upstream
from tools.fuzz_inputs import GEMINI_MODEL, PATHS, Case, HostileInputs


def fuzz_config(upstream_url: str, max_depth: int = DEFAULT_MAX_JSON_DEPTH,
                gemini_url: str | None = None) -> dict[str, Any]:
    """A router config with every tier that reads the request body switched on; with
    ``gemini_url``, a ``type: gemini`` backend answering on its native API (the
    translation both ways reads the body too)."""
    gemini = [{"name": "gem", "url": gemini_url, "type": "gemini", "api_key": "fuzz",
               "models": [GEMINI_MODEL]}] if gemini_url else []
    return {
        "backends": [
            {"name": "up", "url": upstream_url, "models": [MODEL]},
            {"name": "anth", "url": upstream_url, "type": "anthropic", "models": [MODEL],
             "api_key": "fuzz"},
            *gemini,
        ],
        "gemini_context_cache": {"prefer_native_api": True},
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "response_cache": {"enabled": True},
        "kv_cache_index": {
            "enabled": True,
            # Never connected: the app's background greenlets are not started here.
            "event_sources": [{"backend_name": "up",
                               "endpoint": "http://127.0.0.1:9/events/up"}],
            "cache_salt": {"enabled": True, "secret": "fuzz-secret"},
        },
        "health_check": {"enabled": False},
        "server": {"max_json_depth": max_depth},
    }


class _LogTally(logging.Handler):
    """Counts the app's warnings about rejected input and its unhandled errors."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.guarded = 0
        self.unhandled = 0
        self.examples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "input rejected" in message:
            self.guarded += 1
        elif record.levelno >= logging.ERROR:
            self.unhandled += 1
        else:
            return
        if len(self.examples) < 5:
            self.examples.append(message[:300])


@dataclass
class Report:
    """What a run found."""

    seed: int
    inputs: int = 0
    seconds: float = 0.0
    stopped_by_time: bool = False
    by_status: Counter[int] = field(default_factory=Counter)
    by_kind: dict[str, Counter[int]] = field(default_factory=dict)
    by_endpoint: dict[str, Counter[int]] = field(default_factory=dict)
    server_errors: int = 0
    crashes: int = 0
    bad_error_bodies: int = 0
    missing_request_id: int = 0
    guarded: int = 0
    unhandled_logged: int = 0
    final_status: int | None = None
    examples: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.server_errors or self.crashes or self.bad_error_bodies
                    or self.missing_request_id or self.final_status != 200)

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "inputs": self.inputs, "seconds": round(self.seconds, 1),
                "stopped_by_time": self.stopped_by_time,
                "by_status": dict(sorted(self.by_status.items())),
                "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
                "by_endpoint": {k: dict(sorted(v.items()))
                                for k, v in sorted(self.by_endpoint.items())},
                "server_errors": self.server_errors, "crashes": self.crashes,
                "bad_error_bodies": self.bad_error_bodies,
                "missing_request_id": self.missing_request_id, "guarded": self.guarded,
                "unhandled_logged": self.unhandled_logged, "final_status": self.final_status,
                "examples": self.examples, "failed": self.failed}


def _shaped(endpoint: str, result: falcon.testing.Result) -> bool:
    """Whether a router-made error body is in the client's shape."""
    try:
        doc = json.loads(result.content)
    except ValueError:
        return False
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
        return False
    error = doc["error"]
    if endpoint == "anthropic":
        return doc.get("type") == "error" and {"type", "message"} <= set(error)
    return {"message", "type", "param", "code"} <= set(error)


def _example(case: Case, result: falcon.testing.Result | None, note: str) -> str:
    answer = "" if result is None else f" -> {result.status_code} {result.text[:200]!r}"
    return f"{note}: {case.kind} {PATHS[case.endpoint]} {case.body[:300]!r}{answer}"


def check(report: Report, case: Case, result: falcon.testing.Result) -> None:
    """Tally one answer and keep an example of each kind of failure."""
    status = result.status_code
    report.by_status[status] += 1
    report.by_kind.setdefault(case.kind, Counter())[status] += 1
    report.by_endpoint.setdefault(case.endpoint, Counter())[status] += 1
    from_router = "X-Continuum-Backend" not in result.headers
    if status >= 500:
        report.server_errors += 1
        report.examples.setdefault(f"{case.endpoint} {status}", _example(case, result, "5xx"))
    elif status >= 400 and from_router and not _shaped(case.endpoint, result):
        report.bad_error_bodies += 1
        report.examples.setdefault(f"{case.endpoint} shape", _example(case, result, "shape"))
    if not result.headers.get("X-Request-Id"):
        report.missing_request_id += 1
        report.examples.setdefault("request id", _example(case, result, "no X-Request-Id"))


def _send_all(client: falcon.testing.TestClient, inputs: HostileInputs, count: int,
              max_seconds: float, report: Report) -> None:
    deadline = time.monotonic() + max_seconds
    for _ in range(count):
        if time.monotonic() > deadline:
            report.stopped_by_time = True
            return
        case = inputs.case()
        report.inputs += 1
        try:
            result = client.simulate_post(PATHS[case.endpoint], body=case.body,
                                          headers=case.headers)
        except Exception as exc:  # out of the app: a real worker would lose the request
            report.crashes += 1
            report.examples.setdefault(f"crash {type(exc).__name__}",
                                       _example(case, None, repr(exc)[:200]))
            continue
        check(report, case, result)


def run(count: int, seed: int, max_seconds: float,
        max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Report:
    """Start the upstream, build the app, send ``count`` generated inputs (or as many as
    ``max_seconds`` allows), then one valid request; stop the upstream."""
    report = Report(seed)
    tally = _LogTally()
    app_log = logging.getLogger("continuum")
    propagate = app_log.propagate
    app_log.addHandler(tally)
    app_log.propagate = False  # the tally is the report; no log lines on the terminal
    try:
        with tempfile.TemporaryDirectory(prefix="continuum-fuzz-") as tmp:
            upstream, port = start_upstream(Path(tmp), chunks=3, chunk_delay_ms=0)
            gemini: FakeGeminiProcess | None = None
            app = None
            try:
                gemini = FakeGeminiProcess(Path(tmp))
                config = parse_config(fuzz_config(f"http://127.0.0.1:{port}", max_depth,
                                                  gemini.url))
                app = create_app(config, registry=PluginRegistry())
                client = falcon.testing.TestClient(app)
                started = time.monotonic()
                _send_all(client, HostileInputs(seed, max_depth), count, max_seconds, report)
                report.seconds = time.monotonic() - started
                report.final_status = client.simulate_post(PATHS["chat"], json={
                    "model": MODEL, "messages": [{"role": "user", "content": "still there?"}],
                }).status_code
            finally:
                if app is not None:
                    app.service.stop()
                if gemini is not None:
                    gemini.stop()
                upstream.stop()
    finally:
        app_log.removeHandler(tally)
        app_log.propagate = propagate
    report.guarded, report.unhandled_logged = tally.guarded, tally.unhandled
    for i, text in enumerate(tally.examples):
        report.examples.setdefault(f"log {i}", text)
    return report


def print_report(report: Report) -> None:
    rate = report.inputs / report.seconds if report.seconds else 0.0
    print(f"fuzz: {report.inputs} inputs, seed {report.seed}, {report.seconds:.1f} s "
          f"({rate:.0f} inputs/s){' - stopped by --max-seconds' if report.stopped_by_time else ''}")
    print("  answers by status: " + ", ".join(
        f"{status}: {n}" for status, n in sorted(report.by_status.items())))
    for kind, statuses in sorted(report.by_kind.items()):
        print(f"    {kind:12} " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print("  answers by endpoint (gemini*: a type: gemini backend on its native API):")
    for endpoint, statuses in sorted(report.by_endpoint.items()):
        print(f"    {endpoint:16} " + ", ".join(
            f"{s}: {n}" for s, n in sorted(statuses.items())))
    print(f"  5xx: {report.server_errors}")
    print(f"  exceptions out of the app: {report.crashes}")
    print(f"  router error bodies not in the client's shape: {report.bad_error_bodies}")
    print(f"  answers without X-Request-Id: {report.missing_request_id}")
    print(f"  400s from the admission guard (unforeseen exceptions): {report.guarded}")
    print(f"  unhandled errors logged: {report.unhandled_logged}")
    print(f"  valid request after the run: {report.final_status}")
    for name, text in report.examples.items():
        print(f"  example [{name}] {text}")
    print("FAILED" if report.failed else "OK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz",
                                     description="fuzz the router's request path in-process")
    parser.add_argument("--count", type=int, default=10_000, help="inputs to send")
    parser.add_argument("--seed", type=int, default=1, help="generator seed")
    parser.add_argument("--max-seconds", type=float, default=900.0,
                        help="stop sending after this long (the report says so)")
    parser.add_argument("--max-json-depth", type=int, default=DEFAULT_MAX_JSON_DEPTH,
                        help="server.max_json_depth of the fuzzed router")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.count < 1 or args.max_seconds <= 0:
        parser.error("--count and --max-seconds must be positive")
    report = run(args.count, args.seed, args.max_seconds, args.max_json_depth)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print_report(report)
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
