"""``continuum-sim``: run one simulated engine, or a fleet of them, from one command.

Examples::

    continuum-sim --port 8000                                  # one vLLM-like engine
    continuum-sim --engine sglang --zmq-endpoint tcp://*:5557 --template llama3
    continuum-sim --fleet 3 --port 8001 --zmq-endpoint tcp://*:5557 --fast
    continuum-sim --engine trtllm --port 8000   # events at POST/GET /kv_cache_events

Fleet member ``i`` listens on ``port + i`` and publishes on the ZMQ endpoint's port ``+ i``.
Nothing network-related is imported before :func:`main` has monkey-patched the process, so
this module is also safe to import from a process that patches on its own (then use
:func:`start_fleet`).
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from continuum import __version__

if TYPE_CHECKING:
    from gevent.pywsgi import WSGIServer

    from continuum.sim.engine import EngineConfig, SimEngine

#: Default KV-event wire profile per engine (``--kv-format`` overrides).
DEFAULT_PROFILES = {"vllm": "vllm-0.33", "sglang": "sglang-0.5.22", "trtllm": "trtllm"}


@dataclass
class RunningEngine:
    """One started fleet member."""

    index: int
    engine: SimEngine
    server: WSGIServer
    url: str
    zmq_endpoint: str | None = None
    closeables: list[Any] = field(default_factory=list)

    def stop(self, timeout: float = 1.0) -> None:
        """Stop serving and close the event publisher."""
        self.server.stop(timeout=timeout)
        for thing in self.closeables:
            close = getattr(thing, "close", None)
            if close is not None:
                close()


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:P`` → ``tcp://host:P+offset`` (port 0 stays 0: each binds a free port);
    other schemes get an ``_{offset}`` suffix."""
    if offset == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if match:
        port = int(match.group(2))
        return endpoint if port == 0 else f"{match.group(1)}{port + offset}"
    return f"{endpoint}_{offset}"


def build_engine(
    config: EngineConfig,
    *,
    zmq_endpoint: str | None = None,
    zmq_bind: bool | None = None,
    zmq_topic: str = "",
    replay_endpoint: str | None = None,
    kv_format: str | None = None,
    max_events: int = 10000,
) -> tuple[SimEngine, Any, list[Any]]:
    """An engine wired to its engine's block hasher and event sink.

    Returns:
        ``(engine, kv_events_drain_or_None, closeables)``.
    """
    # Imported here: these modules open sockets and must come after monkey patching.
    from continuum.sim.engine import SimEngine
    from continuum.sim.hashing import hasher_for
    from continuum.sim.kv_publish import TrtllmEventQueue, ZmqKvPublisher
    from continuum.sim.kv_wire import get_profile

    profile = kv_format or DEFAULT_PROFILES[config.engine]
    if kv_format is not None:
        get_profile(kv_format)  # unknown profile: ValueError listing the known ones
    if config.engine == "trtllm" and kv_format is not None:
        raise ValueError("--kv-format applies to vllm and sglang; trtllm serves JSON events")
    if not profile.startswith(config.engine):
        raise ValueError(f"KV-event profile {profile!r} does not belong to {config.engine}")
    sink: Any = None
    drain = None
    if config.engine == "trtllm":
        levels = (config.num_blocks, config.cpu_blocks)
        sink = TrtllmEventQueue(max_events=max_events, num_blocks_per_cache_level=levels)
        drain = sink.drain
    elif zmq_endpoint:
        sink = ZmqKvPublisher(
            profile,
            zmq_endpoint,
            bind=zmq_bind,
            topic=zmq_topic,
            replay_endpoint=replay_endpoint,
        )
        if replay_endpoint:
            sink.start_replay_server()
    engine = SimEngine(config, hasher=hasher_for(profile), sink=sink)
    return engine, drain, [sink] if sink is not None else []


def start_fleet(
    config: EngineConfig,
    *,
    count: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    zmq_endpoint: str | None = None,
    access_log: bool = False,
    **sink_options: Any,
) -> list[RunningEngine]:
    """Start ``count`` engines on ``port``, ``port+1`` … (port 0: each picks a free port).

    Call from a gevent-patched process; ``sink_options`` go to :func:`build_engine`.
    """
    from continuum.sim.server import create_engine_app, make_server

    fleet: list[RunningEngine] = []
    try:
        for i in range(count):
            endpoint = offset_endpoint(zmq_endpoint, i) if zmq_endpoint else None
            options = dict(sink_options)
            if options.get("replay_endpoint"):
                options["replay_endpoint"] = offset_endpoint(options["replay_endpoint"], i)
            engine, drain, closeables = build_engine(config, zmq_endpoint=endpoint, **options)
            app = create_engine_app(engine, kv_events=drain)
            server = make_server(app, host, port + i if port else 0, access_log=access_log)
            bound = getattr(closeables[0], "endpoint", endpoint) if closeables else endpoint
            running = RunningEngine(i, engine, server, "", bound, closeables)
            fleet.append(running)
            server.start()
            running.url = f"http://{host}:{server.server_port}"
    except BaseException:
        for running in fleet:
            running.stop()
        raise
    return fleet


def build_parser() -> argparse.ArgumentParser:
    """The ``continuum-sim`` argument parser."""
    p = argparse.ArgumentParser(
        prog="continuum-sim", description="Simulated vLLM/SGLang/TensorRT-LLM engine(s)."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--engine", choices=("vllm", "sglang", "trtllm"), default="vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="first HTTP port (0: any free port)")
    p.add_argument("--fleet", type=int, default=1, metavar="N", help="run N engines")
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help="served model name (repeatable; default sim-model)",
    )
    p.add_argument("--template", choices=("chatml", "llama3", "mistral"), default="chatml")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096, help="GPU KV capacity in blocks")
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier capacity")
    p.add_argument("--max-num-seqs", type=int, default=64, help="concurrent request slots")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--embedding-dim", type=int, default=256)
    lat = p.add_argument_group("latency model (seconds)")
    lat.add_argument("--fast", action="store_true", help="near-zero latencies, for tests")
    lat.add_argument("--prefill-base", type=float)
    lat.add_argument("--prefill-per-token", type=float)
    lat.add_argument("--cached-per-token", type=float)
    lat.add_argument("--cpu-load-per-token", type=float)
    lat.add_argument("--decode-per-token", type=float)
    lat.add_argument("--latency-scale", type=float, default=1.0)
    kv = p.add_argument_group("KV events")
    kv.add_argument("--zmq-endpoint", help="publish ZMQ KV events here (vllm, sglang)")
    mode = kv.add_mutually_exclusive_group()
    mode.add_argument("--zmq-bind", dest="zmq_bind", action="store_true", default=None)
    mode.add_argument("--zmq-connect", dest="zmq_bind", action="store_false")
    kv.add_argument("--zmq-topic", default="")
    kv.add_argument("--zmq-replay-endpoint")
    kv.add_argument(
        "--kv-format",
        help="ZMQ wire profile: vllm-0.22 (array), vllm-0.33 (map), sglang-0.5.9, "
        "sglang-0.5.18, sglang-0.5.22 (default: newest of the engine)",
    )
    kv.add_argument("--max-events", type=int, default=10000, help="trtllm event buffer size")
    p.add_argument("--access-log", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` the parsed arguments describe."""
    from continuum.sim.engine import DEFAULT_MODEL, EngineConfig
    from continuum.sim.latency import LatencyModel

    latency = LatencyModel.fast() if args.fast else LatencyModel()
    overrides = {
        name: getattr(args, name)
        for name in (
            "prefill_base",
            "prefill_per_token",
            "cached_per_token",
            "cpu_load_per_token",
            "decode_per_token",
        )
        if getattr(args, name) is not None
    }
    latency = replace(latency, **overrides).scaled(args.latency_scale)
    return EngineConfig(
        engine=args.engine,
        models=tuple(args.models or (DEFAULT_MODEL,)),
        template=args.template,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        cpu_blocks=args.cpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        latency=latency,
        embedding_dim=args.embedding_dim,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the engines until SIGTERM or SIGINT."""
    from gevent import monkey

    monkey.patch_all()
    import gevent
    from gevent.event import Event

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fleet < 1:
        parser.error("--fleet must be >= 1")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        fleet = start_fleet(
            config,
            count=args.fleet,
            host=args.host,
            port=args.port,
            zmq_endpoint=args.zmq_endpoint,
            access_log=args.access_log,
            zmq_bind=args.zmq_bind,
            zmq_topic=args.zmq_topic,
            replay_endpoint=args.zmq_replay_endpoint,
            kv_format=args.kv_format,
            max_events=args.max_events,
        )
    except Exception as exc:  # bad profile, port in use, ZMQ endpoint error …
        parser.error(f"cannot start: {exc}")
    for running in fleet:
        events = running.zmq_endpoint or ("/kv_cache_events" if args.engine == "trtllm" else "-")
        print(
            f"continuum-sim: engine {running.index} ({args.engine}) {running.url} "
            f"models={','.join(config.models)} kv_events={events}",
            flush=True,
        )
    stop = Event()
    gevent.signal_handler(signal.SIGTERM, stop.set)
    gevent.signal_handler(signal.SIGINT, stop.set)
    stop.wait()
    for running in fleet:
        running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
