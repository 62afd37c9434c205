"""``continuum-router``: serve, check config, print defaults, run the demo."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from continuum import __version__
from continuum.config import CONFIG_ENV, check_config_file, defaults_text

if TYPE_CHECKING:
    from continuum.registry import PluginRegistry


def _cmd_serve(args: argparse.Namespace) -> int:
    config = args.config or os.environ.get(CONFIG_ENV)
    if not config:
        print(f"continuum-router serve: give --config FILE or set ${CONFIG_ENV}", file=sys.stderr)
        return 2
    result = check_config_file(config, _registry())
    if result.config is None:
        for issue in result.errors:
            print(issue.render(result.source), file=sys.stderr)
        return 1
    os.environ[CONFIG_ENV] = os.path.abspath(config)
    # The worker class (gevent, with header timeouts) and the per-instance control socket
    # come from continuum.gunicorn_conf.
    argv = ["gunicorn", "-c", "python:continuum.gunicorn_conf"]
    if args.bind:
        argv += ["--bind", args.bind]
    if args.workers:
        argv += ["--workers", str(args.workers)]
    argv.append("continuum.app:get_app()")
    from gunicorn.app.wsgiapp import run

    sys.argv = argv
    run()
    return 0


def _registry() -> PluginRegistry:
    from continuum.registry import PluginRegistry

    return PluginRegistry()


def _cmd_validate(args: argparse.Namespace) -> int:
    result = check_config_file(args.file, _registry())
    for issue in result.errors:
        print("error: " + issue.render(result.source))
    for issue in result.warnings:
        print("warning: " + issue.render(result.source))
    if result.errors:
        print(f"{result.source}: {len(result.errors)} error(s)")
        if result.incomplete:
            print("note: some checks that combine several keys (such as a setting that "
                  "names a backend) run only once these values are fixed: run validate again "
                  "then")
        return 1
    print(f"{result.source}: ok ({len(result.warnings)} warning(s))")
    return 0


def _cmd_defaults(args: argparse.Namespace) -> int:
    sys.stdout.write(defaults_text())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:  # pragma: no cover - see main()
    from continuum.devtools.demo import main as demo_main

    return int(demo_main(args.demo_args))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the man page and tests)."""
    parser = argparse.ArgumentParser(
        prog="continuum-router", description="Prefix- and KV-cache-aware LLM router"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router under gunicorn with gevent workers")
    serve.add_argument("--config", help=f"config file (default: ${CONFIG_ENV})")
    serve.add_argument("--bind", help="override server.bind, e.g. 0.0.0.0:8080")
    serve.add_argument("--workers", type=int, help="override server.workers")
    serve.set_defaults(func=_cmd_serve)

    config = sub.add_parser("config", help="check a config file or print the defaults")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    validate = config_sub.add_parser("validate", help="report every error and warning")
    validate.add_argument("file")
    validate.set_defaults(func=_cmd_validate)
    defaults = config_sub.add_parser("defaults", help="print every key with its default")
    defaults.set_defaults(func=_cmd_defaults)

    demo = sub.add_parser("demo", add_help=False,
                          help="run simulated engines + router and compare strategies "
                               "(continuum-router demo --help for its options)")
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options (argparse.REMAINDER cannot)
        from continuum.devtools.demo import main as demo_main

        return int(demo_main(argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
