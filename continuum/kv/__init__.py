"""Tier 4: consuming the listeners' KV event streams and scoring backends on them."""
