"""The access log's direct writer writes what ``logging`` would, byte for byte, and hands
the line to ``logging`` whenever logging is set up other than the router sets it up."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator

import pytest

from continuum.web import observe
from continuum.web.observe import LOG_FORMAT, AccessWriter, access_log, configure_access_log

NOW = 1764604800.25678  # a fixed clock: both paths format the same instant


@pytest.fixture
def root_stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """The root logger as the worker sets it up (one stream handler, LOG_FORMAT), into a
    string; logging's state is put back afterwards."""
    root = logging.root
    saved = root.handlers[:], root.level
    saved_access = (access_log.handlers[:], access_log.propagate, access_log.disabled,
                    access_log.level)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    monkeypatch.setattr(observe, "_test_handler", handler, raising=False)
    monkeypatch.setattr(observe.time, "time", lambda: NOW)
    # logging's records read time.time_ns() from Python 3.13 on
    monkeypatch.setattr(observe.time, "time_ns", lambda: int(NOW * 1e9))
    try:
        yield stream
    finally:
        root.handlers[:], root.level = saved
        (access_log.handlers[:], access_log.propagate, access_log.disabled,
         access_log.level) = saved_access


def _worker_logging() -> None:
    """Only the worker's root handler (pytest adds its capture handlers during the test)."""
    logging.root.handlers[:] = [observe._test_handler]  # type: ignore[attr-defined]


def _as_logging_would(message: str) -> str:
    record = logging.LogRecord("continuum.access", logging.INFO, __file__, 1, message,
                               None, None)
    record.created, record.msecs = NOW, int((NOW - int(NOW)) * 1000) + 0.0
    record.process = os.getpid()
    return logging.Formatter(LOG_FORMAT).format(record) + "\n"


def test_text_line_matches_logging(root_stream: io.StringIO) -> None:
    _worker_logging()
    configure_access_log("text")
    message = 'request_id=abc tenant=- endpoint=chat model="a b" status=200'
    AccessWriter().write(message)
    assert AccessWriter().handler() is not None  # the direct path was the one taken
    assert root_stream.getvalue() == _as_logging_would(message)


def test_json_line_is_the_bare_message(root_stream: io.StringIO) -> None:
    _worker_logging()
    configure_access_log("json")
    out = io.StringIO()
    access_log.handlers[0].setStream(out)  # type: ignore[attr-defined]
    writer = AccessWriter()
    assert writer.handler() is not None
    writer.write('{"request_id":"abc","status":200}')
    assert out.getvalue() == '{"request_id":"abc","status":200}\n'
    assert root_stream.getvalue() == ""  # json lines do not propagate


def test_other_logging_setups_get_the_line_through_logging(root_stream: io.StringIO) -> None:
    _worker_logging()
    configure_access_log("text")
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logging.root.addHandler(Collect())
    writer = AccessWriter()
    assert writer.handler() is None
    writer.write("request_id=abc status=200")
    assert [r.getMessage() for r in seen] == ["request_id=abc status=200"]
    assert root_stream.getvalue() == _as_logging_would("request_id=abc status=200")

    # A filter on the access logger is honoured too (it drops the line).
    logging.root.handlers[:] = logging.root.handlers[:1]
    access_log.addFilter(lambda record: False)
    try:
        assert writer.handler() is None
        writer.write("request_id=def status=200")
    finally:
        access_log.filters.clear()
    assert "def" not in root_stream.getvalue()


def test_off_writes_nothing(root_stream: io.StringIO) -> None:
    _worker_logging()
    configure_access_log("off")
    writer = AccessWriter()
    assert writer.handler() is None
    access_log_state = access_log.disabled
    assert access_log_state


def test_text_format_is_key_equals_text_value_of_each_field() -> None:
    """The text line is ``key=_text_value(value)`` per field, joined by spaces, whatever the
    values: quoted strings (blanks, quotes, ``=``, backslashes, empty), unicode, floats,
    ints, missing values."""
    from continuum.metrics import RequestRecord

    models = ["m", "a b", 'q"uote', "k=v", "back\\\\slash", "", "ünï", "tab\there", None,
              "trail ", "=lead", "end=", " ", "=", "m"]
    for i, model in enumerate(models):
        record = RequestRecord("chat", "" if i == len(models) - 1 else f"id-{i}")
        record.model = model
        record.tenant = None if i % 2 else f"tenant {i}"
        record.backend = None if i == 3 else "b 1" if i == 4 else "bench"
        record.status = 200 + i
        record.stream = bool(i % 2)
        record.first_byte = record.started + 0.0012345 * i if i % 3 else None
        record.finished = record.started + (float("nan") if i == 5 else 0.5 * i)
        record.prompt_tokens = i if i % 2 else None
        record.cached_tokens = 0
        record.completion_tokens = 10**i
        record.cache = "miss" if i % 2 else "" if i == 10 else None
        fields = observe.access_fields(record)
        expected = " ".join(f"{key}={observe._text_value(value)}"
                            for key, value in fields.items())
        assert observe.format_access(record, "text") == expected


def test_a_continuum_logger_between_it_and_the_root_keeps_the_direct_path(
    root_stream: io.StringIO,
) -> None:
    """gunicorn turns the ``continuum`` placeholder into a logger in every worker (its
    ``glogging.loggers()`` gets every name in the logger dict) when any ``continuum.x``
    logger was made before the fork, as ``continuum-router serve`` does: a logger with no
    handler that propagates passes the line on unchanged, so the direct path still holds;
    one with a handler of its own, or that stops propagation, sends it through logging."""
    _worker_logging()
    configure_access_log("text")
    parent = logging.getLogger("continuum")
    assert access_log.parent is parent
    saved = parent.handlers[:], parent.propagate, parent.level
    try:
        parent.setLevel(logging.WARNING)  # its level is not the access logger's
        writer = AccessWriter()
        assert writer.handler() is not None
        writer.write("request_id=abc status=200")
        assert root_stream.getvalue() == _as_logging_would("request_id=abc status=200")

        seen: list[str] = []

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(record.getMessage())

        parent.addHandler(Collect())
        assert writer.handler() is None
        writer.write("request_id=def status=200")
        assert seen == ["request_id=def status=200"]
        assert root_stream.getvalue().endswith(_as_logging_would("request_id=def status=200"))

        parent.handlers[:] = []
        parent.propagate = False
        assert writer.handler() is None
    finally:
        parent.handlers[:], parent.propagate = saved[0], saved[1]
        parent.setLevel(saved[2])


class _CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_several_lines_go_out_in_one_write_each_as_logging_would(
        root_stream: io.StringIO) -> None:
    _worker_logging()
    configure_access_log("text")
    out = _CountingStream()
    logging.root.handlers[0].setStream(out)  # type: ignore[attr-defined]
    AccessWriter().write_lines(["request_id=a status=200", 'request_id=b model="x y"'])
    assert out.writes == 1
    assert out.getvalue() == (_as_logging_would("request_id=a status=200")
                              + _as_logging_would('request_id=b model="x y"'))


def _record(request_id: str) -> observe.RequestRecord:
    record = observe.RequestRecord("chat")
    record.request_id, record.status = request_id, 200
    return record


class _Metrics:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def observe_request(self, record: observe.RequestRecord) -> None:
        self.seen.append(record.request_id)


def test_under_the_worker_the_metrics_are_at_once_and_the_lines_from_the_hub(
        root_stream: io.StringIO) -> None:
    """The router's gevent worker hands the observer its hub's run_callback: a finished
    request is counted at once (a scrape after the answer sees it), its access line is
    written by one callback for all requests finished before the hub ran it."""
    _worker_logging()
    configure_access_log("text")
    out = _CountingStream()
    logging.root.handlers[0].setStream(out)  # type: ignore[attr-defined]
    metrics = _Metrics()
    observer = observe.Observer(metrics, "text")  # type: ignore[arg-type]
    callbacks: list[object] = []
    observer.log_after_sending(callbacks.append)
    try:
        observer.finish(_record("r1"))
        observer.finish(_record("r2"))
        assert metrics.seen == ["r1", "r2"]
        assert out.getvalue() == "" and len(callbacks) == 1  # one callback for both
        callbacks.pop()()  # the hub's turn
        assert out.writes == 1
        assert [line.split("request_id=")[1].split()[0]
                for line in out.getvalue().splitlines()] == ["r1", "r2"]
        observer.finish(_record("r3"))  # the next turn schedules a new callback
        assert len(callbacks) == 1
        observer.flush()  # at exit, without the hub
        assert out.getvalue().count("request_id=") == 3
        callbacks.pop()()  # the hub's callback after the flush writes nothing twice
        assert out.getvalue().count("request_id=") == 3
    finally:
        observe.atexit.unregister(observer.flush)


def test_without_the_worker_the_line_is_written_at_once(root_stream: io.StringIO) -> None:
    _worker_logging()
    configure_access_log("text")
    metrics = _Metrics()
    observe.Observer(metrics, "text").finish(_record("r1"))  # type: ignore[arg-type]
    assert metrics.seen == ["r1"] and "request_id=r1 " in root_stream.getvalue()
