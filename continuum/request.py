"""The request context: a client request parsed once, read by every later stage."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from continuum.errors import RequestError

#: Endpoint kinds the router proxies.
CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
ANTHROPIC_MESSAGES = "anthropic_messages"


@dataclass(slots=True)
class RequestContext:
    """Everything the routing and caching stages need to know about one request.

    Built once by :func:`parse_request`; stages add to ``state`` (e.g. the KV tier of the
    chosen backend) rather than re-reading the body.
    """

    endpoint: str
    model: str
    body: dict[str, Any]
    raw: bytes
    stream: bool = False
    messages: list[Any] | None = None
    system: Any = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    tenant: str | None = None
    request_id: str = ""
    prefix_key: bytes | None = None
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def protocol(self) -> str:
        """The API family of the request: ``anthropic`` or ``openai``."""
        return "anthropic" if self.endpoint == ANTHROPIC_MESSAGES else "openai"

    @property
    def prefix_hash(self) -> str | None:
        """The prefix key as lowercase hex, or ``None`` when the request has none."""
        return None if self.prefix_key is None else self.prefix_key.hex()


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number", param=name)
    return float(value)


def parse_request(
    raw: bytes, endpoint: str, *, tenant: str | None = None, request_id: str | None = None
) -> RequestContext:
    """Parse a JSON request body into a :class:`RequestContext`.

    Raises:
        RequestError: the body is not a JSON object, or ``model`` is missing or not a string.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise RequestError("'messages' must be an array", param="messages")
    if endpoint in (CHAT, ANTHROPIC_MESSAGES) and not messages:
        raise RequestError("'messages' is required and must be a non-empty array", param="messages")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise RequestError("'max_tokens' must be an integer", param="max_tokens")
    return RequestContext(
        endpoint=endpoint,
        model=model,
        body=body,
        raw=raw,
        stream=stream,
        messages=messages,
        system=body.get("system"),
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        max_tokens=max_tokens,
        tenant=tenant,
        request_id=request_id or uuid.uuid4().hex,
    )
