"""The fake Gemini API (:mod:`continuum.sim.gemini`) as a child process, for tests and the
cost benchmark: started on a free port, read back through its ``/_sim`` endpoints."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import requests

from continuum.devtools.procs import Child, free_port, wait_http


class FakeGeminiProcess:
    """A running ``python -m continuum.sim.gemini`` on 127.0.0.1.

    Args:
        tmp: where its log goes.
        api_key: the ``x-goog-api-key`` it requires (None: any).
        min_cache_tokens: smallest cachedContents for every model (None: per model).
        clock_offset: seconds added to its clock (negative: behind ours).
    """

    def __init__(self, tmp: Path, *, api_key: str | None = None,
                 min_cache_tokens: int | None = None, clock_offset: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "continuum.sim.gemini", "--port", str(self.port),
                "--clock-offset", str(clock_offset)]
        if api_key is not None:
            argv += ["--api-key", api_key]
        if min_cache_tokens is not None:
            argv += ["--min-cache-tokens", str(min_cache_tokens)]
        self.proc = Child(argv, log=tmp / f"gemini-{self.port}.log")
        wait_http(self.url + "/health", children=[self.proc])

    def received(self, path_part: str = "", method: str | None = None) -> list[dict[str, Any]]:
        """Recorded requests (oldest first) whose path contains ``path_part``."""
        doc = requests.get(self.url + "/_sim/received", timeout=5).json()
        return [r for r in doc["received"] if path_part in r["path"]
                and (method is None or r["method"] == method)]

    def stats(self) -> dict[str, Any]:
        """``GET /_sim/stats``."""
        return requests.get(self.url + "/_sim/stats", timeout=5).json()  # type: ignore[no-any-return]

    def expire(self, name: str) -> bool:
        """End the cache ``name`` now, as its TTL running out would."""
        doc = requests.post(self.url + "/_sim/expire", json={"name": name}, timeout=5).json()
        return bool(doc["expired"])

    def reset(self) -> None:
        """Forget recorded requests, caches and counters."""
        requests.post(self.url + "/_sim/reset", timeout=5).raise_for_status()

    def stop(self) -> None:
        """Stop the process."""
        self.proc.stop()
