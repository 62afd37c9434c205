"""Router-issued cache salts: the prefix key travels to the engine and back in KV events.

With ``kv_cache_index.cache_salt.enabled`` the router sends ``cache_salt`` on requests to
backends that have a KV event source. The salt names the request's prefix key and carries
an HMAC bound to the backend, so the listener can attribute the stored blocks to a prefix
without reconstructing tokens (required for TensorRT-LLM, which has no ``/detokenize``)
and cannot be fooled by a salt a client made up or one meant for another backend::

    cr1-<prefix_hash: 64 lowercase hex>-<attribution: 16 hex><isolation: 16 hex>

    attribution = HMAC-SHA256(secret, backend ‖ 0x00 ‖ prefix_hash)[:16 hex]
    isolation   = the same HMAC's next 16 hex (shared salts), or, per tenant,
                  HMAC-SHA256(secret, backend ‖ 0x00 ‖ prefix_hash ‖ 0x00 ‖ tenant)[:16 hex]

101 characters, within vLLM's 128-character limit and free of ``@ / \\`` and NUL.
Salting also isolates KV reuse to requests with the same salt, i.e. the same prefix on the
same backend, which is what prefix routing arranges anyway; with
``cache_salt.per_tenant`` the isolation half binds the salt to the client's tenant as well,
so tenants never share an engine's prefix cache (and cannot time each other's prompts
through it). The listener does not know tenants: it verifies the attribution half (a
64-bit HMAC tag, bound to backend and prefix) and ignores the isolation half, so shared
and per-tenant salts attribute alike and the tenant is never visible in the salt. One
implementation: the router and the listener both import this module.
"""

from __future__ import annotations

import hashlib
import hmac
import re

SALT_VERSION = "cr1"
_SALT = re.compile(r"cr1-([0-9a-f]{64})-([0-9a-f]{16})[0-9a-f]{16}")
_HALF = 16


def _mac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _attribution_message(backend: str, prefix_hash: str) -> bytes:
    return backend.encode("utf-8") + b"\x00" + prefix_hash.encode("ascii")


def make_salt(secret: bytes, backend: str, prefix_hash: str, tenant: str | None = None) -> str:
    """The salt the router sends to ``backend`` for a request with ``prefix_hash``.

    ``tenant`` (per-tenant isolation; None: shared) goes into the isolation half's HMAC
    input: two tenants get different salts for the same prefix, one tenant always the same.
    """
    message = _attribution_message(backend, prefix_hash)
    mac = _mac(secret, message)
    if tenant is None:
        tag = mac[:2 * _HALF]
    else:
        tenant_mac = _mac(secret, message + b"\x00" + tenant.encode("utf-8", "surrogatepass"))
        tag = mac[:_HALF] + tenant_mac[:_HALF]
    return f"{SALT_VERSION}-{prefix_hash}-{tag}"


def verify_salt(secret: bytes, backend: str, salt: object) -> str | None:
    """The prefix hash a salt names, if it is one of ours and valid for ``backend``
    (shared or per-tenant: only the attribution half is checked)."""
    if not isinstance(salt, str):
        return None
    match = _SALT.fullmatch(salt)
    if match is None:
        return None
    prefix_hash, attribution = match.groups()
    expected = _mac(secret, _attribution_message(backend, prefix_hash))[:_HALF]
    if not hmac.compare_digest(attribution, expected):
        return None
    return prefix_hash
