"""Router-issued cache salts: the prefix key travels to the engine and back in KV events.

With ``kv_cache_index.cache_salt.enabled`` the router sends ``cache_salt`` on requests to
backends that have a KV event source. The salt names the request's prefix key and carries
an HMAC bound to the backend, so the listener can attribute the stored blocks to a prefix
without reconstructing tokens (required for TensorRT-LLM, which has no ``/detokenize``)
and cannot be fooled by a salt a client made up or one meant for another backend::

    cr1-<prefix_hash: 64 lowercase hex>-<HMAC-SHA256(secret, backend ‖ 0x00 ‖ prefix_hash)[:16] hex>

101 characters, within vLLM's 128-character limit and free of ``@ / \\`` and NUL.
Salting also isolates KV reuse to requests with the same salt, i.e. the same prefix on the
same backend, which is what prefix routing arranges anyway. One implementation: the router
and the listener both import this module.
"""

from __future__ import annotations

import hashlib
import hmac
import re

SALT_VERSION = "cr1"
_SALT = re.compile(r"cr1-([0-9a-f]{64})-([0-9a-f]{32})")


def _mac(secret: bytes, backend: str, prefix_hash: str) -> str:
    message = backend.encode("utf-8") + b"\x00" + prefix_hash.encode("ascii")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:32]


def make_salt(secret: bytes, backend: str, prefix_hash: str) -> str:
    """The salt the router sends to ``backend`` for a request with ``prefix_hash``."""
    return f"{SALT_VERSION}-{prefix_hash}-{_mac(secret, backend, prefix_hash)}"


def verify_salt(secret: bytes, backend: str, salt: object) -> str | None:
    """The prefix hash a salt names, if it is one of ours and valid for ``backend``."""
    if not isinstance(salt, str):
        return None
    match = _SALT.fullmatch(salt)
    if match is None:
        return None
    prefix_hash, mac = match.groups()
    if not hmac.compare_digest(mac, _mac(secret, backend, prefix_hash)):
        return None
    return prefix_hash
