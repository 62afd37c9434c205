"""``continuum-kv-listener``: run the KV listener, check its config, print the defaults.

Examples::

    continuum-kv-listener --config conf/config.kv-listener.yaml
    continuum-kv-listener --config conf/config.kv-listener.yaml --check
    continuum-kv-listener --print-defaults

:func:`main` monkey-patches the process with gevent before anything else is imported; this
module imports nothing network-related at import time (a test checks it in a subprocess).
SIGTERM or SIGINT sends ``draining`` to every stream subscriber and exits 0; SIGHUP is logged
and ignored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from continuum import __version__

if TYPE_CHECKING:  # annotations only: main() must monkey-patch before these are imported
    from continuum.errors import ConfigIssue
    from listener.config import ListenerConfig

__all__ = ["build_parser", "defaults_text", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for the man page and tests)."""
    parser = argparse.ArgumentParser(
        prog="continuum-kv-listener",
        description="Turn engine KV-cache events into per-backend prefix event streams "
        "(SSE at /events/<backend>) for continuum-router.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--config", metavar="FILE", help="listener config (YAML)")
    parser.add_argument("--check", action="store_true",
                        help="validate --config, print every error and warning, and exit")
    parser.add_argument("--print-defaults", action="store_true",
                        help="print every config key with its default and meaning, and exit")
    return parser


def defaults_text() -> str:
    """Every key of the listener config with its default and meaning, as commented YAML."""
    from continuum.config.fields import defaults_text as render_defaults
    from listener.config import ListenerConfig

    return render_defaults(ListenerConfig)


def _load(path: str) -> tuple[ListenerConfig | None, list[ConfigIssue], list[ConfigIssue]]:
    """(config or None, errors, warnings) of a config file, every check included."""
    from listener.app import listener_issues
    from listener.config import check_listener_file

    config, errors, warnings = check_listener_file(path)
    if config is not None:
        more_errors, more_warnings = listener_issues(config)
        errors = errors + more_errors
        warnings = warnings + more_warnings
    return (None if errors else config), errors, warnings


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point: returns the exit status."""
    from gevent import monkey

    monkey.patch_all()

    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.print_defaults:
        sys.stdout.write(defaults_text())
        return 0
    if not args.config:
        parser.error("--config FILE is required (or use --print-defaults)")
    config, errors, warnings = _load(args.config)
    if args.check:
        for issue in errors:
            print("error: " + issue.render(args.config))
        for issue in warnings:
            print("warning: " + issue.render(args.config))
        if errors:
            print(f"{args.config}: {len(errors)} error(s)")
            return 1
        print(f"{args.config}: ok ({len(warnings)} warning(s))")
        return 0
    if config is None:
        for issue in errors:
            print("error: " + issue.render(args.config), file=sys.stderr)
        return 1
    for issue in warnings:
        print("warning: " + issue.render(args.config), file=sys.stderr)
    from zmq.error import ZMQError

    from listener.app import run

    try:
        return run(config)
    except (OSError, ValueError, ZMQError) as exc:  # a port in use, a bad endpoint …
        print(f"error: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
