"""Client API keys and tenants (``auth`` section).

A client presents its key as ``Authorization: Bearer <key>`` (OpenAI SDKs) or
``x-api-key: <key>`` (Anthropic SDKs). A known key names the tenant, which goes into the
response-cache key so tenants never share cached answers. With ``auth.required`` an
unknown or missing key is a 401; otherwise such requests run with no tenant.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from continuum.errors import AuthenticationError

if TYPE_CHECKING:
    from continuum.config import AuthConfig


def _digest(key: str) -> bytes:
    # Looking keys up by digest keeps the comparison's timing independent of the secret.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ClientAuth:
    """Maps presented keys to tenants."""

    def __init__(self, config: AuthConfig) -> None:
        self.required = config.required
        self._tenants: dict[bytes, str] = {}
        for entry in config.keys:
            key, tenant = entry.resolved()
            if key:
                self._tenants[_digest(key)] = tenant

    def tenant(self, authorization: str | None, api_key: str | None) -> str | None:
        """The tenant of the presented key, or None (no keys configured / unknown key).

        Raises:
            AuthenticationError: ``auth.required`` and the key is missing or unknown.
        """
        if not self._tenants and not self.required:
            return None
        key = api_key
        if key is None and authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                key = value.strip()
        tenant = self._tenants.get(_digest(key)) if key else None
        if tenant is None and self.required:
            raise AuthenticationError(
                "Incorrect API key provided" if key else "Missing API key: send "
                "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        return tenant
