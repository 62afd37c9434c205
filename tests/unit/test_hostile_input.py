"""Hostile input through the real app never gets a 5xx (hypothesis, real fake upstream).

The app runs in-process (falcon.testing) with every tier that reads the body switched on,
in front of a real ``continuum.devtools.fake_upstream`` on 127.0.0.1 that answers whatever
gets through, so a 5xx here is the router's, never a missing upstream's.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterator
from typing import Any

import falcon.testing
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum.config import parse_config
from continuum.devtools.servers import FakeUpstream
from continuum.registry import PluginRegistry
from continuum.request import DEFAULT_MAX_JSON_DEPTH, NUMBER_FIELDS
from continuum.web.app import create_app

PATHS = ("/v1/chat/completions", "/v1/completions", "/anthropic/v1/messages")
#: Also parses a client request and derives its keys (admin API, opened by the config).
EXPLAIN = "/admin/routing/explain"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
#: Top-level fields the router reads or checks.
KNOWN = (*NUMBER_FIELDS, "model", "messages", "stream", "prompt", "input", "system", "stop",
         "stop_sequences", "logprobs", "tools", "cache_salt", "metadata", "cache_control")
#: How the admission guard's 400 begins (an exception no explicit check foresaw).
GUARD_MESSAGE = "the request could not be processed"
BOUNDED = settings(max_examples=150, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow])


def _config(url: str) -> dict[str, Any]:
    return {
        "backends": [{"name": "up", "url": url, "models": ["m"]},
                     {"name": "anth", "url": url, "type": "anthropic", "models": ["m"],
                      "api_key": "k"}],
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True},
        "response_cache": {"enabled": True},
        "kv_cache_index": {"enabled": True,
                           "event_sources": [{"backend_name": "up",
                                              "endpoint": "http://127.0.0.1:9/events/up"}],
                           "cache_salt": {"enabled": True, "secret": "s"}},
        "health_check": {"enabled": False},
        "admin": {"allow_unauthenticated": True},  # explain parses requests too
    }


@pytest.fixture
def client(upstreams: Callable[[str], FakeUpstream]) -> Iterator[falcon.testing.TestClient]:
    app = create_app(parse_config(_config(upstreams("up").url)), registry=PluginRegistry())
    yield falcon.testing.TestClient(app)
    app.service.stop()


def _assert_answered(client: falcon.testing.TestClient, path: str, body: bytes) -> None:
    """Not a 5xx; a router error is in the client's shape and comes from an explicit check
    (not from the admission guard's catch-all); the id header is always there."""
    resp = client.simulate_post(path, body=body, headers={"Content-Type": "application/json"})
    assert resp.status_code < 500, (body[:300], resp.status_code, resp.text[:300])
    assert resp.headers.get("X-Request-Id")
    if resp.status_code >= 400 and "X-Continuum-Backend" not in resp.headers:
        doc = json.loads(resp.content)
        if path.startswith("/anthropic/"):
            assert doc["type"] == "error" and doc["error"]["type"] and doc["error"]["message"]
        else:
            assert {"message", "type", "param", "code"} <= set(doc["error"])
        assert not doc["error"]["message"].startswith(GUARD_MESSAGE), (body[:300], doc)


def _still_serves(client: falcon.testing.TestClient) -> None:
    resp = client.simulate_post(PATHS[0], json={"model": "m", "messages": MSGS})
    assert resp.status_code == 200 and resp.json["choices"][0]["message"]["content"] == \
        "hello from up"


# --- strategies --------------------------------------------------------------------------

_huge_ints = st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**4000)])
_scalars = (st.none() | st.booleans() | st.integers() | _huge_ints
            | st.floats(allow_nan=True, allow_infinity=True)
            | st.text(max_size=20) | st.characters(categories=["Cs"]))  # lone surrogates
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=15)
_keys = st.sampled_from(KNOWN) | st.text(max_size=8).filter(lambda k: k != "x_test")
_bodies = st.dictionaries(_keys, _json, max_size=6) | _json


def _encode(value: Any, ascii_only: bool) -> bytes:
    # NaN and Infinity go out as the JSON extensions json.loads accepts.
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@BOUNDED
@given(path=st.sampled_from((*PATHS, EXPLAIN)), body=_bodies, ascii_only=st.booleans())
def test_random_json_never_gets_a_5xx(client: falcon.testing.TestClient, path: str,
                                      body: Any, ascii_only: bool) -> None:
    _assert_answered(client, path, _encode(body, ascii_only))


@BOUNDED
@given(path=st.sampled_from((*PATHS, EXPLAIN)), field=st.sampled_from(KNOWN), value=_json,
       stream=st.booleans())
def test_any_value_at_every_known_field(client: falcon.testing.TestClient, path: str,
                                        field: str, value: Any, stream: bool) -> None:
    body: dict[str, Any] = {"model": "m", "messages": MSGS, "prompt": "p", "max_tokens": 5,
                            "temperature": 0, "stream": stream}
    body[field] = value
    _assert_answered(client, path, _encode(body, True))


@BOUNDED
@given(path=st.sampled_from(PATHS), data=st.binary(max_size=600))
def test_random_bytes_never_get_a_5xx(client: falcon.testing.TestClient, path: str,
                                      data: bytes) -> None:
    _assert_answered(client, path, data)


@BOUNDED
@given(path=st.sampled_from(PATHS),
       depth=st.integers(0, 3 * DEFAULT_MAX_JSON_DEPTH) | st.integers(900, 20_000),
       objects=st.booleans(), wrapped=st.booleans(),
       decoy=st.sampled_from(["", '"]]]]", ', '"\\"[[", ', '"\\\\", ']))
def test_deep_nesting_never_gets_a_5xx(client: falcon.testing.TestClient, path: str,
                                       depth: int, objects: bool, wrapped: bool,
                                       decoy: str) -> None:
    opener, closer = ('{"k":', "}") if objects else ("[" + decoy, "]")
    nested = opener * depth + "0" + closer * depth
    text = '{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":"p",' \
           f'"metadata":{nested}}}' if wrapped else nested
    raw = text.encode()
    resp = client.simulate_post(path, body=raw)
    assert resp.status_code < 500
    if depth + wrapped > DEFAULT_MAX_JSON_DEPTH:
        assert resp.status_code == 400
        error = resp.json["error"]
        assert "levels deep" in error["message"]


def test_the_worker_survives_the_reported_inputs(client: falcon.testing.TestClient,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The three inputs of the report, on every endpoint: a 400 naming the field."""
    base = '{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":"p",'
    cases = [(b"[" * 990 + b"]" * 990, None),
             ((base + '"temperature":1' + "0" * 400 + "}").encode(), "temperature"),
             ((base + '"top_p":1' + "0" * 400 + "}").encode(), "top_p"),
             ((base + f'"max_tokens":{2**63}}}').encode(), "max_tokens")]
    with caplog.at_level(logging.WARNING):
        for path in PATHS:
            for raw, param in cases:
                resp = client.simulate_post(path, body=raw)
                assert resp.status_code == 400, resp.text
                if path.startswith("/v1/"):
                    assert resp.json["error"]["param"] == param
                else:
                    assert resp.json["error"]["type"] == "invalid_request_error"
                    assert param is None or f"'{param}'" in resp.json["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info]  # no tracebacks logged
    _still_serves(client)


def test_an_unforeseen_exception_while_deriving_keys_is_a_400(
    client: falcon.testing.TestClient, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The admission guard: whatever the key functions raise on some input is the input's
    fault (a 400 carrying the request id, logged with it), never a 500."""
    import continuum.service as service_module

    def broken_cache_key(ctx: object) -> str:
        raise struct.error("argument out of range")

    def broken_prefix_key(*args: object, **kwargs: object) -> bytes:
        raise RecursionError("maximum recursion depth exceeded")

    body = {"model": "m", "messages": MSGS, "temperature": 0}
    for name, broken in (("cache_key", broken_cache_key),
                         ("request_prefix_key", broken_prefix_key)):
        with monkeypatch.context() as patch:
            patch.setattr(service_module, name, broken)
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                resp = client.simulate_post(PATHS[0], json=body,
                                            headers={"X-Request-Id": f"guard-{name}"})
        assert resp.status_code == 400
        assert resp.json["error"]["code"] == "invalid_request"
        assert f"guard-{name}" in resp.json["error"]["message"]
        logged = [r.getMessage() for r in caplog.records]
        assert any(f"request guard-{name}: input rejected" in m for m in logged), logged
    explain = client.simulate_post("/admin/routing/explain", json=body)
    assert explain.status_code == 200 and explain.json["prefix_hash"]
    _still_serves(client)
