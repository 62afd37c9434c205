"""Continuum Router: a prefix- and KV-cache-aware router for fleets of LLM backends."""

__version__ = "0.1.0"
