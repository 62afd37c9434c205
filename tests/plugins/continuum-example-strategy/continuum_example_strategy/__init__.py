"""An example third-party selection strategy for Continuum Router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from continuum.errors import NoHealthyBackendError
from continuum.interfaces import SelectionStrategy
from continuum.request import RequestContext
from continuum.routing.backends import Backend

__all__ = ["FirstHealthy"]


class FirstHealthy(SelectionStrategy):
    """Always the first candidate: active/standby in config order."""

    name: ClassVar[str] = "FirstHealthy"
    deterministic: ClassVar[bool] = True
    sticky: ClassVar[bool] = True

    def select(self, candidates: Sequence[Backend], ctx: RequestContext) -> Backend:
        """Return ``candidates[0]``.

        Raises:
            NoHealthyBackendError: ``candidates`` is empty.
        """
        if not candidates:
            raise NoHealthyBackendError("no healthy backend to select from")
        return candidates[0]
