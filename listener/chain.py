"""Chain keys of stored block chains: the router's :mod:`continuum.prefix_chain` keys,
computed from the prompt recovered through ``/detokenize`` and the chat template.

Every ``BlockStored`` whose blocks carry their token ids extends a chain: from the root
(no parent) or from a parent block of a chain whose tokens are remembered. The whole
chain's text is one ``/detokenize`` call, split into turns
(:func:`listener.templates.parse_messages`) and keyed with
:func:`continuum.prefix_chain.message_keys`, the router's own function. A key whose end
lies beyond the parent is attributed to the new block holding that end, found by spreading
the text evenly over the chain's tokens (exact for the simulated engine's word tokens,
within a block or so for real tokenizers); its token count is that block's chain length.

What gives full chains: engines that send token ids with their stored blocks and serve
``/detokenize`` (vLLM, SGLang), with a chat template the listener knows or can learn
(ChatML, Llama-3, ``template: auto``). Otherwise (TensorRT-LLM, whose blocks are attributed
only through router-issued salts; templates that fold the system prompt into the first
user turn; a chain whose parent's text was forgotten) no chain keys are reported and the
router falls back to the seed key for that backend. The token ids of recent chains are
remembered in an LRU bounded by ``limits.max_chain_text_bytes`` (4 bytes a token), so any
block of them can be extended. Nothing here logs prompt text or token ids.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from continuum.prefix_chain import chain_root, message_bytes, message_keys
from listener.templates import ChatMarkers, RenderedMessage, parse_messages
from listener.tracker import BlockKey

#: ``detokenize(tokens, model) -> text or None``.
Detokenize = Callable[[Sequence[int], str], "str | None"]


@dataclass(frozen=True)
class NewBlocks:
    """The blocks one ``BlockStored`` added to a chain, root first.

    Attributes:
        parent: the block they extend (None: they start the chain).
        keys: their block keys.
        ends: chain length in tokens at the end of each.
        tokens: their token ids, concatenated.
        model: model name for ``/detokenize`` and the chain's root key.
    """

    parent: BlockKey | None
    keys: tuple[BlockKey, ...]
    ends: tuple[int, ...]
    tokens: tuple[int, ...]
    model: str


class _Chain:
    """A remembered chain: its tokens and, per block, its key and chain length."""

    __slots__ = ("ends", "keys", "tokens")

    def __init__(self, tokens: array[int], keys: tuple[BlockKey, ...],
                 ends: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.keys = keys
        self.ends = ends


class ChainKeys:
    """Remembered chains and the chain keys of new blocks (module docstring)."""

    def __init__(self, detokenize: Detokenize, chunk_bytes: int, max_keys: int,
                 max_text_bytes: int, max_chain_tokens: int) -> None:
        self.detokenize = detokenize
        self.chunk_bytes = chunk_bytes
        self.max_keys = max_keys
        self.max_bytes = max_text_bytes
        self.max_chain_tokens = max_chain_tokens
        self._chains: OrderedDict[BlockKey, _Chain] = OrderedDict()  # by tip, LRU
        self._where: dict[BlockKey, BlockKey] = {}  # block -> tip of a chain holding it
        self._bytes = 0
        self.unknown_parents = 0

    @property
    def enabled(self) -> bool:
        """Whether chain keys are computed at all (``max_chain_text_bytes`` > 0)."""
        return self.max_bytes > 0

    def clear(self) -> None:
        """Forget every remembered chain (the backend's state was reset)."""
        self._chains.clear()
        self._where.clear()
        self._bytes = 0

    def keys_for(self, new: NewBlocks, markers: ChatMarkers
                 ) -> list[tuple[BlockKey, str, int]] | None:
        """``(block key, chain key, tokens)`` for the chain keys ending in ``new``'s blocks;
        None when the text cannot be had (unknown parent, too long, failed call, not a
        prompt of this template)."""
        keys, ends = new.keys, new.ends
        tokens = array("I", new.tokens)
        base_end = 0
        if new.parent is not None:
            found = self._chain_of(new.parent)
            if found is None:
                self.unknown_parents += 1
                return None
            known, at = found
            base_end = known.ends[at]
            tokens = known.tokens[:base_end] + tokens
            keys, ends = known.keys[:at + 1] + keys, known.ends[:at + 1] + ends
        if len(tokens) > self.max_chain_tokens:
            return None
        self._remember(_Chain(tokens, keys, ends))
        text = self.detokenize(tokens.tolist(), new.model)
        messages = parse_messages(text, markers) if text is not None else None
        if not messages or text is None:
            return None
        return self._attribute(messages, len(text), base_end, new, len(tokens))

    def _chain_of(self, block: BlockKey) -> tuple[_Chain, int] | None:
        """A remembered chain through ``block`` and the block's index in it."""
        tip = self._where.get(block)
        chain = self._chains.get(tip) if tip is not None else None
        if chain is None or tip is None or block not in chain.keys:
            return None  # forgotten, or the tip was stored again on another chain
        self._chains.move_to_end(tip)
        return chain, chain.keys.index(block)

    def _attribute(self, messages: list[RenderedMessage], text_chars: int, base_end: int,
                   new: NewBlocks, total: int) -> list[tuple[BlockKey, str, int]]:
        pairs = [(m.role, m.content) for m in messages]
        found = []
        keys = message_keys(chain_root(new.model), pairs, last_complete=messages[-1].complete,
                            chunk_bytes=self.chunk_bytes, max_keys=self.max_keys)
        for key, index, covered in keys:
            pos = _text_position(messages[index], covered)
            token_end = math.ceil(pos / max(text_chars, 1) * total)
            if token_end <= base_end:
                continue  # ends in the parent's blocks: reported with them
            block = next((i for i, end in enumerate(new.ends) if end >= token_end),
                         len(new.ends) - 1)
            found.append((new.keys[block], key, new.ends[block]))
        return found

    def _remember(self, chain: _Chain) -> None:
        size = 4 * len(chain.tokens)
        if size > self.max_bytes:
            return
        tip = chain.keys[-1]
        old = self._chains.pop(tip, None)
        if old is not None:
            self._bytes -= 4 * len(old.tokens)
        self._chains[tip] = chain
        self._bytes += size
        for key in chain.keys:
            self._where[key] = tip
        while self._bytes > self.max_bytes:
            dropped_tip, dropped = self._chains.popitem(last=False)
            self._bytes -= 4 * len(dropped.tokens)
            for key in dropped.keys:
                if self._where.get(key) == dropped_tip:
                    del self._where[key]


def _text_position(message: RenderedMessage, covered: int) -> int:
    """Where in the text a key's end lies: ``covered`` bytes into the message's canonical
    rendering (``role ++ "\\n" ++ stripped content``)."""
    head = len(message_bytes(message.role, ""))
    content = message.content
    lead = len(content) - len(content.lstrip())
    data = content.lstrip().encode("utf-8", "surrogatepass")[:max(0, covered - head)]
    return message.start + lead + len(data.decode("utf-8", "ignore"))
