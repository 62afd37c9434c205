"""Anthropic prompt caching, simulated: breakpoints, a TTL'd prefix cache, usage numbers.

The prompt is one ordered sequence of blocks (every tool, then the system blocks, then each
message's content blocks), the order in which the real API caches. Each position carries a
chained hash of everything up to and including its block (``cache_control`` markers left
out, so marking a block does not change what it hashes to) and the running token count.

Rules, as Anthropic documents them:
  * at most :data:`MAX_BREAKPOINTS` blocks may carry ``cache_control``; more is a 400 (a
    top-level ``cache_control``, automatic caching, marks the last block and counts too);
  * a breakpoint caches its prefix only when that prefix has at least
    :func:`min_cacheable_tokens` tokens; shorter ones are silently not cached;
  * a request reads the longest prefix already cached that ends at one of its breakpoints
    or up to :data:`LOOKBACK_BLOCKS` blocks before one: ``cache_read_input_tokens``;
  * every cacheable breakpoint past that is written: ``cache_creation_input_tokens`` are
    the tokens from the end of the read prefix to the last cacheable breakpoint;
  * ``input_tokens`` are the rest, after the last breakpoint read or written;
  * entries live 5 minutes (``"ttl": "1h"``: an hour), refreshed on every hit, and are
    keyed by model and prefix hash.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from continuum.errors import RequestError
from continuum.sim.tokenizer import SimTokenizer

MAX_BREAKPOINTS = 4
LOOKBACK_BLOCKS = 20
TTLS = {"5m": 300.0, "1h": 3600.0}


def min_cacheable_tokens(model: str) -> int:
    """The shortest cacheable prefix: 2048 tokens for Haiku models, 1024 for the others."""
    return 2048 if "haiku" in model else 1024


@dataclass(frozen=True, slots=True)
class Block:
    """One block of the prompt at its place in the sequence."""

    end: int
    """Tokens of the prompt up to and including this block."""
    digest: bytes
    """Chained hash of the prompt up to and including this block."""
    ttl: str | None
    """``"5m"`` or ``"1h"`` when the block is a cache breakpoint, else None."""


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """The input-side ``usage`` numbers of one request."""

    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The fields as the Messages API spells them (without ``output_tokens``)."""
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.ephemeral_5m_input_tokens,
                "ephemeral_1h_input_tokens": self.ephemeral_1h_input_tokens,
            },
        }


def _ttl(marker: Any, where: str) -> str:
    if not isinstance(marker, dict) or marker.get("type") != "ephemeral":
        raise RequestError(f"{where}.type: Input should be 'ephemeral'")
    ttl = marker.get("ttl", "5m")
    if ttl not in TTLS:
        raise RequestError(f"{where}.ttl: Input should be '5m' or '1h'")
    return str(ttl)


def _sections(body: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(section, path, block)`` for every block, in caching order."""
    out = [("tools", f"tools.{i}", tool) for i, tool in enumerate(body.get("tools") or ())]
    system = body.get("system")
    if isinstance(system, str):
        system = [{"type": "text", "text": system}] if system else []
    out += [("system", f"system.{i}", block) for i, block in enumerate(system or ())]
    for m, message in enumerate(body["messages"]):
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        role = message["role"]
        out += [(role, f"messages.{m}.content.{i}", block) for i, block in enumerate(content)]
    return out


def _nested_markers(block: dict[str, Any], depth: int = 0) -> int:
    """``cache_control`` markers inside ``block``: on the blocks of its ``content`` (a
    ``tool_result``'s) or of a document's ``source.content``. They count toward the four
    (here they mark no prefix of their own: the fake caches at top-level blocks only)."""
    count = 0
    source = block.get("source")
    for inner in (block.get("content"),
                  source.get("content") if isinstance(source, dict) else None):
        if isinstance(inner, list) and depth < 3:
            for item in inner:
                if isinstance(item, dict):
                    count += ("cache_control" in item) + _nested_markers(item, depth + 1)
    return count


def prompt_blocks(body: dict[str, Any], tokenizer: SimTokenizer) -> list[Block]:
    """The blocks of a validated Messages request, with token counts and chained hashes.

    Raises:
        RequestError: a malformed ``cache_control``, or more than four of them (the real
            API's message).
    """
    blocks: list[Block] = []
    digest = b""
    end = 0
    found = 0
    for section, path, block in _sections(body):
        ttl = None
        if "cache_control" in block:
            ttl = _ttl(block["cache_control"], f"{path}.cache_control")
            found += 1
        found += _nested_markers(block)
        bare = {k: v for k, v in block.items() if k != "cache_control"}
        text = bare.get("text") if bare.get("type") == "text" else None
        canonical = json.dumps(bare, sort_keys=True, separators=(",", ":"))
        end += len(tokenizer.encode(text if isinstance(text, str) else canonical))
        digest = hashlib.sha256(digest + section.encode() + b"\0" + canonical.encode()).digest()
        blocks.append(Block(end, digest, ttl))
    auto = body.get("cache_control")
    if auto is not None and blocks and blocks[-1].ttl is None:
        # Top-level cache_control (automatic caching) marks the last block, using a slot.
        blocks[-1] = Block(blocks[-1].end, blocks[-1].digest, _ttl(auto, "cache_control"))
        found += 1
    if found > MAX_BREAKPOINTS:
        raise RequestError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {found}."
        )
    return blocks


class PromptCache:
    """The server-side prefix cache of one fake API: ``(model, prefix hash) → expiry``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._entries: dict[tuple[str, bytes], tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every cached prefix."""
        self._entries.clear()

    def _live(self, key: tuple[str, bytes], now: float) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry[0] <= now:
            del self._entries[key]
            return False
        self._entries[key] = (now + entry[1], entry[1])  # a hit refreshes the TTL
        return True

    def account(self, model: str, blocks: list[Block], min_tokens: int) -> CacheUsage:
        """Look the request's prefixes up, write its new cacheable ones, and say how many
        input tokens were read, written and left uncached."""
        now = self.clock()
        total = blocks[-1].end if blocks else 0
        breakpoints = [i for i, block in enumerate(blocks) if block.ttl is not None]
        read = 0
        for bp in breakpoints:
            for i in range(bp, max(-1, bp - LOOKBACK_BLOCKS), -1):
                if blocks[i].end > read and self._live((model, blocks[i].digest), now):
                    read = blocks[i].end
                    break
        written = {"5m": 0, "1h": 0}
        done = read
        for bp in breakpoints:
            block = blocks[bp]
            if block.end <= done or block.end < min_tokens:
                continue
            assert block.ttl is not None
            seconds = TTLS[block.ttl]
            self._entries[(model, block.digest)] = (now + seconds, seconds)
            written[block.ttl] += block.end - done
            done = block.end
        creation = written["5m"] + written["1h"]
        return CacheUsage(
            input_tokens=total - read - creation,
            cache_creation_input_tokens=creation,
            cache_read_input_tokens=read,
            ephemeral_5m_input_tokens=written["5m"],
            ephemeral_1h_input_tokens=written["1h"],
        )
