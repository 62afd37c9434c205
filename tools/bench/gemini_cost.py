"""What the Gemini context-cache manager saves, or costs: cached tokens and the estimated
bill with and without it, for a prompt size, a request rate and a TTL.

    python -m tools.bench.gemini_cost --system-tokens 20000 --rate 2 --ttl 600
    python -m tools.bench.gemini_cost --system-tokens 3000 --rate 0.05 --ttl 600 --json
    python -m tools.bench.gemini_cost --input-price 1.25 --cached-price 0.125 \\
        --storage-price 4.5 --output-price 10   # another model's price list

The requests (one system prompt shared by all, ``--question-tokens`` of their own and
``--output-tokens`` of answer) arrive at ``--rate`` per second for ``--hours``, evenly or
(``--poisson``) at random. The manager's policy is replayed on a virtual clock exactly as
:mod:`continuum.caching.gemini_context` runs it: a miss forwards the request unchanged and
creates a ``cachedContents`` resource that lives ``--ttl`` seconds (after
``--create-seconds``, during which requests still miss); a hit before expiry is served from
it; with ``--extend-on-hit`` a hit that finds at most 20% of the TTL left extends it by the
TTL. Storage is billed per token-hour while a resource lives; its creation bills the system
prompt as input once.

Without the manager every request pays its whole prompt at the input price, except what
implicit caching (Gemini 2.5+) catches: ``--implicit-hit-rate`` (default 0; Google does not
guarantee it) of the system tokens at the cached price. The default prices are
illustrative, per million tokens (USD): set them from the current price list of your model.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

EXTEND_AT = 0.2  # the seed's "20% of the TTL left"


@dataclass(frozen=True)
class Prices:
    """USD per million tokens (storage: per million token-hours)."""

    input: float = 0.30
    cached: float = 0.03
    output: float = 2.50
    storage: float = 1.00


@dataclass
class Outcome:
    """One scenario's counts and cost."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    creates: int = 0
    extends: int = 0
    cached_tokens: int = 0
    storage_token_hours: float = 0.0
    cost_usd: float = 0.0


def arrivals(rate: float, seconds: float, poisson: bool, seed: int = 1) -> list[float]:
    """Request times in [0, seconds)."""
    if rate <= 0:
        return []
    if not poisson:
        step = 1.0 / rate
        return [i * step for i in range(int(seconds * rate))]
    rng = random.Random(seed)
    times, now = [], rng.expovariate(rate)
    while now < seconds:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def with_manager(times: Sequence[float], *, system: int, question: int, output: int,
                 ttl: float, extend: bool, create_seconds: float, end: float,
                 prices: Prices) -> Outcome:
    """Replay the manager's policy over ``times``."""
    out = Outcome(requests=len(times))
    live_from = expire = -1.0
    created_at = -1.0
    storage_seconds = 0.0
    input_tokens = cached = 0
    for t in times:
        if live_from <= t < expire:
            out.hits += 1
            cached += system
            input_tokens += question
            if extend and expire - t <= EXTEND_AT * ttl:
                expire = t + ttl
                out.extends += 1
            continue
        out.misses += 1
        input_tokens += system + question
        if t >= expire:  # none alive or being created: create one
            if expire > 0:
                storage_seconds += expire - created_at
            out.creates += 1
            input_tokens += system  # creating the cache bills its tokens once
            created_at, live_from, expire = t, t + create_seconds, t + create_seconds + ttl
    if expire > 0:
        storage_seconds += min(expire, end) - created_at
    out.cached_tokens = cached
    out.storage_token_hours = system * storage_seconds / 3600
    out.cost_usd = (input_tokens * prices.input + cached * prices.cached
                    + len(times) * output * prices.output
                    + out.storage_token_hours * prices.storage) / 1e6
    return out


def without_manager(times: Sequence[float], *, system: int, question: int, output: int,
                    implicit: float, prices: Prices) -> Outcome:
    """Every request pays its prompt; implicit caching catches ``implicit`` of the system
    tokens."""
    n = len(times)
    cached = int(n * system * implicit)
    out = Outcome(requests=n, cached_tokens=cached)
    out.cost_usd = ((n * (system + question) - cached) * prices.input + cached * prices.cached
                    + n * output * prices.output) / 1e6
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both scenarios for ``args``."""
    prices = Prices(args.input_price, args.cached_price, args.output_price, args.storage_price)
    seconds = args.hours * 3600
    times = arrivals(args.rate, seconds, args.poisson)
    managed = with_manager(times, system=args.system_tokens, question=args.question_tokens,
                           output=args.output_tokens, ttl=args.ttl, extend=args.extend_on_hit,
                           create_seconds=args.create_seconds, end=seconds, prices=prices)
    plain = without_manager(times, system=args.system_tokens, question=args.question_tokens,
                            output=args.output_tokens, implicit=args.implicit_hit_rate,
                            prices=prices)
    saving = plain.cost_usd - managed.cost_usd
    return {"inputs": {"system_tokens": args.system_tokens, "rate_per_second": args.rate,
                       "ttl_seconds": args.ttl, "hours": args.hours,
                       "extend_on_hit": args.extend_on_hit, "prices": asdict(prices)},
            "without_manager": asdict(plain), "with_manager": asdict(managed),
            "saving_usd": round(saving, 6),
            "saving_percent": round(100 * saving / plain.cost_usd, 2) if plain.cost_usd else 0}


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m tools.bench.gemini_cost",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--system-tokens", type=int, default=20000)
    p.add_argument("--question-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=300)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--ttl", type=float, default=600.0, help="gemini_context_cache.ttl, s")
    p.add_argument("--extend-on-hit", action="store_true")
    p.add_argument("--create-seconds", type=float, default=1.0,
                   help="time a create takes (requests meanwhile miss)")
    p.add_argument("--poisson", action="store_true", help="random arrivals")
    p.add_argument("--implicit-hit-rate", type=float, default=0.0)
    p.add_argument("--input-price", type=float, default=Prices.input)
    p.add_argument("--cached-price", type=float, default=Prices.cached)
    p.add_argument("--output-price", type=float, default=Prices.output)
    p.add_argument("--storage-price", type=float, default=Prices.storage,
                   help="USD per million token-hours")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the comparison."""
    args = build_parser().parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = (("without manager", result["without_manager"]),
            ("with manager", result["with_manager"]))
    print(f"{'scenario':16} {'requests':>8} {'hits':>7} {'creates':>7} {'cached tok':>12} "
          f"{'storage tok-h':>14} {'cost USD':>10}")
    for label, row in rows:
        print(f"{label:16} {row['requests']:8d} {row['hits']:7d} {row['creates']:7d} "
              f"{row['cached_tokens']:12d} {row['storage_token_hours']:14.0f} "
              f"{row['cost_usd']:10.4f}")
    print(f"saving: {result['saving_usd']:.4f} USD ({result['saving_percent']}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
