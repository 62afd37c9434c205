"""The Tier 2 cache key: every request field that can change the answer, and nothing else.

Byte layout (each ``‖`` is one ``0x00`` byte; ``tag(x)`` is ``b"N"`` for a missing value
and ``b"S"`` followed by the value's bytes otherwise; floats are IEEE-754 big-endian
doubles, integers big-endian signed 64-bit)::

    SHA256( model_utf8 ‖ input ‖ tag(temperature) ‖ tag(max_tokens)
            ‖ tag(top_p) ‖ tag(tenant_utf8) ‖ SHA256(rest_json) ‖ endpoint ‖ stream )

* ``input``: ``messages`` (chat, Anthropic), ``prompt`` (completions) or ``input``
  (embeddings). When it is a list of objects whose values are all strings (the usual chat
  request) it is ``b"F"`` + SHA256 of the concatenation, per message, of
  ``"<len(key)>:<key><len(value)>:<value>"`` for each field followed by ``";"`` (lengths make
  it unambiguous; this skips a JSON encode, the costliest step); otherwise ``b"J"`` +
  SHA256 of its compact JSON. Both keep the client's key order: a client that reorders
  keys only misses, it can never hit a wrong entry;
* ``rest_json``: the sorted compact JSON of every remaining body field (``tools``,
  ``tool_choice``, ``response_format``, ``stop``, ``seed``, ``n``, penalties,
  ``logprobs``, ``stream_options``, ``system`` for Anthropic, unknown fields too), except
  fields that cannot change the output (:data:`IGNORED_FIELDS`), plus the forwarded
  Anthropic ``anthropic-version``/``anthropic-beta`` headers under the key ``"\x00headers"``;
* ``stream``: ``b"S"`` for a streamed request, ``b"B"`` for a buffered one — the cached
  bytes differ in shape.

The seed's layout (model, messages digest, temperature, SOME/NONE-tagged max_tokens,
top_p and tenant, 0x00 separators) is the prefix of this one; the temperature is tagged
too, so an omitted temperature and ``0`` do not share an entry (backends default to 1).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from continuum.request import RequestContext

_INPUT_FIELDS = ("messages", "prompt", "input")
#: Fields with their own place in the key.
KEYED_FIELDS = frozenset({
    "model", "messages", "prompt", "input", "temperature", "max_tokens",
    "max_completion_tokens", "top_p", "stream",
})
#: Fields that cannot change the answer: who asks, and bookkeeping.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                            "prompt_cache_key"})
_SKIP = KEYED_FIELDS | IGNORED_FIELDS
_SEP = b"\x00"
_NONE = b"N"


def _float(value: float | None) -> bytes:
    return _NONE if value is None else b"S" + struct.pack(">d", value)


def _int(value: int | None) -> bytes:
    return _NONE if value is None else b"S" + struct.pack(">q", value)


def _text(value: str | None) -> bytes:
    return _NONE if value is None else b"S" + value.encode("utf-8", "surrogatepass")


# Built once: json.dumps() with keyword arguments constructs a new encoder on every call,
# which costs more than encoding a small request.
_ENCODE = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, check_circular=False
).encode
_ENCODE_SORTED = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, check_circular=False, sort_keys=True
).encode


def _compact(value: Any, sort: bool = False) -> bytes:
    return (_ENCODE_SORTED if sort else _ENCODE)(value).encode("utf-8", "surrogatepass")


def _input_digest(payload: Any) -> bytes:
    if type(payload) is list:
        parts: list[str] = []
        for message in payload:
            if type(message) is not dict:
                break
            for name, value in message.items():
                if type(value) is not str:
                    break
                parts.append(f"{len(name)}:{name}{len(value)}:{value}")
            else:
                parts.append(";")
                continue
            break
        else:
            joined = "".join(parts).encode("utf-8", "surrogatepass")
            return b"F" + hashlib.sha256(joined).digest()
    return b"J" + hashlib.sha256(_compact(payload)).digest()


def cache_key(ctx: RequestContext) -> str:
    """The hex cache key of ``ctx`` (see the module docstring for the byte layout)."""
    body = ctx.body
    payload = None
    for name in _INPUT_FIELDS:
        if name in body:
            payload = body[name]
            break
    rest = {k: v for k, v in body.items() if k not in _SKIP}
    headers = ctx.forward_headers
    if headers:  # anthropic-version / anthropic-beta can change the answer's shape
        rest["\x00headers"] = headers
    return hashlib.sha256(_SEP.join((
        ctx.model.encode("utf-8", "surrogatepass"),
        _input_digest(payload),
        _float(ctx.temperature),
        _int(ctx.max_tokens),
        _float(ctx.top_p),
        _text(ctx.tenant),
        hashlib.sha256(_compact(rest, sort=True)).digest() if rest else _NONE,
        ctx.endpoint.encode(),
        b"S" if ctx.stream else b"B",
    ))).hexdigest()
