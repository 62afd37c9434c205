"""HTTP face of the simulated engine: vLLM's OpenAI server routes on a Falcon WSGI app.

``create_app()`` is the reusable base (vLLM-style JSON errors, ``/health``);
``create_engine_app(engine)`` adds the engine routes:

* ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``
  (:mod:`continuum.sim.responses`);
* ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (not trtllm): Anthropic's
  Messages API, translated into the chat path as vLLM (>= 0.11.1) does
  (:mod:`continuum.sim.messages`), errors in Anthropic's ``{"type": "error", "error":
  {...}}`` shape;
* ``GET /v1/models``, ``/version``, ``/metrics`` (vLLM's Prometheus names), ``/health``;
  ``POST /tokenize``, ``/detokenize`` (not trtllm); ``/reset_prefix_cache`` and
  ``/flush_cache``; ``/kv_cache_events`` (trtllm);
* for tests: ``GET /sim/stats`` (counters) and ``GET /sim/received?n=N`` (the last POST
  bodies with their path and ``anthropic-*``/``authorization`` headers, oldest first).

``make_server``/``serve`` run any of them on gevent's WSGI server with ``TCP_NODELAY`` on
every accepted socket, so each SSE chunk leaves as soon as it is yielded. Bodies and chunks
are compact JSON, the way vLLM's pydantic models serialise; OpenAI streams are
``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import falcon
from gevent.pywsgi import WSGIHandler, WSGIServer

from continuum.errors import ContinuumError, RequestError
from continuum.sim import messages as anthropic_messages
from continuum.sim.engine import Generation, GenerationRequest, SimEngine, render_metrics
from continuum.sim.responses import ResponseShape, chat_messages

_OWNERS = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm"}
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError"}
#: Paths whose errors take Anthropic's shape (vLLM's Messages router translates its own).
_MESSAGES_PATH = "/v1/messages"
#: POST bodies kept for ``GET /sim/received``, and the request headers kept with them.
_RECEIVED = 64
_RECEIVED_HEADERS = ("anthropic-version", "anthropic-beta", "authorization")


def dumps(doc: Any) -> bytes:
    """Compact JSON bytes (non-ASCII kept as UTF-8 when it can be encoded)."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:  # lone surrogates: fall back to \\u escapes
        return json.dumps(doc, separators=(",", ":")).encode()


def read_json(req: falcon.Request) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise)."""
    raw = req.bounded_stream.read()
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def send_json(resp: falcon.Response, doc: Any, status: int = 200) -> None:
    """Answer with ``doc`` as JSON."""
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = "application/json"
    resp.data = dumps(doc)


def _error_handler(req: falcon.Request, resp: falcon.Response, ex: Exception, params: Any) -> None:
    assert isinstance(ex, ContinuumError)
    kind = _ERROR_TYPES.get(ex.status, "InternalServerError")
    if req.path.startswith(_MESSAGES_PATH):  # vLLM keeps the type, in Anthropic's shape
        send_json(resp, {"type": "error", "error": {"type": kind, "message": ex.message}},
                  ex.status)
        return
    error = {"message": ex.message, "type": kind, "param": ex.fields.get("param"),
             "code": ex.status}
    send_json(resp, {"error": error}, ex.status)


def create_app() -> falcon.App[falcon.Request, falcon.Response]:
    """A bare simulator app: vLLM-style error bodies and ``GET /health``; add routes to it."""
    app = falcon.App()
    app.add_error_handler(ContinuumError, _error_handler)
    app.add_route("/health", _Health())
    return app


class _Health:
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.status = falcon.HTTP_200
        resp.data = b""


def create_engine_app(
    engine: SimEngine, *, kv_events: Callable[[], list[dict[str, Any]]] | None = None
) -> falcon.App[falcon.Request, falcon.Response]:
    """The app of one simulated engine.

    Args:
        engine: the engine to serve.
        kv_events: TensorRT-LLM's destructive drain; when given, ``POST``/``GET
            /kv_cache_events`` return its JSON array.
    """
    app = create_app()
    api = _EngineApi(engine)
    app.add_route("/v1/models", api, suffix="models")
    app.add_route("/v1/chat/completions", api, suffix="chat")
    app.add_route("/v1/completions", api, suffix="completions")
    app.add_route("/v1/embeddings", api, suffix="embeddings")
    app.add_route("/v1/responses", api, suffix="responses")
    # trtllm-serve has neither the Messages API nor public (de)tokenize endpoints
    if engine.config.engine != "trtllm":
        app.add_route("/v1/messages", api, suffix="messages")
        app.add_route("/v1/messages/count_tokens", api, suffix="count_tokens")
        app.add_route("/tokenize", api, suffix="tokenize")
        app.add_route("/detokenize", api, suffix="detokenize")
    app.add_route("/version", api, suffix="version")
    app.add_route("/metrics", api, suffix="metrics")
    app.add_route("/sim/stats", api, suffix="stats")
    app.add_route("/sim/received", api, suffix="received")
    # vLLM's (dev-mode) and SGLang's ways to drop the prefix cache
    app.add_route("/reset_prefix_cache", api, suffix="reset")
    app.add_route("/flush_cache", api, suffix="reset")
    if kv_events is not None:
        app.add_route("/kv_cache_events", _KvEvents(kv_events))
    return app


class _KvEvents:
    def __init__(self, drain: Callable[[], list[dict[str, Any]]]) -> None:
        self.drain = drain

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, self.drain())

    on_get = on_post


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", param=name)
    return value


def _int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"'{name}' must be an integer >= {minimum}", param=name)
    return value


def _sampling(
    engine: SimEngine, body: dict[str, Any], model: str, prompt: list[int]
) -> GenerationRequest:
    if body.get("n") not in (None, 1):
        raise RequestError("the simulated engine supports only n=1", param="n")
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise RequestError("'temperature' must be a number", param="temperature")
    if temperature < 0:
        raise RequestError("temperature must be non-negative", param="temperature")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings", param="stop")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError("'cache_salt' must be a non-empty string", param="cache_salt")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    return GenerationRequest(
        model=model,
        prompt_ids=tuple(prompt),
        max_tokens=max_tokens,
        temperature=float(temperature),
        seed=_int(body, "seed", -(2**63)),
        stop=tuple(stop),
        cache_salt=salt,
        ignore_eos=_flag(body, "ignore_eos", False),
        min_tokens=_int(body, "min_tokens", 0) or 0,
    )


def _stream_options(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise RequestError("Stream options can only be defined when `stream=True`.")
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    usage = _flag(options, "include_usage", False)
    return usage, usage and _flag(options, "continuous_usage_stats", False)


def usage_doc(gen: Generation) -> dict[str, Any]:
    """vLLM's ``usage`` object, always with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "completion_tokens": gen.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


class _EngineApi:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.received: deque[dict[str, Any]] = deque(maxlen=_RECEIVED)

    def _read(self, req: falcon.Request) -> dict[str, Any]:
        """The request's JSON body, recorded for ``GET /sim/received`` before any check."""
        body = read_json(req)
        headers = {name: value for name in _RECEIVED_HEADERS
                   if (value := req.get_header(name)) is not None}
        self.received.append({"path": req.path, "headers": headers, "body": body})
        return body

    def on_get_received(self, req: falcon.Request, resp: falcon.Response) -> None:
        n = req.get_param_as_int("n", min_value=1) or _RECEIVED
        send_json(resp, {"received": list(self.received)[-n:]})

    def on_get_models(self, req: falcon.Request, resp: falcon.Response) -> None:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": _OWNERS[self.engine.config.engine],
                "root": name,
                "parent": None,
                "max_model_len": self.engine.config.max_model_len,
            }
            for name in self.engine.config.models
        ]
        send_json(resp, {"object": "list", "data": data})

    def on_get_version(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, {"version": "0.0.0+continuum.sim"})

    def on_get_metrics(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.text = render_metrics(self.engine)

    def on_get_stats(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, self.engine.stats())

    def on_get_reset(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.on_post_reset(req, resp)

    def on_post_reset(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.engine.reset_prefix_cache():
            raise RequestError("Failed to reset prefix cache: requests are still running.")
        resp.status = falcon.HTTP_200
        resp.data = b""

    def on_post_tokenize(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = self._read(req)
        engine = self.engine
        engine.resolve_model(body.get("model"))
        if "messages" in body:
            ids = engine.chat_prompt(
                body["messages"],
                add_generation_prompt=_flag(body, "add_generation_prompt", True),
                continue_final_message=_flag(body, "continue_final_message", False),
                add_special_tokens=_flag(body, "add_special_tokens", False),
            )
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("'prompt' must be a string", param="prompt")
            bos = engine.template.bos if _flag(body, "add_special_tokens", True) else None
            ids = engine.tokenizer.encode(prompt, bos=bos)
        strs = engine.tokenizer.token_strs(ids) if _flag(body, "return_token_strs", False) else None
        doc = {
            "count": len(ids),
            "max_model_len": engine.config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        send_json(resp, doc)

    def on_post_detokenize(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = self._read(req)
        self.engine.resolve_model(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise RequestError("'tokens' must be a list of integers", param="tokens")
        send_json(resp, {"prompt": self.engine.tokenizer.decode(tokens)})

    def on_post_embeddings(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = self._read(req)
        engine = self.engine
        model = engine.resolve_model(body.get("model"))
        raw = body.get("input")
        items = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise RequestError("'encoding_format' must be 'float' or 'base64'")
        dims = _int(body, "dimensions", 1)
        data, tokens = [], 0
        for index, item in enumerate(items):
            ids = engine.text_prompt(item, add_special_tokens=False)
            tokens += len(ids)
            vector = engine.embed(engine.tokenizer.decode(ids), dims)
            embedding: Any = vector
            if fmt == "base64":
                embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        doc = {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": {**usage, "prompt_tokens_details": None},
        }
        send_json(resp, doc)

    def on_post_chat(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._generate(req, resp, chat=True)

    def on_post_completions(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._generate(req, resp, chat=False)

    def on_post_responses(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1/responses`` (see :mod:`continuum.sim.responses`)."""
        body = self._read(req)
        if body.get("previous_response_id") is not None:
            raise RequestError("previous_response_id is not supported: this server stores "
                               "no responses (store: false)", param="previous_response_id")
        engine = self.engine
        model = engine.resolve_model(body.get("model"))
        stream = _flag(body, "stream", False)
        prompt = engine.chat_prompt(chat_messages(body))
        sampling = {k: v for k, v in body.items() if k in ("temperature", "seed")}
        if body.get("max_output_tokens") is not None:
            sampling["max_tokens"] = body["max_output_tokens"]
        gen = engine.start(_sampling(engine, sampling, model, prompt))
        shape = ResponseShape(model, body)
        if stream:
            resp.content_type = "text/event-stream"
            resp.stream = (b"event: " + name.encode() + b"\ndata: " + dumps(doc) + b"\n\n"
                           for name, doc in shape.events(gen))
        else:
            send_json(resp, shape.full(gen.run()))

    def on_post_messages(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1/messages`` (see :mod:`continuum.sim.messages`)."""
        body = self._read(req)
        engine = self.engine
        model = engine.resolve_model(body.get("model"))
        stream = _flag(body, "stream", False)
        prompt = engine.chat_prompt(anthropic_messages.chat_messages(body))
        gen = engine.start(_sampling(engine, anthropic_messages.sampling(body), model, prompt))
        shape = anthropic_messages.MessageShape(model)
        if stream:
            resp.content_type = "text/event-stream"
            resp.stream = shape.events(gen)
        else:
            send_json(resp, shape.full(gen.run()))

    def on_post_count_tokens(self, req: falcon.Request, resp: falcon.Response) -> None:
        """``POST /v1/messages/count_tokens``: the rendered prompt's length."""
        body = self._read(req)
        engine = self.engine
        engine.resolve_model(body.get("model"))
        prompt = engine.chat_prompt(anthropic_messages.chat_messages(body))
        send_json(resp, {"input_tokens": len(prompt)})

    def _generate(self, req: falcon.Request, resp: falcon.Response, *, chat: bool) -> None:
        body = self._read(req)
        engine = self.engine
        model = engine.resolve_model(body.get("model"))
        stream = _flag(body, "stream", False)
        include_usage, continuous = _stream_options(body, stream)
        if chat:
            prompt = engine.chat_prompt(
                body.get("messages"),
                add_generation_prompt=_flag(body, "add_generation_prompt", True),
                continue_final_message=_flag(body, "continue_final_message", False),
                add_special_tokens=_flag(body, "add_special_tokens", False),
            )
        else:
            prompt = engine.text_prompt(
                body.get("prompt"), add_special_tokens=_flag(body, "add_special_tokens", True)
            )
        gen = engine.start(_sampling(engine, body, model, prompt))
        shape = _Shape(chat, model)
        if stream:
            resp.content_type = "text/event-stream"
            resp.stream = shape.sse(gen, include_usage, continuous)
        else:
            send_json(resp, shape.full(gen.run()))


class _Shape:
    """vLLM's chat/completion JSON for one request, streamed or whole."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, gen: Generation) -> dict[str, Any]:
        last = gen.steps[-1]
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": gen.text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
        else:
            choice["text"] = gen.text
        choice.update(logprobs=None, finish_reason=last.finish_reason, stop_reason=last.stop_reason)
        if not self.chat:
            choice["prompt_logprobs"] = None
        doc = self._head(self.object)
        doc.update(choices=[choice], service_tier=None, system_fingerprint=None)
        doc["usage"] = usage_doc(gen)
        if self.chat:
            doc["prompt_logprobs"] = None
        doc["kv_transfer_params"] = None
        return doc

    def _chunk(self, choice: dict[str, Any], gen: Generation, continuous: bool) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        doc = self._head(obj)
        doc["choices"] = [choice]
        if continuous:
            doc["usage"] = {k: v for k, v in usage_doc(gen).items() if k != "prompt_tokens_details"}
        return b"data: " + dumps(doc) + b"\n\n"

    def sse(self, gen: Generation, include_usage: bool, continuous: bool) -> Iterator[bytes]:
        """The SSE byte stream; closing it releases the request's slot and blocks."""
        steps = iter(gen)
        try:
            for i, step in enumerate(steps):
                if i == 0 and self.chat:
                    role = {"role": "assistant", "content": ""}
                    first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
                    yield self._chunk(first, gen, continuous)
                choice: dict[str, Any] = {"index": 0}
                if self.chat:
                    choice["delta"] = {"content": step.text}
                else:
                    choice["text"] = step.text
                choice.update(logprobs=None, finish_reason=step.finish_reason)
                if step.finish_reason is not None or not self.chat:
                    choice["stop_reason"] = step.stop_reason
                yield self._chunk(choice, gen, continuous)
            if include_usage:
                doc = self._head("chat.completion.chunk" if self.chat else "text_completion")
                doc.update(choices=[], usage=usage_doc(gen))
                yield b"data: " + dumps(doc) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            steps.close()  # type: ignore[attr-defined]


class _NoDelayHandler(WSGIHandler):  # type: ignore[misc]
    def handle(self) -> None:
        try:
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # not a TCP socket (unix socket in tests): nothing to tune
            pass
        super().handle()


def make_server(
    app: Callable[..., Any], host: str = "127.0.0.1", port: int = 0, *, access_log: bool = False
) -> WSGIServer:
    """A gevent WSGI server for ``app`` (not started; ``port=0`` picks a free port)."""
    return WSGIServer(
        (host, port),
        app,
        handler_class=_NoDelayHandler,
        log="default" if access_log else None,
    )


def serve(app: Callable[..., Any], host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` until the process is stopped."""
    make_server(app, host, port).serve_forever()
