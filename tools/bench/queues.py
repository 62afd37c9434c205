"""Where a replay's requests queued: each engine's load at the moment each request was
sent, rebuilt from the demo's request records (``continuum-router demo --records DIR``).

Run::

    continuum-router demo --scenario load --strategies 'KV index' --records /tmp/rec
    python -m tools.bench.queues /tmp/rec                 # every *.jsonl in it
    python -m tools.bench.queues /tmp/rec/kv-index.jsonl --slots 2 --tail 12

A simulated engine runs ``--max-num-seqs`` requests at once (2 with ``--scenario load``,
``--slots`` here) and queues the rest, so a request sent to an engine already running that
many waits for a slot. For each file it prints:

* the share of requests sent to an engine that was full when they were sent, and the share
  sent to a full engine while another engine had a free slot (what a load-aware router
  should avoid unless the other engine would redo a long prefill);
* the time to first token (p50, p99) of the requests sent to a full engine and of the rest;
* the ``--tail`` slowest first tokens, with every engine's load when each was sent and the
  share of its prompt the engine had cached.

The load is the client's view: a request counts on its engine from the moment it was sent
to its last byte (``start`` to ``start + latency``), which includes the router's and the
network's share, so the counts are approximate by a few milliseconds at each end.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum.sim.replay import percentile


@dataclass(frozen=True)
class Sent:
    """One request and every engine's load (requests in flight) when it was sent."""

    record: dict[str, Any]
    loads: dict[str, int]

    @property
    def backend(self) -> str:
        return str(self.record["backend"])


def load_records(path: Path) -> list[dict[str, Any]]:
    """The completed requests of a records file (one JSON object per line), those with a
    backend and a first token."""
    records = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("error") is None and record.get("backend") \
                    and record.get("ttft") is not None and record.get("latency") is not None:
                records.append(record)
    return records


def loads_at_send(records: Sequence[dict[str, Any]]) -> list[Sent]:
    """Each request with every engine's count of requests in flight when it was sent:
    those sent strictly before it and not finished by then (so never itself)."""
    starts: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    for r in records:
        starts.setdefault(r["backend"], []).append(r["start"])
        ends.setdefault(r["backend"], []).append(r["start"] + r["latency"])
    for values in (*starts.values(), *ends.values()):
        values.sort()
    sent = []
    for r in records:
        t = r["start"]
        # in flight at t: started before t, not ended by t (an ended one started before)
        loads = {b: bisect.bisect_left(starts[b], t) - bisect.bisect_right(ends[b], t)
                 for b in sorted(starts)}
        sent.append(Sent(r, loads))
    return sent


def summarize(sent: Sequence[Sent], slots: int, tail: int = 10) -> dict[str, Any]:
    """The shares, the first-token percentiles and the slowest ``tail`` (see the module
    docstring); times in ms."""
    full = [s for s in sent if s.loads[s.backend] >= slots]
    avoidable = [s for s in full
                 if any(n < slots for b, n in s.loads.items() if b != s.backend)]
    rest = [s for s in sent if s.loads[s.backend] < slots]

    def ms(group: Sequence[Sent], pct: float) -> float | None:
        value = percentile(sorted(s.record["ttft"] * 1000 for s in group), pct)
        return None if value is None else round(value, 1)

    total = max(len(sent), 1)
    slowest = sorted(sent, key=lambda s: -s.record["ttft"])[:tail]
    return {
        "requests": len(sent),
        "slots": slots,
        "sent_to_full": round(len(full) / total, 4),
        "sent_to_full_with_a_free_slot_elsewhere": round(len(avoidable) / total, 4),
        "ttft_ms": {"full": {"p50": ms(full, 50), "p99": ms(full, 99)},
                    "not_full": {"p50": ms(rest, 50), "p99": ms(rest, 99)}},
        "requests_per_engine": {b: sum(1 for s in sent if s.backend == b)
                                for b in sorted(sent[0].loads)} if sent else {},
        "slowest": [{
            "ttft_ms": round(s.record["ttft"] * 1000, 1),
            "start_s": round(s.record["start"], 2),
            "backend": s.backend,
            "loads": s.loads,
            "cached_share": round(s.record.get("cached_tokens", 0)
                                  / max(s.record.get("prompt_tokens", 0), 1), 3),
        } for s in slowest],
    }


def render(name: str, summary: dict[str, Any]) -> str:
    """The summary as text."""
    ttft = summary["ttft_ms"]
    lines = [
        f"{name}: {summary['requests']} requests, {summary['slots']} slots per engine; "
        f"per engine {summary['requests_per_engine']}",
        f"  sent to a full engine {summary['sent_to_full']:.1%}, of them while another had "
        f"a free slot {summary['sent_to_full_with_a_free_slot_elsewhere']:.1%} of all",
        f"  TTFT ms sent to a full engine p50 {ttft['full']['p50']} p99 {ttft['full']['p99']}"
        f"; the rest p50 {ttft['not_full']['p50']} p99 {ttft['not_full']['p99']}",
    ]
    if summary["slowest"]:
        lines.append("  slowest first tokens (engine loads when sent):")
    for row in summary["slowest"]:
        loads = "/".join(str(n) for n in row["loads"].values())
        lines.append(f"    {row['ttft_ms']:7.1f} ms  at {row['start_s']:7.2f} s  "
                     f"{row['backend']:<10} loads {loads:<12} cached {row['cached_share']:.0%}")
    return "\n".join(lines)


def record_files(paths: Sequence[str]) -> list[Path]:
    """The ``.jsonl`` files named, and those in the directories named."""
    files: list[Path] = []
    for item in paths:
        path = Path(item)
        files.extend(sorted(path.glob("*.jsonl")) if path.is_dir() else [path])
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.queues",
        description="Each engine's load when each request of a demo replay was sent, from "
                    "its request records (continuum-router demo --records DIR).")
    parser.add_argument("paths", nargs="+", help="records files (.jsonl) or directories")
    parser.add_argument("--slots", type=int, default=2,
                        help="requests an engine runs at once (the demo's --max-num-seqs: "
                             "2 with --scenario load, 4 otherwise; default 2)")
    parser.add_argument("--tail", type=int, default=10, help="slowest requests to list")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.slots < 1 or args.tail < 0:
        parser.error("--slots must be >= 1 and --tail >= 0")
    files = record_files(args.paths)
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        print(f"python -m tools.bench.queues: no records file: {', '.join(missing) or args.paths}",
              file=sys.stderr)
        return 2
    out = {str(f): summarize(loads_at_send(load_records(f)), args.slots, args.tail)
           for f in files}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join(render(name, summary) for name, summary in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
