"""The semantic cache's quality and cost: hit rate, false-hit rate and added latency per
lookup at thresholds 0.85/0.90/0.92/0.95, with the false-hit gate on and off; and the
index scan over 100,000 x 1,024-dim entries.

    python -m tools.bench.semantic            # the table and the scan figure
    python -m tools.bench.semantic --json
    python -m tools.bench.semantic --pairs    # print the labelled set

**How the labelled set is built** (deterministically, in :func:`labelled_pairs`): 15
question templates over a slot (a product feature, a city, a number...) are filled from
fixed word lists. Each filled question gives

* paraphrase pairs (label 1): the question against rewritings that keep its meaning —
  "How do I" / "How can I", "What is" / "What's", a trailing "please", lower case, a
  synonym swap ("change"/"update", "remove"/"delete");
* non-paraphrase pairs (label 0): the question against a *negated* one ("enable" /
  "disable", an inserted "not"), one with a *different number*, one with a *different
  named entity*, and an unrelated question of another template.

Every pair is embedded with the simulator's deterministic embedder
(:mod:`continuum.sim.embedder`, 256 dims): a stand-in whose similarities behave like a real
model's on these cases (rewordings close, negations and number changes close too), not a
real model. A pair is *served* when its cosine reaches the threshold and (gate on) the
false-hit gate lets it through. Hit rate = served paraphrase pairs / paraphrase pairs;
false-hit rate = served non-paraphrase pairs / non-paraphrase pairs.

Added latency per lookup is the router's own work on a miss-or-hit: the partition digest,
the index search in a partition of 1,000 entries, and the gate; the embedding round trip
is the embedding backend's and is reported by the router's
``continuum_semantic_cache_embedding_seconds`` histogram instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import numpy as np

from continuum.caching.false_hit_gate import refusal
from continuum.caching.vector_index import VectorIndex, unit
from continuum.sim.embedder import embed

THRESHOLDS = (0.85, 0.90, 0.92, 0.95)
DIMS = 256
#: (template, slot values); ``{x}`` is the slot.
TEMPLATES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("How do I enable {x} on my account?", ("2FA", "dark mode", "notifications")),
    ("How do I change my {x}?", ("password", "email address", "billing plan")),
    ("What is the capital city of {x}?", ("France", "Japan", "Brazil")),
    ("How do I remove a {x} from my workspace?", ("user", "project", "webhook")),
    ("What is the refund window for orders over {x} dollars?", ("50", "100", "250")),
    ("How many days does shipping to {x} take?", ("Canada", "Germany", "Australia")),
    ("Can I upgrade my plan to {x} in the middle of the month?", ("Pro", "Team")),
    ("How do I export my {x} as CSV?", ("invoices", "contacts", "reports")),
    ("What is the maximum file size for {x} uploads?", ("image", "video", "audio")),
    ("How do I reset the {x} on my router?", ("password", "firmware", "settings")),
    ("Is the {x} store open on Sundays?", ("Boston", "Denver", "Seattle")),
    ("How do I enable {x} for my team?", ("SSO", "audit logs", "guest access")),
    ("What is the late fee after {x} days?", ("10", "15", "30")),
    ("How do I remove the {x} integration?", ("Slack", "GitHub", "Jira")),
    ("How many seats does the {x} plan include?", ("Starter", "Business", "Enterprise")),
)
_PARAPHRASES = (("How do I", "How can I"), ("What is", "What's"), ("change", "update"),
                ("remove", "delete"), ("How many days does", "How long does"))


def _paraphrases(question: str) -> list[str]:
    out = []
    for old, new in _PARAPHRASES:
        if old in question:
            out.append(question.replace(old, new, 1))
    out.append(question.rstrip("?") + ", please?")
    out.append(question.lower().rstrip("?"))
    return out


def _negation(question: str) -> str:
    for old, new in (("enable", "disable"), ("remove", "add"), ("export", "import"),
                     ("upgrade", "downgrade"), ("maximum", "minimum")):
        if old in question:
            return question.replace(old, new, 1)
    for verb in ("Can I", "How do I", "does", "is"):
        if verb in question:
            return question.replace(verb, verb + " not", 1)
    return "Why can I not " + question[0].lower() + question[1:]


def labelled_pairs() -> list[tuple[str, str, int, str]]:
    """(question, other, label, kind): label 1 for paraphrases (see the module docstring)."""
    pairs: list[tuple[str, str, int, str]] = []
    filled = [(t, x, t.format(x=x)) for t, xs in TEMPLATES for x in xs]
    for i, (template, x, question) in enumerate(filled):
        pairs += [(question, p, 1, "paraphrase") for p in _paraphrases(question)]
        pairs.append((question, _negation(question), 0, "negation"))
        others = [v for tt, vs in TEMPLATES if tt == template for v in vs if v != x]
        if others:
            kind = "number" if x.isdigit() else "entity" if x[0].isupper() else "slot"
            pairs.append((question, template.format(x=others[0]), 0, kind))
        if x.isdigit():
            pairs.append((question, question.replace(x, str(int(x) * 10)), 0, "number"))
        else:
            pairs.append((question, question.rstrip("?") + " within 30 days?", 0, "number"))
        unrelated = filled[(i + 7) % len(filled)][2]
        pairs.append((question, unrelated, 0, "unrelated"))
    return pairs


def quality(pairs: list[tuple[str, str, int, str]]) -> list[dict[str, Any]]:
    cosines = [float(np.dot(unit(embed(a, DIMS)), unit(embed(b, DIMS))))  # type: ignore[arg-type]
               for a, b, _, _ in pairs]
    gated = [refusal(a, b) is None for a, b, _, _ in pairs]
    positives = sum(1 for p in pairs if p[2] == 1)
    negatives = len(pairs) - positives
    rows = []
    for threshold, gate in itertools.product(THRESHOLDS, (False, True)):
        served = [c >= threshold and (g or not gate) for c, g in zip(cosines, gated, strict=True)]
        hits = sum(1 for s, p in zip(served, pairs, strict=True) if s and p[2] == 1)
        false = sum(1 for s, p in zip(served, pairs, strict=True) if s and p[2] == 0)
        rows.append({"threshold": threshold, "gate": gate,
                     "hit_rate": round(hits / positives, 4),
                     "false_hit_rate": round(false / negatives, 4),
                     "false_hits": false})
    return rows


def lookup_latency(pairs: list[tuple[str, str, int, str]], entries: int = 1000) -> float:
    """Microseconds of router work per lookup (digest excluded: microseconds): index search
    in a partition of ``entries`` and the gate."""
    index = VectorIndex(entries + 1)
    rng = np.random.default_rng(1)
    for i in range(entries):
        v = rng.standard_normal(DIMS).astype(np.float32)
        index.add("p", f"k{i}", v / np.linalg.norm(v), f"text {i}", 3600)
    queries = [(a, unit(embed(b, DIMS))) for a, b, _, _ in pairs[:200]]
    started = time.perf_counter()
    for text, vector in queries:
        match = index.search("p", vector)  # type: ignore[arg-type]
        if match is not None:
            refusal(text, match.text)
    return (time.perf_counter() - started) / len(queries) * 1e6


def scan_latency(entries: int = 100_000, dims: int = 1024, rounds: int = 20) -> dict[str, float]:
    """Milliseconds per search over ``entries`` unit vectors of ``dims`` in one partition
    (the worst case: every entry in the same partition)."""
    index = VectorIndex(entries)
    rng = np.random.default_rng(2)
    block = rng.standard_normal((entries, dims)).astype(np.float32)
    block /= np.linalg.norm(block, axis=1, keepdims=True)
    for i in range(entries):
        index.add("p", f"k{i}", block[i], "", 3600)
    target = block[12345] + 0.05 * rng.standard_normal(dims).astype(np.float32)
    query = target / np.linalg.norm(target)
    times = []
    found = 0
    for _ in range(rounds):
        started = time.perf_counter()
        match = index.search("p", query)
        times.append((time.perf_counter() - started) * 1000)
        found += match is not None and match.key == "k12345"
    return {"entries": entries, "dims": dims, "p50_ms": round(statistics.median(times), 3),
            "max_ms": round(max(times), 3), "found_true_match": found / rounds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pairs", action="store_true", help="print the labelled set")
    args = parser.parse_args(argv)
    pairs = labelled_pairs()
    if args.pairs:
        for a, b, label, kind in pairs:
            print(f"{label}\t{kind}\t{a}\t{b}")
        return
    doc = {"pairs": len(pairs), "paraphrases": sum(p[2] for p in pairs),
           "quality": quality(pairs), "lookup_us": round(lookup_latency(pairs), 1),
           "scan": scan_latency()}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{doc['pairs']} labelled pairs ({doc['paraphrases']} paraphrases)")
    print("threshold  gate  hit_rate  false_hit_rate")
    for row in doc["quality"]:
        print(f"{row['threshold']:9.2f}  {'on ' if row['gate'] else 'off'}  "
              f"{row['hit_rate']:8.3f}  {row['false_hit_rate']:14.3f}")
    print(f"added latency per lookup (search in 1,000 entries + gate): {doc['lookup_us']} us")
    scan = doc["scan"]
    print(f"scan of {scan['entries']:,} x {scan['dims']}-dim entries: p50 {scan['p50_ms']} ms, "
          f"max {scan['max_ms']} ms, true match found {scan['found_true_match']:.0%}")


if __name__ == "__main__":
    main()
