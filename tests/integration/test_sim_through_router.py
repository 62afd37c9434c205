"""The official openai SDK through the router to simulated engines (no fake upstreams)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.test_sim_http import MODEL, SYSTEM, Sim

pytestmark = pytest.mark.e2e


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Sim]:
    # Port 0: each engine binds a port of its own choosing. A single free port would make
    # the second engine assume that the next port is free too (it was once taken).
    sims = Sim(tmp_path, "--fast", "--fleet", "2", count=2, port=0)
    yield sims
    sims.stop()


def test_openai_sdk_streams_from_engines_through_the_router(
    fleet: Sim, router_factory: Any
) -> None:
    router = router_factory({
        "backends": [{"name": f"sim-{i}", "url": url} for i, url in enumerate(fleet.urls)],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "health_check": {"interval_seconds": 30, "path": "/v1/models"},
    })
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What does a prefix cache store?"}]
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        assert [m.id for m in client.models.list()] == [MODEL]  # discovered from the engines
        whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content and streamed
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
        # Same system prompt, same engine (sticky): the second request hits its prefix cache.
        assert usage.prompt_tokens_details.cached_tokens > 0
