"""tools.bench.bytecodes: its tracer counts the opcodes and calls of each function between
two signals, in a real interpreter, and the report divides them per request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.bench import bytecodes

SCRIPT = """
import os, signal
def work(n):
    total = 0
    for i in range(n):
        total += i
    return total
work(100)  # before the count: not counted
os.kill(os.getpid(), signal.SIGRTMIN)
for _ in range(10):
    work(5)
os.kill(os.getpid(), signal.SIGRTMIN)
work(100)  # after: not counted either
"""


def test_the_tracer_counts_only_between_the_two_signals(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(bytecodes.SITECUSTOMIZE)
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(tmp_path),
           "BYTECODES_OUT": str(tmp_path / "counts")}
    done = subprocess.run([sys.executable, str(tmp_path / "script.py")], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    [out] = tmp_path.glob("counts.*")
    rows = {row[1]: row for row in json.loads(out.read_text())
            if row[0].endswith("script.py")}
    assert done.returncode == 0
    calls = rows["work"][3]
    assert calls == 10
    once = rows["work"][2] / calls
    # work(5) runs its loop body 5 times: more than a call's fixed opcodes, far fewer than
    # work(100)'s, which ran outside the count
    assert 20 < once < 200


def test_the_report_is_per_request_and_names_files_without_their_directories() -> None:
    rows = [[str(bytecodes.ob.ROOT / "continuum" / "metrics.py"), "inc", 3000, 20],
            ["/venv/lib/python3.11/site-packages/falcon/app.py", "__call__", 1000, 10]]
    text = bytecodes.report(rows, 10, top=5)
    assert text.splitlines()[0] == "400 bytecodes and 3 Python calls per request"
    assert "       300.0      2.00  continuum/metrics.py:inc" in text
    assert "       100.0      1.00  falcon/app.py:__call__" in text
