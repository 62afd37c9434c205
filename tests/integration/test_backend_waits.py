"""A backend's wait for a first token as the router learns it from its streams (the
adaptive load guard's ``learned_wait``): the forwarder, in this process, against a real
upstream."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from continuum.config import BackendConfig
from continuum.devtools.servers import FakeUpstream
from continuum.metrics import RouterMetrics
from continuum.routing.backends import WAIT_SAMPLES, Backend, BackendPool
from continuum.routing.forwarder import Forwarder, openai_error_event
from continuum.testing import make_context

pytestmark = pytest.mark.e2e

PATH = "/v1/chat/completions"
HANG = 0.2


def _body(stream: bool, hang: float = 0.0) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": stream, "x_test": {"chunks": 3, "hang": hang}}).encode()


def _open(forwarder: Forwarder, backend: Backend, hang: float = 0.0) -> Iterator[bytes]:
    upstream = forwarder.send(backend, make_context(), PATH, _body(True, hang))
    return forwarder.relay(upstream, openai_error_event)


def test_first_tokens_slower_at_a_higher_in_flight_count_are_a_learned_wait(
    upstreams: Callable[[str], FakeUpstream],
) -> None:
    up = upstreams("a")
    backend = Backend(BackendConfig(name="a", url=up.url), ewma_alpha=1.0)
    forwarder = Forwarder(BackendPool([backend]), RouterMetrics())
    try:
        # plain answers sent at 1 in flight, however slow, teach nothing
        for _ in range(WAIT_SAMPLES):
            first = _open(forwarder, backend)
            next(first)
            forwarder.read_all(forwarder.send(backend, make_context(), PATH,
                                              _body(False, HANG)))
            b"".join(first)
        backend.in_flight = 1
        assert backend.queue_wait() == 0.0
        backend.in_flight = 0
        # streams: sent alone, the first token comes at once; sent while one is in
        # flight, HANG seconds later
        for i in range(WAIT_SAMPLES):
            first = _open(forwarder, backend)
            next(first)
            second = _open(forwarder, backend, HANG)
            assert backend.in_flight == 2
            b"".join(second)
            b"".join(first)
            assert backend.in_flight == 0
            if i < WAIT_SAMPLES - 1:  # not enough samples yet
                backend.in_flight = 1
                assert backend.queue_wait() == 0.0
                backend.in_flight = 0
        assert backend.queue_wait() == 0.0  # nothing in flight: no wait
        first = _open(forwarder, backend)
        next(first)
        assert HANG * 0.75 < backend.queue_wait() < HANG * 3  # one in flight: HANG more
        b"".join(first)
    finally:
        forwarder.close()


def test_a_stream_the_client_leaves_before_its_first_token_teaches_nothing(
    upstreams: Callable[[str], FakeUpstream],
) -> None:
    up = upstreams("a")
    backend = Backend(BackendConfig(name="a", url=up.url))
    forwarder = Forwarder(BackendPool([backend]), RouterMetrics())
    try:
        for _ in range(WAIT_SAMPLES):
            first = _open(forwarder, backend)
            next(first)
            upstream = forwarder.send(backend, make_context(), PATH, _body(True, HANG))
            upstream.lease.release(499, None)  # the client went away first
            upstream.response.close()
            b"".join(first)
        backend.in_flight = 1
        assert backend.queue_wait() == 0.0
    finally:
        forwarder.close()
