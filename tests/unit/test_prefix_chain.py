"""The chain of prefix keys: canonical rendering, chunking at message boundaries, depth."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import xxhash

from continuum.prefix_chain import (
    KEY_BYTES,
    chain_root,
    message_bytes,
    message_keys,
    request_chain,
    request_messages,
)

SYSTEM = "You are terse. " * 10  # 149 bytes once stripped; "system\n" makes 156


def body(*messages: tuple[str, str], **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_key_i_is_the_hash_of_key_i_minus_1_and_chunk_i() -> None:
    doc = "x" * 300
    chain = request_chain(body(("system", SYSTEM), ("user", doc)), "m", chunk_bytes=128)
    assert chain is not None
    prev = chain_root("m")
    assert prev == hashlib.sha256(b"cr-chain2\x00m\x00").digest()[:KEY_BYTES]
    assert chain_root("m") is prev  # kept per model (no tools)
    expected = []
    for role, text in (("system", SYSTEM), ("user", doc)):
        data = message_bytes(role, text)
        for start in range(0, len(data), 128):  # each message is cut on its own
            prev = xxhash.xxh3_64(prev + data[start:start + 128]).digest()
            expected.append(prev.hex())
    assert list(chain.keys) == expected
    assert len(chain.keys) == 2 + 3  # 156 bytes -> 2 chunks, 305 bytes -> 3 chunks
    assert chain.ends == (128, 156, 156 + 128, 156 + 256, 156 + 305)
    assert chain.anchor_end == 156 and chain.total_bytes == 156 + 305
    assert chain.route_depth == 2  # the second message fills a chunk: its first one


def test_requests_share_exactly_the_keys_of_their_shared_prefix() -> None:
    doc = "Document about ships. " * 200
    a = request_chain(body(("system", SYSTEM), ("user", doc + "Question one?")), "m")
    b = request_chain(body(("system", SYSTEM), ("user", doc + "Another question?")), "m")
    other = request_chain(body(("system", SYSTEM), ("user", "Other text. " * 400)), "m")
    assert a is not None and b is not None and other is not None
    shared = next(i for i, (x, y) in enumerate(zip(a.keys, b.keys, strict=False)) if x != y)
    assert shared == len(a.keys) - 1  # everything but the chunk holding the question
    assert a.keys[0] == other.keys[0] and a.keys[1] != other.keys[1]
    assert a.route_key == b.route_key != other.route_key  # the documents name the route
    short = request_chain(body(("system", SYSTEM), ("user", "A short question?")), "m")
    assert short is not None and short.route_key is None  # the seed's key decides


def test_model_tools_role_and_message_boundaries_change_the_keys() -> None:
    base = request_chain(body(("system", SYSTEM), ("user", "hi")), "m")
    assert base is not None
    for changed in (
        request_chain(body(("system", SYSTEM), ("user", "hi")), "m2"),
        request_chain(body(("system", SYSTEM), ("user", "hi"), tools=[{"type": "x"}]), "m"),
        request_chain(body(("developer", SYSTEM), ("user", "hi")), "m"),
    ):
        assert changed is not None and changed.keys[0] != base.keys[0]
    joined = request_chain(body(("system", SYSTEM + "hi")), "m")
    assert joined is not None and joined.keys[-1] != base.keys[-1]


def test_whitespace_around_a_message_is_not_part_of_it() -> None:
    a = request_chain(body(("system", SYSTEM), ("user", "hi")), "m")
    b = request_chain(body(("system", "  " + SYSTEM + "\n"), ("user", "hi  ")), "m")
    assert a == b


def test_depth_is_bounded_and_the_tail_ignored() -> None:
    long = request_chain(body(("user", "y" * 10_000)), "m", chunk_bytes=64, max_keys=8)
    assert long is not None and len(long.keys) == 8 and long.ends[-1] == 8 * 64
    assert long.total_bytes == len(message_bytes("user", "y" * 10_000))
    assert request_chain(body(("user", "   ")), "m") is None


def test_claude_codes_attribution_block_is_not_in_the_chain() -> None:
    def body(header: str) -> dict[str, Any]:
        return {"model": "m", "system": [{"type": "text", "text": header},
                                         {"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": "hi"}]}

    first = body("x-anthropic-billing-header: cc_version=2.1.88.a3f; cch=00000;")
    assert request_messages(first) == [("system", SYSTEM), ("user", "hi")]
    assert request_chain(first, "m") == request_chain(
        body("x-anthropic-billing-header: cc_version=2.1.88.e91; cch=4873d;"), "m")


def test_anthropic_system_is_the_first_message() -> None:
    anthropic = {"model": "m", "system": [{"type": "text", "text": SYSTEM}],
                 "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert request_messages(anthropic) == [("system", SYSTEM), ("user", "hi")]
    assert request_chain(anthropic, "m") == request_chain(
        body(("system", SYSTEM), ("user", "hi")), "m")


def test_an_incomplete_last_message_makes_only_its_full_chunks() -> None:
    root = chain_root("m")
    messages = [("system", SYSTEM), ("user", "z" * 300)]
    full = list(message_keys(root, messages, chunk_bytes=128))
    cut = list(message_keys(root, messages, last_complete=False, chunk_bytes=128))
    assert cut == full[:-1]  # 305 bytes: two full chunks, the short third waits
    assert [(i, end) for _, i, end in full] == [(0, 128), (0, 156), (1, 128), (1, 256),
                                               (1, 305)]
    request = request_chain(body(*messages), "m", chunk_bytes=128)
    assert request is not None and [k for k, _, _ in full] == list(request.keys)


def test_the_consumer_reads_the_chain_field_and_refuses_malformed_ones() -> None:
    from continuum.kv.consumer import MalformedRecord, parse_chain

    assert parse_chain({"prefix_hash": "ab"}) == []
    assert parse_chain({"chain": {"cache_created": [["0A1b", 16]],
                                  "cache_evicted": [["ff", 0]]}}) == [
        ("cache_created", [("0a1b", 16)]), ("cache_evicted", [("ff", 0)])]
    for bad in ([["ab", 1]], {"cache_cleared": []}, {"cache_exploded": []},
                {"cache_created": [["xyz", 1]]}, {"cache_created": [["ab", -1]]},
                {"cache_created": [["ab", True]]}, {"cache_created": [["ab"]]}):
        with pytest.raises(MalformedRecord, match="chain"):
            parse_chain({"chain": bad})
