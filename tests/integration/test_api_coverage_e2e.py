"""API endpoints clients call besides chat: ``POST /v1/responses`` (OpenAI's Responses API)
and ``POST /anthropic/v1/messages/count_tokens``, through real gunicorn -k gevent with 2
workers, called with the official SDKs' own methods (``responses.create``,
``messages.count_tokens``). The engines are two continuum-sim vLLM engines and the fake
Anthropic API, each speaking its real wire format.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import anthropic
import openai
import pytest
import requests

from continuum.devtools.fleet import metric_sum
from continuum.devtools.procs import Child, free_port, wait_http
from continuum.devtools.servers import FakeUpstream, RouterProcess

pytestmark = pytest.mark.e2e

MODEL = "sim-model"
CLAUDE = "claude-sonnet-4-6"
ANT_KEY = "sk-ant-upstream"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("api-engines")
    ports = {"a": free_port(), "b": free_port(), "claude": free_port()}
    children = {
        name: Child([sys.executable, "-m", "continuum.sim.cli", "--fast", "--port",
                     str(ports[name]), "--model", MODEL], log=tmp / f"{name}.log")
        for name in ("a", "b")
    }
    children["claude"] = Child([sys.executable, "-m", "continuum.sim.anthropic", "--port",
                                str(ports["claude"]), "--api-key", ANT_KEY],
                               log=tmp / "anthropic.log")
    try:
        for name, child in children.items():
            wait_http(f"http://127.0.0.1:{ports[name]}/health", children=[child])
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        for child in children.values():
            child.stop()


@pytest.fixture(scope="module")
def router(fleet: dict[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    cfg = {
        "backends": [
            {"name": "a", "url": fleet["a"], "models": [MODEL]},
            {"name": "b", "url": fleet["b"], "models": [MODEL]},
            {"name": "claude", "url": fleet["claude"], "type": "anthropic",
             "api_key": ANT_KEY, "models": [CLAUDE]},
        ],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "response_cache": {"enabled": True},
    }
    proc = RouterProcess(cfg, tmp_path_factory.mktemp("api-router"), workers=2)
    yield proc
    proc.stop()


def _oai(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)


def _stats(url: str) -> dict[str, int]:
    return requests.get(url + "/sim/stats", timeout=5).json()  # type: ignore[no-any-return]


def test_responses_create_routes_by_instructions_and_reports_usage(
        router: RouterProcess, fleet: dict[str, str]) -> None:
    client = _oai(router)
    instructions = "You summarise tickets for the on-call engineer, tersely. " * 30
    backends = set()
    for i in range(4):
        raw = client.responses.with_raw_response.create(
            model=MODEL, instructions=instructions, input=f"ticket {i}: disk full",
            max_output_tokens=8)
        answer = raw.parse()
        backends.add(raw.headers["x-continuum-backend"])
        assert raw.headers["x-cache"] == "BYPASS"  # never cached: each answer has an id
        assert answer.object == "response" and answer.status == "completed"
        assert answer.output_text  # the SDK's own accessor over output[].content[]
        assert answer.usage is not None and answer.usage.input_tokens > 0
    # The same instructions are one prefix key: every request went to one backend...
    assert len(backends) == 1
    # ...whose engine then held the prefix: later requests report cached input tokens.
    assert answer.usage.input_tokens_details.cached_tokens > 0
    text = router.metrics()
    assert metric_sum(text, "continuum_requests_total", endpoint="responses",
                      outcome="upstream", status_class="2xx") == 4
    assert metric_sum(text, "continuum_prompt_tokens_total") >= 4 * answer.usage.input_tokens - 4
    assert metric_sum(text, "continuum_cached_prompt_tokens_total") > 0


def test_responses_input_items_key_like_the_first_message(router: RouterProcess) -> None:
    """Without instructions, the first message of ``input`` (message items with
    ``input_text`` parts) is the key: the same opening goes to the same backend."""
    client = _oai(router)
    opening = "Here is the incident log of the night shift, line by line. " * 20
    seen = set()
    for follow_up in ("what failed first?", "who was paged?", "what was the fix?"):
        raw = client.responses.with_raw_response.create(model=MODEL, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_text", "text": opening}]},
            {"role": "assistant", "content": "Read it."},
            {"role": "user", "content": follow_up},
        ])
        assert raw.parse().output_text
        seen.add(raw.headers["x-continuum-backend"])
    assert len(seen) == 1


def test_responses_stream_relays_typed_events_and_counts_usage(router: RouterProcess) -> None:
    client = _oai(router)
    before = metric_sum(router.metrics(), "continuum_completion_tokens_total")
    events = list(client.responses.create(model=MODEL, input="stream me a short answer",
                                          max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas
    assert final.usage is not None and final.usage.output_tokens > 0
    after = metric_sum(router.metrics(), "continuum_completion_tokens_total")
    assert after - before == final.usage.output_tokens  # read from response.completed


def test_responses_bad_input_is_a_400_naming_the_field(router: RouterProcess) -> None:
    client = _oai(router)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=42)  # type: ignore[arg-type]
    assert err.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", instructions=["x"])  # type: ignore[arg-type]
    assert err.value.body["param"] == "instructions"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")


def test_count_tokens_reaches_the_anthropic_backend(router: RouterProcess,
                                                    fleet: dict[str, str]) -> None:
    client = anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="x",
                                 max_retries=0)
    short = client.messages.count_tokens(
        model=CLAUDE, messages=[{"role": "user", "content": "How many tokens is this?"}])
    longer = client.messages.count_tokens(
        model=CLAUDE, system="You count tokens for a living. " * 20,
        messages=[{"role": "user", "content": "How many tokens is this?"}])
    assert short.input_tokens > 0
    assert longer.input_tokens > short.input_tokens + 20
    # The fake recorded it on its own path, with the upstream key the router holds.
    received = requests.get(fleet["claude"] + "/_sim/received?n=1", timeout=5).json()
    last = received["received"][-1]
    assert last["path"] == "/v1/messages/count_tokens"
    assert last["headers"]["x-api-key"] == ANT_KEY
    text = router.metrics()
    assert metric_sum(text, "continuum_requests_total", endpoint="anthropic_count_tokens",
                      status_class="2xx") == 2
    # Its refusals come back in Anthropic's shape.
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope",
                                     messages=[{"role": "user", "content": "x"}])


def test_model_ids_with_slashes_are_retrieved_by_the_sdks(
    upstreams: Callable[[str], FakeUpstream], router_factory: Callable[..., RouterProcess]
) -> None:
    """Hugging Face model ids (``org/name``) are what vLLM and SGLang serve; the SDKs ask
    for ``/v1/models/org/name``, which matched no route (404 ``404 Not Found``)."""
    up = upstreams("up")
    hf, claude = "meta-llama/Llama-3.1-8B-Instruct", "vendor/claude-like"
    router = router_factory({
        "backends": [{"name": "up", "url": up.url, "models": [hf]},
                     {"name": "ant", "url": up.url, "type": "anthropic", "api_key": "k",
                      "models": [claude]}],
        "health_check": {"enabled": False}})
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        assert client.models.retrieve(hf).id == hf
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("meta-llama/no-such-model")
    assert "meta-llama/no-such-model" in str(missing.value)
    # the same id with its slash escaped, as a client that quotes path segments sends it
    escaped = requests.get(router.url + "/v1/models/meta-llama%2FLlama-3.1-8B-Instruct",
                           timeout=10)
    assert escaped.status_code == 200 and escaped.json()["id"] == hf
    with anthropic.Anthropic(base_url=router.url + "/anthropic", api_key="x",
                             max_retries=0) as ant:
        assert ant.models.retrieve(claude).id == claude
