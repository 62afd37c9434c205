"""Hot-path shortcuts keep their behaviour: the worker's head/body coalescing, request ids,
the pid the multiprocess metric values use."""

from __future__ import annotations

import os
import uuid
from typing import Any

import gevent
import pytest
from gevent import socket

from continuum.gunicorn_worker import _CoalescingSocket
from continuum.request import new_request_id


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.settimeout(2)
    return a, b


def _read_available(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(2)


def test_head_goes_out_with_the_body_in_one_send() -> None:
    a, b = _pair()
    out = _CoalescingSocket(a)
    out.sendall(b"HEAD\r\n\r\n")
    assert _read_available(b) == b""  # held back: the greenlet has not blocked yet
    out.sendall(b"body")
    assert b.recv(100) == b"HEAD\r\n\r\nbody"
    out.sendall(b"more")
    assert b.recv(100) == b"more"
    out.flush()
    assert _read_available(b) == b""
    a.close()
    b.close()


def test_held_head_is_sent_as_soon_as_the_greenlet_blocks() -> None:
    a, b = _pair()
    out = _CoalescingSocket(a)
    out.sendall(b"HEAD\r\n\r\n")
    gevent.sleep(0.01)  # e.g. waiting for the first piece of an upstream stream
    assert _read_available(b) == b"HEAD\r\n\r\n"
    out.sendall(b"first piece")
    assert b.recv(100) == b"first piece"
    a.close()
    b.close()


def test_head_alone_is_flushed_when_the_request_ends() -> None:
    a, b = _pair()
    out = _CoalescingSocket(a)
    out.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
    out.flush()
    assert b.recv(100) == b"HTTP/1.1 204 No Content\r\n\r\n"
    gevent.sleep(0)  # the hub's callback finds nothing left to send
    assert _read_available(b) == b""
    assert out.fileno() == a.fileno()  # everything else is the socket's
    a.close()
    b.close()


def test_generated_request_ids_are_uuid4_hex_and_distinct() -> None:
    ids = {new_request_id() for _ in range(2000)}
    assert len(ids) == 2000
    for rid in list(ids)[:200]:
        parsed = uuid.UUID(hex=rid)
        assert len(rid) == 32 and rid == parsed.hex
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert new_request_id("client-id-1") == "client-id-1"
    assert new_request_id("bad id") != "bad id"


def test_metric_values_follow_the_pid_into_a_forked_child(tmp_path: object) -> None:
    """The cached pid is refreshed after a fork: a child's samples go to its own file."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from continuum.metrics import RouterMetrics\n"
        "m = RouterMetrics(); m.workers.inc()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    m2 = RouterMetrics(); m2.workers.inc(); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "names = sorted(os.listdir(os.environ['PROMETHEUS_MULTIPROC_DIR']))\n"
        "print(os.getpid(), pid, ' '.join(names))\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    parent, child, names = out[0], out[1], out[2:]
    assert f"gauge_livesum_{parent}.db" in names
    assert f"gauge_livesum_{child}.db" in names


def test_cached_http_date_is_gunicorns() -> None:
    """The worker's ``http_date`` gives gunicorn's text, for given times and for now."""
    import time

    from gunicorn.util import http_date

    from continuum.gunicorn_worker import _HttpDate

    cached = _HttpDate(http_date)
    for stamp in (0, 1764604800, 1764604800.999, 2000000000.5):
        assert cached(stamp) == http_date(stamp)
    for _ in range(3):  # the second may turn between the two calls: one try is enough
        before, text, after = http_date(), cached(), http_date()
        if before == after:
            assert text == before
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the clock turned a second in every try")


@pytest.mark.parametrize("errorlog", ["-", "/var/log/gunicorn-error.log"])
def test_the_wsgi_errors_stream_is_gunicorns(errorlog: str) -> None:
    """``wsgi.errors`` made without a ``getLogger`` per request writes where gunicorn's own
    does, also once a handler's stream was replaced (a log file reopened on USR1), before
    or after the request's stream was made."""
    import io
    import logging
    import types

    from gunicorn.http.wsgi import WSGIErrorsWrapper

    from continuum.gunicorn_worker import _ErrorsWrapper

    errorlog_logger = logging.getLogger("gunicorn.error")
    saved = list(errorlog_logger.handlers)
    first, second = logging.StreamHandler(io.StringIO()), logging.StreamHandler(io.StringIO())
    cfg = types.SimpleNamespace(errorlog=errorlog)
    try:
        errorlog_logger.handlers = [first, second, logging.NullHandler()]
        assert _ErrorsWrapper(cfg).streams == WSGIErrorsWrapper(cfg).streams
        second.setStream(io.StringIO())  # what gunicorn's reopen_files does
        ours, theirs = _ErrorsWrapper(cfg), WSGIErrorsWrapper(cfg)
        assert ours.streams == theirs.streams
        assert second.stream in ours.streams
        assert (first.stream in ours.streams) is (errorlog != "-")
        ours.write("boom\n")
        assert second.stream.getvalue() == "boom\n"
        second.setStream(io.StringIO())  # reopened after the stream was made
        ours.write("late\n")
        assert second.stream.getvalue() == "late\n"
    finally:
        errorlog_logger.handlers = saved


_SAMPLES_SCRIPT = """
import os, sys
from prometheus_client import CollectorRegistry, generate_latest, multiprocess, values
from prometheus_client.mmap_dict import MmapedDict
from continuum.metrics import RouterMetrics
if sys.argv[1] == "stock":
    values.ValueClass = values.MultiProcessValue()
m = RouterMetrics()
m.adder(m.requests, "chat", "2xx", "upstream")(1)
m.child(m.requests, "chat", "2xx", "upstream").inc(2.5)
m.adder(m.requests, "chat", "5xx", "router_error")(1)
add = m.adder(m.in_flight, "b")
add(1); add(1); add(-1)
m.child(m.in_flight, "b").dec()
m.child(m.in_flight, "c").inc(3)
m.child(m.healthy, "b").set(1)
m.child(m.healthy, "b").set(0)
m.child(m.draining, "b").set(1)
m.workers.set(1)
m.cache_entries.inc(3)
m.cache_entries.dec(1)
observe = m.observer(m.duration, "chat", "b", "strategy")
for x in (0.0, 0.0005, 0.001, 0.0011, 0.25, 7, 120, 1e9, float("inf"), float("nan"), -1):
    observe(x)
m.child(m.ttft, "chat", "b", "strategy").observe(0.3)
m.observer(m.kv_overlap_score)(0.55)
m.kv_query_latency.observe(0.00002)
both = m.joint((m.adder(m.prefix_requests, "prefix_hash"), m.adder(m.prefix_distribution, "b")))
both((1, 1)); both((2, 0))
m.attempt_done("chat", "b", 200); m.attempt_done("chat", "b", 499)
# Enough series to grow the counter file past its first map (1 MiB) twice; then samples
# to a series made before the growth (its view of the old map was replaced) and after.
early = m.adder(m.requests, "chat", "2xx", "upstream")
for i in range(9000):
    m.adder(m.upstream_attempts, "chat", f"backend-{i:05d}", "200")(1)
early(1)
m.adder(m.upstream_attempts, "chat", "backend-08999", "200")(2)
import time
from continuum.metrics import CACHE, RequestRecord
time.perf_counter = lambda: 100.0  # the durations observe_request takes
for i, (prompt, cached, created, completion) in enumerate(
        [(12, 3, None, 6), (None, None, None, None), (5, None, 7, 0), (0, 0, 0, 9)]):
    record = RequestRecord("chat", f"id{i}")
    record.started = 100.0 - 0.0011 * (i + 1) ** 3
    record.backend, record.decision, record.status = "b", "strategy", 200 + 100 * (i % 4)
    record.stream, record.first_byte = bool(i % 2), 100.0 - 0.0004 * i
    record.prompt_tokens, record.cached_tokens = prompt, cached
    record.cache_creation_tokens, record.completion_tokens = created, completion
    m.observe_request(record)
cached_answer = RequestRecord("chat", "hit")
cached_answer.decision, cached_answer.status, cached_answer.started = CACHE, 200, 99.0
m.observe_request(cached_answer)
pid = os.fork()
if pid == 0:
    m.adder(m.requests, "chat", "2xx", "upstream")(5)
    m.child(m.healthy, "b").set(1)
    m.observer(m.duration, "chat", "b", "strategy")(0.2)
    m.adder(m.in_flight, "b")(1)
    os._exit(0)
os.waitpid(pid, 0)
m.adder(m.requests, "chat", "2xx", "upstream")(1)
names = {str(os.getpid()): "PARENT", str(pid): "CHILD"}
import re
# Only where a pid stands for a process (a file name, a pid label): a pid's digits can also
# occur inside a series' label value, such as backend-04637.
def rename(text):
    return re.sub(r'(?<=_)\\d+(?=\\.db)|(?<=pid=")\\d+(?=")', lambda m: names.get(m[0], m[0]), text)
directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
for name in sorted(os.listdir(directory)):
    print(rename(name), sorted(MmapedDict.read_all_values_from_file(os.path.join(directory, name))))
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
# the collector's order follows the directory listing's: compared as sorted lines
for line in sorted(rename(generate_latest(registry).decode()).splitlines()):
    print(line)
"""


def test_multiprocess_values_write_what_prometheus_client_writes(tmp_path: Any) -> None:
    """The router's multiprocess value class (and the adders and observers over it) leave
    the same files and the same exposition as prometheus-client's own class for the same
    samples: counters, gauges of each mode, histogram buckets at and around their bounds
    (+Inf, NaN, negative), joint samples, finished requests and attempts, samples to series
    made before and after their file grew, and samples after a fork, which go to the
    child's own files."""
    import subprocess
    import sys

    outputs = []
    for kind in ("fast", "stock"):
        directory = tmp_path / kind
        directory.mkdir()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
        outputs.append(subprocess.run(
            [sys.executable, "-c", _SAMPLES_SCRIPT, kind], env=env, capture_output=True,
            text=True, timeout=60, check=True).stdout)
    fast, stock = outputs
    assert "continuum_request_duration_seconds_bucket" in fast
    assert "counter_CHILD.db" in fast and "gauge_livesum_CHILD.db" in fast
    assert fast == stock


def test_settled_config_reads_what_gunicorns_config_holds() -> None:
    """The worker's config gives each setting's value as gunicorn's ``Config`` does (hooks,
    properties, methods and unknown names included), takes ``set`` afresh and refuses
    attribute assignment like ``Config``."""
    import pytest
    from gunicorn.config import Config

    from continuum.gunicorn_worker import _SettledConfig

    cfg = Config()
    cfg.set("keepalive", 7)
    settled = _SettledConfig(cfg)
    for name in ("keepalive", "limit_request_fields", "secure_scheme_headers", "is_ssl",
                 "pre_request", "post_request", "workers", "forwarder_headers"):
        assert getattr(settled, name) == getattr(cfg, name)
        assert getattr(settled, name) == getattr(cfg, name)  # the kept value
    assert settled.forwarded_allow_networks() == cfg.forwarded_allow_networks()
    assert getattr(settled, "proxy_protocol", "off") == getattr(cfg, "proxy_protocol", "off")
    with pytest.raises(AttributeError):
        settled.no_such_setting  # noqa: B018
    settled.set("keepalive", 9)
    assert settled.keepalive == cfg.keepalive == 9
    with pytest.raises(AttributeError):
        settled.keepalive = 3
