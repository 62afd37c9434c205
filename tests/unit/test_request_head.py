"""The fast path for request heads builds exactly the request gunicorn's parser builds, and
leaves everything it does not take to gunicorn (same result, same errors)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from gunicorn.config import Config
from gunicorn.http.errors import LimitRequestHeaders, LimitRequestLine
from gunicorn.http.message import Request
from gunicorn.http.unreader import IterUnreader

from continuum.wire.request_head import FastRequest, _targets_anthropic

ADDR = ("127.0.0.1", 40000)
BODY = b'{"model":"m"}'
TYPICAL = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
           b"User-Agent: bench/1\r\nAuthorization: Bearer sk-x\r\n"
           b"Content-Type: application/json\r\nContent-Length: 13\r\n\r\n" + BODY)


def _config(**settings: Any) -> Config:
    cfg = Config()
    for name, value in settings.items():
        cfg.set(name, value)
    return cfg


def _read(cls: type[Request], data: bytes, cfg: Config, pieces: int = 1) -> Any:
    """The request ``cls`` parses from ``data`` (split into ``pieces`` reads), with its
    body and whatever stays unread; or the exception it raises."""
    step = max(1, len(data) // pieces)
    parts = [data[i:i + step] for i in range(0, len(data), step)]
    unreader = IterUnreader(parts)
    try:
        req = cls(cfg, unreader, ADDR)
        reader = req.body.reader  # its kind and length, before reading moves them
        reader_made = type(reader).__name__, getattr(reader, "length", None)
        body = req.body.read()
    except Exception as exc:  # compared as a value: the same error on both sides
        return type(exc).__name__, str(exc)
    return (req.method, req.uri, req.path, req.query, req.fragment, req.version,
            req.headers, req.scheme, req.should_close(), body, unreader.read(), reader_made)


def _same(data: bytes, cfg: Config | None = None, pieces: int = 1) -> Any:
    cfg = cfg or _config()
    ours, theirs = _read(FastRequest, data, cfg, pieces), _read(Request, data, cfg, pieces)
    assert ours == theirs, data
    return ours


def _took_fast_path(data: bytes, cfg: Config | None = None) -> bool:
    taken: list[bool] = []

    class Probe(FastRequest):
        def _parse_strict(self, data: bytes, end: int) -> bool:
            taken.append(super()._parse_strict(data, end))
            return taken[-1]

    _read(Probe, data, cfg or _config())
    return taken == [True]


def test_a_typical_request_takes_the_fast_path_and_matches_gunicorn() -> None:
    assert _took_fast_path(TYPICAL)
    req = _same(TYPICAL)
    assert req[0] == "POST" and req[2] == "/v1/chat/completions" and req[9] == BODY
    assert ("AUTHORIZATION", "Bearer sk-x") in req[6]


def test_pipelined_and_split_heads_match_gunicorn() -> None:
    _same(TYPICAL + TYPICAL)  # the second request stays unread, byte for byte
    _same(TYPICAL, pieces=7)  # an incomplete first read goes to gunicorn
    _same(b"GET /health?x=1&y=%20 HTTP/1.0\r\nHost: a\r\n\r\n")
    _same(b"GET /metrics HTTP/1.1\r\nConnection: close\r\nX-Empty:\r\n\r\n")


@pytest.mark.parametrize("head", [
    b"GET /a HTTP/1.1\r\nX_Under: 1\r\n\r\n",  # header_map decides
    b"GET /a HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",  # a second singleton: 400
    b"GET /a HTTP/1.1\r\nX-A: 1\r\n  folded\r\n\r\n",  # obsolete folding: 400
    b"GET /a HTTP/1.1\r\nX-A: 1\nX-B: 2\r\n\r\n",  # bare LF
    b"GET /a HTTP/1.1\r\nX-A: \x01\r\n\r\n",  # a control character
    b"GET /a HTTP/1.1\r\nX-A : 1\r\n\r\n",  # blank before the colon
    b"GET /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"GET /a#frag HTTP/1.1\r\n\r\n",
    b"GET //evil/a HTTP/1.1\r\n\r\n",
    b"GET * HTTP/1.1\r\n\r\n",
    b"get /a HTTP/1.1\r\n\r\n",
    b"GET /a HTTP/2.0\r\n\r\n",
    b"GET /\xe9 HTTP/1.1\r\n\r\n",
    b"\r\nGET /a HTTP/1.1\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-Forwarded-Proto: https\r\n\r\n",
    b"",
    # special and repeated singleton fields, anywhere in the head
    b"GET /a HTTP/1.1\r\nContent-Type: a\r\nX-A: 1\r\ncontent-type: a\r\n\r\n",
    b"GET /a HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nX-A: 1\r\nHOST: a\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-A: 1\r\nexpect: 100-continue\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX-A: 1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
])
def test_anything_unusual_is_gunicorns_to_judge(head: bytes) -> None:
    assert not _took_fast_path(head)
    _same(head)


def test_content_length_is_checked_by_gunicorns_body_reader() -> None:
    for head in (b"POST /a HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
                 b"POST /a HTTP/1.1\r\nContent-Length: -3\r\n\r\nabc"):
        assert _same(head)[0] == "InvalidHeader"


def _gunicorns_body_reader_calls(data: bytes, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many times a FastRequest reading ``data`` asked gunicorn's ``set_body_reader``."""
    calls: list[None] = []
    gunicorns = Request.set_body_reader

    def counted(self: Request) -> None:
        calls.append(None)
        gunicorns(self)

    monkeypatch.setattr(Request, "set_body_reader", counted)
    _read(FastRequest, data, _config())
    monkeypatch.undo()
    return len(calls)


@pytest.mark.parametrize(("fields", "plain"), [
    (b"", True),                                   # no length: gunicorn reads no body
    (b"Content-Length: 3\r\n", True),
    (b"content-length:\t3 \r\n", True),            # blanks around it are stripped
    (b"Content-Length: 003\r\n", True),            # int() reads leading zeros
    (b"Content-Length: 0\r\n", True),
    (b"Content-Length: 999999999999999999\r\n", True),   # 18 digits: still read here
    (b"Content-Length: 9999999999999999999\r\n", False),  # 19: gunicorn's to read
    (b"Content-Length: " + b"9" * 5000 + b"\r\n", False),  # past int()'s digit limit: 400
    (b"Content-Length: 3\r\nContent-Length: 3\r\n", False),  # a second one: 400
    (b"Content-Length: 3\r\nX-A: 1\r\nX-A: 2\r\n", True),  # another name repeated
    (b"Content-Length: -3\r\n", False),
    (b"Content-Length: +3\r\n", False),
    (b"Content-Length: 3 3\r\n", False),
    (b"Content-Length: 3,3\r\n", False),
    (b"Content-Length:\r\n", False),
    (b"Content-Length: 0x3\r\n", False),
    (b"Content-Length: \xb3\r\n", False),          # "³": numeric to isnumeric(), not to int()
    (b"Content-Length: \xbd\r\n", False),          # "½" likewise
])
def test_a_plain_content_length_is_read_while_parsing_anything_else_by_gunicorn(
        fields: bytes, plain: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path makes gunicorn's body reader itself only for no Content-Length or one of
    plain ASCII digits; the reader (kind, length, body read) or the refusal is gunicorn's."""
    data = b"POST /a HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\nabc"
    assert _took_fast_path(data)
    _same(data)
    assert _gunicorns_body_reader_calls(data, monkeypatch) == (0 if plain else 1)


@pytest.mark.parametrize("field", [
    b"X-A:v", b"X-A: v", b"X-A:\tv", b"X-A: \t v \t ", b"X-A:\t\t", b"X-A:", b"X-A: ",
    b"X-A: a  b\tc", b"X-A: http://h:1/p?q=a:b", b"X-A::", b"X-A: :v: ", b"X-A:\xdf\xff \xb5",
    b"x-lower-case: V", b"X-A: \x80",
])
def test_field_values_are_split_and_stripped_as_gunicorn_does(field: bytes) -> None:
    """Blanks and tabs around a value go, inside it they stay; a value may be empty, hold
    colons, or bytes past ASCII (which upper-casing the names must not touch)."""
    data = b"GET /a HTTP/1.1\r\nHost: h\r\n" + field + b"\r\nAccept: */*\r\n\r\n"
    assert _took_fast_path(data)
    req = _same(data)
    assert req[6][0] == ("HOST", "h") and req[6][2] == ("ACCEPT", "*/*")


def test_repeated_fields_keep_their_order_and_the_first_connection_decides() -> None:
    data = (b"GET /a HTTP/1.1\r\nX-A: 1\r\nConnection: close\r\nx-a: 2\r\n"
            b"Connection: keep-alive\r\nX-A: 3\r\n\r\n")
    assert _took_fast_path(data)
    req = _same(data)
    assert [value for name, value in req[6] if name == "X-A"] == ["1", "2", "3"]
    assert req[8] is True  # should_close


def test_the_configured_secure_scheme_headers_are_gunicorns() -> None:
    custom = _config(secure_scheme_headers={"X-SCHEME": "https"})
    ours = b"GET /a HTTP/1.1\r\nHost: a\r\nX-Scheme: https\r\n\r\n"
    forwarded = b"GET /a HTTP/1.1\r\nHost: a\r\nX-Forwarded-Proto: https\r\n\r\n"
    assert not _took_fast_path(ours, custom)
    assert _same(ours, custom)[7] == "https"
    assert _took_fast_path(forwarded, custom)  # not a scheme header here
    assert _same(forwarded, custom)[7] == "http"


def test_limits_are_gunicorns() -> None:
    cfg = _config(limit_request_line=64, limit_request_fields=3, limit_request_field_size=40)
    long_line = b"GET /" + b"a" * 100 + b" HTTP/1.1\r\n\r\n"
    many = b"GET /a HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(4)) + b"\r\n"
    big = b"GET /a HTTP/1.1\r\nX-Big: " + b"v" * 40 + b"\r\n\r\n"
    assert _same(long_line, cfg)[0] == LimitRequestLine.__name__
    assert _same(many, cfg)[0] == LimitRequestHeaders.__name__
    assert _same(big, cfg)[0] == LimitRequestHeaders.__name__
    at_limits = b"GET /a HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(3)) + b"\r\n"
    assert _took_fast_path(at_limits, cfg)
    _same(at_limits, cfg)


@pytest.mark.parametrize("others", [b"", b"Host: a\r\nX-B: b\r\n"])
def test_a_field_line_at_the_size_limit_is_taken_one_byte_more_is_gunicorns(
        others: bytes) -> None:
    """A line of ``limit_request_field_size`` bytes with its CRLF is within it, one byte
    more is not; whether the other lines make the block longer than the limit or not."""
    cfg = _config(limit_request_field_size=40)
    at_limit = b"X-Big: " + b"v" * 31 + b"\r\n"
    assert len(at_limit) == 40
    over = b"X-Big: " + b"v" * 32 + b"\r\n"
    for line, taken in ((at_limit, True), (over, False)):
        data = b"GET /a HTTP/1.1\r\n" + others + line + b"\r\n"
        assert _took_fast_path(data, cfg) is taken
        req = _same(data, cfg)
        assert (req[0] == LimitRequestHeaders.__name__) is not taken


def test_many_fields_up_to_the_count_limit_are_taken() -> None:
    cfg = _config(limit_request_fields=100)
    at_limit = b"GET /a HTTP/1.1\r\n" + b"".join(b"X-%d: v%d\r\n" % (i, i) for i in range(100))
    assert _took_fast_path(at_limit + b"\r\n", cfg)
    assert len(_same(at_limit + b"\r\n", cfg)[6]) == 100
    over = at_limit + b"X-100: v\r\n\r\n"
    assert not _took_fast_path(over, cfg)
    assert _same(over, cfg)[0] == LimitRequestHeaders.__name__


def test_random_mutations_of_a_request_match_gunicorn() -> None:
    rng = random.Random(18)
    alphabet = b"\r\n :_-\t/?#aZ0\x00\x7f\xff"
    for _ in range(3000):
        data = bytearray(TYPICAL)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            op = rng.random()
            if op < 0.4:
                data[at] = rng.choice(alphabet)
            elif op < 0.7:
                data.insert(at, rng.choice(alphabet))
            else:
                del data[at]
        _same(bytes(data))


def test_random_well_formed_field_blocks_match_gunicorn() -> None:
    """Heads of valid-looking fields drawn at random (repeated names, the fields with rules
    of their own, blanks, tabs, colons, bytes past ASCII, odd lengths): the fast path takes
    most of them, and every one reads as gunicorn reads it."""
    rng = random.Random(7)
    names = [b"Host", b"content-type", b"Content-Length", b"Connection", b"X-A", b"x-a",
             b"Expect", b"Transfer-Encoding", b"X-Forwarded-Proto", b"Accept"]
    values = [b"", b" ", b"\t", b"a", b"1", b"13", b"-1", b"close", b"keep-alive", b"chunked",
              b":", b"h:80", b"\xdf", b"\xb3", b"https", b" x ", b"100-continue"]
    taken = 0
    for _ in range(2000):
        fields = b"".join(
            rng.choice(names) + b":" + b"".join(rng.choices(values, k=rng.randint(0, 3)))
            + b"\r\n" for _ in range(rng.randint(0, 6)))
        data = b"POST /a?q HTTP/1.%d\r\n" % rng.randint(0, 1) + fields + b"\r\n" + BODY
        taken += _took_fast_path(data)
        _same(data)
    assert taken > 600


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
@pytest.mark.parametrize("fields", [
    b"", b"Connection: close\r\n", b"Connection: Keep-Alive\r\n", b"connection:  CLOSE \t\r\n",
    b"Connection: upgrade\r\n", b"Connection: keep-alive, close\r\n",
    b"Connection: close\r\nConnection: keep-alive\r\n",
    b"Connection: keep-alive\r\nConnection: close\r\n", b"Connection:\r\n",
])
def test_keep_alive_is_decided_as_gunicorn_decides(version: bytes, fields: bytes) -> None:
    """``should_close`` of a head the fast path took answers as gunicorn's, whatever its
    ``Connection`` fields and version say."""
    data = b"GET /health HTTP/" + version + b"\r\nHost: a\r\n" + fields + b"\r\n"
    assert _took_fast_path(data)
    _same(data)


@pytest.mark.parametrize(("data", "anthropic"), [
    (b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: x\r\n", True),
    (b"POST /anthropic/v1/messages?" + b"q" * 9000, True),  # a line over the limit
    (b"POST /anthropic/", True),                               # cut short after the path
    (b"POST /anthropic HTTP/1.1\r\n", False),
    (b"POST /v1/chat/completions HTTP/1.1\r\n", False),
    (b"GET /health?next=/anthropic/ HTTP/1.1\r\n", False),
    (b"X" * 40 + b" /anthropic/", False),                    # no method that long
    (b"", False),
])
def test_a_refused_heads_request_line_is_peeked_for_the_anthropic_api(
        data: bytes, anthropic: bool) -> None:
    assert _targets_anthropic(data) is anthropic


def _parser(data: bytes, cfg: Config | None = None) -> Any:
    from gunicorn.http.parser import RequestParser

    parser = RequestParser(cfg or _config(), [data], ADDR)
    parser.mesg_class = FastRequest
    return parser


def test_finish_body_skips_the_drain_of_a_body_read_to_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from continuum.wire import request_head

    drains: list[bool] = []
    real = request_head._gunicorn_finish_body

    def counted(*args: Any) -> bool:
        drains.append(True)
        return bool(real(*args))

    monkeypatch.setattr(request_head, "_gunicorn_finish_body", counted)
    following = b"GET /next HTTP/1.1\r\nHost: h\r\n\r\n"
    for read in (len(BODY), 3, 0):  # read to the end, partly, not at all
        drains.clear()
        parser = _parser(TYPICAL + following)
        req = next(parser)
        assert req.body.read(read) == BODY[:read]
        assert request_head.finish_body(parser) is True
        assert drains == ([] if read == len(BODY) else [True])  # gunicorn drained the rest
        assert parser.mesg.body.read() == b""  # nothing of this body is left either way
        parser.finish_body = request_head.finish_body.__get__(parser)
        assert next(parser).path == "/next"  # the next request starts where it should


def test_finish_body_leaves_a_failed_or_chunked_body_to_gunicorn() -> None:
    from continuum.wire.request_head import finish_body

    chunked = (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n0\r\n\r\nGET /next HTTP/1.1\r\n\r\n")
    parser = _parser(chunked)
    next(parser)
    assert finish_body(parser) is True and next(parser).path == "/next"
    parser = _parser(TYPICAL)
    req = next(parser)
    req.body.read()
    req.body.failed = True  # reading it raised: where the next request starts is unknown
    assert finish_body(parser) is False
    assert finish_body(_parser(b"")) is True  # no request yet
