"""The chain of prefix keys: one key per chunk of a request's canonical rendering.

The seed's prefix key (:mod:`continuum.prefix`) names a request by its system prompt alone,
so every request behind one system prompt looks the same to the KV index. The chain names
every prefix of the whole prompt instead, so the index can answer "how far does this
backend's cache go into *this* request":

    root   = SHA256(b"cr-chain2" ++ 0x00 ++ model ++ 0x00 ++ SHA256(canonical tools JSON))[:8]
    key_i  = XXH3-64(key_{i-1} ++ chunk_i)             (key_0 = root; keys are 8 bytes,
                                                         the digest big-endian)

with ``chunk_bytes`` 1024 and at most ``max_keys`` 128 keys by default (128 KiB).

The canonical rendering is every message in order, each as ``role ++ "\\n" ++ text`` where
``text`` is the message's text (:func:`continuum.prefix.content_text`) with leading and
trailing whitespace stripped (chat templates such as Llama-3 strip it, so the KV listener
cannot tell). Each message is cut into chunks of ``chunk_bytes`` bytes on its own, so a chunk
never spans two messages; the last, shorter chunk of a message counts only when the message
is complete (a request's messages always are; a prompt recovered from a KV block chain may
end inside one). Anthropic's top-level ``system`` is a first ``system`` message (its text as
:func:`continuum.prefix.system_text` reads it: Claude Code's attribution block left out). At most
``max_keys`` keys are made; the rest of the prompt is ignored.

Key *i* covers bytes ``0 .. ends[i]`` of the rendering, so two requests share key *i*
exactly when they share that much of their prompt, and a backend that cached a prompt up to
key *i* holds every shorter key of it. Cost: one XXH3-64 call per chunk (the ``xxhash``
package), about 0.4 µs for a 1 KiB chunk with the call itself. The keys were SHA-256
before (``cr-chain1``): SHA-256 is the fastest hash in ``hashlib`` on CPUs with SHA
extensions, but each call creates and finalises an OpenSSL context, about 0.9 µs of its
1.5 µs per 1 KiB chunk, so a 16 KiB prompt cost about 38 µs to key, and SHA-256 over
the chunks alone could not get under 24 µs. A chain key only names a prefix for
routing, never the content a client gets (the response cache keys on SHA-256), so a
64-bit non-cryptographic hash is enough: a made-up collision could only route its own
request to a backend that lacks the prefix. ``tools/bench/micro.py`` measures it.

This is the only implementation: the router computes a request's chain with
:func:`request_chain`, the KV listener computes the chain of a recovered prompt with
:func:`message_keys`, and both must use the same ``chunk_bytes``.

Message content that is not text (images, tool calls) adds nothing to the rendering.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64_digest

from continuum.prefix import content_text, system_text

DEFAULT_CHUNK_BYTES = 1024
DEFAULT_MAX_KEYS = 128
KEY_BYTES = 8
#: Rough bytes per token of English text, for token counts the router has to estimate
#: (the chain entries it records itself; the listener reports real counts).
BYTES_PER_TOKEN = 4
_VERSION = b"cr-chain2"

#: One message of the canonical rendering: ``(role, text)``.
Message = tuple[str, str]


@dataclass(frozen=True, slots=True)
class PrefixChain:
    """A request's chain of prefix keys.

    Attributes:
        keys: the keys as 16-character lowercase hex, shortest prefix first.
        ends: canonical bytes covered by each key.
        total_bytes: canonical bytes of the whole prompt (beyond the last key too).
        anchor_end: bytes of the first message (the seed key's system prompt when the
            request has one); what a backend known only through the seed key is credited.
        route_depth: index of the key that names what the request shares beyond its first
            message: the first chunk of the second message when that message fills a
            whole chunk (a document in the user turn), else -1 (a short question: the
            first message, the seed's key, is what is shared). A fallback strategy hashes
            it so that new documents spread over the fleet while each stays together.
    """

    keys: tuple[str, ...]
    ends: tuple[int, ...]
    total_bytes: int
    anchor_end: int
    route_depth: int

    @property
    def route_key(self) -> bytes | None:
        """The key named by ``route_depth`` as bytes; None when there is none (hash the
        seed's key then)."""
        if not 0 <= self.route_depth < len(self.keys):
            return None
        return bytes.fromhex(self.keys[self.route_depth])


def chain_root(model: str, tools: Any = None) -> bytes:
    """The chain's root key: the model and, when given, the tools (canonical JSON)."""
    return _root(model, tools) if tools else _toolless_root(model)


@functools.lru_cache(maxsize=1024)
def _toolless_root(model: str) -> bytes:
    """A root without tools, kept per model (the common case: one SHA-256 call saved a
    request)."""
    return _root(model, None)


def _root(model: str, tools: Any) -> bytes:
    digest = hashlib.sha256(_VERSION + b"\x00" + model.encode("utf-8", "surrogatepass")
                            + b"\x00")
    if tools:
        canonical = json.dumps(tools, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False, default=str)
        digest.update(hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).digest())
    return digest.digest()[:KEY_BYTES]


def request_messages(body: dict[str, Any]) -> list[Message]:
    """The canonical ``(role, text)`` messages of an OpenAI or Anthropic request body."""
    out: list[Message] = []
    system = body.get("system")
    if system is not None:
        text = system_text(system)
        if text is not None:
            out.append(("system", text))
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                role = message.get("role")
                text = content_text(message.get("content"))
                out.append((role if isinstance(role, str) else "", text or ""))
    return out


def message_bytes(role: str, text: str, complete: bool = True) -> bytes:
    """One message's canonical bytes: ``role ++ "\\n" ++ text`` stripped (only on the left
    for an incomplete message, whose end is not known yet)."""
    text = text.strip() if complete else text.lstrip()
    return role.encode("utf-8", "surrogatepass") + b"\n" + text.encode("utf-8", "surrogatepass")


def message_keys(
    root: bytes,
    messages: Iterable[Message],
    *,
    last_complete: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_keys: int = DEFAULT_MAX_KEYS,
) -> Iterator[tuple[str, int, int]]:
    """The chain of ``messages``: ``(key hex, message index, bytes of that message's
    canonical rendering covered)`` per key.

    ``last_complete`` False: the last message may continue, so its last, shorter chunk
    makes no key (the listener's view of a chain that ends inside a turn).
    """
    items = list(messages)
    prev = root
    made = 0
    for index, (role, text) in enumerate(items):
        complete = last_complete or index < len(items) - 1
        data = message_bytes(role, text, complete)
        size = len(data)
        stop = size if complete else size - size % chunk_bytes
        for start in range(0, stop, chunk_bytes):
            end = min(start + chunk_bytes, size)
            prev = xxh3_64_digest(prev + data[start:end])
            yield prev.hex(), index, end
            made += 1
            if made >= max_keys:
                return


def request_chain(
    body: dict[str, Any],
    model: str,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_keys: int = DEFAULT_MAX_KEYS,
) -> PrefixChain | None:
    """The chain of a parsed request body; None when it has no message text at all."""
    messages = request_messages(body)
    if not any(text and not text.isspace() for _, text in messages):
        return None
    root = chain_root(model, body.get("tools"))
    digests: list[bytes] = []
    ends: list[int] = []
    add_digest, add_end = digests.append, ends.append
    total = anchor_end = 0
    route_depth = -1
    prev = root
    room = max_keys
    for index, (role, text) in enumerate(messages):
        data = memoryview(f"{role}\n{text.strip()}".encode("utf-8", "surrogatepass"))
        size = len(data)
        if index == 1 and size > chunk_bytes:
            route_depth = len(digests)
        start = 0
        # the slices of a memoryview copy nothing until ``prev +`` joins them
        while start < size and room:
            end = start + chunk_bytes
            prev = xxh3_64_digest(prev + data[start:end])
            add_digest(prev)
            add_end(total + (end if end < size else size))
            start = end
            room -= 1
        total += size
        if index == 0:
            anchor_end = total
    keys = [digest.hex() for digest in digests]
    return PrefixChain(tuple(keys), tuple(ends), total, anchor_end,
                       route_depth if route_depth < len(keys) else -1)

