"""A deterministic text embedder whose cosine similarity behaves like a real one on
paraphrases: hashed word unigrams, word bigrams and character trigrams (the "hashing
trick"), weighted, summed and normalised.

Why these features: word unigrams carry the topic, bigrams some word order, and character
trigrams make inflections and near-spellings close ("jumps"/"jumped", "enable"/"disable").
That last property is also a real embedder's weakness the router's false-hit gate exists
for: "enable 2FA" and "disable 2FA" come out closer than many true paraphrases.

Each feature is hashed (BLAKE2b, so the result never depends on ``PYTHONHASHSEED``) to
:data:`SLOTS` (index, sign) pairs; no model, no numpy, microseconds per sentence.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re

_WORD = re.compile(r"\w+")
#: Dimensions each feature touches (more: smoother, slower).
SLOTS = 4
#: Weight of each feature family in the sum.
WORD_WEIGHT, BIGRAM_WEIGHT, TRIGRAM_WEIGHT = 1.0, 0.3, 0.25
#: Words too common to say what a sentence is about; they count a tenth.
STOP_WORDS = frozenset({
    "a", "an", "the", "is", "are", "was", "were", "be", "to", "of", "in", "on", "for", "and",
    "or", "how", "do", "does", "i", "my", "me", "you", "your", "it", "what", "can", "with",
    "this", "that"})
_CACHE: dict[tuple[str, int], tuple[tuple[int, float], ...]] = {}


def _slots(feature: str, dims: int) -> tuple[tuple[int, float], ...]:
    key = (feature, dims)
    found = _CACHE.get(key)
    if found is None:
        digest = hashlib.blake2b(feature.encode("utf-8", "surrogatepass"),
                                 digest_size=4 * SLOTS).digest()
        found = tuple(
            (int.from_bytes(digest[4 * i:4 * i + 4], "big") % dims,
             1.0 if digest[4 * i] & 1 else -1.0)
            for i in range(SLOTS))
        if len(_CACHE) > 65536:
            _CACHE.clear()
        _CACHE[key] = found
    return found


def features(text: str) -> list[tuple[str, float]]:
    """The weighted features of ``text``."""
    words = _WORD.findall(text.lower())
    out: list[tuple[str, float]] = []
    for word in words:
        weight = WORD_WEIGHT * (0.1 if word in STOP_WORDS else 1.0)
        out.append(("w:" + word, weight))
        padded = f"#{word}#"
        out.extend(("c:" + padded[i:i + 3], TRIGRAM_WEIGHT)
                   for i in range(len(padded) - 2))
    out.extend((f"b:{a} {b}", BIGRAM_WEIGHT) for a, b in itertools.pairwise(words))
    return out or [("t:" + text, 1.0)]


def embed(text: str, dims: int = 256) -> list[float]:
    """A unit vector of ``dims`` floats for ``text``."""
    vector = [0.0] * dims
    for feature, weight in features(text):
        for index, sign in _slots(feature, dims):
            vector[index] += sign * weight
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]
