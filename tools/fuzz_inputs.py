"""The seeded generator of hostile requests behind ``python -m tools.fuzz``.

:class:`HostileInputs` returns the same sequence of :class:`Case` for the same seed. Deep
nesting is written as text, never built as Python objects, so the generator itself never
recurses deeply; hostile numbers that ``json.dumps`` cannot write (``NaN`` spelled several
ways, integers past Python's 4300-digit limit) go in verbatim as :class:`Raw`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from continuum.request import DEFAULT_MAX_JSON_DEPTH, NUMBER_FIELDS
from tools.bench.overhead import MODEL

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "anthropic": "/anthropic/v1/messages",
         # the same OpenAI endpoints for a model a Gemini backend serves on its native API
         # (the router translates both ways): chat, and the Responses API
         "gemini": "/v1/chat/completions", "gemini_responses": "/v1/responses"}
#: The model the fuzz config's ``type: gemini`` backend serves.
GEMINI_MODEL = "gemini-3-pro-preview"
#: Top-level fields some stage of the router reads, or that are commonly sent.
KNOWN_FIELDS = (*NUMBER_FIELDS, "model", "messages", "stream", "prompt", "input", "system",
                "stop", "stop_sequences", "logprobs", "tools", "tool_choice",
                "response_format", "cache_salt", "stream_options", "user", "metadata",
                "cache_control", "reasoning_effort", "reasoning", "instructions", "text",
                "extra_body", "top_logprobs")
_TEXT_ALPHABET = ('abc xyz"\\[]{}:,/\n\t\x00\x1f\x7f' "é漢\u2028\U0001f600\ud800\udfff")
#: Literals json.dumps cannot write, or writes only one way.
_LITERALS = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0", "0.0",
             "1" + "0" * 400, "-" + "9" * 4000, "1" + "0" * 5000, "1.5e308", "123456789e-9999")
#: Lone surrogates are valid in JSON (as \ud800 escapes) and in this generator's text.
SURROGATES = "surrogatepass"
_BIG_INTS = (2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1, 2**31, -1, 0, 10**30)


@dataclass(frozen=True)
class Raw:
    """JSON text inserted verbatim."""

    text: str


def dump(value: Any, ascii_only: bool) -> str:
    """``value`` as JSON text; :class:`Raw` parts verbatim (the generator nests only a few
    levels, deep nesting is written as text)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=ascii_only) + ":"
                              + dump(v, ascii_only) for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


@dataclass
class Case:
    """One generated request."""

    kind: str
    endpoint: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class HostileInputs:
    """The seeded generator: :meth:`case` returns the next request."""

    def __init__(self, seed: int, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self.rng = random.Random(seed)
        self.max_depth = max_depth
        self.kinds = (("valid", 12), ("field", 30), ("random_json", 18), ("deep", 12),
                      ("decoys", 8), ("mutated", 12), ("bytes", 5), ("messages", 3))

    # -- values ---------------------------------------------------------------------------

    def text(self, longest: int = 24) -> str:
        rng = self.rng
        if rng.random() < 0.02:
            return rng.choice(_TEXT_ALPHABET) * rng.randint(100, 3000)
        return "".join(rng.choice(_TEXT_ALPHABET) for _ in range(rng.randint(0, longest)))

    def scalar(self) -> Any:
        rng = self.rng
        pick = rng.randrange(9)
        if pick == 0:
            return None
        if pick == 1:
            return rng.random() < 0.5
        if pick == 2:
            return rng.randint(-1000, 1000)
        if pick == 3:
            return rng.choice(_BIG_INTS) + rng.choice((0, 0, 1, -1))
        if pick == 4:
            return rng.choice((rng.uniform(-3, 3), rng.uniform(-1e308, 1e308), 0.0, 1e-320))
        if pick == 5:
            return Raw(rng.choice(_LITERALS))
        return self.text()

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        if depth >= 4 or rng.random() < 0.55:
            return self.scalar()
        if rng.random() < 0.5:
            return [self.value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {self.key(): self.value(depth + 1) for _ in range(rng.randint(0, 4))}

    def key(self) -> str:
        # Never the fake upstreams' test knobs; known fields often.
        return self.rng.choice(KNOWN_FIELDS) if self.rng.random() < 0.4 else self.text(8)

    def deep_text(self, depth: int) -> str:
        """``depth`` levels of arrays/objects as text (never built as Python objects)."""
        rng = self.rng
        openers, closers = [], []
        for _ in range(depth):
            if rng.random() < 0.5:
                openers.append("[")
                closers.append("]")
            else:
                openers.append('{"k":')
                closers.append("}")
        return "".join(openers) + dump(self.scalar(), True) + "".join(reversed(closers))

    def decoy(self) -> str:
        """A string that fools a scanner which ignores strings or escapes."""
        return json.dumps(self.rng.choice(("]]]]", "[[[[", '\\"[[', '\\\\"]]', '"{', "\\")
                                          ) * self.rng.randint(1, 40))

    # -- requests -------------------------------------------------------------------------

    def valid(self, endpoint: str) -> dict[str, Any]:
        rng = self.rng
        messages = [{"role": "user", "content": self.text(40) or "hi"}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": rng.choice(
                ("You are terse.", "You are a pirate.", self.text(60)))})
        model = GEMINI_MODEL if endpoint.startswith("gemini") else MODEL
        body: dict[str, Any] = {"model": model if rng.random() < 0.95 else self.text(6)}
        if endpoint == "completions":
            body["prompt"] = self.text(40)
        elif endpoint == "gemini_responses":
            body["input"] = messages if rng.random() < 0.5 else messages[-1]["content"]
        else:
            body["messages"] = messages[-1:] if endpoint == "anthropic" else messages
        if endpoint == "anthropic":
            body["max_tokens"] = rng.randint(1, 64)
            if rng.random() < 0.5:
                body["system"] = rng.choice(("Be brief.", [{"type": "text", "text": "Be."}]))
        if rng.random() < 0.6:
            body["temperature"] = rng.choice((0, 0, 0.7, 1))
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.3:
            body["top_p"] = rng.choice((0.5, 1))
        return body

    def with_fields(self, endpoint: str) -> dict[str, Any]:
        body = self.valid(endpoint)
        for _ in range(self.rng.randint(1, 3)):
            body[self.rng.choice(KNOWN_FIELDS)] = self.value(2)
        return body

    def message(self) -> Any:
        """A message (or system block, or Responses input item) of some wrong shape."""
        value = self.value
        return self.rng.choice((
            lambda: value(2),
            lambda: {"role": value(3), "content": value(2)},
            lambda: {"role": "system", "content": [value(3), {"type": "text", "text": value(3)}]},
            lambda: {"role": "user", "content": [{"type": value(3), "text": "x",
                                                  "cache_control": value(3)}]},
            lambda: {"role": "assistant", "content": value(2), "tool_calls": self.rng.choice((
                value(3), [value(2)], [{"id": value(1), "function": value(2)}],
                [{"id": "c", "function": {"name": value(1), "arguments": value(2)},
                  "extra_content": value(3)}]))},
            lambda: {"role": "tool", "tool_call_id": value(1), "content": value(2)},
            lambda: {"role": "user", "content": [{"type": "image_url", "image_url": value(2)}]},
            lambda: {"type": self.rng.choice(("function_call", "function_call_output",
                                              "reasoning", "message", "input_image")),
                     "call_id": value(1), "name": value(1), "arguments": value(1),
                     "output": value(2), "content": value(2), "role": value(1)},
        ))()

    def hostile_messages(self, endpoint: str) -> dict[str, Any]:
        rng = self.rng
        body = self.valid(endpoint)
        if endpoint == "gemini_responses":
            body["input"] = [self.message() for _ in range(rng.randint(1, 4))]
            return body
        body["messages"] = [self.message() for _ in range(rng.randint(1, 4))]
        if endpoint == "anthropic" and rng.random() < 0.5:
            body["system"] = [self.message() for _ in range(rng.randint(0, 3))]
        return body

    def deep(self, endpoint: str) -> str:
        rng = self.rng
        limit = self.max_depth
        depth = rng.choice((limit - 2, limit - 1, limit, limit + 1, rng.randint(0, 3 * limit),
                            rng.randint(limit, 50_000)))
        nested = self.deep_text(max(depth, 0))
        if rng.random() < 0.4:
            return nested
        body = self.valid(endpoint)
        name = rng.choice(("metadata", "tools", "response_format", "messages", "x"))
        return dump({**body, name: Raw(nested)}, True)

    def decoys(self, endpoint: str) -> str:
        """Nesting near the limit with decoy strings at every level."""
        rng = self.rng
        depth = rng.randint(self.max_depth - 3, self.max_depth + 3)
        parts = "".join("[" + self.decoy() + "," for _ in range(depth))
        nested = parts + "0" + "]" * depth
        if rng.random() < 0.5:
            return nested
        return dump({**self.valid(endpoint), "metadata": Raw(nested)}, True)

    def mutated(self, endpoint: str) -> bytes:
        rng = self.rng
        data = bytearray(dump(self.valid(endpoint), rng.random() < 0.5).encode(
            "utf-8", "surrogatepass"))
        for _ in range(rng.randint(1, 6)):
            at = rng.randint(0, len(data))
            action = rng.randrange(4)
            if action == 0 and data:
                del data[min(at, len(data) - 1)]
            elif action == 1:
                data[at:at] = rng.choice((b'"', b"\\", b"[", b"{", b"]", b"}", b",", b":",
                                          b"\x00", b"\xff", b"NaN", b"1e999", b"-"))
            elif action == 2:
                data[at:at] = data[at:at + rng.randint(1, 40)]
            else:
                del data[at:]
        return bytes(data)

    def raw_bytes(self, endpoint: str) -> bytes:
        rng = self.rng
        pick = rng.randrange(4)
        if pick == 0:
            return rng.randbytes(rng.randint(0, 512))
        text = dump(self.valid(endpoint), True)
        if pick == 1:
            return text.encode(rng.choice(("utf-16", "utf-16-be", "utf-32", "utf-32-le")))
        if pick == 2:
            return b"\xef\xbb\xbf" + text.encode()  # dump(..., True) is ASCII
        return text.encode()[: rng.randint(0, len(text))]

    def headers(self, endpoint: str) -> dict[str, str]:
        rng = self.rng
        headers = {"Content-Type": "application/json"}
        if rng.random() < 0.2:
            headers["X-Request-Id"] = rng.choice((
                f"client-{rng.randrange(10**6)}", "", "x" * 300, "bad id", "id\u00e9",
                "../../etc", "-x"))
        if rng.random() < 0.05:
            headers["Cache-Control"] = "no-store"
        if endpoint == "anthropic":
            headers["anthropic-version"] = rng.choice(("2023-06-01", "bogus"))
        return headers

    def case(self) -> Case:
        rng = self.rng
        kinds, weights = zip(*self.kinds, strict=True)
        kind = rng.choices(kinds, weights)[0]
        endpoint = rng.choice(tuple(PATHS))
        ascii_only = rng.random() < 0.5
        body: bytes
        if kind == "valid":
            body = dump(self.valid(endpoint), ascii_only).encode("utf-8", SURROGATES)
        elif kind == "field":
            body = dump(self.with_fields(endpoint), ascii_only).encode("utf-8", SURROGATES)
        elif kind == "random_json":
            value = self.value() if rng.random() < 0.3 else {
                self.key(): self.value(1) for _ in range(rng.randint(0, 6))}
            body = dump(value, ascii_only).encode("utf-8", SURROGATES)
        elif kind == "messages":
            body = dump(self.hostile_messages(endpoint), ascii_only).encode(
                "utf-8", "surrogatepass")
        elif kind == "deep":
            body = self.deep(endpoint).encode("utf-8", SURROGATES)
        elif kind == "decoys":
            body = self.decoys(endpoint).encode("utf-8", SURROGATES)
        elif kind == "mutated":
            body = self.mutated(endpoint)
        else:
            body = self.raw_bytes(endpoint)
        return Case(kind, endpoint, body, self.headers(endpoint))
