"""``continuum.wire.plain.HeldInput`` (the worker's own loop's ``wsgi.input``) reads a body
as gunicorn's body reader does, from the bytes that came with the head and then the socket,
and never reads past the body: the same random reads on both, over real socket pairs."""

from __future__ import annotations

import random
import socket
from typing import Any

import pytest
from gunicorn.http.body import Body, LengthReader
from gunicorn.http.unreader import SocketUnreader

from continuum.wire.plain import HeldInput, Replayed

NEXT = b"GET /next HTTP/1.1\r\n\r\n"


def _pair(rest: bytes) -> tuple[socket.socket, socket.socket]:
    """A connected pair whose first end has ``rest`` then the next request waiting."""
    ours, peer = socket.socketpair()
    peer.sendall(rest + NEXT)
    ours.settimeout(5)
    return ours, peer


def _operate(stream: Any, ops: list[tuple[str, int | None]]) -> list[Any]:
    out = []
    for op, size in ops:
        if op == "read":
            out.append(stream.read(size))
        elif op == "readline":
            out.append(stream.readline(size))
        elif op == "readlines":
            out.append(stream.readlines())
        else:
            out.append(list(stream))
    return out


def _both(body: bytes, cut: int, ops: list[tuple[str, int | None]]) -> tuple[list[Any], bytes]:
    """What the same reads give on gunicorn's body and on HeldInput; and that HeldInput left
    the socket at the next request."""
    theirs_sock, theirs_peer = _pair(body[cut:])
    ours_sock, ours_peer = _pair(body[cut:])
    try:
        unreader = SocketUnreader(theirs_sock)
        unreader.unread(body[:cut])
        theirs = _operate(Body(LengthReader(unreader, len(body))), ops)
        held = HeldInput(body[:cut], len(body) - cut, ours_sock)
        ours = _operate(held, ops)
        assert ours == theirs, (body, cut, ops)
        assert held.drain() is True
        return ours, ours_sock.recv(len(NEXT))
    finally:
        for sock in (theirs_sock, theirs_peer, ours_sock, ours_peer):
            sock.close()


def test_reads_of_a_body_partly_on_the_socket_are_gunicorns() -> None:
    body = b"line one\nline two\n\nthree" * 40
    out, after = _both(body, 7, [("read", 5), ("readline", None), ("readline", 3),
                                 ("read", 100), ("readlines", None), ("read", None)])
    assert b"".join([out[0], out[1], out[2], out[3], *out[4]]) == body
    assert after == NEXT


def test_random_reads_are_gunicorns_and_stop_at_the_body_end() -> None:
    rng = random.Random(18)
    for _ in range(150):
        body = bytes(rng.choice(b"ab\n") for _ in range(rng.randint(1, 300)))
        cut = rng.randint(0, len(body))
        ops: list[tuple[str, int | None]] = [
            (rng.choice(["read", "read", "readline", "readlines", "iter"]),
             rng.choice([None, -1, 0, 1, 2, 7, 50, 1000]))
            for _ in range(rng.randint(1, 6))]
        _, after = _both(body, cut, ops)
        assert after == NEXT


def test_a_whole_body_is_taken_once_and_only_when_all_of_it_came() -> None:
    held = HeldInput(b"abc", 0, None)
    assert held.whole(4) is None  # another length
    assert held.whole(3) == b"abc" and held.read() == b""  # at its end after
    assert HeldInput(b"ab", 1, None).whole(3) is None  # a byte still on the socket
    partly = HeldInput(b"abc", 0, None)
    partly.read(1)
    assert partly.whole(3) is None


def test_a_client_closing_within_the_body_ends_it_short() -> None:
    ours, peer = socket.socketpair()
    try:
        peer.sendall(b"cd")
        peer.shutdown(socket.SHUT_WR)
        held = HeldInput(b"ab", 5, ours)
        assert held.read() == b"abcd" and held.ended_early
        assert held.drain() is False
    finally:
        ours.close()
        peer.close()


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_replayed_socket_gives_its_bytes_first(size: int) -> None:
    ours, peer = socket.socketpair()
    try:
        peer.sendall(b"xyz")
        replayed = Replayed(ours, b"abcd")
        got = b""
        while len(got) < 7:
            got += replayed.recv(size)
        assert got == b"abcdxyz" and replayed.held == b""
        assert replayed.fileno() == ours.fileno()  # the rest is the socket's
    finally:
        ours.close()
        peer.close()
