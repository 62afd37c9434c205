"""The simulator's embedders: the deterministic hashed one (what tests use) and the numpy
BERT forward pass behind the optional all-MiniLM-L6-v2 benchmark embedder."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from continuum.sim.embedder import MiniLmEmbedder, _gelu, embed


def _cos(a: str, b: str, dims: int = 256) -> float:
    return float(np.dot(embed(a, dims), embed(b, dims)))


def test_vectors_are_unit_length_of_the_asked_size() -> None:
    for dims in (8, 64, 256):
        v = embed("How do I reset my password?", dims)
        assert len(v) == dims and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-9)


def test_the_same_text_embeds_the_same_under_any_hash_seed() -> None:
    code = "from continuum.sim.embedder import embed; print(embed('Reset my 2FA', 16))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60, env={"PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert outs == {str(embed("Reset my 2FA", 16)) + "\n"}


def test_paraphrases_are_close_and_unrelated_texts_are_not() -> None:
    para = _cos("How do I reset my password?", "How can I reset my password?")
    unrelated = _cos("How do I reset my password?", "Explain how photosynthesis works")
    assert para > 0.85 and abs(unrelated) < 0.3
    # Opposite meaning, still close vectors (the gate's reason to exist); with this
    # embedder not as close as a light rewording.
    opposite = _cos("How do I enable 2FA on my account?", "How do I disable 2FA on my account?")
    reworded = _cos("How do I enable 2FA on my account?", "How can I enable 2FA on my account?")
    assert 0.7 < opposite < reworded


def test_gelu_matches_the_exact_erf_form() -> None:
    xs = np.linspace(-6, 6, 241)
    exact = np.array([0.5 * x * (1 + math.erf(x / math.sqrt(2))) for x in xs])
    assert np.max(np.abs(_gelu(xs) - exact)) < 1e-6


@dataclass
class _Encoding:
    ids: list[int]
    attention_mask: list[int]


class _Tokenizer:
    """Word ids by position in a fixed vocabulary, padded to the longest text."""

    VOCAB = ("[PAD]", "[CLS]", "[SEP]", "reset", "my", "password", "enable", "2fa", "now")

    def enable_truncation(self, n: int) -> None:
        self.limit = n

    def enable_padding(self) -> None:
        pass

    def encode_batch(self, texts: list[str]) -> list[_Encoding]:
        rows = [[1, *(self.VOCAB.index(w) for w in t.split()), 2] for t in texts]
        n = max(len(r) for r in rows)
        return [_Encoding(r + [0] * (n - len(r)), [1] * len(r) + [0] * (n - len(r)))
                for r in rows]


def _tiny_bert(hidden: int = 24, layers: int = 2, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> Any:
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    w = {"embeddings.word_embeddings.weight": r(9, hidden),
         "embeddings.position_embeddings.weight": r(16, hidden),
         "embeddings.token_type_embeddings.weight": r(2, hidden),
         "embeddings.LayerNorm.weight": np.ones(hidden, np.float32),
         "embeddings.LayerNorm.bias": np.zeros(hidden, np.float32)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            w[p + f"attention.self.{name}.weight"] = r(hidden, hidden)
            w[p + f"attention.self.{name}.bias"] = r(hidden)
        w[p + "attention.output.dense.weight"] = r(hidden, hidden)
        w[p + "attention.output.dense.bias"] = r(hidden)
        w[p + "intermediate.dense.weight"] = r(4 * hidden, hidden)
        w[p + "intermediate.dense.bias"] = r(4 * hidden)
        w[p + "output.dense.weight"] = r(hidden, 4 * hidden)
        w[p + "output.dense.bias"] = r(hidden)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + ln + ".weight"] = np.ones(hidden, np.float32)
            w[p + ln + ".bias"] = np.zeros(hidden, np.float32)
    return w


def test_bert_forward_pass_ignores_padding_and_returns_unit_rows() -> None:
    model = MiniLmEmbedder(_tiny_bert(), _Tokenizer())
    assert model.layers == 2
    alone = model.embed_batch(["reset my password"])
    padded = model.embed_batch(["reset my password", "enable 2fa now reset my password"])
    assert padded.shape == (2, 24) and padded.dtype == np.float32
    assert np.allclose(np.linalg.norm(padded, axis=1), 1.0, atol=1e-5)
    # The padded copy of the short text embeds exactly as the text alone.
    assert np.allclose(alone[0], padded[0], atol=1e-5)
    assert not np.allclose(padded[0], padded[1], atol=1e-2)


@pytest.mark.parametrize("batch", [1, 2, 64])
def test_batches_give_the_same_rows(batch: int) -> None:
    model = MiniLmEmbedder(_tiny_bert(seed=1), _Tokenizer())
    texts = ["reset my password", "enable 2fa", "now"]
    assert np.allclose(model.embed_batch(texts, batch), model.embed_batch(texts, 3),
                       atol=1e-5)
