"""The request context: a client request parsed once, read by every later stage.

Parsing is where hostile input stops. :func:`parse_request` refuses, with a 400 naming the
field (``param``), anything later stages could choke on: bodies that are not UTF-8 JSON
objects, nesting deeper than ``server.max_json_depth`` (see :func:`load_json`), and known
fields of the wrong type or out of range — NaN, infinities and integers too large for the
cache key's 64-bit fields included.
The ranges mirror what OpenAI and Anthropic accept, widened where the engines behind the
router (vLLM, SGLang, TensorRT-LLM) accept more; whatever passes is the backend's to judge.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from random import getrandbits
from typing import TYPE_CHECKING, Any

from msgspec import DecodeError as _FastDecodeError
from msgspec.json import decode as _fast_decode

from continuum.errors import RequestError

if TYPE_CHECKING:
    from continuum.prefix_chain import PrefixChain

#: Endpoint kinds the router proxies.
CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
ANTHROPIC_MESSAGES = "anthropic_messages"
#: OpenAI's Responses API (``instructions`` + ``input``), passed through to OpenAI-compatible
#: backends; and Anthropic's token counting, passed to Anthropic backends.
RESPONSES = "responses"
ANTHROPIC_COUNT_TOKENS = "anthropic_count_tokens"
ANTHROPIC_ENDPOINTS = frozenset({ANTHROPIC_MESSAGES, ANTHROPIC_COUNT_TOKENS})

#: Default of ``server.max_json_depth``: far deeper than any real request (a structured
#: output schema at OpenAI's own limit nests about 30 levels), far below the ~1000 frames
#: at which ``json.loads`` would raise ``RecursionError``.
DEFAULT_MAX_JSON_DEPTH = 128

INT64_MAX = 2**63 - 1
_FLOAT_MAX = sys.float_info.max
#: A client-supplied ``X-Request-Id`` is kept when it looks like an id (it is logged and
#: forwarded upstream as a header); anything else is replaced by a fresh one.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(slots=True)
class RequestContext:
    """Everything the routing and caching stages need to know about one request.

    Built once by :func:`parse_request`; the router then derives the keys
    (:meth:`~continuum.service.RouterService.admit`), and the stages read those rather than
    re-reading the body.
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
    #: Client headers sent upstream as they are (Anthropic's version and betas); they can
    #: change the answer's shape, so they are part of the cache key.
    forward_headers: dict[str, str] | None = None
    #: The response cache key, set when the cache may answer the request.
    cache_key: str | None = None
    #: What the KV scorer read from the index for this request (its ``prepare``), kept per
    #: request so that every later read sees the same moment; opaque to other stages.
    kv_snapshot: object | None = None
    #: The chain of prefix keys (:mod:`continuum.prefix_chain`), derived with the prefix
    #: key when the KV scorer matches chains (``kv_cache_index.match: chain``).
    chain: PrefixChain | None = None
    #: What the prefix key and chain are computed from when it is not :attr:`body`: a
    #: Responses request's ``instructions`` and ``input`` as a chat-shaped body
    #: (:func:`responses_key_body`).
    key_body: dict[str, Any] | None = None
    #: Set by the KV scorer with ``load_guard.slot_wait``: a backend whose ``slots`` are
    #: full is passed over while another has a free one (PrefixAwareHash along its ring,
    #: any other strategy by the pipeline: :mod:`continuum.routing.selection`).
    spill_at_slots: bool = False

    @property
    def protocol(self) -> str:
        """The API family of the request: ``anthropic`` or ``openai``."""
        return "anthropic" if self.endpoint in ANTHROPIC_ENDPOINTS else "openai"

    @property
    def keyed_body(self) -> dict[str, Any]:
        """The body the prefix key and chain are computed from."""
        return self.body if self.key_body is None else self.key_body

    @property
    def prefix_hash(self) -> str | None:
        """The prefix key as lowercase hex, or ``None`` when the request has none."""
        return None if self.prefix_key is None else self.prefix_key.hex()

    @property
    def route_key(self) -> bytes | None:
        """The key a prefix-hashing strategy places the request by: its chain's route key
        (a document in the user turn, :attr:`PrefixChain.route_key`) when it has one, so
        new documents behind one system prompt spread over the fleet; else the prefix key."""
        chain = self.chain
        key = chain.route_key if chain is not None else None
        return key if key is not None else self.prefix_key


def new_request_id(supplied: str | None = None) -> str:
    """``supplied`` (the client's ``X-Request-Id``) when it is a sane id — 1 to 128 of
    ``A-Z a-z 0-9 . _ : -``, starting with a letter or digit — else a fresh random one."""
    if supplied and _REQUEST_ID.fullmatch(supplied):
        return supplied
    # A version-4 UUID's 32 hex digits, like uuid.uuid4().hex, without its os.urandom
    # syscall: an id must be unique, not secret (random reseeds in every forked worker).
    return f"{getrandbits(128) & _UUID4_CLEAR | _UUID4_SET:032x}"


#: The version (4) and variant (10xx) bits of a random UUID.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


# --- nesting depth -------------------------------------------------------------------------



def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether the decoded JSON ``value`` nests arrays and objects more than ``limit`` deep.

    Walks the containers with an explicit stack (no recursion, whatever the depth), so
    the later stages that do recurse (the cache key's and prefix key's serialisers) only
    ever see bounded nesting.
    """
    stack = [(value, 1)] if type(value) in (dict, list) else []
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            return True
        for child in (node.values() if type(node) is dict else node):
            if type(child) in (dict, list):
                push((child, depth + 1))
    return False


def load_json(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """Decode a UTF-8 JSON request body, refusing nesting deeper than ``max_depth``.

    ``json.loads`` itself stops hostile depth: it recurses in C once per level and raises
    ``RecursionError`` near the interpreter's limit, long before the stack is at risk.
    What it accepts is then measured without recursion, and only when the body has more
    ``[``/``{`` bytes than the limit at all (:func:`_brackets_exceed`; most requests have
    fewer), which costs a fraction of the decode itself.

    A UTF-8 body is decoded by ``msgspec.json.decode`` (a quarter of ``json.loads``'s time
    on a small chat request, half on a 47 KB one), which gives what ``json.loads`` gives
    for every document it accepts: integers of any size, the same floats, strings and key
    order, the last of repeated keys. Whatever it refuses goes to ``json.loads``, which
    accepts or refuses it as before.

    Raises:
        RequestError: not UTF-8, not JSON, or nested too deep.
    """
    # What json.loads would decode it as; a body opening with "{" and no NUL is UTF-8.
    encoding = "utf-8" if raw[:1] == b"{" and raw[1:2] != b"\x00" else json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise RequestError(f"request body is not valid JSON: not UTF-8 (looks like {encoding})",
                           code="invalid_json")
    try:
        if encoding == "utf-8":
            try:
                value = _fast_decode(raw)
            except _FastDecodeError:
                # What msgspec refuses json may accept (NaN, Infinity, 1e400, a lone
                # surrogate escaped or encoded) or refuse with its own message: json
                # decides, as json.loads(raw) would, after the detection above.
                value = json.loads(raw.decode("utf-8", "surrogatepass"))
        else:
            value = json.loads(raw)
    except RecursionError:
        value = _TOO_DEEP
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") \
            from None
    if value is _TOO_DEEP or (_brackets_exceed(raw, max_depth)
                              and nesting_exceeds(value, max_depth)):
        raise RequestError(
            f"request body nests arrays/objects more than {max_depth} levels deep",
            code="json_too_deep",
        )
    return value


#: Marks a body ``json.loads`` refused to descend into.
_TOO_DEEP = object()


#: Bodies up to this size have their brackets counted: two passes over a few hundred bytes
#: cost less than the loop of finds (0.65 against 1.7 µs at 200 bytes; even at 1 KiB).
_COUNTED = 512


def _brackets_exceed(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` holds more than ``limit`` ``[`` and ``{`` bytes together (then, and
    only then, can its nesting be deeper than ``limit``).

    ``bytes.find`` of one byte is a ``memchr``, and this stops at the ``limit + 1``-th
    bracket; ``bytes.count`` of one byte reads the body a byte at a time: two counts took
    73 µs on a 128 KiB prompt, as long as decoding it, where the finds take 3 µs.
    """
    if len(raw) <= _COUNTED:  # a small body: two counts cost less than a loop of finds
        return raw.count(b"[") + raw.count(b"{") > limit
    seen = 0
    find = raw.find
    for bracket in (b"[", b"{"):
        at = find(bracket)
        while at >= 0:
            seen += 1
            if seen > limit:
                return True
            at = find(bracket, at + 1)
    return False


# --- field checks --------------------------------------------------------------------------

_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object", type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def _wrong_type(name: str, expected: str, value: Any) -> RequestError:
    return RequestError(f"'{name}' must be {expected}, got {_json_type(value)}",
                        param=name, code="invalid_type")


@dataclass(frozen=True, slots=True)
class NumberField:
    """A numeric body field: an ``integer`` or any JSON number, in ``[low, high]``.

    NaN and the infinities (``NaN``, ``Infinity``, ``1e999`` in the JSON) fail every
    range; so does an integer beyond the bounds, before anything converts it to a float.
    """

    low: float
    high: float
    integer: bool = False

    def check(self, name: str, value: Any) -> None:
        """Raise :class:`RequestError` unless ``value`` fits (``None`` always does)."""
        if value is None:
            return
        kind = type(value)
        if kind is not int and (self.integer or kind is not float):
            raise _wrong_type(name, "an integer" if self.integer else "a number", value)
        if not self.low <= value <= self.high:
            raise RequestError(f"'{name}' must be {self.describe()}, got {_shown(value)}",
                               param=name, code="invalid_value")

    def describe(self) -> str:
        """The accepted values, in words."""
        if self.integer:
            return f"an integer between {self.low} and {self.high}"
        if self.high < _FLOAT_MAX:
            return f"a number between {self.low:g} and {self.high:g}"
        return "a finite number" if self.low == -_FLOAT_MAX else f"a finite number >= {self.low:g}"


#: Numeric fields (OpenAI's, Anthropic's and the engines' sampling extensions) and what
#: is accepted. Upper bounds are OpenAI's where the engines agree (penalties, top_p);
#: elsewhere engines accept more, so only the type, the sign and 64 bits are enforced.
NUMBER_FIELDS: dict[str, NumberField] = {
    "temperature": NumberField(0, _FLOAT_MAX),  # OpenAI <= 2, Anthropic <= 1, vLLM any
    "top_p": NumberField(0, 1),
    "min_p": NumberField(0, 1),
    "frequency_penalty": NumberField(-2, 2),
    "presence_penalty": NumberField(-2, 2),
    "repetition_penalty": NumberField(0, _FLOAT_MAX),
    "length_penalty": NumberField(-_FLOAT_MAX, _FLOAT_MAX),
    "max_tokens": NumberField(0, INT64_MAX, integer=True),
    "max_completion_tokens": NumberField(0, INT64_MAX, integer=True),
    "max_output_tokens": NumberField(0, INT64_MAX, integer=True),  # Responses API
    "min_tokens": NumberField(0, INT64_MAX, integer=True),
    "n": NumberField(1, INT64_MAX, integer=True),
    "best_of": NumberField(1, INT64_MAX, integer=True),
    "top_k": NumberField(-1, INT64_MAX, integer=True),  # vLLM: -1 = off; Anthropic >= 0
    "top_logprobs": NumberField(0, INT64_MAX, integer=True),
    "seed": NumberField(-(2**63), 2**64 - 1, integer=True),
}
#: Completions take a count, chat completions a boolean.
_LOGPROBS = NumberField(0, INT64_MAX, integer=True)
#: The endpoint's own input field besides ``messages``: a string or an array (of strings,
#: token ids or content blocks — the backend checks the items).
_INPUT_FIELD = {COMPLETIONS: "prompt", EMBEDDINGS: "input", ANTHROPIC_MESSAGES: "system",
                ANTHROPIC_COUNT_TOKENS: "system", RESPONSES: "input"}


_CHECKED_FIELDS = frozenset({*NUMBER_FIELDS, "logprobs", "stop", "stop_sequences"})


def _check_field(name: str, value: Any) -> None:
    """Type and range of one known top-level field; unknown fields are the backend's."""
    spec = NUMBER_FIELDS.get(name)
    if spec is not None:
        spec.check(name, value)
    elif name == "logprobs":
        if type(value) is not bool:
            _LOGPROBS.check(name, value)
    elif name in ("stop", "stop_sequences") and value is not None:
        if name == "stop" and type(value) is str:
            return
        if type(value) is not list or not all(type(s) is str for s in value):
            raise _wrong_type(name, "a string or an array of strings" if name == "stop"
                              else "an array of strings", value)


def _check_messages(messages: Any, endpoint: str) -> list[Any] | None:
    """``messages``: required by chat and Anthropic, an array of objects wherever given."""
    needed = endpoint in (CHAT, ANTHROPIC_MESSAGES, ANTHROPIC_COUNT_TOKENS)
    if messages is None or messages == []:
        if needed:
            raise RequestError("'messages' is required and must be a non-empty array",
                               param="messages", code="invalid_value")
        return None if messages is None else messages
    if type(messages) is not list:
        raise _wrong_type("messages", "an array", messages)
    if needed:
        for index, message in enumerate(messages):
            if type(message) is not dict:
                raise _wrong_type(f"messages[{index}]", "an object", message)
    return messages


def responses_key_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat-shaped body its keys are computed from: the
    ``instructions`` as the system prompt, ``input`` (a string, or message items) as the
    messages, so the same instructions, or the same opening input, give the same prefix
    key as the equivalent chat completion would."""
    given = body.get("input")
    messages = [{"role": "user", "content": given}] if isinstance(given, str) else \
        [item for item in given if isinstance(item, dict) and "role" in item] \
        if isinstance(given, list) else []
    keyed: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("instructions"), str):
        keyed["system"] = body["instructions"]
    return keyed


def parse_request(
    raw: bytes,
    endpoint: str,
    *,
    tenant: str | None = None,
    request_id: str | None = None,
    max_depth: int = DEFAULT_MAX_JSON_DEPTH,
) -> RequestContext:
    """Parse and check a JSON request body into a :class:`RequestContext`.

    Raises:
        RequestError: the body is not a UTF-8 JSON object within ``max_depth`` levels,
            ``model`` is missing or not a string, or a known field has the wrong type or
            is out of range (the error's ``param`` names it).
    """
    body = load_json(raw, max_depth)
    if type(body) is not dict:
        raise RequestError("request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if type(model) is not str or not model:
        raise RequestError("'model' is required and must be a non-empty string",
                           param="model", code="invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    elif type(stream) is not bool:
        raise _wrong_type("stream", "a boolean", stream)
    messages = _check_messages(body.get("messages"), endpoint)
    input_field = _INPUT_FIELD.get(endpoint)
    if input_field is not None:
        value = body.get(input_field)
        if value is not None and type(value) not in (str, list):
            raise _wrong_type(input_field, "a string or an array", value)
    key_body = None
    if endpoint == RESPONSES:
        instructions = body.get("instructions")
        if instructions is not None and type(instructions) is not str:
            raise _wrong_type("instructions", "a string", instructions)
        if body.get("input") is None:
            raise RequestError("'input' is required: a string or an array",
                               param="input", code="invalid_value")
        key_body = responses_key_body(body)
    for name, value in body.items():
        if name in _CHECKED_FIELDS:
            _check_field(name, value)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    temperature = body.get("temperature")
    top_p = body.get("top_p")
    return RequestContext(
        endpoint=endpoint,
        model=model,
        body=body,
        raw=raw,
        stream=stream,
        messages=messages,
        system=body.get("system"),
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        max_tokens=max_tokens,
        tenant=tenant,
        request_id=request_id or new_request_id(),
        key_body=key_body,
    )
