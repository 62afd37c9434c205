"""Token usage read from upstream answers, for the token counters and the access log.

Every answer that reports usage is read, whatever its shape:

* OpenAI (chat, completions, embeddings; vLLM, SGLang, TensorRT-LLM): ``usage`` with
  ``prompt_tokens``, ``prompt_tokens_details.cached_tokens`` and ``completion_tokens``;
* OpenAI Responses: ``usage`` with ``input_tokens`` (cached ones included),
  ``input_tokens_details.cached_tokens`` and ``output_tokens``, streamed in the
  ``response`` of ``response.completed``;
* Anthropic Messages: ``usage`` with ``input_tokens`` (the uncached part only),
  ``cache_read_input_tokens``, ``cache_creation_input_tokens`` and ``output_tokens``; a
  stream reports them in ``message_start`` and the running ``output_tokens`` in each
  ``message_delta``, so later reports override earlier ones field by field;
* Gemini ``usageMetadata`` (``promptTokenCount``, ``cachedContentTokenCount``,
  ``candidatesTokenCount``): :data:`EXTRACTORS` holds one function per shape, and a
  backend with yet another shape adds its own there (the Gemini backend may extend or
  replace :func:`gemini_usage`).

Cost: a plain body is not decoded as a whole; the last ``"usage`` key is found with
``bytes.rfind`` (C speed) and only the object after it is decoded. A stream piece is
scanned with one ``in``; only a piece that carries usage is decoded.

Streams: the OpenAI usage chunk comes only when the request asked for it
(``stream_options.include_usage``). :func:`with_stream_usage` adds that to a request that
did not ask, and :class:`UsageStream` then strips the chunk (``"choices": []`` with
``usage``) from what the client sees, so its stream looks as it asked for it. The usage
field of the other chunks (``"usage": null`` when asked) is left alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, Protocol

_DECODER = json.JSONDecoder()
_KEY = b'"usage'
_RECORD_END = b"\n\n"
#: A partial SSE record longer than this is passed on unparsed (an upstream that does not
#: end its records with a blank line must not make the router buffer without bound).
_MAX_PENDING = 1 << 20


class UsageSink(Protocol):
    """What usage is written to (:class:`~continuum.metrics.RequestRecord`)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    cache_creation_tokens: int | None
    completion_tokens: int | None


def _int(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def openai_usage(doc: dict[str, Any]) -> dict[str, int | None] | None:
    """OpenAI's ``usage`` object (``prompt_tokens`` marks it)."""
    usage = doc.get("usage")
    if not isinstance(usage, dict) or _int(usage.get("prompt_tokens")) is None:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": _int(usage.get("prompt_tokens")),
            "cached_tokens": _int(cached) if cached is not None else 0,
            "completion_tokens": _int(usage.get("completion_tokens", 0))}


def responses_usage(doc: dict[str, Any]) -> dict[str, int | None] | None:
    """The Responses API's ``usage`` (``input_tokens`` with ``input_tokens_details``, which
    include the cached ones), in a response or in the ``response`` of its stream events."""
    usage = doc.get("usage")
    if usage is None:
        response = doc.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict) or "input_tokens_details" not in usage or \
            _int(usage.get("input_tokens")) is None:
        return None
    details = usage["input_tokens_details"]
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": _int(usage["input_tokens"]),
            "cached_tokens": _int(cached) if cached is not None else 0,
            "completion_tokens": _int(usage.get("output_tokens", 0))}


def anthropic_usage(doc: dict[str, Any]) -> dict[str, int | None] | None:
    """Anthropic's ``usage``, in a message, ``message_start`` or ``message_delta``."""
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        message = doc.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
    if not isinstance(usage, dict) or not ("input_tokens" in usage or "output_tokens" in usage):
        return None
    out: dict[str, int | None] = {}
    if "output_tokens" in usage:
        out["completion_tokens"] = _int(usage["output_tokens"])
    if "input_tokens" in usage:
        fresh = _int(usage["input_tokens"]) or 0
        read = _int(usage.get("cache_read_input_tokens")) or 0
        written = _int(usage.get("cache_creation_input_tokens")) or 0
        out["prompt_tokens"] = fresh + read + written
        out["cached_tokens"] = read
        out["cache_creation_tokens"] = written
    return out


def gemini_usage(doc: dict[str, Any]) -> dict[str, int | None] | None:
    """Gemini's ``usageMetadata`` (``generateContent`` and each streamed chunk)."""
    meta = doc.get("usageMetadata")
    if not isinstance(meta, dict) or _int(meta.get("promptTokenCount")) is None:
        return None
    return {"prompt_tokens": _int(meta.get("promptTokenCount")),
            "cached_tokens": _int(meta.get("cachedContentTokenCount", 0)),
            "completion_tokens": _int(meta.get("candidatesTokenCount", 0))}


#: Tried in order on a decoded answer (or stream event); the first non-None wins.
EXTRACTORS: list[Callable[[dict[str, Any]], dict[str, int | None] | None]] = [
    openai_usage, responses_usage, anthropic_usage, gemini_usage,
]


def usage_of(doc: Any) -> dict[str, int | None] | None:
    """The token counts ``doc`` (a decoded answer or event) reports, or None."""
    if not isinstance(doc, dict):
        return None
    for extract in EXTRACTORS:
        found = extract(doc)
        if found is not None:
            return found
    return None


def apply(sink: UsageSink, found: dict[str, int | None]) -> None:
    """Write ``found`` onto ``sink``, field by field (a later report overrides)."""
    for name, value in found.items():
        if value is not None:
            setattr(sink, name, value)


def read_body(sink: UsageSink, body: bytes) -> None:
    """Read the usage of a whole (non-streamed) JSON answer into ``sink``: only the value
    after the last ``"usage…"`` key is decoded (answers put it last; inside a JSON string
    the quotes would be escaped, so the key cannot be found in generated text)."""
    at = body.rfind(_KEY)
    if at < 0:
        return
    close = body.find(b'"', at + 1)
    colon = body.find(b":", close)
    if close < 0 or colon < 0 or body[close + 1:colon].strip():
        return
    try:
        tail = body[colon + 1:].decode("utf-8").lstrip()
        value, _end = _DECODER.raw_decode(tail)
    except (ValueError, UnicodeDecodeError):
        return
    found = usage_of({body[at + 1:close].decode("ascii", "replace"): value})
    if found is not None:
        apply(sink, found)


def _event_json(record: bytes) -> Any:
    """The JSON of an SSE record's ``data:`` line(s), or None."""
    lines = [line[5:].strip() for line in record.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None


def _is_usage_chunk(doc: Any) -> bool:
    """OpenAI's final usage chunk: no choices, a usage object."""
    return isinstance(doc, dict) and doc.get("choices") == [] and \
        isinstance(doc.get("usage"), dict)


class UsageStream:
    """Relays an SSE stream, reading every usage report into ``sink`` (and, with
    ``strip``, leaving out OpenAI's usage-only chunk), calling ``on_first`` with the first
    piece sent.

    Pieces go on as they come when they hold whole records and no usage (the common case:
    one ``find`` per piece: ``bytes in bytes`` first tries the key as an integer, and
    formats and drops a ``TypeError``, about 1.8k instructions, before it searches).
    Otherwise records are cut at blank lines; a record split across pieces waits for its
    end (bounded by :data:`_MAX_PENDING`).
    """

    __slots__ = ("_pending", "sink", "source", "strip")

    def __init__(self, source: Iterator[bytes], sink: UsageSink, *, strip: bool = False) -> None:
        self.source = source
        self.sink = sink
        self.strip = strip
        self._pending = b""

    def __iter__(self) -> Iterator[bytes]:
        key, end, sink, strip = _KEY, _RECORD_END, self.sink, self.strip
        try:
            for piece in self.source:
                if not self._pending and piece.find(key) < 0 and piece.endswith(end):
                    yield piece
                    continue
                data = self._pending + piece
                cut = data.rfind(end)
                if cut < 0:
                    if len(data) > _MAX_PENDING:
                        self._pending = b""
                        yield data
                    else:
                        self._pending = data
                    continue
                self._pending = data[cut + 2:]
                whole = data[:cut + 2]
                if whole.find(key) >= 0:
                    whole = self._records(whole, sink, strip)
                if whole:
                    yield whole
            if self._pending:
                yield self._pending
        finally:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()

    @staticmethod
    def _records(data: bytes, sink: UsageSink, strip: bool) -> bytes:
        """Read the usage in the records of ``data``; without the usage chunk if ``strip``."""
        kept: list[bytes] = []
        start = 0
        while start < len(data):
            stop = data.find(_RECORD_END, start)
            stop = len(data) if stop < 0 else stop + 2
            record = data[start:stop]
            start = stop
            if record.find(_KEY) >= 0:
                doc = _event_json(record)
                found = usage_of(doc)
                if found is not None:
                    apply(sink, found)
                    if strip and _is_usage_chunk(doc):
                        continue
            kept.append(record)
        return b"".join(kept)


def asks_for_usage(body: dict[str, Any]) -> bool:
    """Whether a streamed OpenAI request already asks for the usage chunk."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def with_stream_usage(body: dict[str, Any], raw: bytes) -> bytes:
    """``raw`` (the JSON of ``body``) with ``stream_options.include_usage`` set: spliced
    in before the closing brace when the request has no ``stream_options`` (no re-encode),
    else re-encoded with the option added to the client's."""
    options = body.get("stream_options")
    if "stream_options" not in body:
        end = raw.rstrip().rfind(b"}")
        if end > 0:
            return raw[:end] + b',"stream_options":{"include_usage":true}}'
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    return json.dumps({**body, "stream_options": merged}).encode()
