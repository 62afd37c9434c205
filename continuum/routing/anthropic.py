"""Native Anthropic Messages support: cache_control injection and error shapes.

Precedence of injection (the seed's rules):
  * ``prefix_routing.anthropic_cache_control_injection: true`` injects for every Anthropic
    backend, even one with ``anthropic_auto_cache_control: false``;
  * otherwise the backend's ``anthropic_auto_cache_control`` (default true) decides;
  * the marker ``{"type": "ephemeral"}`` goes on the last system block only (a string
    system prompt becomes one text block), and nothing is injected when the request
    already carries ``cache_control`` anywhere (system, messages, tools): the caller's
    own breakpoints win.
"""

from __future__ import annotations

import json
from typing import Any

EPHEMERAL = {"type": "ephemeral"}
#: Client headers forwarded to Anthropic backends: the API version the client's SDK
#: speaks (it wins over the backend's configured default) and opted-in betas.
FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta")

#: HTTP status → Anthropic error ``type``.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",  # Anthropic's own type for a request that timed out
}


def _blocks_have_cache_control(blocks: Any, depth: int = 0) -> bool:
    """Whether a block of ``blocks``, or one nested in a block's ``content`` (a
    ``tool_result``'s) or in a document's ``source.content``, carries ``cache_control``:
    Anthropic counts those among its four breakpoints too."""
    if not isinstance(blocks, list) or depth > 3:
        return False
    for block in blocks:
        if not isinstance(block, dict):
            continue
        if "cache_control" in block or _blocks_have_cache_control(block.get("content"),
                                                                   depth + 1):
            return True
        source = block.get("source")
        if isinstance(source, dict) and _blocks_have_cache_control(source.get("content"),
                                                                   depth + 1):
            return True
    return False


def has_cache_control(body: dict[str, Any]) -> bool:
    """Whether the request already sets ``cache_control``: at the top level (automatic
    caching), or on any system block, message block or tool."""
    if body.get("cache_control") is not None:
        return True
    if _blocks_have_cache_control(body.get("system")):
        return True
    if _blocks_have_cache_control(body.get("tools")):
        return True
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and _blocks_have_cache_control(message.get("content")):
                return True
    return False


def should_inject(global_injection: bool, backend_auto: bool) -> bool:
    """The seed's precedence: the fleet-wide switch forces it on, else the backend decides."""
    return global_injection or backend_auto


def inject_cache_control(body: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of ``body`` with the last system block marked ephemeral, or None when the
    request has no system prompt or already carries ``cache_control`` somewhere."""
    system = body.get("system")
    if not system or has_cache_control(body):
        return None
    if isinstance(system, str):
        blocks: list[Any] = [{"type": "text", "text": system}]
    elif isinstance(system, list) and isinstance(system[-1], dict):
        blocks = list(system)
    else:
        return None
    blocks[-1] = {**blocks[-1], "cache_control": dict(EPHEMERAL)}
    return {**body, "system": blocks}


def injected_body(body: dict[str, Any]) -> bytes | None:
    """:func:`inject_cache_control` serialised, or None when nothing changes."""
    injected = inject_cache_control(body)
    return None if injected is None else json.dumps(injected).encode()


def error_document(status: int, message: str, request_id: str | None = None) -> bytes:
    """An Anthropic-shaped error body for ``status`` (``request_id`` at the top level, as
    Anthropic's API has it, when given)."""
    # any other 4xx (405, 408, 409, 414, 431) is the client's request: Anthropic's
    # api_error is its 5xx
    error_type = _ERROR_TYPES.get(
        status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    doc: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id is not None:
        doc["request_id"] = request_id
    return json.dumps(doc).encode()
