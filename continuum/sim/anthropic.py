"""A fake Anthropic Messages API that speaks the real wire format, for tests and demos.

``python -m continuum.sim.anthropic --port 9000 [--api-key K]`` serves:

* ``POST /v1/messages``: a deterministic answer unless ``temperature`` > 0 is sent (words
  drawn from a seed that is the hash of the prompt), whole or as the real SSE sequence
  ``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``…,
  ``content_block_stop``, ``message_delta``, ``message_stop``; token counts from
  :class:`~continuum.sim.tokenizer.SimTokenizer`; ``usage`` with the prompt-cache fields of
  :mod:`continuum.sim.anthropic_cache`;
* ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}`` for a Messages request
  without ``max_tokens``, counted like ``usage`` counts the prompt;
* ``GET /v1/models`` and ``GET /v1/models/{id}`` (``"type": "model"`` entries);
* errors as ``{"type": "error", "error": {"type", "message"}, "request_id"}`` with the
  real statuses, and a ``request-id`` header on every answer (and the
  ``anthropic-ratelimit-*`` headers on every ``/v1/messages`` one);
* for tests: ``GET /_sim/received?n=N`` (the last ``POST /v1/messages[/count_tokens]`` bodies and
  headers, oldest first, recorded before any check) and ``POST /_sim/reset``.

With ``api_key`` set, ``x-api-key`` (or ``Authorization: Bearer``) must match it (401
``authentication_error`` otherwise); ``anthropic-version`` is required (400).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import falcon

from continuum.errors import AuthenticationError, ContinuumError, ModelNotFoundError, RequestError
from continuum.sim.anthropic_cache import PromptCache, min_cacheable_tokens, prompt_blocks
from continuum.sim.tokenizer import SimTokenizer

DEFAULT_MODELS = ("claude-sonnet-4-6", "claude-opus-4-7", "claude-haiku-4-5", "claude-sonnet-4-5")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
_ROLES = ("user", "assistant")


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y")


def _error_doc(status: int, message: str, request_id: str) -> bytes:
    error = {"type": ERROR_TYPES.get(status, "api_error"), "message": message}
    return _dumps({"type": "error", "error": error, "request_id": request_id})


def _on_error(req: falcon.Request, resp: falcon.Response, ex: Exception, params: Any) -> None:
    assert isinstance(ex, ContinuumError)
    resp.status = falcon.code_to_http_status(ex.status)
    resp.content_type = falcon.MEDIA_JSON
    resp.data = _error_doc(ex.status, ex.message, req.context.request_id)


def _serialize(req: falcon.Request, resp: falcon.Response, ex: falcon.HTTPError) -> None:
    resp.content_type = falcon.MEDIA_JSON
    message = ex.description or ex.title or "error"
    resp.data = _error_doc(ex.status_code, message, str(req.context.get("request_id", "")))


#: The rate-limit headers the real API sends on every Messages answer (fixed values here).
RATE_LIMIT_HEADERS = {
    f"anthropic-ratelimit-{kind}-{field}": value
    for kind, limit in (("requests", 1000), ("tokens", 96000), ("input-tokens", 80000),
                        ("output-tokens", 16000))
    for field, value in (("limit", str(limit)), ("remaining", str(limit - 1)),
                         ("reset", "2026-01-01T00:00:00Z"))
}


class _RequestId:
    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_id = _new_id("req_")
        resp.set_header("request-id", req.context.request_id)
        if req.path.startswith("/v1/messages"):
            resp.set_headers(RATE_LIMIT_HEADERS)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(message)


def _validate_blocks(blocks: Any, where: str) -> None:
    _check(isinstance(blocks, list), f"{where}: Input should be a valid list")
    for i, block in enumerate(blocks):
        _check(isinstance(block, dict), f"{where}.{i}: Input should be a valid dictionary")
        _check(isinstance(block.get("type"), str), f"{where}.{i}.type: Field required")
        if block["type"] == "text":
            _check(isinstance(block.get("text"), str), f"{where}.{i}.text: Field required")


def validate(body: dict[str, Any], models: Sequence[str]) -> None:
    """Check a Messages request the way the API does (field errors first, then the model).

    Raises:
        RequestError: a missing or malformed field (400 ``invalid_request_error``).
        ModelNotFoundError: an unknown model (404 ``not_found_error``).
    """
    for name in ("model", "max_tokens", "messages"):
        _check(name in body, f"{name}: Field required")
    _check(isinstance(body["model"], str), "model: Input should be a valid string")
    max_tokens = body["max_tokens"]
    _check(isinstance(max_tokens, int) and not isinstance(max_tokens, bool),
           "max_tokens: Input should be a valid integer")
    _check(max_tokens >= 1, "max_tokens: Input should be greater than or equal to 1")
    messages = body["messages"]
    _check(isinstance(messages, list), "messages: Input should be a valid list")
    _check(bool(messages), "messages: at least one message is required")
    for i, message in enumerate(messages):
        _check(isinstance(message, dict), f"messages.{i}: Input should be a valid dictionary")
        _check(message.get("role") in _ROLES,
               f"messages.{i}.role: Input should be 'user' or 'assistant'")
        _check("content" in message, f"messages.{i}.content: Field required")
        if not isinstance(message["content"], str):
            _validate_blocks(message["content"], f"messages.{i}.content")
            _check(bool(message["content"]), f"messages.{i}: all messages must have non-empty "
                   "content except for the optional final assistant message")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _validate_blocks(system, "system")
        for i, block in enumerate(system):
            _check(block["type"] == "text", f"system.{i}.type: Input should be 'text'")
    tools = body.get("tools", [])
    _check(isinstance(tools, list), "tools: Input should be a valid list")
    for i, tool in enumerate(tools):
        _check(isinstance(tool, dict) and isinstance(tool.get("name"), str),
               f"tools.{i}.name: Field required")
    _check(isinstance(body.get("stream", False), bool), "stream: Input should be a valid boolean")
    temperature = body.get("temperature", 1.0)
    _check(isinstance(temperature, (int, float)) and not isinstance(temperature, bool),
           "temperature: Input should be a valid number")
    _check(0 <= temperature <= 1, "temperature: Input should be between 0 and 1")
    stops = body.get("stop_sequences", [])
    _check(isinstance(stops, list) and all(isinstance(s, str) for s in stops),
           "stop_sequences: Input should be a valid list of strings")
    if body["model"] not in models:
        raise ModelNotFoundError(f"model: {body['model']}")


class FakeAnthropic:
    """State and responders of one fake API: its models, key, prompt cache, request log."""

    def __init__(self, *, models: Sequence[str] = DEFAULT_MODELS, api_key: str | None = None,
                 min_cache_tokens: int | None = None, keep_received: int = 100) -> None:
        self.models = tuple(models)
        self.api_key = api_key
        self.min_cache_tokens = min_cache_tokens
        self.cache = PromptCache()
        self.received: deque[dict[str, Any]] = deque(maxlen=keep_received)
        self.tokenizer = SimTokenizer()
        self._spaced, self._capital = self.tokenizer.generation_lexicon()

    def _authorize(self, req: falcon.Request) -> None:
        given = req.get_header("x-api-key")
        scheme, _, token = (req.get_header("Authorization") or "").partition(" ")
        if not given and scheme.lower() == "bearer":
            given = token  # recent SDKs send the API key as a bearer token
        if self.api_key is not None:
            if not given:
                raise AuthenticationError("x-api-key header is required")
            if not secrets.compare_digest(given.encode(), self.api_key.encode()):
                raise AuthenticationError("invalid x-api-key")
        if not req.get_header("anthropic-version"):
            raise RequestError("anthropic-version: header is required")

    def _model_doc(self, model: str) -> dict[str, Any]:
        words = [w.capitalize() for w in model.split("-")[1:] if not w.isdigit()]
        version = ".".join(w for w in model.split("-") if w.isdigit())
        return {"type": "model", "id": model, "display_name": " ".join(["Claude", *words,
                version]).strip(), "created_at": "2025-09-29T00:00:00Z"}

    def on_get_models(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /v1/models``: the served models, one page."""
        self._authorize(req)
        data = [self._model_doc(m) for m in self.models]
        resp.media = {"data": data, "has_more": False,
                      "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None}

    def on_get_model(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        """``GET /v1/models/{model_id}``."""
        self._authorize(req)
        if model_id not in self.models:
            raise ModelNotFoundError(f"model: {model_id}")
        resp.media = self._model_doc(model_id)

    def on_get_received(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``GET /_sim/received?n=N``: the last N recorded Messages requests."""
        n = req.get_param_as_int("n", min_value=1) or len(self.received)
        resp.media = {"received": list(self.received)[-n:] if self.received else []}

    def _received_object(self, req: falcon.Request) -> dict[str, Any]:
        """The request's JSON object body, once it is recorded (as text when it is not
        JSON) and the caller authorized; the API's 400 when it is not an object."""
        raw = req.bounded_stream.read()
        try:
            body: Any = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        headers = {name.lower(): value for name, value in req.headers.items()}
        self.received.append({"path": req.path, "headers": headers,
                              "body": body if body is not None else raw.decode("utf-8", "replace")})
        self._authorize(req)
        if not isinstance(body, dict):
            raise RequestError("There was an issue with the format or content of your "
                               "request: the body is not a JSON object")
        return body

    def on_post_reset(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /_sim/reset``: forget recorded requests and the prompt cache."""
        self.received.clear()
        self.cache.clear()
        resp.media = {"reset": True}

    def on_post_messages(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1/messages``: record, check, account the prompt cache, answer."""
        body = self._received_object(req)
        validate(body, self.models)
        blocks = prompt_blocks(body, self.tokenizer)
        model = body["model"]
        minimum = self.min_cache_tokens or min_cacheable_tokens(model)
        usage = self.cache.account(model, blocks, minimum).as_dict()
        usage["service_tier"] = "standard"
        # Deterministic unless sampling is asked for explicitly (recent SDKs send no
        # temperature at all, and tests compare streamed and whole answers).
        seed: Any = os.urandom(16) if body.get("temperature", 0) > 0 else blocks[-1].digest
        pieces, stop_reason, stop_sequence = self._generate(
            random.Random(seed), body["max_tokens"], body.get("stop_sequences", []))
        message = {"id": _new_id("msg_"), "type": "message", "role": "assistant",
                   "model": model, "content": [{"type": "text", "text": "".join(pieces)}],
                   "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                   "usage": {**usage, "output_tokens": len(pieces)}}
        if body.get("stream", False):
            resp.content_type = "text/event-stream; charset=utf-8"
            resp.set_header("cache-control", "no-cache")
            resp.stream = _events(message, pieces)
        else:
            resp.media = message

    def on_post_count_tokens(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1/messages/count_tokens``: the request's input tokens, as the API
        answers them (``{"input_tokens": N}``); nothing is generated or cached. The body
        is a Messages request without ``max_tokens`` (which the API refuses here)."""
        body = self._received_object(req)
        for extra in ("max_tokens", "stream", "stop_sequences", "temperature"):
            _check(extra not in body, f"{extra}: Extra inputs are not permitted")
        validate({**body, "max_tokens": 1}, self.models)
        blocks = prompt_blocks(body, self.tokenizer)
        resp.media = {"input_tokens": blocks[-1].end if blocks else 0}

    def _generate(self, rng: random.Random, max_tokens: int,
                  stops: Sequence[str]) -> tuple[list[str], str, str | None]:
        """Token strings of the answer, the stop reason and the stop sequence hit, if any."""
        length = rng.randint(8, 24)
        ids = [rng.choice(self._capital)] + [rng.choice(self._spaced) for _ in range(length)]
        pieces = self.tokenizer.token_strs(ids[:max_tokens]) + (
            ["."] if max_tokens > length + 1 else [])
        reason = "end_turn" if max_tokens > length + 1 else "max_tokens"
        text = "".join(pieces)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if not hits:
            return pieces, reason, None
        cut, stop = min(hits)
        kept: list[str] = []
        for piece in pieces:  # keep whole tokens before the cut, then the cut one's head
            room = cut - sum(map(len, kept))
            if room <= 0:
                break
            kept.append(piece[:room])
        return kept, "stop_sequence", stop


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _dumps({"type": name, **doc}) + b"\n\n"


def _events(message: dict[str, Any], pieces: list[str]) -> Iterator[bytes]:
    """The Messages streaming event sequence for a finished ``message``."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 1}}
    yield _event("message_start", {"message": start})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                        "text": ""}})
    yield _event("ping", {})
    for piece in pieces:
        delta = {"type": "text_delta", "text": piece}
        yield _event("content_block_delta", {"index": 0, "delta": delta})
    yield _event("content_block_stop", {"index": 0})
    final = {k: usage[k] for k in ("input_tokens", "cache_creation_input_tokens",
                                   "cache_read_input_tokens", "output_tokens")}
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield _event("message_delta", {"delta": delta, "usage": final})
    yield _event("message_stop", {})


def create_anthropic_app(
    fake: FakeAnthropic | None = None,
) -> falcon.App[falcon.Request, falcon.Response]:
    """The fake API's WSGI app, on :func:`continuum.sim.server.create_app` (``/health``)."""
    from continuum.sim.server import create_app

    fake = fake or FakeAnthropic()
    app = create_app()
    app.add_middleware(_RequestId())
    app.add_error_handler(ContinuumError, _on_error)  # replaces the base's vLLM shape
    app.set_error_serializer(_serialize)
    app.add_route("/v1/messages", fake, suffix="messages")
    app.add_route("/v1/messages/count_tokens", fake, suffix="count_tokens")
    app.add_route("/v1/models", fake, suffix="models")
    app.add_route("/v1/models/{model_id}", fake, suffix="model")
    app.add_route("/_sim/received", fake, suffix="received")
    app.add_route("/_sim/reset", fake, suffix="reset")
    return app


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m continuum.sim.anthropic``."""
    p = argparse.ArgumentParser(prog="python -m continuum.sim.anthropic",
                                description="A fake Anthropic Messages API.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--api-key", default=None, help="require this x-api-key")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated ids")
    p.add_argument("--min-cache-tokens", type=int, default=None,
                   help="shortest cacheable prefix (default: 1024, Haiku 2048)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the fake API until SIGTERM or SIGINT."""
    from gevent import monkey

    monkey.patch_all()
    import gevent
    from gevent.event import Event

    from continuum.sim.server import make_server

    args = build_parser().parse_args(argv)
    fake = FakeAnthropic(models=[m for m in args.models.split(",") if m],
                         api_key=args.api_key, min_cache_tokens=args.min_cache_tokens)
    server = make_server(create_anthropic_app(fake), args.host, args.port)
    server.start()
    print(f"continuum-sim anthropic: http://{args.host}:{server.server_port} "
          f"models={','.join(fake.models)}", flush=True)
    stop = Event()
    gevent.signal_handler(signal.SIGTERM, stop.set)
    gevent.signal_handler(signal.SIGINT, stop.set)
    stop.wait()
    server.stop(timeout=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
