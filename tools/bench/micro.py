"""Micro-benchmarks of the router's hot-path pieces, in microseconds per operation.

    python -m tools.bench.micro            # every group
    python -m tools.bench.micro --only tier1 tier2
    python -m tools.bench.micro --json

Groups and the seed's goals (figures from a native implementation):

* ``tier1``: prefix-key extraction (1 KiB and 16 KiB system prompts; goal < 10 µs), ring
  lookup with 8 backends x 150 virtual nodes (goal < 5 µs), the bounded walk when the
  owner is full, and a whole ``PrefixAwareHash.select``. Prefix keys and ring positions
  are remembered once computed (a prompt repeats: that is what prefix routing is for);
  the ``_new`` figures are a prompt or key met for the first time.
* ``tier2``: cache key of a 2 KiB request (goal < 5 µs), parsing it and a 128 KiB one,
  in-memory store hit and miss
  (goal < 1 µs), envelope decode, and the Redis GET/SET round trip on loopback (a
  ``redis-server`` is started on a free port when one is installed).
* ``tier4``: ``InMemoryKvIndex.query_backends`` with 100,000 prefixes (goal < 100 µs),
  ``KvOverlapScorer.score_with_tier`` (goal < 1 µs) and 1,000 prepare + score passes over 8
  backends (goal < 100 ms; reported in ms).

* ``chain``: the chain of prefix keys of a 16 KiB prompt (2 KiB system prompt, 14 KiB
  document in the user turn) at the default 1024-byte chunks and at 512 and 256 (goal
  < 20 µs), ``InMemoryKvIndex.query_chain`` of that chain with 8 backends holding parts of
  it among 100,000 chain keys, ``ChainOverlapScorer`` prepare + score of 8 backends, and
  the Redis chain query on loopback: one ``EVALSHA`` round trip (counted) for chains of 16
  and 128 keys; a new session's placement pass (prepare + score of 8 backends with their
  KV pressure) and its pressure update.

Each figure is the median of ``--repeat`` runs of ``--number`` calls.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import timeit
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any


def measure(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Median microseconds per call."""
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def _chat(system: str, user: str = "Summarise the attached notes.") -> dict[str, Any]:
    return {"model": "llama-3-8b", "temperature": 0, "max_tokens": 256,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


def tier1(number: int, repeat: int) -> dict[str, float]:
    from continuum import prefix
    from continuum.config import parse_config
    from continuum.prefix import request_prefix_key
    from continuum.routing.hashring import HashRing
    from continuum.testing import make_backends, make_context
    from strategies.prefix_aware_hash import PrefixAwareHash

    results: dict[str, float] = {}
    for size in (1024, 16384):
        body = _chat("Você é um assistente útil. " * (size // 28))
        results[f"prefix_key_{size // 1024}KiB"] = measure(
            partial(request_prefix_key, body, "llama-3-8b"), number, repeat)
        # A prompt not seen lately: what the remembered keys save (the clear is ~0.05 us).

        def new_prompt(body: dict[str, Any] = body) -> None:
            prefix._recent.clear()
            request_prefix_key(body, "llama-3-8b")

        results[f"prefix_key_{size // 1024}KiB_new"] = measure(new_prompt, number, repeat)
    names = [f"vllm-{i}" for i in range(8)]
    ring = HashRing(names, 150)
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(1024)]
    counter = iter(range(10**12))
    results["ring_lookup_8x150"] = measure(
        lambda: ring.lookup_probes(keys[next(counter) & 1023]), number, repeat)

    def new_key() -> None:
        ring.remembered.clear()
        ring.lookup_probes(keys[next(counter) & 1023])

    results["ring_lookup_8x150_new"] = measure(new_key, number, repeat)
    strategy = PrefixAwareHash(parse_config({"prefix_routing": {"enabled": True}}))
    backends = make_backends(8)
    contexts = [make_context(prefix=k) for k in keys]
    results["prefix_aware_select"] = measure(
        lambda: strategy.select(backends, contexts[next(counter) & 1023]), number, repeat)
    # Bounded walk: the owner of every key is over the bound, so each select walks on.
    hot = make_context(prefix=keys[0])
    owner = strategy.select(backends, hot)
    owner.in_flight = 50
    results["bounded_walk_owner_full"] = measure(
        lambda: strategy.select(backends, hot), number, repeat)
    return results


@contextlib.contextmanager
def _redis_server() -> Iterator[int | None]:
    """A throwaway redis-server on a free port (None when none is installed)."""
    from continuum.devtools.redis_server import RedisServer, redis_available

    if redis_available() is None:
        print("redis-server not installed; Redis figures skipped", file=sys.stderr)
        yield None
        return
    with RedisServer() as server:
        yield server.port


def _redis_roundtrip(number: int, repeat: int) -> dict[str, float]:
    from continuum.config import parse_config
    from continuum.resources import WorkerResources
    from stores.redis_store import RedisCacheStore

    with _redis_server() as port:
        if port is None:
            return {}
        config = parse_config({"response_cache": {"backend": "redis", "redis": {
            "url": f"redis://127.0.0.1:{port}/0"}}})
        store = RedisCacheStore.from_config(config, resources=WorkerResources())
        value = os.urandom(4096)
        store.set("bench", value, 60)
        n = max(number // 50, 200)
        out = {
            "redis_get_4KiB": measure(lambda: store.get("bench"), n, repeat),
            "redis_set_4KiB": measure(lambda: store.set("bench", value, 60), n, repeat),
        }
        store.close()  # the last user of its link: closes it
        return out


@contextlib.contextmanager
def _redis_kv_index() -> Iterator[Any]:
    """A ``RedisKvIndex`` on a throwaway redis-server (None when none is installed)."""
    from continuum.config import parse_config
    from continuum.resources import WorkerResources
    from stores.kv_redis import RedisKvIndex

    with _redis_server() as port:
        if port is None:
            yield None
            return
        config = parse_config({"response_cache": {"redis": {
            "url": f"redis://127.0.0.1:{port}/0"}}, "kv_cache_index": {"backend": "redis"}})
        index = RedisKvIndex.from_config(config, resources=WorkerResources())
        try:
            yield index
        finally:
            index.close()  # the last user of its link: closes it


def _redis_kv_query(number: int, repeat: int) -> dict[str, float]:
    with _redis_kv_index() as index:
        if index is None:
            return {}
        prefix = "ab" * 32
        for i in range(3):
            index.apply(f"vllm-{i}", "cache_created", prefix, 512 * (i + 1))
        n = max(number // 50, 200)
        return {"redis_query_hit_3_holders": measure(lambda: index.query_backends(prefix), n,
                                                     repeat)}


def tier2(number: int, repeat: int) -> dict[str, float]:
    from continuum.caching.cache_key import cache_key
    from continuum.caching.response_cache import decode_entry, encode_entry
    from continuum.request import CHAT, parse_request
    from stores.memory import InMemoryCacheStore

    body = _chat("You are a careful analyst. " * 60, "hello " * 50)
    raw = json.dumps(body).encode()
    ctx = parse_request(raw, CHAT)
    results = {
        f"parse_request_{len(raw) // 1024}KiB": measure(
            lambda: parse_request(raw, CHAT), number, repeat),
        f"cache_key_{len(raw) // 1024}KiB": measure(lambda: cache_key(ctx), number, repeat),
    }
    # a RAG-sized request: the body's byte scans dominate, not the fields
    big = json.dumps(_chat("You are a careful analyst. " * 60,
                           "Context: " + "the quarterly report says revenue grew. " * 3200
                           + "Question: did revenue grow?")).encode()
    results[f"parse_request_{len(big) // 1024}KiB"] = measure(
        lambda: parse_request(big, CHAT), max(number // 50, 200), repeat)
    store = InMemoryCacheStore(capacity=10_000)
    entry = encode_entry("body", "application/json", b"x" * 2048)
    for i in range(5000):
        store.set(f"k{i}", entry, 300)
    results["memory_get_hit"] = measure(lambda: store.get("k42"), number, repeat)
    results["memory_get_miss"] = measure(lambda: store.get("absent"), number, repeat)
    results["decode_entry_2KiB"] = measure(lambda: decode_entry(entry), number, repeat)
    results.update(_redis_roundtrip(number, repeat))
    return results


def tier4(number: int, repeat: int) -> dict[str, float]:
    from continuum.config import parse_config
    from continuum.kv.scorer import KvOverlapScorer
    from continuum.testing import make_backends, make_context
    from stores.kv_memory import InMemoryKvIndex

    config = parse_config({"kv_cache_index": {"enabled": True}})
    index = InMemoryKvIndex.from_config(config)
    prefixes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(100_000)]
    for i, prefix in enumerate(prefixes):
        index.apply(f"vllm-{i % 8}", "cache_created", prefix, 512 + i % 1024)
        index.apply(f"vllm-{(i + 3) % 8}", "cache_created", prefix, 256)
    counter = iter(range(10**12))
    results = {
        "memory_query_hit": measure(
            lambda: index.query_backends(prefixes[next(counter) % 100_000]), number, repeat),
        "memory_query_miss": measure(lambda: index.query_backends("f" * 64), number, repeat),
        "memory_apply_update": measure(
            lambda: index.apply("vllm-1", "cache_created", prefixes[1], 700), number, repeat),
    }
    scorer = KvOverlapScorer(index, config.kv_cache_index.scoring)
    backends = make_backends(8)
    for i, backend in enumerate(backends):
        backend.name = f"vllm-{i}"
    ctx = make_context(prefix=bytes.fromhex(prefixes[42]))
    scorer.prepare(ctx, backends)
    results["score_with_tier"] = measure(
        lambda: scorer.score_with_tier(backends[2], ctx), number, repeat)
    contexts = [make_context(prefix=bytes.fromhex(p)) for p in prefixes[:1000]]

    def thousand_scoring_passes() -> None:
        for c in contexts:
            scorer.prepare(c, backends)
            for backend in backends:
                scorer.score_with_tier(backend, c)

    scorer.clock = lambda: float(next(counter))  # every prepare misses the 100 ms cache
    results["1000_prepare_and_score_8_ms"] = measure(thousand_scoring_passes, 3, repeat) / 1000
    results.update(_redis_kv_query(number, repeat))
    return results


def _rag_body() -> dict[str, Any]:
    """A 16 KiB prompt: a 2 KiB system prompt, a 14 KiB document and a question."""
    return _chat("You are a careful analyst of harbour logs. " * 47,
                 "Document: " + "The pilot logged the arrival at berth nine. " * 325
                 + "Question: when?")


def chain(number: int, repeat: int) -> dict[str, float]:
    from continuum.config import parse_config
    from continuum.interfaces import CACHE_CREATED
    from continuum.kv.chain_scorer import ChainOverlapScorer
    from continuum.prefix_chain import request_chain
    from continuum.testing import make_backends, make_context
    from stores.kv_memory import InMemoryKvIndex

    body = _rag_body()
    size = len(json.dumps(body)) // 1024
    n = max(number // 10, 500)
    results = {f"chain_{size}KiB_{chunk}B": measure(
        partial(request_chain, body, "m", chunk_bytes=chunk), n, repeat)
        for chunk in (1024, 512, 256)}
    prompt = request_chain(body, "m")
    assert prompt is not None
    config = parse_config({"kv_cache_index": {"enabled": True, "max_entries": 200_000}})
    index = InMemoryKvIndex.from_config(config)
    for i in range(100_000 // 8):  # other chains' keys: 100,000 keys in all
        index.apply_chain(f"vllm-{i % 8}", CACHE_CREATED,
                          [(f"{i:012x}{j:04x}", 64 * (j + 1)) for j in range(8)])
    for b in range(8):  # each backend holds a longer part of this prompt's chain
        depth = 1 + b * (len(prompt.keys) - 1) // 7
        index.apply_chain(f"vllm-{b}", CACHE_CREATED,
                          [(k, e // 4) for k, e in zip(prompt.keys[:depth], prompt.ends,
                                                       strict=False)])
    results[f"memory_query_chain_{len(prompt.keys)}_keys"] = measure(
        lambda: index.query_chain(prompt.keys), n, repeat)
    results["memory_query_chain_miss"] = measure(
        lambda: index.query_chain(("f" * 16,) * len(prompt.keys)), n, repeat)
    scorer = ChainOverlapScorer(index, config.kv_cache_index)
    backends = make_backends(8)
    for i, backend in enumerate(backends):
        backend.name = f"vllm-{i}"
    ctx = make_context()
    ctx.chain = prompt
    counter = iter(range(10**12))
    scorer.clock = lambda: float(next(counter))  # every prepare queries the index

    def prepare_and_score() -> None:
        scorer.prepare(ctx, backends)
        for backend in backends:
            scorer.score_with_tier(backend, ctx)

    results["prepare_and_score_8"] = measure(prepare_and_score, n, repeat)
    results.update(_placement(scorer, backends, n, repeat))
    results.update(_redis_chain_query(number, repeat))
    return results


def _placement(scorer: Any, backends: list[Any], n: int, repeat: int) -> dict[str, float]:
    """A new session's first request (2 KiB system prompt, a short task) that half the
    backends hold up to its system prompt, with every backend's KV pressure known: the
    placement pass (``prepare`` + 8 scores) and the pressure update of ``record_route``."""
    from continuum.interfaces import CACHE_CREATED
    from continuum.prefix_chain import request_chain
    from continuum.testing import make_context

    body = _chat("You are a careful analyst of harbour logs. " * 47, "Task: find the logs.")
    first = request_chain(body, "m")
    assert first is not None
    anchor = first.ends.index(first.anchor_end) + 1
    for backend in backends[::2]:
        scorer.index.apply_chain(backend.name, CACHE_CREATED,
                                 [(k, e // 4) for k, e in zip(first.keys[:anchor],
                                                              first.ends, strict=False)])
    ctx = make_context()
    ctx.chain = first
    for i, backend in enumerate(backends):  # the pressure alone (a record_route would
        for _ in range(i + 1):              # also record the whole chain as held)
            scorer._add_pressure(backend.name, ctx, first)

    def placed() -> None:
        scorer.prepare(ctx, backends)
        for backend in backends:
            scorer.score_with_tier(backend, ctx)

    placed()
    assert getattr(ctx.kv_snapshot, "placed", None) is not None, "the first request was not placed"
    return {"placement_prepare_and_score_8": measure(placed, n, repeat),
            "placement_record_route": measure(
                lambda: scorer._add_pressure(backends[0].name, ctx, first), n, repeat)}


def _redis_chain_query(number: int, repeat: int) -> dict[str, float]:
    from continuum.interfaces import CACHE_CREATED

    with _redis_kv_index() as index:
        if index is None:
            return {}
        keys = [f"{i:016x}" for i in range(128)]
        for b in range(4):
            index.apply_chain(f"vllm-{b}", CACHE_CREATED,
                              [(k, 64 * (i + 1)) for i, k in enumerate(keys[:32 * (b + 1)])])
        link = index.link
        trips = []
        execute = link.execute

        def counting(operation: str, command: Callable[[Any], Any]) -> Any:
            trips.append(operation)
            return execute(operation, command)

        link.execute = counting
        out: dict[str, float] = {}
        n = max(number // 50, 200)
        for length in (16, 128):
            index.query_chain(keys[:length], "ab" * 32)  # loads the script
            trips.clear()
            out[f"redis_query_chain_{length}_keys"] = measure(
                partial(index.query_chain, keys[:length], "ab" * 32), n, repeat)
            out[f"redis_query_chain_{length}_round_trips"] = len(trips) / (n * repeat)
        return out



def scaleout(number: int, repeat: int) -> dict[str, float]:
    """Shared in-flight counts (docs/scale-out.md): the same operations on private counts
    and on counts shared through the host segment with 4 worker rows in use; RoundRobin on
    its own counter and on the host's rotation."""
    import tempfile

    from continuum import hostshm
    from continuum.config import parse_config
    from continuum.hostshm import HostSegment
    from continuum.routing.backends import Backend
    from continuum.testing import make_backends, make_context
    from strategies.prefix_aware_hash import PrefixAwareHash
    from strategies.round_robin import RoundRobin

    results: dict[str, float] = {}
    strategy = PrefixAwareHash(parse_config({"prefix_routing": {"enabled": True}}))
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(1024)]
    contexts = [make_context(prefix=k) for k in keys]
    with tempfile.TemporaryDirectory(prefix="continuum-bench-") as directory:
        segment = HostSegment(directory)
        # Four rows in use, as with 4 workers (the others' counts are read, never written).
        segment.words[hostshm._HDR_SLOTS_USED] = 4
        for label, shared in (("local", None), ("shared", segment)):
            backends = make_backends(8)
            for backend in backends:
                backend.share_load(shared)
            one = backends[0]

            def in_flight(one: Backend = one) -> int:
                return one.in_flight

            results[f"in_flight_read_{label}"] = measure(in_flight, number, repeat)

            def acquire_release(one: Any = one) -> None:
                one.acquire()
                one.release()

            results[f"acquire_release_{label}"] = measure(acquire_release, number, repeat)
            counter = iter(range(10**12))

            def prefix_aware(backends: list[Any] = backends, counter: Any = counter) -> None:
                strategy.select(backends, contexts[next(counter) & 1023])

            results[f"prefix_aware_select_{label}"] = measure(prefix_aware, number, repeat)
            # RoundRobin: its own counter, or the host's rotation (with a router place set)
            if shared is not None:
                segment.set_place(1, 2)
            rotation = RoundRobin(host=shared)

            def round_robin(backends: list[Any] = backends, rotation: Any = rotation) -> None:
                rotation.select(backends, contexts[0])

            results[f"round_robin_select_{label}"] = measure(round_robin, number, repeat)
            for backend in backends:
                backend.share_load(None)
        # The pushed counts (fleet.fleet_load_push_ms): the holder's look every 5 ms when
        # nothing changed, and applying another router's message; no Redis is reached
        # (a stand-in client: only publish would talk to it, and nothing changes).
        from continuum.routing.backends import BackendPool
        from continuum.routing.fleet_load import FleetLoad

        class _NoRedis:
            def register_script(self, _script: str) -> None:
                return None

            def publish(self, _channel: str, _message: str) -> int:
                return 0

        load = FleetLoad(BackendPool(make_backends(8)), segment, _NoRedis(), "bench:", 0.025,
                         push_interval=0.005)
        load.push()
        results["fleet_push_unchanged_8_backends"] = measure(load.push, number, repeat)
        seq = iter(range(1, 10**12))
        counts = json.dumps({f"b{i}": i % 3 for i in range(8)})
        results["fleet_on_counts_8_backends"] = measure(
            lambda: load.on_counts(f'{{"h":"x","s":{next(seq)},"c":{counts}}}'),
            number, repeat)
        segment.close()
    return results


GROUPS: dict[str, Callable[[int, int], dict[str, float]]] = {
    "tier1": tier1, "tier2": tier2, "tier4": tier4, "chain": chain, "scaleout": scaleout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(GROUPS), help="groups to run")
    parser.add_argument("--number", type=int, default=20000, help="calls per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    for name in args.only or sorted(GROUPS):
        results[name] = GROUPS[name](args.number, args.repeat)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for group, figures in results.items():
        print(f"[{group}]")
        for name, micros in figures.items():
            print(f"  {name:<28} {micros:10.3f} us/op")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
