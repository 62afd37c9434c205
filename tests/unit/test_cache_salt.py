"""Router-issued cache salts: format, backend binding, forgery, per-tenant isolation."""

from __future__ import annotations

import hashlib
import hmac
import re

from continuum.cache_salt import make_salt, verify_salt

SECRET = b"s3cret"
PREFIX = "0f" * 32
SALT_SHAPE = re.compile(r"cr1-[0-9a-f]{64}-[0-9a-f]{32}")


def _flip(salt: str, at: int) -> str:
    return salt[:at] + ("0" if salt[at] != "0" else "1") + salt[at + 1:]


def test_roundtrip_and_format() -> None:
    for tenant in (None, "acme"):
        salt = make_salt(SECRET, "vllm-1", PREFIX, tenant)
        assert len(salt) <= 128 and not re.search(r"[@/\\\x00]", salt)
        assert SALT_SHAPE.fullmatch(salt)
        assert verify_salt(SECRET, "vllm-1", salt) == PREFIX


def test_bound_to_backend_secret_and_shape() -> None:
    salt = make_salt(SECRET, "vllm-1", PREFIX)
    assert verify_salt(SECRET, "vllm-2", salt) is None
    assert verify_salt(b"other", "vllm-1", salt) is None
    attribution_start = len("cr1-") + 64 + 1
    for at in (attribution_start, attribution_start + 15, 4, 4 + 63):
        assert verify_salt(SECRET, "vllm-1", _flip(salt, at)) is None
    assert verify_salt(SECRET, "vllm-1", "client-made-salt") is None
    assert verify_salt(SECRET, "vllm-1", None) is None
    assert verify_salt(SECRET, "vllm-1", salt.upper()) is None
    assert verify_salt(SECRET, "vllm-1", salt + "0") is None


def test_per_tenant_salts_differ_across_tenants_and_repeat_within_one() -> None:
    shared = make_salt(SECRET, "vllm-1", PREFIX)
    acme = make_salt(SECRET, "vllm-1", PREFIX, "acme")
    globex = make_salt(SECRET, "vllm-1", PREFIX, "globex")
    assert len({shared, acme, globex}) == 3
    assert make_salt(SECRET, "vllm-1", PREFIX, "acme") == acme
    # The tenant is in the HMAC input only: no field of the salt names it, and the
    # attribution half (what the listener checks) is the shared salt's.
    assert "acme" not in acme and acme[:-16] == shared[:-16] == globex[:-16]
    # A tenant's salt is still bound to backend and secret.
    assert verify_salt(SECRET, "vllm-2", acme) is None
    assert verify_salt(b"other", "vllm-1", acme) is None
    assert make_salt(SECRET, "vllm-2", PREFIX, "acme")[-16:] != acme[-16:]


def test_shared_salts_are_unchanged() -> None:
    """Without per-tenant isolation the salt is the one earlier releases issued, so a
    router and a listener of different versions still agree."""
    mac = hmac.new(SECRET, b"vllm-1\x00" + PREFIX.encode(), hashlib.sha256).hexdigest()
    assert make_salt(SECRET, "vllm-1", PREFIX) == f"cr1-{PREFIX}-{mac[:32]}"
