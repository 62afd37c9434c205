"""Ports, child processes and waiting: the plumbing shared by the demo, the tests and ``tools/``.

Everything that starts a real process on 127.0.0.1 needs the same three things, and they are
written once here:

* a free port (:func:`free_port`) or a block of consecutive free ports
  (:func:`free_port_block`);
* a child process with its output in a log file, stopped by its PID only, that can say how
  it ended (:class:`Child`; :class:`Children` for a group sharing a work directory);
* a bounded wait (:func:`wait_until`, :func:`wait_http`) that gives up at a deadline, and
  at once — with the child's exit status and the end of its log (:class:`ChildExited`) —
  when a child it watches dies meanwhile, instead of running into the timeout.

Standard library only: the demo runs without the test extras, and with gevent's monkey
patching (``time.sleep`` and ``http.client`` then yield to other greenlets).
"""

from __future__ import annotations

import atexit
import functools
import http.client
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

#: Proxy variables a child must not inherit: everything here talks to 127.0.0.1.
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                   "all_proxy")

#: A line of a log that names an exception (``ModuleNotFoundError: No module named 'x'``).
ERROR_LINE = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)\b.*)$", re.MULTILINE)


# -- ports -----------------------------------------------------------------------------------


#: How many of the ports it handed out lately this process remembers.
RECENT_PORTS = 4096

#: The ports :func:`free_port` and :func:`free_port_block` handed out lately (oldest
#: first), which they do not hand out again. Nothing holds a free port between the call
#: and the server's bind, so the kernel can offer one port twice in a row: two fake
#: servers of one test fixture once got the same port, one failed to bind, and the
#: test's requests reached the other (a 404 from the wrong fake).
_recent: dict[int, None] = {}


def _remember(ports: Iterable[int]) -> None:
    for port in ports:
        _recent[port] = None
    while len(_recent) > RECENT_PORTS:
        del _recent[next(iter(_recent))]


def _unused_port() -> int:
    """The port the kernel gives a socket bound to 127.0.0.1 port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The environment variables pytest-xdist gives each of its workers (``gw0``, ``gw1``, ...;
#: how many there are), which its children inherit.
LANE_VARIABLES = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")


def port_lane(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(lane, lanes)``: the share of the ports this process and its children pick from.
    Processes that pick ports at once (pytest-xdist's workers, each with its own memory of
    the ports it handed out) get disjoint lanes, so two of them never hand out one port;
    ``(0, 1)``, every port, outside xdist."""
    env = os.environ if environ is None else environ
    worker, count = (env.get(name, "") for name in LANE_VARIABLES)
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return 0, 1
    lanes = max(int(count), 1)
    return int(worker[2:]) % lanes, lanes


def lane_of(port: int, lanes: int) -> int:
    """Which of ``lanes`` lanes ``port`` is in: a multiplicative hash, not the remainder,
    since the kernel gives ``bind(("127.0.0.1", 0))`` ports of one parity only (it keeps the
    others for ``connect()``), and a lane of odd ports would never be offered one."""
    return ((port * 0x9E3779B1) & 0xFFFFFFFF) * lanes >> 32


def free_port(attempts: int = 100) -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago, that this process
    has not handed out lately (see :data:`RECENT_PORTS`), and in this process's lane
    (:func:`port_lane`, :func:`lane_of`)."""
    lane, lanes = port_lane()
    for _ in range(attempts * lanes):
        port = _unused_port()
        if lane_of(port, lanes) == lane and port not in _recent:
            _remember((port,))
            return port
    raise RuntimeError(f"the kernel offered only ports handed out lately or outside lane "
                       f"{lane} of {lanes} ({attempts * lanes} tries)")


#: The sockets :func:`refused_port` holds: bound, never listening, kept until exit.
_REFUSING: list[socket.socket] = []


def refused_port() -> int:
    """A TCP port on 127.0.0.1 that refuses connections for as long as this process lives:
    bound and never listening, so no other server can take it meanwhile (a bare
    :func:`free_port` for a dead backend could be picked up by another test's server and
    come alive)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    if not _REFUSING:
        atexit.register(_release_refused_ports)
    _REFUSING.append(sock)
    return int(sock.getsockname()[1])


def _release_refused_ports() -> None:
    """At exit: close what :func:`refused_port` held (no unclosed-socket warnings)."""
    while _REFUSING:
        _REFUSING.pop().close()


#: Where :func:`free_port_block` draws its blocks: 20000-31999.
BLOCK_PORTS_FROM, BLOCK_PORTS_SPAN = 20000, 12000


def free_port_block(count: int, attempts: int = 200) -> int:
    """The first of ``count`` consecutive ports on 127.0.0.1 that were all free a moment
    ago, none of them handed out lately (a fleet's member ``i`` publishes on ``port +
    i``). Drawn below the usual ephemeral range, so outgoing connections are unlikely to
    take one meanwhile, from this process's lane's part of it (:func:`port_lane`)."""
    lane, lanes = port_lane()
    span = BLOCK_PORTS_SPAN // lanes
    low = BLOCK_PORTS_FROM + lane * span
    if count > span:
        raise ValueError(f"{count} consecutive ports do not fit in a lane of {span}")
    rng = random.SystemRandom()
    for _ in range(attempts):
        base = rng.randrange(low, low + span - count + 1)
        held: list[socket.socket] = []
        try:
            if any(port in _recent for port in range(base, base + count)):
                continue
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            _remember(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports on 127.0.0.1")


# -- child processes -------------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without proxy variables, with
    ``NO_PROXY`` for loopback and ``extra`` on top: the environment of a local child."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in PROXY_VARIABLES}
    env["NO_PROXY"] = "127.0.0.1,localhost"
    env.update(extra or {})
    return env


class ChildExited(RuntimeError):
    """A child that :func:`wait_until` watched ended; the message says how
    (:meth:`Child.exit_report`)."""

    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


class Child:
    """A process we started, with stdout and stderr in ``log`` (discarded without one).

    It is stopped by its PID only (:meth:`stop`: ``stop_signal``, then SIGKILL after a
    timeout), and tells how it ended (:meth:`exit_report`). With ``die_with_parent`` (Linux
    only) the kernel sends it SIGTERM when this process dies, so even a SIGKILLed parent
    leaves nothing behind. A context manager: leaving the block stops it.

    Args:
        argv: the command.
        log: file for the child's output; the child keeps its own descriptor.
        name: how reports call it (default: the log's name without ``.log``, else argv[0]).
        env: its environment (default: this process's).
        cwd: its working directory (default: this process's).
        stop_signal: what :meth:`stop` sends first (gunicorn's quick shutdown is SIGQUIT).
        die_with_parent: ask Linux to SIGTERM it when this process dies.
    """

    def __init__(
        self, argv: Sequence[str], log: Path | None = None, *, name: str | None = None,
        env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        stop_signal: int = signal.SIGTERM, die_with_parent: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.log = log
        self.name = name or (log.name.removesuffix(".log") if log else Path(argv[0]).name)
        self.stop_signal = stop_signal
        preexec = die_with_parent_hook() if die_with_parent else None
        env_dict = dict(env) if env is not None else None
        if log is None:
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=env_dict, cwd=cwd, preexec_fn=preexec)
        else:
            with open(log, "wb") as out:  # the child keeps its own descriptor
                self.popen = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    env=env_dict, cwd=cwd, preexec_fn=preexec)
        self.pid = self.popen.pid
        self.started = time.monotonic()

    def __repr__(self) -> str:
        return f"<Child {self.name} pid {self.pid}>"

    def __enter__(self) -> Child:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def returncode(self) -> int | None:
        """Its exit status (negative: killed by that signal); None while it runs."""
        return self.popen.poll()

    def running(self) -> bool:
        """Whether it has not ended yet."""
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int:
        """Wait for it to end (:class:`subprocess.TimeoutExpired` after ``timeout``)."""
        return self.popen.wait(timeout)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to it, if it still runs."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, sig: int | None = None, timeout: float = 10.0) -> int | None:
        """Send ``sig`` (default: ``stop_signal``) and wait; SIGKILL when it outlives
        ``timeout``. Idempotent; returns the exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(self.stop_signal if sig is None else sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode

    def log_text(self) -> str:
        """Its whole log so far ("" when there is none)."""
        if self.log is None:
            return ""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its log, for error messages."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def exit_report(self) -> str | None:
        """How it ended: its name, exit status or signal, how long it ran, the last error
        its log names and the end of that log; None while it runs."""
        code = self.popen.poll()
        if code is None:
            return None
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        report = f"{self.name} (pid {self.pid}) {how} after {time.monotonic() - self.started:.1f}s"
        text = self.log_text()
        errors = ERROR_LINE.findall(text)
        if errors:
            report += f" ({errors[-1].strip()})"
        if text and self.log is not None:
            report += f"; the end of {self.log.name}:\n" + self.log_tail()
        return report


class Children:
    """Children logging into one work directory, stopped together (newest first).

    Args:
        workdir: where :meth:`spawn` puts each child's log.
        env: the environment every child starts from (default: :func:`child_env`).
        die_with_parent: see :class:`Child`.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str] | None = None,
                 die_with_parent: bool = False) -> None:
        self.workdir = workdir
        self.env = dict(env) if env is not None else child_env()
        self.die_with_parent = die_with_parent
        #: Every child started, running or not, oldest first.
        self.all: list[Child] = []
        #: The children not stopped yet.
        self.live: list[Child] = []

    @property
    def pids(self) -> list[int]:
        """The PIDs of every child started."""
        return [child.pid for child in self.all]

    def spawn(self, argv: Sequence[str], log: str, env: Mapping[str, str] | None = None,
              stop_signal: int = signal.SIGTERM) -> Child:
        """Start ``argv`` with output to ``workdir/log`` and ``env`` over the group's."""
        child = Child(argv, self.workdir / log, env={**self.env, **(env or {})},
                      stop_signal=stop_signal, die_with_parent=self.die_with_parent)
        self.all.append(child)
        self.live.append(child)
        return child

    def stop(self, child: Child, timeout: float = 10.0) -> None:
        """Stop one child and wait for it."""
        child.stop(timeout=timeout)
        self.live = [c for c in self.live if c is not child]

    def stop_all(self) -> None:
        """Stop every child still running, newest first."""
        for child in reversed(list(self.live)):
            self.stop(child)

    def exited(self) -> list[Child]:
        """The children that ended although nobody stopped them."""
        return [child for child in self.live if not child.running()]

    def log_tail(self, log: str, lines: int = 20) -> str:
        """The end of the log file ``log`` in the work directory ("" when there is none)."""
        try:
            text = (self.workdir / log).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when its parent dies; None
    elsewhere. Resolved here, in the parent: the child between fork and exec must not
    import anything."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return functools.partial(prctl, 1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# -- waiting ---------------------------------------------------------------------------------


class WaitTimeout(RuntimeError):
    """:func:`wait_until` gave up: the condition did not hold before the deadline."""


def wait_until(
    condition: Callable[[], T], what: str | Callable[[], str], timeout: float = 20.0, *,
    children: Iterable[Child] = (), interval: float = 0.05,
    sleep: Callable[[float], object] = time.sleep,
    retry_on: tuple[type[BaseException], ...] = (OSError,), tail: int = 20,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Raises:
        ChildExited: at once when one of ``children`` ends meanwhile (with how it ended).
        WaitTimeout: after ``timeout`` seconds, naming ``what`` (or what it returns), the
            condition's last error and the end of the watched children's logs (``tail``
            lines each; 0 for none).

    ``retry_on`` errors of the condition mean "not yet" (``OSError`` covers refused
    connections, and ``requests``' errors); ``sleep`` is ``gevent.sleep`` where the waiting
    thread must let greenlets run without monkey patching.
    """
    watched = list(children)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except retry_on as exc:
            last = exc
        for child in watched:
            report = child.exit_report()
            if report is not None:
                raise ChildExited(child, f"while waiting for {_describe(what)}: {report}")
        if time.monotonic() > deadline:
            break
        sleep(interval)
    message = f"timed out after {timeout:g}s waiting for {_describe(what)}"
    if last is not None:
        message += f" (last error: {last!r})"
    tails = [child.log_tail(tail) for child in watched if tail > 0]
    if any(tails):
        message += ":\n" + "\n".join(t for t in tails if t)
    raise WaitTimeout(message)


def _describe(what: str | Callable[[], str]) -> str:
    if isinstance(what, str):
        return what
    try:
        return what()
    except Exception as exc:  # the explanation must not hide the timeout
        return f"<{exc!r}>"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """``GET url`` on a plain-HTTP server (never through a proxy): status and body.

    Raises:
        OSError: nothing answers (or the connection broke).
        http.client.HTTPException: what answered does not speak HTTP.
    """
    parts = urlsplit(url)
    path = parts.path or "/"
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                      timeout=timeout)
    try:
        conn.request("GET", f"{path}?{parts.query}" if parts.query else path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status of ``GET url``, or None when nothing answers it in HTTP."""
    try:
        return http_get(url, timeout)[0]
    except (OSError, http.client.HTTPException):
        return None


def wait_http(url: str, timeout: float = 20.0, *, statuses: Iterable[int] = (200,),
              children: Iterable[Child] = (), tail: int = 20) -> None:
    """Wait until ``GET url`` answers with one of ``statuses``. Errors as
    :func:`wait_until` (``what`` names the URL and the last status seen)."""
    wanted = set(statuses)
    seen: list[int | None] = [None]

    def answers() -> bool:
        seen[0] = http_status(url)
        return seen[0] in wanted

    wait_until(answers, lambda: f"{url} (last status: {seen[0]})", timeout,
               children=children, tail=tail)
