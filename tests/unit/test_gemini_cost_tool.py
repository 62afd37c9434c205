"""``tools.bench.gemini_cost``: the policy replay counts what the manager would do."""

from __future__ import annotations

from tools.bench.gemini_cost import Prices, arrivals, build_parser, run, with_manager


def test_busy_prompt_saves_and_extend_keeps_one_resource() -> None:
    plain = run(build_parser().parse_args(["--rate", "1", "--ttl", "600"]))
    managed = plain["with_manager"]
    assert managed["creates"] == 6  # a new resource after each 600 s TTL (+1 s create)
    assert managed["hits"] + managed["misses"] == managed["requests"] == 3600
    assert managed["cached_tokens"] == managed["hits"] * 20000
    assert plain["saving_usd"] > 0
    extended = run(build_parser().parse_args(["--rate", "1", "--ttl", "600",
                                              "--extend-on-hit"]))["with_manager"]
    assert extended["creates"] == 1 and extended["extends"] > 0


def test_rare_prompt_costs_more_with_the_manager() -> None:
    # one request an hour, a large prompt kept half an hour: never reused, storage and the
    # creates are pure cost
    result = run(build_parser().parse_args(["--rate", str(1 / 3600), "--hours", "10",
                                            "--ttl", "1800", "--system-tokens", "50000"]))
    assert result["with_manager"]["hits"] == 0 and result["saving_usd"] < 0


def test_requests_during_the_create_miss() -> None:
    times = arrivals(10, 2.0, poisson=False)  # every 0.1 s for 2 s
    out = with_manager(times, system=1000, question=10, output=10, ttl=60, extend=False,
                       create_seconds=0.5, end=2.0, prices=Prices())
    assert (out.creates, out.misses, out.hits) == (1, 5, 15)
