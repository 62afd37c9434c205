"""Request parsing against hostile input: nesting depth, numeric ranges, types."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum.errors import RequestError
from continuum.request import (
    ANTHROPIC_MESSAGES,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    INT64_MAX,
    NUMBER_FIELDS,
    _brackets_exceed,
    load_json,
    nesting_exceeds,
    new_request_id,
    parse_request,
)

MSGS = [{"role": "user", "content": "hi"}]


def _raw(**body: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MSGS, **body}).encode()


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (0 for a scalar), level by level."""
    deepest, level = 0, [value]
    while True:
        containers = [v for v in level if isinstance(v, (list, dict))]
        if not containers:
            return deepest
        deepest += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]


def _nested(depth: int, opener: str = "[", closer: str = "]", inner: str = "1") -> bytes:
    return (opener * depth + inner + closer * depth).encode()


# --- nesting depth ---------------------------------------------------------------------

# Strings full of what could fool a scanner: quotes, backslashes, brackets, escapes.
_tricky_text = st.text(alphabet=st.sampled_from(list('"\\[]{}ab\n\t/é\u2028')), max_size=12)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | _tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_tricky_text, inner,
                                                                 max_size=4),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(value=_json_values, ascii_only=st.booleans(), limit=st.integers(0, 12))
def test_the_depth_limit_is_exact_for_valid_json(value: Any, ascii_only: bool,
                                                 limit: int) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    too_deep = _depth(value) > limit
    assert nesting_exceeds(value, limit) == too_deep
    if limit >= 1:
        try:
            assert load_json(raw, max_depth=limit) == value and not too_deep
        except RequestError as exc:
            assert too_deep and exc.code == "json_too_deep"


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64) | st.text(alphabet="[{]}a", max_size=64).map(str.encode),
       limit=st.integers(0, 20))
def test_the_bracket_prefilter_counts_exactly(raw: bytes, limit: int) -> None:
    for body in (raw, raw * 20 + b" " * 600):  # counted when small, found one by one when not
        assert _brackets_exceed(body, limit) == (body.count(b"[") + body.count(b"{") > limit)


def test_depth_helper() -> None:
    assert [_depth(v) for v in (1, [], [1], {"a": [1, {}]}, [[[["x"]]]])] == [0, 1, 1, 3, 4]


@pytest.mark.parametrize("raw", [
    # Brackets inside strings never count, whatever the escapes around them.
    b'["' + b"[" * 500 + b'"]',
    b'["\\"' + b"[" * 500 + b'"]',
    b'["\\\\\\"' + b"{" * 500 + b'"]',
    b'["\\n' + b"]" * 500 + b'", ' + b"[" * 100 + b"]" * 100 + b"]",
])
def test_brackets_in_strings_do_not_count(raw: bytes) -> None:
    assert load_json(raw) == json.loads(raw)


@pytest.mark.parametrize("raw", [
    _nested(129),
    _nested(990),
    _nested(129, '{"a":', "}"),
    # Closers hidden in strings must not hide the depth.
    b'["]]]]]]", ' * 129 + b"1" + b"]" * 129,
    # An escaped backslash before a quote ends the string: the brackets after it count.
    b'["\\\\", ' * 129 + b"1" + b"]" * 129,
    # Deeper than json.loads itself will go: refused, not a RecursionError.
    _nested(100_000),
])
def test_deep_nesting_is_refused(raw: bytes) -> None:
    with pytest.raises(RequestError, match="more than 128 levels deep") as err:
        load_json(raw)
    assert err.value.code == "json_too_deep" and err.value.status == 400


def test_an_invalid_text_nested_deep_is_refused_either_way() -> None:
    """1,250 levels, then a syntax error. A decoder that gives up on the depth first
    (RecursionError) makes it json_too_deep; one that descends that far meets the error
    (invalid_json): which one happens depends on the interpreter's C recursion limit
    (msgspec's decoder and CPython 3.13's json.loads go deeper). Both are a 400, never a
    500."""
    with pytest.raises(RequestError) as err:
        load_json(_nested(2000)[:2500] + b"\\x")
    assert err.value.code in ("invalid_json", "json_too_deep") and err.value.status == 400


def test_the_limit_is_inclusive_and_configurable() -> None:
    assert load_json(_nested(128)) is not None
    with pytest.raises(RequestError):
        load_json(_nested(129))
    assert load_json(_nested(512), max_depth=512) is not None  # the config's maximum parses
    with pytest.raises(RequestError):
        load_json(_nested(9), max_depth=8)


def test_nesting_far_beyond_the_interpreter_limit_is_cheap_and_refused() -> None:
    raw = _nested(sys.getrecursionlimit() * 50)
    with pytest.raises(RequestError, match="levels deep"):
        parse_request(raw, CHAT)


def test_non_utf8_json_is_refused() -> None:
    body = json.dumps({"model": "m", "messages": MSGS})
    for encoded in (body.encode("utf-16"), body.encode("utf-32-le")):
        with pytest.raises(RequestError, match="not UTF-8") as err:
            parse_request(encoded, CHAT)
        assert err.value.code == "invalid_json"
    assert parse_request(b"\xef\xbb\xbf" + body.encode(), CHAT).model == "m"  # UTF-8 BOM


# --- msgspec first, json for what it refuses ------------------------------------------

def _json_outcome(raw: bytes) -> tuple[str, str]:
    """What json alone makes of a UTF-8 body (the reference): its value's repr (NaN and
    -0.0 compare by repr), or the error it raises."""
    try:
        return "value", repr(json.loads(raw.decode("utf-8", "surrogatepass")))
    except (ValueError, UnicodeDecodeError) as exc:
        return "error", f"request body is not valid JSON: {exc}"


def _load_outcome(raw: bytes) -> tuple[str, str]:
    try:
        return "value", repr(load_json(raw, max_depth=512))
    except RequestError as exc:
        assert exc.code == "invalid_json"
        return "error", str(exc)


_any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=4),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(value=_any_json, ascii_only=st.booleans())
def test_bodies_decode_to_what_json_gives(value: Any, ascii_only: bool) -> None:
    """Any document (integers of any size, floats to the last bit, text escaped or as
    UTF-8, repeated keys collapsed as json collapses them) decodes as json.loads does."""
    raw = json.dumps({"v": value, "k": 1, "k ": [value]}, ensure_ascii=ascii_only).encode()
    assert _load_outcome(raw) == _json_outcome(raw)
    assert _load_outcome(b'{"a": 1, "a": ' + raw + b"}") == \
        _json_outcome(b'{"a": 1, "a": ' + raw + b"}")


@pytest.mark.parametrize("raw", [
    # json accepts these; msgspec refuses them, so json decides
    b'{"t": NaN, "u": Infinity, "v": -Infinity}',
    b'{"t": 1e400, "u": -1e400}',
    b'{"s": "\\ud800 lone", "p": "\\udc00"}',
    b'{"s": "\xed\xa0\x80"}',  # a surrogate encoded in the bytes (surrogatepass)
    # both refuse: json's message, as before
    b'{"a": 1} trailing',
    b'{"a": "\xff"}',
    b'{"a": }',
    b"{",
    # both accept
    b'{"big": 123456789012345678901234567890, "neg": -18446744073709551617}',
    b'{"f": [0.1, 1e-400, -0.0, 4.9e-324, 1.7976931348623157e308, 1E2, -0]}',
    b'{"e": "\\ud83d\\ude00 \\u00e9 \\n \\/"}',
])
def test_what_msgspec_refuses_json_decides(raw: bytes) -> None:
    assert _load_outcome(raw) == _json_outcome(raw)


def test_a_plain_body_is_decoded_by_msgspec(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast decoder is the one used for an ordinary request (json only after it
    refused): a change that always fell back would pass every equality test above."""
    import continuum.request as request_module

    calls: list[bytes] = []
    fast = request_module._fast_decode

    def counted(raw: bytes) -> Any:
        calls.append(raw)
        return fast(raw)

    monkeypatch.setattr(request_module, "_fast_decode", counted)
    monkeypatch.setattr(request_module.json, "loads", None)  # json is not reached
    assert parse_request(_raw(temperature=0.5), CHAT).temperature == 0.5
    assert calls == [_raw(temperature=0.5)]


# --- numbers and types -----------------------------------------------------------------

@pytest.mark.parametrize(("field", "literal", "code"), [
    ("temperature", "1" + "0" * 400, "invalid_value"),   # 10**400: OverflowError in float()
    ("temperature", "1e400", "invalid_value"),           # json.loads makes it inf
    ("temperature", "NaN", "invalid_value"),
    ("temperature", "-Infinity", "invalid_value"),
    ("temperature", "-0.5", "invalid_value"),
    ("temperature", '"hot"', "invalid_type"),
    ("temperature", "true", "invalid_type"),
    ("top_p", "1" + "0" * 400, "invalid_value"),
    ("top_p", "1.5", "invalid_value"),
    ("top_p", "Infinity", "invalid_value"),
    ("max_tokens", str(2**63), "invalid_value"),         # struct.error in the cache key
    ("max_tokens", "-1", "invalid_value"),
    ("max_tokens", "1.5", "invalid_type"),
    ("max_tokens", '"10"', "invalid_type"),
    ("max_completion_tokens", str(2**64), "invalid_value"),
    ("n", "0", "invalid_value"),
    ("n", "1e3", "invalid_type"),
    ("seed", str(2**64), "invalid_value"),
    ("frequency_penalty", "2.5", "invalid_value"),
    ("presence_penalty", "NaN", "invalid_value"),
    ("top_k", "-2", "invalid_value"),
    ("logprobs", "-1", "invalid_value"),
    ("logprobs", '"yes"', "invalid_type"),
    ("top_logprobs", "[]", "invalid_type"),
    ("stop", "5", "invalid_type"),
    ("stop", "[1]", "invalid_type"),
    ("stream", '"yes"', "invalid_type"),
    ("messages", '"hi"', "invalid_type"),
])
def test_out_of_range_and_wrong_types_name_the_field(field: str, literal: str,
                                                     code: str) -> None:
    body = {"model": "m", "messages": MSGS}
    body.pop(field, None)
    raw = json.dumps(body)[:-1] + f', "{field}": {literal}}}'
    with pytest.raises(RequestError) as err:
        parse_request(raw.encode(), CHAT)
    assert (err.value.status, err.value.param, err.value.code) == (400, field, code)
    assert f"'{field}'" in err.value.message and len(err.value.message) < 200


@pytest.mark.parametrize(("endpoint", "field", "value"), [
    (COMPLETIONS, "prompt", 5),
    (EMBEDDINGS, "input", {"a": 1}),
    (ANTHROPIC_MESSAGES, "system", 1.5),
    (ANTHROPIC_MESSAGES, "stop_sequences", "END"),
])
def test_each_endpoint_checks_its_input_field(endpoint: str, field: str, value: Any) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(_raw(**{field: value}), endpoint)
    assert err.value.param == field and err.value.code == "invalid_type"


def test_messages_must_be_objects() -> None:
    with pytest.raises(RequestError) as err:
        parse_request(json.dumps({"model": "m", "messages": [MSGS[0], "x"]}).encode(), CHAT)
    assert err.value.param == "messages[1]"


def test_accepted_edges_and_engine_extensions() -> None:
    ctx = parse_request(_raw(temperature=7, top_p=1, max_tokens=INT64_MAX, seed=-(2**63), n=1,
                             top_k=-1, logprobs=True, top_logprobs=0, stop=None,
                             presence_penalty=-2, stream=None, min_p=0.0), CHAT)
    assert (ctx.temperature, ctx.top_p, ctx.max_tokens, ctx.stream) == (7.0, 1.0, INT64_MAX,
                                                                       False)
    assert type(ctx.temperature) is float
    assert parse_request(_raw(logprobs=5), COMPLETIONS).body["logprobs"] == 5
    assert parse_request(_raw(max_tokens=None, max_completion_tokens=9), CHAT).max_tokens == 9
    for name, spec in NUMBER_FIELDS.items():  # every field takes null and its own bounds
        for value in (None, spec.low, spec.high):
            parse_request(_raw(**{name: value}), CHAT)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(NUMBER_FIELDS)),
       value=st.one_of(st.floats(), st.integers(min_value=-(10**400), max_value=10**400),
                       st.text(max_size=3), st.booleans(), st.lists(st.integers(), max_size=2)))
def test_number_fields_accept_exactly_their_range(field: str, value: Any) -> None:
    spec = NUMBER_FIELDS[field]
    kind_ok = type(value) is int or (type(value) is float and not spec.integer)
    ok = kind_ok and spec.low <= value <= spec.high
    raw = _raw(**{field: value})
    if ok:
        parse_request(raw, CHAT)
    else:
        with pytest.raises(RequestError) as err:
            parse_request(raw, CHAT)
        assert err.value.param == field


def test_request_ids_keep_sane_client_values_only() -> None:
    assert new_request_id("req-42_a.b:c") == "req-42_a.b:c"
    for insane in ("", "-leading-dash", "x" * 129, "a b", "id\u00e9", "a/b", None):
        fresh = new_request_id(insane)
        assert fresh != insane and len(fresh) == 32
    assert new_request_id() != new_request_id()


def test_responses_keys_come_from_instructions_then_input() -> None:
    """A Responses request is keyed like the chat request it stands for: ``instructions``
    as the system prompt, else the first ``input`` message (string or ``input_text``)."""
    from continuum.prefix import request_prefix_key
    from continuum.request import CHAT, RESPONSES, parse_request

    def key(body: dict[str, object], endpoint: str = RESPONSES) -> bytes | None:
        ctx = parse_request(json.dumps({"model": "m", **body}).encode(), endpoint)
        return request_prefix_key(ctx.keyed_body, "m")

    chat_system = key({"messages": [{"role": "system", "content": "Be terse."},
                                    {"role": "user", "content": "q"}]}, CHAT)
    assert key({"instructions": "Be terse.", "input": "q1"}) == chat_system
    assert key({"instructions": "Be terse.", "input": "another"}) == chat_system
    chat_user = key({"messages": [{"role": "user", "content": "Read this log."}]}, CHAT)
    assert key({"input": "Read this log."}) == chat_user
    assert key({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Read this log."}]}]}) == chat_user
    assert key({"input": "Read that log."}) != chat_user
