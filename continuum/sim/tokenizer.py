"""A deterministic, exactly reversible tokenizer for the simulated engine.

Every process builds the same vocabulary from constants, so a fleet of simulated engines,
the router and the KV listener all agree on token ids without sharing state.

Vocabulary layout (all ids < 2**31, so they fit the 4-byte token packing SGLang hashes use):

* ``0 .. 63``: special tokens (chat-template markers of ChatML, Llama-3 and Mistral).
* ``64 ..``: whole words from a fixed list, each as ``word``, `` word``, ``Word``, `` Word``.
* ``CHUNK_BASE ..``: any run of whole characters whose UTF-8 form (surrogates allowed) is at
  most 3 bytes, packed bijectively as ``CHUNK_BASE + int.from_bytes(b"\\x01" + utf8) - 256``.
* ``CODEPOINT_BASE + ord(ch)``: a single character that needs 4 UTF-8 bytes (emoji, …).

Each id decodes to a fixed string on its own, so ``decode(encode(x)) == x`` for every ``str``
(lone surrogates included) and streaming detokenization is a plain concatenation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from continuum.errors import RequestError

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<s>",
    "</s>",
    "<unk>",
    "[INST]",
    "[/INST]",
)
WORD_BASE = 64
CHUNK_BASE = 1 << 16
CODEPOINT_BASE = 1 << 26
_CHUNK_END = CHUNK_BASE + (1 << 25) - 256
_CODEPOINT_END = CODEPOINT_BASE + 0x110000

_WORD_LIST = """
    the of and to a in is it you that he was for on are with as I his they be at one have
    this from or had by hot word but what some we can out other were all there when up use
    your how said an each she which do their time if will way about many then them write
    would like so these her long make thing see him two has look more day could go come did
    number sound no most people my over know water than call first who may down side been
    now find any new work part take get place made live where after back little only round
    man year came show every good me give our under name very through just form sentence
    great think say help low line differ turn cause much mean before move right boy old too
    same tell does set three want air well also play small end put home read hand port large
    spell add even land here must big high such follow act why ask men change went light
    kind off need house picture try us again animal point mother world near build self earth
    father head stand own page should country found answer school grow study still learn
    plant cover food sun four between state keep eye never last let thought city tree cross
    farm hard start might story saw far sea draw left late run while press close night real
    life few north open seem together next white children begin got walk example ease paper
    group always music those both mark often letter until mile river car feet care second
    book carry took science eat room friend began idea fish mountain stop once base hear
    horse cut sure watch color face wood main enough plain girl usual young ready above ever
    red list though feel talk bird soon body dog family direct pose leave song measure door
    product black short numeral class wind question happen complete ship area half rock
    order fire south problem piece told knew pass since top whole king space heard best hour
    better true during hundred five remember step early hold west ground interest reach fast
    verb sing listen six table travel less morning ten simple several vowel toward war lay
    against pattern slow center love person money serve appear road map rain rule govern
    pull cold notice voice unit power town fine certain fly fall lead cry dark machine note
    wait plan figure star box noun field rest correct able pound done beauty drive stood
    contain front teach week final gave green quick develop ocean warm free minute strong
    special mind behind clear tail produce fact street inch multiply nothing course stay
    wheel full force blue object decide surface deep moon island foot system busy test record
    boat common gold possible plane instead dry wonder laugh thousand ago ran check game shape
    equate miss brought heat snow tire bring yes distant fill east paint language among
    model cache token prefix request server router engine block memory latency
"""
#: Common English words: the tokenizer's whole-word vocabulary and the generator's lexicon.
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())

_PIECE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+|.", re.DOTALL)
_SPECIAL_SPLIT = re.compile(
    "(" + "|".join(re.escape(s) for s in sorted(SPECIAL_TOKENS, key=len, reverse=True)) + ")"
)


def _build_words() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for word in WORDS:
        for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            seen.setdefault(form, None)
    return tuple(seen)


_WORD_FORMS = _build_words()
_WORD_END = WORD_BASE + len(_WORD_FORMS)


class SimTokenizer:
    """Stateless tokenizer: words and character chunks to stable ids and back.

    Special-token literals in the text (``<|im_start|>`` …) become their special ids, as
    Hugging Face tokenizers do by default.
    """

    def __init__(self) -> None:
        self._special_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._word_ids = {form: WORD_BASE + i for i, form in enumerate(_WORD_FORMS)}

    @property
    def vocab_size(self) -> int:
        """One past the largest id :meth:`decode` accepts (the id space is sparse)."""
        return _CODEPOINT_END

    def special_id(self, token: str) -> int:
        """The id of a special token such as ``"<|im_end|>"``."""
        return self._special_ids[token]

    def word_id(self, form: str) -> int | None:
        """The id of a whole-word form such as ``" model"``, or ``None``."""
        return self._word_ids.get(form)

    def encode(self, text: str, *, bos: str | None = None) -> list[int]:
        """Token ids of ``text``, preceded by the special token ``bos`` when given."""
        ids: list[int] = [] if bos is None else [self._special_ids[bos]]
        for i, part in enumerate(_SPECIAL_SPLIT.split(text)):
            if i % 2:
                ids.append(self._special_ids[part])
            elif part:
                for match in _PIECE.finditer(part):
                    self._encode_piece(match.group(), ids)
        return ids

    def _encode_piece(self, piece: str, out: list[int]) -> None:
        word = self._word_ids.get(piece)
        if word is not None:
            out.append(word)
            return
        chunk = b""
        for ch in piece:
            raw = ch.encode("utf-8", "surrogatepass")
            if len(raw) == 4:
                if chunk:
                    out.append(_chunk_id(chunk))
                    chunk = b""
                out.append(CODEPOINT_BASE + ord(ch))
            elif len(chunk) + len(raw) > 3:
                out.append(_chunk_id(chunk))
                chunk = raw
            else:
                chunk += raw
        if chunk:
            out.append(_chunk_id(chunk))

    def token_str(self, token_id: int) -> str:
        """The exact text one token id stands for.

        Raises:
            RequestError: ``token_id`` is outside the vocabulary.
        """
        if 0 <= token_id < len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token_id]
        if WORD_BASE <= token_id < _WORD_END:
            return _WORD_FORMS[token_id - WORD_BASE]
        if CHUNK_BASE <= token_id < _CHUNK_END:
            marked = (token_id - CHUNK_BASE + 256).to_bytes(4, "big").lstrip(b"\x00")
            if marked[0] != 1:
                raise RequestError(f"Token id {token_id} is out of vocabulary", param="tokens")
            packed = marked[1:]
            try:
                return packed.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                return packed.decode("utf-8", "replace")
        if CODEPOINT_BASE <= token_id < _CODEPOINT_END:
            return chr(token_id - CODEPOINT_BASE)
        raise RequestError(f"Token id {token_id} is out of vocabulary", param="tokens")

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens are kept, as vLLM's ``/detokenize`` does."""
        return "".join(self.token_str(i) for i in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """One string per token id (``/tokenize``'s ``return_token_strs``)."""
        return [self.token_str(i) for i in ids]

    def generation_lexicon(self) -> tuple[list[int], list[int]]:
        """Ids the generator draws from: (leading-space lowercase words, capitalised words)."""
        spaced = [self._word_ids[" " + w] for w in WORDS if w.islower()]
        capital = [self._word_ids[w.capitalize()] for w in WORDS if w.islower()]
        return spaced, capital


def _chunk_id(raw: bytes) -> int:
    return CHUNK_BASE + int.from_bytes(b"\x01" + raw, "big") - 256
