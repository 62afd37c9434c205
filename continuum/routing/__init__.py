"""Choosing a backend and talking to it: pool, health, hash ring, selection, forwarder."""
