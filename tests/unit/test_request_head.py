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
        body = req.body.read()
    except Exception as exc:  # compared as a value: the same error on both sides
        return type(exc).__name__, str(exc)
    return (req.method, req.uri, req.path, req.query, req.fragment, req.version,
            req.headers, req.scheme, req.should_close(), body, unreader.read())


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
])
def test_anything_unusual_is_gunicorns_to_judge(head: bytes) -> None:
    assert not _took_fast_path(head)
    _same(head)


def test_content_length_is_checked_by_gunicorns_body_reader() -> None:
    for head in (b"POST /a HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
                 b"POST /a HTTP/1.1\r\nContent-Length: -3\r\n\r\nabc"):
        assert _same(head)[0] == "InvalidHeader"


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
