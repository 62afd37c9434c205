"""The README's rehearsal holds together: the simulated engines it starts serve the models
that ``conf/config.yaml.example`` routes to them (the semantic cache's embedding model
included), and its curl examples ask for a model that config serves. (A newcomer who
followed it got "The model `sim-llama-3-8b` does not exist" from the engines, which served
``sim-model``.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from continuum.config import load_config
from continuum.registry import PluginRegistry
from continuum.sim.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _sim_commands(readme: str) -> list[list[str]]:
    return [shlex.split(line.split("#", 1)[0])[1:] for line in readme.splitlines()
            if line.startswith("continuum-sim ")]


def test_the_rehearsal_engines_serve_the_example_configs_models(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTINUUM_ADMIN_TOKEN", "t")
    readme = (ROOT / "README.md").read_text()
    config = load_config(ROOT / "conf" / "config.yaml.example", PluginRegistry())
    served: dict[int, set[str]] = {}  # port -> models, of every rehearsal engine
    for argv in _sim_commands(readme):
        args = build_parser().parse_args(argv)
        for i in range(args.fleet):
            served[args.port + i] = set(args.models or ["sim-model"])
    assert served, "no continuum-sim command found in the README"
    local = [(b.name, urlsplit(b.url).port, set(b.models), b.internal)
             for b in config.backends
             if b.enabled and urlsplit(b.url).hostname == "127.0.0.1"]
    routed = [(name, port, models) for name, port, models, internal in local if not internal]
    assert routed, "the example config routes to no local engine"
    # internal ones too: the semantic cache's embedder, once the example's switch is flipped
    for name, port, models, _ in local:
        assert port in served, f"{name}: no rehearsal engine on port {port}"
        assert models <= served[port], f"{name} routes {models}, the engine serves {served[port]}"
    semantic = config.response_cache.semantic
    embedder = next(b for b in config.backends if b.name == semantic.backend)
    assert semantic.embedding_model in embedder.models
    commands = re.sub(r"\\\n", " ", readme).splitlines()  # continuation lines joined
    asked = {model for command in commands if command.startswith("curl ")
             and "localhost:8080/v1/" in command
             for model in re.findall(r'"model": "([^"]+)"', command)}
    assert asked and asked <= set().union(*(m for _, _, m in routed)), asked
