"""The simulated engine's latency model.

Time to first token = queueing for a slot (measured, not modelled: requests wait on the
engine's ``max_num_seqs`` semaphore) + ``prefill_base`` + uncached prompt tokens *
``prefill_per_token`` + CPU-tier hits * ``cpu_load_per_token`` + GPU hits *
``cached_per_token``. Each further output token costs ``decode_per_token``. Cached tokens
are priced far below computed ones, so a cached prefix visibly shortens TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LatencyModel:
    """Per-request timing, in seconds. Pure arithmetic: the engine does the sleeping."""

    prefill_base: float = 0.015
    prefill_per_token: float = 0.0002
    cached_per_token: float = 0.000002
    cpu_load_per_token: float = 0.00002
    decode_per_token: float = 0.012

    def __post_init__(self) -> None:
        for name in (
            "prefill_base",
            "prefill_per_token",
            "cached_per_token",
            "cpu_load_per_token",
            "decode_per_token",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"latency {name} must be >= 0 (got {getattr(self, name)})")

    @classmethod
    def fast(cls) -> LatencyModel:
        """Near-zero latencies for tests, with cached tokens still cheaper than computed."""
        return cls(
            prefill_base=0.0,
            prefill_per_token=1e-7,
            cached_per_token=1e-9,
            cpu_load_per_token=1e-8,
            decode_per_token=0.0,
        )

    def scaled(self, factor: float) -> LatencyModel:
        """The same model with every cost multiplied by ``factor``."""
        return replace(
            self,
            prefill_base=self.prefill_base * factor,
            prefill_per_token=self.prefill_per_token * factor,
            cached_per_token=self.cached_per_token * factor,
            cpu_load_per_token=self.cpu_load_per_token * factor,
            decode_per_token=self.decode_per_token * factor,
        )

    def prefill(
        self, prompt_tokens: int, cached_tokens: int = 0, cpu_cached_tokens: int = 0
    ) -> float:
        """Seconds from admission to the first token (queueing excluded).

        Args:
            prompt_tokens: all prompt tokens.
            cached_tokens: prompt tokens found in the prefix cache (GPU and CPU tiers).
            cpu_cached_tokens: the part of ``cached_tokens`` loaded from the CPU tier.
        """
        if not 0 <= cpu_cached_tokens <= cached_tokens <= prompt_tokens:
            raise ValueError("need 0 <= cpu_cached_tokens <= cached_tokens <= prompt_tokens")
        computed = prompt_tokens - cached_tokens
        gpu_hits = cached_tokens - cpu_cached_tokens
        return (
            self.prefill_base
            + computed * self.prefill_per_token
            + gpu_hits * self.cached_per_token
            + cpu_cached_tokens * self.cpu_load_per_token
        )

    def ttft(
        self,
        prompt_tokens: int,
        cached_tokens: int = 0,
        cpu_cached_tokens: int = 0,
        *,
        queued: float = 0.0,
    ) -> float:
        """Time to first token: ``queued`` seconds of waiting plus :meth:`prefill`."""
        return queued + self.prefill(prompt_tokens, cached_tokens, cpu_cached_tokens)

    def decode(self, output_tokens: int) -> float:
        """Seconds to produce ``output_tokens`` tokens after the first one."""
        return max(output_tokens - 1, 0) * self.decode_per_token
