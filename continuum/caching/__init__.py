"""Tier 2: the response cache and its key (stores plug in through ``continuum.cache_stores``)."""
