"""``continuum-kv-listener``: engine KV events in, per-backend prefix streams out."""
