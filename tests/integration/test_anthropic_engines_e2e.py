"""Anthropic's Messages API passed through to self-hosted engines (``anthropic_messages:
true``), through real gunicorn -k gevent, driven by the official anthropic SDK.

The engines are simulated vLLM servers (``python -m continuum.sim.cli --fleet 4``, one
process) that serve ``/v1/messages`` by translating it into their chat path; what an
engine received is read back from its ``GET /sim/received``. ``e0``..``e2`` have the
setting and serve ``sim-model``; ``plain`` (the fourth engine) has not and serves
``other-model`` to the OpenAI endpoints only, until a reload turns the setting on.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import requests
import yaml

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import Child, free_port_block, wait_http

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
OTHER = "other-model"
ENGINES = ("e0", "e1", "e2")
SECRET = "salt-secret"
#: About 600 tokens: many 16-token blocks the engine's prefix cache can serve again.
SYSTEM = ("You are the build assistant of the Continuum project. Answer questions about "
          "caches, prefixes, tokens and routers in one short paragraph. ") * 20
USER: list[Any] = [{"role": "user", "content": "Which engine holds my prefix?"}]


class EngineFleet:
    """Four simulated vLLM engines in one process, on consecutive ports."""

    def __init__(self, tmp: Path) -> None:
        port = free_port_block(4)
        self.urls = {name: f"http://127.0.0.1:{port + i}"
                     for i, name in enumerate((*ENGINES, "plain"))}
        argv = [sys.executable, "-m", "continuum.sim.cli", "--fast", "--fleet", "4",
                "--port", str(port), "--model", MODEL, "--model", OTHER]
        self.proc = Child(argv, log=tmp / "engines.log")
        for url in self.urls.values():
            wait_http(url + "/health", children=[self.proc])

    def received(self, name: str) -> list[dict[str, Any]]:
        """What engine ``name`` was sent (path, anthropic/authorization headers, body)."""
        doc = requests.get(self.urls[name] + "/sim/received", timeout=5).json()
        return doc["received"]  # type: ignore[no-any-return]

    def reset(self) -> None:
        """Empty every engine's prefix cache."""
        for url in self.urls.values():
            requests.post(url + "/reset_prefix_cache", timeout=5).raise_for_status()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFleet]:
    fleet = EngineFleet(tmp_path_factory.mktemp("engines"))
    yield fleet
    fleet.proc.stop()


@pytest.fixture(autouse=True)
def _cold_caches(engines: EngineFleet) -> None:
    engines.reset()


def _config(engines: EngineFleet, **extra: Any) -> dict[str, Any]:
    """The three Messages-capable engines (salted on the OpenAI path: each has a KV event
    source, the index itself off), the plain one, prefix-aware routing."""
    backends: list[dict[str, Any]] = [
        {"name": name, "url": engines.urls[name], "models": [MODEL], "api_key": "sk-engine",
         "anthropic_messages": True} for name in ENGINES]
    backends.append({"name": "plain", "url": engines.urls["plain"], "models": [OTHER]})
    sources = [{"backend_name": name, "endpoint": f"http://127.0.0.1:1/{name}"}
               for name in ENGINES]
    cfg: dict[str, Any] = {
        "backends": backends,
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "health_check": {"interval_seconds": 0.5},
        "kv_cache_index": {"event_sources": sources,
                           "cache_salt": {"enabled": True, "secret": SECRET}},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture
def clients() -> Iterator[Callable[[Any], anthropic.Anthropic]]:
    """Factory of anthropic SDK clients on a router's /anthropic; closed at the end."""
    made: list[anthropic.Anthropic] = []

    def make(router: Any) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="sk-client",
                                     max_retries=0)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def test_answers_streams_and_counts_pass_through_unchanged(
    engines: EngineFleet, router_factory: Callable[..., Any],
    clients: Callable[[Any], anthropic.Anthropic],
) -> None:
    router = router_factory(_config(engines))
    router.wait_healthy()
    client = clients(router)
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "system": SYSTEM,
                            "messages": USER}
    # temperature 0 (which this SDK no longer takes as an argument): the same answer twice
    greedy = {"temperature": 0}

    raw = client.messages.with_raw_response.create(**args, extra_body=greedy)
    whole = raw.parse()
    backend = raw.headers["x-continuum-backend"]
    assert backend in ENGINES
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "end_turn"
    text = whole.content[0].text  # type: ignore[union-attr]
    assert text and whole.usage.output_tokens > 0
    assert whole.usage.cache_read_input_tokens is None  # a cold cache: all of it is new
    first_input = whole.usage.input_tokens

    # the engine got the client's body as sent: no cache_control injected, no cache_salt
    (record,) = engines.received(backend)
    assert record["path"] == "/v1/messages"
    assert record["body"] == {**args, **greedy}
    assert record["headers"]["authorization"] == "Bearer sk-engine"
    # the SDK's version header is forwarded (the engine ignores it)
    assert record["headers"]["anthropic-version"] == raw.http_request.headers[
        "anthropic-version"]

    with client.messages.stream(**args, extra_body=greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the same prompt again: the engine's prefix cache serves all but its last block
    cached = final.usage.cache_read_input_tokens
    assert cached is not None and cached > 0
    assert final.usage.input_tokens + cached == first_input
    assert engines.received(backend)[-1]["body"] == {**args, **greedy, "stream": True}

    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=USER)
    assert count.input_tokens == first_input
    assert engines.received(backend)[-1]["path"] == "/v1/messages/count_tokens"

    truncated = client.messages.create(**{**args, "max_tokens": 2})
    assert truncated.stop_reason == "max_tokens" and truncated.usage.output_tokens == 2

    # the OpenAI path to the same engine is salted (it has an event source): the
    # Anthropic requests above were left alone by choice, not for want of a salt
    gpt = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-client", max_retries=0)
    try:
        gpt.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "system", "content": SYSTEM}, *USER])
    finally:
        gpt.close()
    assert "cache_salt" in engines.received(backend)[-1]["body"]

    # the router's token counters read the engines' Anthropic usage
    metrics = router.metrics()
    prompt = metric_sum(metrics, "continuum_prompt_tokens_total", backend=backend)
    assert prompt >= 3 * first_input  # create, stream, max_tokens=2 (and the chat's)
    assert metric_sum(metrics, "continuum_cached_prompt_tokens_total",
                      backend=backend) >= cached


def test_a_shared_system_prompt_sticks_to_one_engine_that_reports_cache_hits(
    engines: EngineFleet, router_factory: Callable[..., Any],
    clients: Callable[[Any], anthropic.Anthropic],
) -> None:
    router = router_factory(_config(engines))
    router.wait_healthy()
    client = clients(router)

    def ask(system: str, question: str) -> tuple[str, anthropic.types.Message]:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, system=system,
            messages=[{"role": "user", "content": question}])
        return raw.headers["x-continuum-backend"], raw.parse()

    answers = [ask(SYSTEM, f"Question {i}: where is my prefix cached?") for i in range(6)]
    assert len({backend for backend, _ in answers}) == 1
    assert answers[0][1].usage.cache_read_input_tokens is None
    for _, later in answers[1:]:
        assert (later.usage.cache_read_input_tokens or 0) > 500  # the system prompt
    # other prompts go elsewhere too: the stickiness is the prefix's, not the fleet's
    spread = {ask(f"Tenant {i} system prompt. " + SYSTEM, "Hello?")[0] for i in range(8)}
    assert len(spread) > 1


def test_claude_codes_attribution_block_does_not_split_its_conversations(
    engines: EngineFleet, router_factory: Callable[..., Any],
    clients: Callable[[Any], anthropic.Anthropic],
) -> None:
    """Claude Code opens ``system`` with an attribution block whose hash changes with each
    conversation; the engine leaves it out of the prompt (as vLLM does), and so does the
    prefix key: every conversation behind one system prompt goes to one engine, whose
    cache serves that prompt."""
    router = router_factory(_config(engines))
    router.wait_healthy()
    client = clients(router)
    backends = []
    for i in range(6):
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": f"Task {i}"}],
            system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.88."
                     f"{i:03x}; cc_entrypoint=cli; cch={i * 7919:05x};"},
                    {"type": "text", "text": "You are Claude Code. "},
                    {"type": "text", "text": SYSTEM}])
        backends.append(raw.headers["x-continuum-backend"])
        answer = raw.parse()
        if i:
            assert (answer.usage.cache_read_input_tokens or 0) > 500
    assert len(set(backends)) == 1
    # the engine got the blocks as the client sent them
    sent = engines.received(backends[0])[-1]["body"]
    assert sent["system"][0]["text"].startswith("x-anthropic-billing-header: cc_version")


def test_models_list_and_a_backend_without_the_setting_until_a_reload(
    engines: EngineFleet, router_factory: Callable[..., Any],
    clients: Callable[[Any], anthropic.Anthropic],
) -> None:
    cfg = _config(engines)
    router = router_factory(cfg)
    router.wait_healthy()
    client = clients(router)
    assert [m.id for m in client.models.list()] == [MODEL]

    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model=OTHER, max_tokens=8, messages=USER)
    body: Any = err.value.body
    assert body["type"] == "error"
    assert body["error"]["message"] == (
        f"The model '{OTHER}' is served by this router's OpenAI endpoints "
        "(/v1/chat/completions, ...), not by /anthropic/v1/messages, which reaches type: "
        "anthropic and type: gemini backends, and engines configured with "
        "anthropic_messages: true")
    assert engines.received("plain") == []

    # turned on by a reload, as any backend change: the engine is probed, then used
    cfg["backends"][3]["anthropic_messages"] = True
    router.config_path.write_text(yaml.safe_dump(
        {**cfg, "server": {"bind": f"127.0.0.1:{router.port}", "workers": 1}}))
    reload = requests.post(router.url + "/admin/config/reload", timeout=10)
    assert reload.status_code == 200, reload.text
    assert "backends.plain" in reload.json()["applied"]
    assert [m.id for m in client.models.list()] == sorted([MODEL, OTHER])
    assert client.messages.create(model=OTHER, max_tokens=8, messages=USER).content
    assert engines.received("plain")[-1]["path"] == "/v1/messages"

    # an engine's own errors come back in Anthropic's shape, with its status
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8,
                               messages=[{"role": "robot", "content": "hi"}])  # type: ignore[typeddict-item]
    bad_body: Any = bad.value.body
    assert bad_body["type"] == "error"
    assert bad_body["error"]["message"] == \
        "'messages[0].role' must be 'user', 'assistant' or 'system'"


def test_per_tenant_salts_refuse_an_engine_with_the_setting(
    engines: EngineFleet, router_factory: Callable[..., Any], tmp_path: Path
) -> None:
    cfg = _config(engines, auth={"keys": [{"key": "sk-a", "tenant": "a"}]},
                  admin={"token": "t"})
    cfg["kv_cache_index"]["cache_salt"]["per_tenant"] = True
    path = tmp_path / "per-tenant.yaml"
    path.write_text(yaml.safe_dump(cfg))
    message = ("backends[0].anthropic_messages: the engine's /v1/messages takes no "
               "cache_salt, so its /anthropic requests would share its prefix cache across "
               "tenants despite kv_cache_index.cache_salt.per_tenant; set one of the two "
               "false")

    check = subprocess.run([sys.executable, "-m", "continuum.cli", "config", "validate",
                            str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1
    assert message in check.stdout
    assert "backends[3]" not in check.stdout  # the plain engine is fine

    with pytest.raises(RuntimeError, match="router did not start") as failed:
        router_factory(cfg)
    assert message in str(failed.value)

    # per-tenant salts need a restart: a reload that turns them off in the file, together
    # with the setting, would run the setting under the salts still in force
    for backend in cfg["backends"][:3]:
        backend["anthropic_messages"] = False
    router = router_factory(cfg)
    cfg["backends"][0]["anthropic_messages"] = True
    cfg["kv_cache_index"]["cache_salt"]["per_tenant"] = False
    router.config_path.write_text(yaml.safe_dump(
        {**cfg, "server": {"bind": f"127.0.0.1:{router.port}", "workers": 1}}))
    reload = requests.post(router.url + "/admin/config/reload", timeout=10,
                           headers={"Authorization": "Bearer t"})
    assert reload.status_code == 400, reload.text
    assert message in reload.text
    refused = requests.post(router.url + "/anthropic/v1/messages", timeout=10,
                            headers={"x-api-key": "sk-a"},
                            json={"model": MODEL, "max_tokens": 8, "messages": USER})
    assert refused.status_code == 404  # nothing was changed
