"""Router-issued cache salts: format, backend binding, forgery."""

from __future__ import annotations

import re

from continuum.cache_salt import make_salt, verify_salt

SECRET = b"s3cret"
PREFIX = "0f" * 32


def test_roundtrip_and_format() -> None:
    salt = make_salt(SECRET, "vllm-1", PREFIX)
    assert len(salt) <= 128 and not re.search(r"[@/\\\x00]", salt)
    assert verify_salt(SECRET, "vllm-1", salt) == PREFIX


def test_bound_to_backend_secret_and_shape() -> None:
    salt = make_salt(SECRET, "vllm-1", PREFIX)
    assert verify_salt(SECRET, "vllm-2", salt) is None
    assert verify_salt(b"other", "vllm-1", salt) is None
    forged = salt[:-1] + ("0" if salt[-1] != "0" else "1")
    assert verify_salt(SECRET, "vllm-1", forged) is None
    assert verify_salt(SECRET, "vllm-1", "client-made-salt") is None
    assert verify_salt(SECRET, "vllm-1", None) is None
    assert verify_salt(SECRET, "vllm-1", salt.upper()) is None
