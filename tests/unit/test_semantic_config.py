"""``response_cache.semantic``: key-path errors, the visibility rule, numpy as an extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum.config import parse_config
from continuum.errors import ConfigError


def _doc(**semantic: Any) -> dict[str, Any]:
    return {"backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]},
                         {"name": "emb", "url": "http://127.0.0.1:8", "internal": True},
                         {"name": "off", "url": "http://127.0.0.1:7", "enabled": False}],
            "response_cache": {"enabled": True, "semantic": {
                "enabled": True, "backend": "emb", "embedding_model": "e", **semantic}}}


def _errors(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    return [f"{i.path}: {i.message}" for i in info.value.issues]


def test_internal_backend_is_accepted_with_defaults() -> None:
    config = parse_config(_doc())
    sem = config.response_cache.semantic
    assert (sem.threshold, sem.max_entries, sem.ttl, sem.embedding_timeout_ms,
            sem.max_input_bytes, sem.false_hit_gate) == (0.92, 1000, None, 2000, 8192, True)


@pytest.mark.parametrize(("semantic", "path"), [
    ({"backend": "off"}, "response_cache.semantic.backend"),
    ({"backend": "nope"}, "response_cache.semantic.backend"),
    ({"embedding_model": None}, "response_cache.semantic.embedding_model"),
    ({"max_entries": 1_000_001}, "response_cache.semantic.max_entries"),
    ({"embedding_timeout_ms": 99}, "response_cache.semantic.embedding_timeout_ms"),
    ({"max_input_bytes": 0}, "response_cache.semantic.max_input_bytes"),
    ({"threshold": 1.01}, "response_cache.semantic.threshold"),
])
def test_bad_values_name_their_key(semantic: dict[str, Any], path: str) -> None:
    assert any(e.startswith(path + ":") for e in _errors(_doc(**semantic)))


def test_missing_numpy_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)  # blocks the import, as if missing
    errors = _errors(_doc())
    assert any(e.startswith("response_cache.semantic.enabled:") and "numpy" in e
               for e in errors)


def test_default_path_never_imports_numpy() -> None:
    code = ("import sys; from continuum.app import get_app; import continuum.service; "
            "import continuum.cli; print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_the_example_config_semantic_block_is_valid_when_switched_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTINUUM_ADMIN_TOKEN", "t")
    path = Path(__file__).resolve().parents[2] / "conf" / "config.yaml.example"
    doc = yaml.safe_load(path.read_text())
    assert doc["response_cache"]["semantic"]["enabled"] is False  # off by default
    doc["response_cache"]["enabled"] = doc["response_cache"]["semantic"]["enabled"] = True
    sem = parse_config(doc).response_cache.semantic
    assert (sem.backend, sem.embedding_model, sem.threshold, sem.max_entries, sem.ttl,
            sem.embedding_timeout_ms, sem.max_input_bytes, sem.false_hit_gate) == \
        ("embedder", "bge-m3", 0.92, 1000, 300.0, 2000, 8192, True)
