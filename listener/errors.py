"""Errors raised by the kv-listener."""

from __future__ import annotations

from continuum.errors import ContinuumError


class DecodeError(ContinuumError, ValueError):
    """A KV-event message could not be decoded.

    The message names what was wrong and where, as a JSON-path-like location into the
    decoded structure (``$[1][0].block_hashes: expected an array, got str``). The decoders
    raise nothing else for any input, so a listener needs exactly one ``except``.

    Attributes:
        path: Location of the offending value (``$`` is the whole payload).
        reason: What was wrong, without the location.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}", path=path)
        self.path = path
        self.reason = reason
