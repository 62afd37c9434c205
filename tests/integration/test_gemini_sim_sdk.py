"""The fake Gemini API (``continuum.sim.gemini``) is faithful: Google's own google-genai SDK
drives it, caches create/get/list/update/delete and ``generate_content`` with
``cached_content``, whole and streamed, and reads its errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from google import genai
from google.genai import errors, types

from continuum.devtools.gemini_fake import FakeGeminiProcess

KEY = "AIza-test-key"
MODEL = "gemini-2.5-flash"
SYSTEM = "You are the router's manual. Answer from it and nothing else. " * 150


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGeminiProcess]:
    proc = FakeGeminiProcess(tmp_path_factory.mktemp("gemini"), api_key=KEY)
    yield proc
    proc.stop()


@pytest.fixture
def client(fake: FakeGeminiProcess) -> Iterator[genai.Client]:
    fake.reset()
    c = genai.Client(api_key=KEY, http_options=types.HttpOptions(
        base_url=fake.url, retry_options=types.HttpRetryOptions(attempts=1)))
    yield c
    c.close()


def test_cache_lifecycle_with_the_sdk(client: genai.Client, fake: FakeGeminiProcess) -> None:
    cache = client.caches.create(model=MODEL, config=types.CreateCachedContentConfig(
        system_instruction=SYSTEM, ttl="300s", display_name="manual"))
    assert cache.name is not None and cache.name.startswith("cachedContents/")
    assert cache.model == "models/" + MODEL and cache.display_name == "manual"
    assert cache.usage_metadata is not None and cache.usage_metadata.total_token_count
    assert cache.expire_time is not None and cache.create_time is not None
    assert 299 <= (cache.expire_time - cache.create_time).total_seconds() <= 301
    assert fake.received("/cachedContents", "POST")[0]["headers"]["x-goog-api-key"] == KEY

    got = client.caches.get(name=cache.name)
    assert got.name == cache.name and got.expire_time == cache.expire_time
    updated = client.caches.update(name=cache.name,
                                   config=types.UpdateCachedContentConfig(ttl="900s"))
    assert updated.expire_time is not None and updated.expire_time > cache.expire_time

    answer = client.models.generate_content(
        model=MODEL, contents="How do I clear it?",
        config=types.GenerateContentConfig(cached_content=cache.name))
    assert answer.text and answer.usage_metadata is not None
    total = cache.usage_metadata.total_token_count
    assert answer.usage_metadata.cached_content_token_count == total
    assert answer.usage_metadata.prompt_token_count is not None
    assert answer.usage_metadata.prompt_token_count > total
    assert answer.candidates is not None
    assert answer.candidates[0].finish_reason == types.FinishReason.STOP

    streamed = list(client.models.generate_content_stream(
        model=MODEL, contents="How do I clear it?",
        config=types.GenerateContentConfig(cached_content=cache.name)))
    assert "".join(c.text or "" for c in streamed) == answer.text
    last = streamed[-1].usage_metadata
    assert last is not None and last.cached_content_token_count == total

    with pytest.raises(errors.ClientError) as refused:
        client.models.generate_content(
            model=MODEL, contents="Both?", config=types.GenerateContentConfig(
                cached_content=cache.name, system_instruction="Be brief."))
    assert refused.value.code == 400
    assert "CachedContent can not be used" in str(refused.value.message)

    client.caches.delete(name=cache.name)
    with pytest.raises(errors.ClientError) as gone:
        client.caches.get(name=cache.name)
    assert gone.value.code == 403 and gone.value.status == "PERMISSION_DENIED"
    assert fake.stats()["deleted"] == 1 and fake.stats()["live"] == 0


def test_list_pages_and_minimum_size(client: genai.Client) -> None:
    names = {client.caches.create(model=MODEL, config=types.CreateCachedContentConfig(
        system_instruction=f"Copy {i}. " + SYSTEM, ttl="120s")).name for i in range(3)}
    pager = client.caches.list(config=types.ListCachedContentsConfig(page_size=2))
    assert len(pager.page) == 2
    assert {c.name for c in pager} == names

    with pytest.raises(errors.ClientError) as small:
        client.caches.create(model=MODEL, config=types.CreateCachedContentConfig(
            system_instruction="Too short.", ttl="120s"))
    assert small.value.code == 400 and small.value.status == "INVALID_ARGUMENT"
    assert "Cached content is too small" in str(small.value.message)
    assert "min_total_token_count=2048" in str(small.value.message)


def test_implicit_caching_reports_cached_tokens(client: genai.Client) -> None:
    config = types.GenerateContentConfig(system_instruction=SYSTEM)
    first = client.models.generate_content(model=MODEL, contents="One?", config=config)
    second = client.models.generate_content(model=MODEL, contents="Two?", config=config)
    assert first.usage_metadata is not None and second.usage_metadata is not None
    assert not first.usage_metadata.cached_content_token_count
    cached = second.usage_metadata.cached_content_token_count
    assert cached is not None and cached > 2048
    # promptTokenCount is the whole prompt, the implicitly cached part counted once
    assert second.usage_metadata.prompt_token_count == first.usage_metadata.prompt_token_count
    assert first.usage_metadata.prompt_token_count is not None
    assert cached < first.usage_metadata.prompt_token_count


def test_wrong_key_is_refused(fake: FakeGeminiProcess) -> None:
    with genai.Client(api_key="wrong", http_options=types.HttpOptions(
            base_url=fake.url, retry_options=types.HttpRetryOptions(attempts=1))) as bad, \
            pytest.raises(errors.ClientError) as refused:
        bad.models.generate_content(model=MODEL, contents="Hi")
    assert refused.value.code == 400 and "API key not valid" in str(refused.value.message)


def test_implicit_caching_on_the_openai_endpoint_counts_the_prompt_once(
        fake: FakeGeminiProcess) -> None:
    fake.reset()
    usages = []
    for question in ("One?", "Two?"):
        resp = requests.post(fake.url + "/v1beta/openai/chat/completions", timeout=10,
                             headers={"Authorization": f"Bearer {KEY}"}, json={
                                 "model": MODEL, "messages": [
                                     {"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": question}]})
        assert resp.status_code == 200, resp.text
        usages.append(resp.json()["usage"])
    first, second = usages
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 2048 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
