"""The router worker's environ and response (``continuum.wire.wsgi_fast``) are gunicorn's:
the same environ, the same bytes on the wire, the same errors, for typical, unusual and
randomly varied requests and answers."""

from __future__ import annotations

import random
from typing import Any

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi as gunicorn_wsgi
from gunicorn.http.message import Request
from gunicorn.http.unreader import IterUnreader

from continuum.wire import request_head, wsgi_fast
from continuum.wire.request_head import FastRequest

CLIENT = ("127.0.0.1", 40000)
SERVER = ("127.0.0.1", 8000)
BODY = b'{"model":"m"}'
TYPICAL = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
           b"User-Agent: bench/1\r\nAuthorization: Bearer sk-x\r\n"
           b"Content-Type: application/json\r\nContent-Length: 13\r\n\r\n" + BODY)
#: Environ values that are made per request (compared by kind, not identity).
_MADE = ("wsgi.errors", "wsgi.input", "wsgi.early_hints", "gunicorn.socket")


@pytest.fixture(autouse=True)
def _one_date(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both writers' Date fields the same, whenever the second turns between them."""
    monkeypatch.setattr("gunicorn.util.http_date", lambda *_: "Sun, 06 Dec 2026 12:00:00 GMT")


class Wire:
    """A socket that keeps what is written to it."""

    def __init__(self) -> None:
        self.data = bytearray()

    def sendall(self, data: bytes) -> None:
        self.data += data

    def send(self, data: bytes) -> int:
        self.data += data
        return len(data)


def _config(**settings: Any) -> Config:
    cfg = Config()
    for name, value in settings.items():
        cfg.set(name, value)
    return cfg


def _request(data: bytes, cfg: Config) -> Any:
    return FastRequest(cfg, IterUnreader([data]), CLIENT)


def _environs(data: bytes, cfg: Config | None = None, server: Any = SERVER,
              client: Any = CLIENT) -> tuple[dict, dict]:
    """Our environ and gunicorn's for the request ``data`` (its own parse each)."""
    cfg = cfg or _config()
    ours = wsgi_fast.create(_request(data, cfg), Wire(), client, server, cfg)[1]
    theirs = wsgi_fast._gunicorn_create(_request(data, cfg), Wire(), client, server, cfg)[1]
    for key in _MADE:
        assert type(ours.pop(key)) is type(theirs.pop(key)) or key == "wsgi.early_hints"
    return ours, theirs


def test_a_typical_request_gets_gunicorns_environ() -> None:
    ours, theirs = _environs(TYPICAL)
    assert ours == theirs
    assert ours["HTTP_AUTHORIZATION"] == "Bearer sk-x"
    assert ours["CONTENT_LENGTH"] == "13" and "HTTP_CONTENT_LENGTH" not in ours


@pytest.mark.parametrize("head", [
    b"GET /a%20b/%2F?x=%41 HTTP/1.1\r\nHost: h\r\n\r\n",          # quoted path
    b"GET /a HTTP/1.0\r\n\r\n",                                    # no fields, HTTP/1.0
    b"GET /a HTTP/1.1\r\nX-A: 1\r\nx-a: 2\r\nX-A: 3\r\n\r\n",      # repeated: joined
    b"GET /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
    b"GET /a HTTP/1.1\r\nX_Under: 1\r\n\r\n",                      # gunicorn's parser
    b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /a?b HTTP/1.1\r\nHost: h:1\r\nX-Long: " + b"v" * 4000 + b"\r\n\r\n",
])
def test_unusual_requests_get_gunicorns_environ(head: bytes) -> None:
    ours, theirs = _environs(head)
    assert ours == theirs


def test_a_unix_socket_listener_and_a_script_name_are_gunicorns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = _environs(TYPICAL, server="/tmp/router.sock", client="")
    assert ours == theirs and ours["SERVER_NAME"] == "127.0.0.1"
    monkeypatch.setenv("SCRIPT_NAME", "/v1")
    ours, theirs = _environs(TYPICAL)
    assert ours == theirs and ours["PATH_INFO"] == "/chat/completions"


def test_random_mutations_of_a_request_get_gunicorns_environ() -> None:
    rng = random.Random(18)
    alphabet = b"\r\n :_-\t/?%aZ0\x7f\xff"
    compared = 0
    for _ in range(2000):
        data = bytearray(TYPICAL)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data) - len(BODY))
            if rng.random() < 0.5:
                data[at] = rng.choice(alphabet)
            else:
                data.insert(at, rng.choice(alphabet))
        try:
            ours, theirs = _environs(bytes(data))
        except Exception as exc:  # refused by the parser: the same refusal on both sides
            with pytest.raises(type(exc)):
                Request(_config(), IterUnreader([bytes(data)]), CLIENT)
            continue
        assert ours == theirs, bytes(data)
        compared += 1
    assert compared > 500  # most mutations still parse; the comparison is not vacuous


def test_early_hints_are_written_as_gunicorn_writes_them() -> None:
    cfg = _config()
    wires = []
    for create in (wsgi_fast.create, wsgi_fast._gunicorn_create):
        wire = Wire()
        resp, environ = create(_request(TYPICAL, cfg), wire, CLIENT, SERVER, cfg)
        environ["wsgi.early_hints"]([("Link", "</a.css>; rel=preload")])
        resp.start_response("200 OK", [("Content-Length", "0")])
        resp.close()
        environ["wsgi.early_hints"]([("Link", "</b.css>")])  # after the answer began: dropped
        wires.append(bytes(wire.data))
    assert wires[0].startswith(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
    assert wires[0] == wires[1]


def _answer(cls: type, head: bytes, status: Any, headers: Any, chunks: list[Any],
            cfg: Config) -> Any:
    """The bytes ``cls`` writes for that answer, whether it closes after, and the
    exception it raises (by type and text)."""
    wire = Wire()
    resp = cls(_request(head, cfg), wire, cfg)
    try:
        write = resp.start_response(status, headers)
        for chunk in chunks:
            write(chunk)
        resp.close()
    except Exception as exc:
        return bytes(wire.data), type(exc).__name__, str(exc)
    return bytes(wire.data), resp.should_close(), resp.sent


def _same_answer(head: bytes, status: Any, headers: Any, chunks: list[Any],
                 cfg: Config | None = None) -> Any:
    cfg = cfg or _config()
    ours = _answer(wsgi_fast.FastResponse, head, status, list(headers), chunks, cfg)
    theirs = _answer(gunicorn_wsgi.Response, head, status, list(headers), chunks, cfg)
    assert ours == theirs, (status, headers, chunks)
    return ours


def test_a_typical_answer_is_written_as_gunicorn_writes_it() -> None:
    headers = [("Content-Type", "application/json"), ("Content-Length", "11"),
               ("X-Continuum-Backend", "a")]
    for _ in range(2):  # the second time the names are known
        wire, keep, sent = _same_answer(TYPICAL, "200 OK", headers, [b"hello", b" world"])
        assert wire.endswith(b"X-Continuum-Backend: a\r\n\r\nhello world")
        assert keep is False and sent == 11


HEAD_10 = b"GET /a HTTP/1.0\r\n\r\n"
HEAD_HEAD = b"HEAD /a HTTP/1.1\r\nHost: h\r\n\r\n"
CLOSE = b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("head", [TYPICAL, HEAD_10, HEAD_HEAD, CLOSE])
@pytest.mark.parametrize("status,headers,chunks", [
    ("200 OK", [("Content-Length", "5")], [b"hello", b"more"]),            # more than said
    ("200 OK", [("Content-Length", "5")], [b"he", b"", b"llo!"]),
    ("200 OK", [("Content-Length", "3")], []),                              # less than said
    ("200 OK", [("Content-Type", "text/event-stream")], [b"data: 1\n\n", b""]),  # chunked
    ("204 No Content", [("Content-Length", "0")], [b""]),
    ("304 Not Modified", [("Content-Length", "9")], [b"x"]),
    ("101 Switching Protocols", [("Connection", "Upgrade"), ("Upgrade", "websocket")], []),
    ("200 OK", [("Connection", "close"), ("Keep-Alive", "5"), ("Server", "x"),
                ("Date", "y"), ("Transfer-Encoding", "chunked"), ("TE", "x")], [b"ab"]),
    ("200 OK", [("X-Pad", "  a b\t"), ("X-Empty", ""), ("Content-Length", " 2 ")], [b"ab"]),
    ("200 OK", [("X-Bad", "a\r\nInjected: 1")], []),
    ("200 OK", [("Bad Name", "a")], []),
    ("200 OK", [(b"X-Bytes", "a")], []),
    ("200 OK", [("X-Bytes", b"a")], []),
    ("200 OK", [("Content-Length", "nope")], []),
    ("200 OK", [("Content-Length", "2")], ["ab"]),                          # not bytes
    ("2000 OK", [], []),
    ("200 OK", [("X-Latin", "caf\xe9")], [b""]),
])
def test_unusual_answers_are_written_as_gunicorn_writes_them(
        head: bytes, status: str, headers: list, chunks: list) -> None:
    for _ in range(2):
        _same_answer(head, status, headers, chunks)


def test_random_answers_are_written_as_gunicorn_writes_them() -> None:
    rng = random.Random(18)
    names = ["Content-Type", "Content-Length", "X-Request-Id", "connection", "Upgrade",
             "X-A", "x-a", "Date", "Bad:Name", "", "Content-length", "Vary"]
    values = ["", "1", "5", " 5", "text/plain", "close", "websocket", "a\tb", "a\x00",
              "\xff", "keep-alive", "-1", "2 "]
    statuses = ["200 OK", "201 Created", "204 No Content", "304 Not Modified",
                "100 Continue", "404 Not Found", "200", "abc"]
    heads = [TYPICAL, HEAD_10, HEAD_HEAD, CLOSE]
    for _ in range(1500):
        headers = [(rng.choice(names), rng.choice(values)) for _ in range(rng.randint(0, 5))]
        chunks = [rng.choice([b"", b"x", b"hello", b"0123456789"])
                  for _ in range(rng.randint(0, 3))]
        _same_answer(rng.choice(heads), rng.choice(statuses), headers, chunks)


def test_importing_the_worker_leaves_gunicorn_as_it_is() -> None:
    """Only a worker process swaps gunicorn's pieces (init_process; what it serves through
    them: tests/integration/test_worker_wsgi.py)."""
    from gunicorn.http.parser import RequestParser

    from continuum import gunicorn_worker  # noqa: F401 (imported for its side effects, if any)

    assert gunicorn_wsgi.create is wsgi_fast._gunicorn_create
    assert RequestParser.finish_body is not request_head.finish_body


def _body_stream(parts: list[bytes]) -> Any:
    """gunicorn's ``wsgi.input`` of a request that arrives in ``parts``, and its unreader."""
    unreader = IterUnreader(parts)
    req = FastRequest(_config(), unreader, CLIENT)
    return req.body, unreader


def test_a_body_that_came_with_the_head_is_read_without_waiting() -> None:
    stream, unreader = _body_stream([TYPICAL + b"GET /next HTTP/1.1\r\n\r\n"])
    assert wsgi_fast.read_held(stream, len(BODY)) == BODY
    assert stream.read() == b""  # the reader is at the body's end, as after stream.read
    assert unreader.read() == b"GET /next HTTP/1.1\r\n\r\n"  # the next request is intact


@pytest.mark.parametrize("cut", [1, len(BODY) - 1])
def test_a_body_still_arriving_is_left_to_the_waiting_read(cut: int) -> None:
    head = TYPICAL[:-len(BODY)]
    stream, _ = _body_stream([head + BODY[:cut], BODY[cut:]])
    assert wsgi_fast.read_held(stream, len(BODY)) is None
    assert stream.read(len(BODY) + 1) == BODY  # nothing was taken by the refusal


def test_a_body_partly_read_or_of_another_length_is_not_taken() -> None:
    stream, _ = _body_stream([TYPICAL])
    assert wsgi_fast.read_held(stream, len(BODY) + 1) is None
    assert stream.read(3) == BODY[:3]
    assert wsgi_fast.read_held(stream, len(BODY)) is None
    assert stream.read() == BODY[3:]
    chunked = (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n0\r\n\r\n")
    stream, _ = _body_stream([chunked])
    assert wsgi_fast.read_held(stream, 3) is None
    assert wsgi_fast.read_held(object(), 3) is None


def test_a_known_list_of_names_is_kept_whole_only_with_plain_text_values() -> None:
    names = ("Content-Type", "Content-Length", "X-Request-Id")
    _same_answer(TYPICAL, "200 OK", list(zip(names, ["a/b", "2", "r1"], strict=True)), [b"ab"])
    assert wsgi_fast._NAME_LISTS[names] == 1  # known now, its Content-Length second
    for values in (["a/b", "2", "r2"], ["a/b ", "2", "r"], ["a/b", "2", "r\x00"],
                   ["a/b", b"2", "r"], ["a/b", "x", "r"], ["a\tb", "2", "r"], ["", "2", "r"],
                   ["a/b", "2", "r\n"], ["caf\xe9", "2", " "]):
        _same_answer(TYPICAL, "200 OK", list(zip(names, values, strict=True)), [b"ab"])
    # pairs given as lists, and a second Content-Length after the known list's
    _same_answer(TYPICAL, "200 OK", [[n, v] for n, v in zip(names, ["a", "2", "r"], strict=True)],
                 [b"ab"])
    _same_answer(TYPICAL, "200 OK", [*zip(names, ["a", "2", "r"], strict=True),
                                     ("Content-Length", "1")], [b"ab"])
