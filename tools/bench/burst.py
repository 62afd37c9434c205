"""A burst of new sessions over a few long system prompts, as a workload file for
``continuum-router demo --workload``::

    python -m tools.bench.burst --seed 1 --out /tmp/burst.jsonl
    continuum-router demo --workload /tmp/burst.jsonl --duration 60 \\
        --strategies PrefixAwareHash 'KV index'

``--sessions`` sessions (48) arrive within ``--window`` seconds (1), each over one of
``--prompts`` system prompts (4) of about ``--prompt-tokens`` tokens (1,000), picked
uniformly, with ``--turns`` short user turns (3). No engine holds any of the prompts when
the burst begins, so where each prompt's first requests go decides the run: the demo's
other workloads start their sessions over seconds, and their prompts' holders are known
before most sessions arrive.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

from continuum.sim.workload import Session, Workload, sentence, text_of, write_jsonl


def burst(seed: int, sessions: int = 48, prompts: int = 4, prompt_tokens: int = 1000,
          turns: int = 3, window: float = 1.0) -> Workload:
    """The burst workload described in the module docstring, drawn from ``seed``."""
    rng = random.Random(seed)
    systems = [text_of(rng, prompt_tokens, f"You are assistant {i} of the burst.")
               for i in range(prompts)]
    made = []
    for i in range(sessions):
        which = rng.randrange(prompts)
        made.append(Session(
            id=f"burst-{i}", kind="burst", group=f"sys-{which}",
            arrival=round(rng.uniform(0.0, window), 3), system=systems[which],
            turns=tuple(sentence(rng, 8, 24, "?") for _ in range(turns)),
            think_seconds=0.3, temperature=0.7, max_tokens=48))
    made.sort(key=lambda s: s.arrival)
    return Workload("burst", seed, tuple(made))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.burst",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--window", type=float, default=1.0,
                        help="seconds over which the sessions arrive")
    parser.add_argument("--out", required=True, help="the workload file to write")
    args = parser.parse_args(argv)
    if min(args.sessions, args.prompts, args.prompt_tokens, args.turns) < 1 or args.window < 0:
        parser.error("--sessions, --prompts, --prompt-tokens and --turns must be at least 1, "
                     "--window at least 0")
    workload = burst(args.seed, args.sessions, args.prompts, args.prompt_tokens, args.turns,
                     args.window)
    write_jsonl(workload, args.out)
    print(f"{len(workload.sessions)} sessions, {workload.requests} requests written to "
          f"{args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
