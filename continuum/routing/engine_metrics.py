"""Slots learned from an engine's own Prometheus metrics (``backends[].learn_slots``).

vLLM and SGLang report, as gauges on ``/metrics``, how many requests run in their batch
and how many wait for a place in it (vLLM: ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``; SGLang: ``sglang:num_running_reqs`` and
``sglang:num_queue_reqs``; summed over the series, so data-parallel engines and several
models add up). While requests wait, the requests running are as many as the engine
takes at once: its ``--max-num-seqs`` / ``--max-running-requests``, or fewer when its KV
memory or token budget is what binds. Neither engine reports that limit itself.

:class:`SlotLearner` keeps the running count of the last :data:`KEEP` probes that found
requests waiting and gives the largest once :data:`NEED` such probes were seen. One probe
can find a request waiting only for the next scheduler step, or a step whose token budget
a few long prompts took; the largest of several saturated probes is the limit the engine
kept to, and an old one ages out as the engine's mix changes. An engine that never
queues keeps no slots: nothing to price.
"""

from __future__ import annotations

from collections import deque

#: Gauges of requests running and waiting, by engine.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_NAMES = frozenset(RUNNING + WAITING)
_STARTS = ("vllm:num_requests_", "sglang:num_")

#: Saturated probes kept per backend.
KEEP = 4
#: Saturated probes needed before the slots count.
NEED = 2


def read_queue(text: str) -> tuple[int, int] | None:
    """``(running, waiting)`` from a Prometheus text exposition, each summed over its
    series; None when the text has neither engine's running gauge (not an engine we
    know, or metrics turned off). A waiting gauge that is absent counts as 0."""
    running = waiting = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(_STARTS):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, rest = line[:space], line[space:]
        if name not in _NAMES:
            continue
        fields = rest.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if value != value or value < 0:  # NaN, or nonsense
            continue
        if name in RUNNING:
            running += value
            found = True
        else:
            waiting += value
    if not found:
        return None
    return int(running), int(waiting)


class SlotLearner:
    """One backend's learned slots (module docstring)."""

    __slots__ = ("_saturated",)

    def __init__(self) -> None:
        self._saturated: deque[int] = deque(maxlen=KEEP)

    def observe(self, running: int, waiting: int) -> int | None:
        """Take one probe's gauges; the slots as now learned (None: not yet)."""
        if waiting > 0 and running > 0:
            self._saturated.append(running)
        return self.slots

    @property
    def slots(self) -> int | None:
        if len(self._saturated) < NEED:
            return None
        return max(self._saturated)


__all__ = ["KEEP", "NEED", "RUNNING", "WAITING", "SlotLearner", "read_queue"]
