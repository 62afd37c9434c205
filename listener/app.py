"""Wire a listener together: config → sources → processors → hub → HTTP server.

``run(config)`` is what ``continuum-kv-listener --config FILE`` does after gevent's monkey
patching: build everything (:class:`Listener`), serve until SIGTERM/SIGINT, then shut down
in this order — stop the sources (no new events), send ``draining`` to every subscriber
(:meth:`EventHub.close`), let the streams finish for up to :data:`DRAIN_SECONDS`, close the
ZMQ sockets — and return 0.

Import this module only after monkey patching (it imports gevent's WSGI server, requests
and ``zmq.green``); it opens nothing at import time.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import gevent
import zmq.green as zmq
from gevent.event import Event
from prometheus_client import CollectorRegistry

from continuum.errors import ConfigError, ConfigIssue
from listener.bus_client import BusClient
from listener.bus_metrics import BusCollector
from listener.config import ListenerConfig, SourceConfig
from listener.hub import EventHub
from listener.model import Emit, SourceProcessor
from listener.server import KEEPALIVE_SECONDS, create_app, make_server, parse_listen
from listener.sources_trtllm import TrtllmSource
from listener.sources_zmq import EventSource, ZapAuthenticator, ZmqSource, zmq_source_issues

__all__ = ["DRAIN_SECONDS", "Listener", "ProcessorFactory", "listener_issues", "run"]

log = logging.getLogger(__name__)

#: Seconds the streams get to deliver ``draining`` on shutdown.
DRAIN_SECONDS = 5.0
#: ``factory(source, emit)`` → the source's processor.
ProcessorFactory = Callable[[SourceConfig, Emit], SourceProcessor]
_WILDCARDS = ("0.0.0.0", "::", "*", "")


def listener_issues(config: ListenerConfig) -> tuple[list[ConfigIssue], list[ConfigIssue]]:
    """Checks beyond the config table: ``(errors, warnings)``.

    Errors: a ZMQ endpoint the listener connects to (``zmq_mode: connect``, or a
    ``replay_endpoint``) whose host is not in ``allowed_publishers``. Warning: ``listen`` on
    a wildcard address without ``events_auth`` (the streams would be unauthenticated, and
    they are derived from prompts).
    """
    errors: list[ConfigIssue] = []
    for i, source in enumerate(config.sources):
        errors.extend(zmq_source_issues(source, f"sources[{i}]"))
    warnings: list[ConfigIssue] = []
    try:
        host, _ = parse_listen(config.listen)
    except ValueError:
        host = None
    authenticated = bool(config.events_auth.token_file or config.events_auth.token_env)
    if host in _WILDCARDS and not authenticated:
        warnings.append(ConfigIssue("listen", "binds every interface: the event streams are "
                                    "unauthenticated; bind an internal address", config.listen))
    return errors, warnings


def default_processor_factory(config: ListenerConfig) -> ProcessorFactory:
    """:class:`listener.processor.DefaultSourceProcessor` for each source."""
    from listener.processor import DefaultSourceProcessor

    salt = config.cache_salt.resolved()

    def make(source: SourceConfig, emit: Emit) -> SourceProcessor:
        processor: SourceProcessor = DefaultSourceProcessor(
            source, config.limits, config.detokenize, emit=emit, salt_secret=salt)
        return processor

    return make


class Listener:
    """A built listener: hub, sources with their processors, HTTP app and server.

    Args:
        config: A checked config.
        processor_factory: Builds each source's processor (default: the real one).
        keepalive: Seconds between ``: keepalive`` comments on idle streams.

    Raises:
        ConfigError: A check of :func:`listener_issues` failed.
    """

    def __init__(self, config: ListenerConfig, *,
                 processor_factory: ProcessorFactory | None = None,
                 keepalive: float = KEEPALIVE_SECONDS) -> None:
        errors, _ = listener_issues(config)
        auth = config.events_auth
        token = auth.resolved()
        if token is None and (auth.token_file or auth.token_env):  # gone since the check
            errors.append(ConfigIssue("events_auth", "the token could not be read"))
        bus = config.event_bus
        if bus is not None and (bus.credential_file or bus.credential_env) and \
                bus.resolved_credential() is None:
            errors.append(ConfigIssue("event_bus", "the credential could not be read"))
        if errors:
            raise ConfigError(errors)
        self.config = config
        self.hub = EventHub([s.backend_name for s in config.sources],
                            history_size=config.history_size,
                            subscriber_queue=config.subscriber_queue,
                            max_subscribers=config.max_subscribers)
        factory = processor_factory or default_processor_factory(config)
        self.context: Any = zmq.Context()
        self.zap = ZapAuthenticator(self.context)
        self.sources: list[EventSource] = []
        try:
            for source in config.sources:
                processor = factory(source, self.hub.publisher(source.backend_name))
                if source.engine == "trtllm":
                    self.sources.append(TrtllmSource(source, processor,
                                                     limits=config.limits))
                else:
                    self.sources.append(ZmqSource(source, processor, context=self.context,
                                                  zap=self.zap, limits=config.limits))
        except BaseException:
            self.context.destroy(linger=0)
            raise
        registry = CollectorRegistry(auto_describe=False)
        self.bus: BusClient | None = None
        if config.event_bus is not None:  # push mode, beside the local SSE server
            self.bus = BusClient(config.event_bus, self.hub, keepalive)
            registry.register(BusCollector(self.bus))
        self.app = create_app(self.hub, self.sources, keepalive=keepalive, token=token,
                              registry=registry)
        self.server = make_server(self.app, config.listen)
        self._started = False

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        host, port = self.server.address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Start the HTTP server and every source."""
        self.server.start()
        self._started = True
        for source in self.sources:
            source.start()
        if self.bus is not None:
            self.bus.start()
        log.info("continuum-kv-listener: serving %s/events/<backend> for %s (epoch %s)",
                 self.url, ", ".join(self.hub.backends) or "no sources", self.hub.epoch)

    def stop(self, drain: float = DRAIN_SECONDS) -> None:
        """Stop sources, drain subscribers, stop the server, close ZMQ; idempotent."""
        for source in self.sources:
            source.stop()
            close = getattr(source.processor, "close", None)
            if close is not None:
                close()
        if self.bus is not None:
            self.bus.drain()  # the router stops choosing this session ...
        self.hub.close()  # ... and every stream, pulled or pushed, ends with draining
        if self.bus is not None:
            self.bus.stop()
        if self._started:
            self.server.stop(timeout=drain)
            self._started = False
        else:
            self.server.close()
        self.zap.close()
        if not self.context.closed:
            self.context.destroy(linger=0)


def _configure_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root.setLevel(level.upper())


def _hup_ignored() -> None:
    log.warning("continuum-kv-listener: SIGHUP ignored: the listener has no reload (its "
                "logs go to stderr, nothing to reopen); restart it to apply a new config")


def run(config: ListenerConfig, *, processor_factory: ProcessorFactory | None = None,
        stop: Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set), then shut down cleanly; SIGHUP is
    logged and ignored.

    Returns:
        0 after a clean shutdown.
    """
    _configure_logging(config.log_level)
    stop = stop or Event()
    listener = Listener(config, processor_factory=processor_factory)
    handlers = [gevent.signal_handler(sig, stop.set) for sig in (signal.SIGTERM, signal.SIGINT)]
    # HUP's default action ends the process, and systemd counts that as a clean exit that
    # Restart=on-failure leaves down: a reflexive `kill -HUP` must not stop the streams.
    handlers.append(gevent.signal_handler(signal.SIGHUP, _hup_ignored))
    try:
        listener.start()
        stop.wait()
        log.info("continuum-kv-listener: shutting down (draining subscribers)")
    finally:
        for handler in handlers:
            handler.cancel()
        listener.stop()
    log.info("continuum-kv-listener: stopped")
    return 0
