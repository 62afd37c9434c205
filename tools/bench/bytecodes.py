"""Bytecodes the router worker runs per request, by function: where the interpreter's work
goes, in a count that does not move with the machine's load (like
:mod:`tools.bench.instructions`, but per Python function rather than in total).

Run::

    python -m tools.bench.bytecodes                      # PrefixAwareHash, c=32, 2,000 requests
    python -m tools.bench.bytecodes --strategy RoundRobin --concurrency 1 --top 30

The router (one worker, prefix routing on for PrefixAwareHash) runs with a
``sitecustomize`` that counts every frame's opcodes (``sys.settrace`` with
``f_trace_opcodes`` up to CPython 3.11; ``sys.monitoring``'s instruction events from 3.12,
whose counts differ from 3.11's as its bytecode does). A signal starts the count after a
warm-up and another stops it after the measured requests, non-streaming; the worker then
writes, per function, the opcodes it ran and the calls it made. Tracing makes the worker
many times slower: the counts are what to read, never its speed. Frames already running
when the count starts (the connection loops) are counted from their next call on, so a
function that runs for the whole connection shows few calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from continuum.devtools.procs import Child, free_port
from tools.bench import overhead as ob
from tools.bench.instructions import router_env, wait_router

#: Loaded by the router's interpreter from ``PYTHONPATH``; counts while switched on by
#: SIGRTMIN, and writes ``[file, function, opcodes, calls]`` rows when switched off.
SITECUSTOMIZE = '''
import collections, json, os, signal, sys
_opcodes = collections.Counter()
_calls = collections.Counter()
_on = [False]
_monitoring = getattr(sys, "monitoring", None)
if _monitoring is not None:
    # CPython 3.12+: sys.monitoring (PEP 669); there, f_trace_opcodes set from a trace
    # function's call event gives no opcode events (3.12.1 none at all).
    _TOOL = _monitoring.PROFILER_ID
    _E = _monitoring.events
    def _instruction(code, offset):
        _opcodes[(code.co_filename, code.co_name)] += 1
    def _start(code, offset):
        _calls[(code.co_filename, code.co_name)] += 1
    def _switch(on):
        _monitoring.set_events(_TOOL, (_E.INSTRUCTION | _E.PY_START | _E.PY_RESUME)
                               if on else 0)
else:
    def _trace(frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        key = (frame.f_code.co_filename, frame.f_code.co_name)
        if _on[0]:
            _calls[key] += 1
        def local(frame, event, arg):
            if event == "opcode" and _on[0]:
                _opcodes[key] += 1
            return local
        return local
    def _switch(on):
        pass
def _toggle(signum, frame):
    if not _on[0]:
        _opcodes.clear(); _calls.clear(); _on[0] = True
        _switch(True)
        return
    _switch(False)
    _on[0] = False
    path = os.environ["BYTECODES_OUT"] + "." + str(os.getpid())
    with open(path + ".tmp", "w") as f:
        json.dump([[k[0], k[1], n, _calls[k]] for k, n in _opcodes.items()], f)
    os.replace(path + ".tmp", path)
if os.environ.get("BYTECODES_OUT"):
    signal.signal(signal.SIGRTMIN, _toggle)
    if _monitoring is not None:
        _monitoring.use_tool_id(_TOOL, "bytecodes")
        _monitoring.register_callback(_TOOL, _E.INSTRUCTION, _instruction)
        _monitoring.register_callback(_TOOL, _E.PY_START, _start)
        _monitoring.register_callback(_TOOL, _E.PY_RESUME, _start)
    else:
        sys.settrace(_trace)
'''


def short(path: str) -> str:
    """A source path without its site-packages or checkout directory."""
    for marker in ("site-packages/", str(ob.ROOT) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def report(rows: list[list[Any]], requests_done: int, top: int) -> str:
    """The per-request table of ``rows`` (``[file, function, opcodes, calls]``)."""
    total = sum(row[2] for row in rows)
    by_file: collections.Counter[str] = collections.Counter()
    for path, _, opcodes, _ in rows:
        by_file[short(path)] += opcodes
    lines = [f"{total / requests_done:,.0f} bytecodes and "
             f"{sum(row[3] for row in rows) / requests_done:,.0f} Python calls per request",
             "", "bytecodes/rq  file"]
    lines += [f"{n / requests_done:12.1f}  {name}" for name, n in by_file.most_common(top)]
    lines += ["", "bytecodes/rq  calls/rq  function"]
    for path, function, opcodes, calls in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"{opcodes / requests_done:12.1f}  {calls / requests_done:8.2f}  "
                     f"{short(path)}:{function}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.bytecodes")
    parser.add_argument("--strategy", choices=["PrefixAwareHash", "RoundRobin"],
                        default="PrefixAwareHash")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--top", type=int, default=40, help="rows per table")
    parser.add_argument("--router-src", default=str(ob.ROOT))
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="continuum-bytecodes-"))
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    children: list[Child] = []
    try:
        upstream, up_port = ob.start_upstream(tmp, 8, 0.0)
        children.append(upstream)
        port = free_port()
        env = router_env(tmp, port, up_port, args.strategy, args.router_src)
        env["PYTHONPATH"] = f"{tmp / 'site'}{os.pathsep}{env.get('PYTHONPATH', '')}"
        env["BYTECODES_OUT"] = str(tmp / "counts")
        router = Child([ob.PYTHON, "-m", "gunicorn", "-c", "python:continuum.gunicorn_conf",
                        "continuum.app:get_app()"], tmp / "router.log", name="router",
                       env=env, cwd=tmp)
        children.append(router)
        wait_router(port, router, 120)
        worker = ob.children_of(router.pid)[0]
        conns = [ob.Conn(port, timeout=120) for _ in range(args.concurrency)]
        payload = ob.build_request(port, False)
        ob.Load(conns, payload, False, True).run(max(50, 5 * args.concurrency), 600)
        os.kill(worker, signal.SIGRTMIN)
        time.sleep(0.5)
        load = ob.Load(conns, payload, False, True)
        load.run(args.requests, 600)
        done = len(load.latencies) + load.errors
        os.kill(worker, signal.SIGRTMIN)
        out = tmp / f"counts.{worker}"
        deadline = time.monotonic() + 30
        while not out.exists():
            if time.monotonic() > deadline:
                raise ob.BenchError("the worker wrote no counts:\n" + router.log_tail())
            time.sleep(0.2)
        for c in conns:
            c.close()
        print(f"# {args.strategy}, non-streaming, c={args.concurrency}: {done} requests "
              f"({load.errors} failed)")
        print(report(json.loads(out.read_text()), done, args.top))
    finally:
        for child in reversed(children):
            child.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
