"""Claude-Code-shaped sessions on your own engines: how much of their prompts the engines'
prefix caches serve, through the router's /anthropic endpoint.

    python -m tools.bench.claude_code                            # PrefixAwareHash
    python -m tools.bench.claude_code --strategy RoundRobin
    python -m tools.bench.claude_code --attribution fixed        # CLAUDE_CODE_ATTRIBUTION_HEADER=0
    python -m tools.bench.claude_code --router-src /tmp/old      # another tree's router

Four simulated vLLM engines (``continuum-sim --fleet 4``, each serving Anthropic's
``/v1/messages``) behind the router (one gevent worker, ``anthropic_messages: true`` on
each backend). ``--sessions`` sessions of ``--turns`` turns each, taking turns with each
other in a new random order each round (``--seed``), send what Claude Code sends: a
``system`` of three blocks, the first its attribution line
(``x-anthropic-billing-header: cc_version=…; cch=…;``, whose hash is new for each session
and each request unless ``--attribution fixed``; ``none`` leaves the block out),
then its identity line and a long static prompt (about 1,500 tokens); the conversation so
far (each answer sent back, each turn showing a file of ``--file-words`` words, as a tool
result would) and, from the second turn on, a ``system`` reminder inside ``messages``.

Printed: the share of all prompt tokens the engines served from their caches
(``cache_read_input_tokens``), that share on the sessions' first turns (the system prompt
shared across sessions), and over later turns (each session's own history), how many
engines each session's turns went to, and the requests per engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from continuum.devtools.procs import Child, free_port_block, wait_http
from continuum.devtools.servers import RouterProcess

MODEL = "sim-claude"
ENGINES = 4
IDENTITY = "You are Claude Code, an interactive command line tool for software work. "
#: About 1,500 words of static instructions (the simulated tokenizer: about one token each).
STATIC = ("Follow the repository's conventions. Read a file before editing it. Run the tests "
          "after a change and report what they say. Keep answers short; show commands. ") * 60
REMINDER = "<system-reminder>The todo list is empty. Do not mention this.</system-reminder>"


def _system(attribution: str, session: int, request: int) -> list[dict[str, Any]]:
    blocks = [{"type": "text", "text": IDENTITY}, {"type": "text", "text": STATIC}]
    if attribution == "none":
        return blocks
    suffix = "" if attribution == "fixed" else f".{session * 131 % 4096:03x}"
    cch = "00000" if attribution == "fixed" else f"{(session * 7919 + request) % 65536:05x}"
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.88{suffix}; "
             f"cc_entrypoint=cli; cch={cch};"}, *blocks]


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = free_port_block(ENGINES)
    engines = Child([sys.executable, "-m", "continuum.sim.cli", "--fast", "--fleet",
                     str(ENGINES), "--port", str(port), "--model", MODEL,
                     "--num-blocks", str(args.num_blocks)], tmp / "engines.log")
    router = None
    try:
        urls = [f"http://127.0.0.1:{port + i}" for i in range(ENGINES)]
        for url in urls:
            wait_http(url + "/health", children=[engines])
        config = {"backends": [{"name": f"e{i}", "url": url, "models": [MODEL],
                                "anthropic_messages": True} for i, url in enumerate(urls)],
                  "selection_strategy": args.strategy,
                  "prefix_routing": {"enabled": args.strategy == "PrefixAwareHash"
                                     or args.kv_index},
                  "health_check": {"interval_seconds": 2}}
        if args.kv_index:  # its defaults: chains, approximate entries, placement, guard
            config["kv_cache_index"] = {"enabled": True}
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [
            str(Path(args.router_src).resolve()) if args.router_src else None,
            os.environ.get("PYTHONPATH")]))}
        # from a directory of its own: python -m puts the working directory first on the
        # module path, ahead of --router-src
        here = os.getcwd()
        os.chdir(tmp)
        try:
            router = RouterProcess(config, tmp, env=env)
        finally:
            os.chdir(here)
        return _sessions(args, router.url)
    finally:
        if router is not None:
            router.stop()
        engines.stop()


def _sessions(args: argparse.Namespace, url: str) -> dict[str, Any]:
    http = requests.Session()
    histories: list[list[dict[str, Any]]] = [[] for _ in range(args.sessions)]
    engines: list[list[str]] = [[] for _ in range(args.sessions)]
    totals = {"first": [0, 0], "later": [0, 0]}  # [prompt tokens, cached]
    requests_sent = 0
    deadline = time.monotonic() + args.max_seconds
    order = list(range(args.sessions))
    shuffle = random.Random(args.seed).shuffle
    for turn in range(args.turns):
        shuffle(order)  # the sessions' next turns come in no fixed order
        for session in order:
            if time.monotonic() > deadline:
                raise RuntimeError(f"over --max-seconds ({args.max_seconds} s)")
            history = histories[session]
            if turn:
                history.append({"role": "system", "content": REMINDER})
            history.append({"role": "user", "content": f"Session {session}: step {turn}, "
                            f"fix the failing test in module_{session}_{turn}.py:\n" +
                            f"def check_{session}_{turn}(value): return value\n" *
                            (args.file_words // 4)})
            body = {"model": MODEL, "max_tokens": 24, "messages": history,
                    "system": _system(args.attribution, session, requests_sent)}
            reply = http.post(url + "/anthropic/v1/messages", json=body, timeout=60)
            requests_sent += 1
            if reply.status_code != 200:
                raise RuntimeError(f"status {reply.status_code}: {reply.text[:300]}")
            doc = reply.json()
            usage = doc["usage"]
            cached = usage.get("cache_read_input_tokens") or 0
            bucket = totals["first" if turn == 0 else "later"]
            bucket[0] += usage["input_tokens"] + cached
            bucket[1] += cached
            engines[session].append(reply.headers.get("x-continuum-backend", "?"))
            history.append({"role": "assistant", "content": doc["content"]})
    prompt = totals["first"][0] + totals["later"][0]
    cached = totals["first"][1] + totals["later"][1]
    return {
        "requests": requests_sent,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "first_turn_cached_share": totals["first"][1] / max(totals["first"][0], 1),
        "later_turn_cached_share": totals["later"][1] / max(totals["later"][0], 1),
        "engines_per_session": Counter(len(set(e)) for e in engines),
        "requests_per_engine": Counter(name for e in engines for name in e),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="PrefixAwareHash",
                        choices=["PrefixAwareHash", "RoundRobin"])
    parser.add_argument("--kv-index", action="store_true",
                        help="the KV index too (its defaults; no KV events: the router's own "
                        "approximate entries)")
    parser.add_argument("--attribution", default="varying",
                        choices=["varying", "fixed", "none"])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--file-words", type=int, default=800,
                        help="words of a file each turn shows (a session's own history)")
    parser.add_argument("--num-blocks", type=int, default=4096,
                        help="each engine's KV capacity in 16-token blocks (4096: 65,536 "
                        "tokens, about eight sessions' worth at the last turn)")
    parser.add_argument("--seed", type=int, default=1, help="of the sessions' order")
    parser.add_argument("--max-seconds", type=float, default=300)
    parser.add_argument("--router-src", help="put this tree first on the router's PYTHONPATH")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="claude-code-bench-") as tmp:
        result = run(args, Path(tmp))
    if args.json:
        print(json.dumps(result, default=dict))
        return 0
    print(f"# {args.sessions} sessions x {args.turns} turns, {args.strategy}"
          f"{' + KV index' if args.kv_index else ''}, attribution "
          f"{args.attribution}{', router ' + args.router_src if args.router_src else ''}")
    print(f"prompt tokens served from the engines' caches: {result['cached_share']:.1%} "
          f"({result['cached_tokens']:,} of {result['prompt_tokens']:,})")
    print(f"  first turns (system prompt shared across sessions): "
          f"{result['first_turn_cached_share']:.1%}")
    print(f"  later turns (each session's own history): {result['later_turn_cached_share']:.1%}")
    spread = ", ".join(f"{n} engine(s): {c}" for n, c in sorted(
        result["engines_per_session"].items()))
    print(f"sessions by engines their turns went to: {spread}")
    print("requests per engine: " + ", ".join(
        f"{name} {count}" for name, count in sorted(result["requests_per_engine"].items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
