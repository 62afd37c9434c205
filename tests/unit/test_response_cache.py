"""Tier 2 logic: cache key layout, eligibility, envelopes, stream tee, tenants."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import pytest

from continuum.auth import ClientAuth
from continuum.caching.cache_key import cache_key
from continuum.caching.response_cache import ResponseCache, decode_entry, encode_entry
from continuum.config import parse_config
from continuum.errors import AuthenticationError, StoreError
from continuum.interfaces import CacheStore, CacheStoreStats
from continuum.metrics import RouterMetrics
from continuum.request import ANTHROPIC_MESSAGES, CHAT, parse_request

MSGS = [{"role": "user", "content": "What is 2+2?"}]


def ctx_of(tenant: str | None = None, endpoint: str = CHAT, **body: Any):  # type: ignore[no-untyped-def]
    body = {"model": "m", "messages": MSGS, **body}
    return parse_request(json.dumps(body).encode(), endpoint, tenant=tenant)


class DictStore(CacheStore):
    name = "dict"

    def __init__(self, fail: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.fail = fail

    def get(self, key: str) -> bytes | None:
        if self.fail:
            raise StoreError("down", store="dict", kind="connection")
        return self.data.get(key)

    def set(self, key: str, value: bytes, ttl: float) -> None:
        if self.fail:
            raise StoreError("down", store="dict", kind="connection")
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def clear(self) -> int:
        n = len(self.data)
        self.data.clear()
        return n

    def stats(self) -> CacheStoreStats:
        return CacheStoreStats(backend="dict", entries=len(self.data))


def make_cache(store: CacheStore | None = None, **cfg: Any) -> ResponseCache:
    config = parse_config({"response_cache": {"enabled": True, **cfg}}).response_cache
    return ResponseCache(config, store or DictStore(), RouterMetrics())


def test_key_matches_documented_layout() -> None:
    ctx = ctx_of(temperature=0, max_tokens=5, user="alice")
    messages = b"4:role4:user;".replace(b";", b"7:content12:What is 2+2?;")
    expected = hashlib.sha256(b"\x00".join([
        b"m", b"F" + hashlib.sha256(messages).digest(), b"S" + struct.pack(">d", 0.0),
        b"S" + struct.pack(">q", 5), b"N", b"N", b"N", b"chat", b"B"])).hexdigest()
    assert cache_key(ctx) == expected


@pytest.mark.parametrize("change", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"response_format": {"type": "json_object"}},
    {"stop": ["\n"]}, {"seed": 1}, {"n": 2}, {"presence_penalty": 0.5}, {"logprobs": True},
    {"stream": True}, {"max_tokens": 0}, {"top_p": 1.0}, {"temperature": 0},
    {"messages": [{"role": "user", "content": "What is 2+3?"}]},
])
def test_anything_that_changes_the_answer_changes_the_key(change: dict) -> None:
    assert cache_key(ctx_of()) != cache_key(ctx_of(**change))


def test_bookkeeping_fields_and_tenants() -> None:
    assert cache_key(ctx_of(user="a", metadata={"x": 1})) == cache_key(ctx_of(user="b"))
    assert cache_key(ctx_of("t1")) != cache_key(ctx_of("t2"))
    assert cache_key(ctx_of("t1")) != cache_key(ctx_of(None))
    assert cache_key(ctx_of(endpoint=ANTHROPIC_MESSAGES)) != cache_key(ctx_of())


def test_eligibility_and_counts() -> None:
    cache = make_cache()
    assert cache.eligible(ctx_of(), None) and cache.eligible(ctx_of(temperature=0), None)
    assert not cache.eligible(ctx_of(temperature=0.7), None)
    assert not cache.eligible(ctx_of(), "no-cache")
    assert cache.eligible(ctx_of(stream=True), None)
    no_stream = make_cache(cache_streaming=False)
    assert not no_stream.eligible(ctx_of(stream=True), None)
    assert not make_cache(enabled=False).eligible(ctx_of(), None)
    assert cache.counts["skip"] == 2


def test_miss_store_hit_roundtrip() -> None:
    cache = make_cache()
    ctx = ctx_of()
    assert cache.lookup(ctx) is None
    cache.store_body(ctx, 200, "application/json", b'{"ok":1}')
    hit = cache.lookup(ctx_of())
    assert hit is not None and hit.payload == b'{"ok":1}' and hit.kind == "body"
    assert cache.counts == {"hit": 1, "miss": 1, "skip": 0}
    cache.store_body(ctx_of(seed=9), 500, "application/json", b"err")
    big = ctx_of(seed=10)
    cache.lookup(big)
    cache.store_body(big, 200, "application/json", b"x" * 2_000_000)
    assert len(cache.store.data) == 1  # type: ignore[attr-defined]


def test_garbage_entries_are_misses_and_replaced() -> None:
    store = DictStore()
    cache = make_cache(store)
    ctx = ctx_of()
    key = cache_key(ctx)
    garbages = (b"\x00garbage", b"CRv1\xff\xff\xff\xff", b"CRv1" + struct.pack(">I", 3) + b"{x}",
                encode_entry("sse", "text/event-stream", b"data: [DONE]\n\n"))
    for garbage in garbages:
        store.data[key] = garbage
        assert cache.lookup(ctx_of()) is None
        assert key not in store.data
    assert decode_entry(encode_entry("body", "a/b", b"")) is not None


def test_failing_store_is_a_miss_not_an_error() -> None:
    cache = make_cache(DictStore(fail=True))
    ctx = ctx_of()
    assert cache.lookup(ctx) is None
    cache.store_body(ctx, 200, "application/json", b"{}")  # swallowed
    assert cache.counts["miss"] == 1


SSE = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"]


def _tee(cache: ResponseCache, chunks: list[bytes], completed: bool = True,
         protocol_endpoint: str = CHAT):  # type: ignore[no-untyped-def]
    ctx = ctx_of(stream=True, endpoint=protocol_endpoint)
    cache.lookup(ctx)
    return ctx, cache.tee_stream(ctx, iter(chunks), "text/event-stream", lambda: completed)


def test_complete_stream_is_stored_and_replayed_per_event() -> None:
    cache = make_cache()
    _ctx, tee = _tee(cache, SSE)
    assert b"".join(tee) == b"".join(SSE)
    hit = cache.lookup(ctx_of(stream=True))
    assert hit is not None and list(hit.events()) == SSE


@pytest.mark.parametrize(("chunks", "completed"), [
    (SSE, False),  # the upstream broke: relay yielded an error event
    (SSE[:1], True),  # no [DONE]: truncated
])
def test_incomplete_streams_are_not_stored(chunks: list[bytes], completed: bool) -> None:
    cache = make_cache()
    _ctx, tee = _tee(cache, chunks, completed)
    list(tee)
    assert cache.store.data == {}  # type: ignore[attr-defined]


def test_client_disconnect_mid_stream_is_not_stored() -> None:
    cache = make_cache()
    closed = []

    def upstream():  # type: ignore[no-untyped-def]
        try:
            yield from SSE
        finally:
            closed.append(True)

    ctx = ctx_of(stream=True)
    cache.lookup(ctx)
    tee = cache.tee_stream(ctx, upstream(), "text/event-stream", lambda: True)
    next(tee)
    tee.close()
    assert closed == [True] and cache.store.data == {}  # type: ignore[attr-defined]


def test_oversize_stream_is_passed_through_but_not_stored() -> None:
    cache = make_cache(max_stream_buffer_size=40)
    _ctx, tee = _tee(cache, SSE)
    assert b"".join(tee) == b"".join(SSE)
    assert cache.store.data == {}  # type: ignore[attr-defined]


def test_client_auth_maps_keys_to_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K2", "key-two")
    cfg = parse_config({"auth": {"required": True, "keys": [
        {"key": "key-one", "tenant": "acme"}, {"key_env": "K2", "tenant": "globex"}]}})
    auth = ClientAuth(cfg.auth)
    assert auth.tenant("Bearer key-one", None) == "acme"
    assert auth.tenant(None, "key-two") == "globex"
    with pytest.raises(AuthenticationError):
        auth.tenant("Bearer nope", None)
    with pytest.raises(AuthenticationError):
        auth.tenant(None, None)
    optional = ClientAuth(parse_config({"auth": {"keys": [
        {"key": "key-one", "tenant": "acme"}]}}).auth)
    assert optional.tenant("Bearer unknown", None) is None


def test_non_string_content_takes_the_json_path_and_still_separates() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    as_parts = ctx_of(messages=parts)
    as_text = ctx_of()
    assert cache_key(as_parts) != cache_key(as_text)
    # Field boundaries are unambiguous: moving text between fields changes the key.
    a = ctx_of(messages=[{"role": "user", "content": "ab"}])
    b = ctx_of(messages=[{"role": "usera", "content": "b"}])
    assert cache_key(a) != cache_key(b)
    three = ctx_of(messages=[{"role": "user", "content": "a;"}, {"role": "user", "content": "b"}])
    two = ctx_of(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": ";b"}])
    assert cache_key(three) != cache_key(two)
