"""The HTTP layer: the Falcon app, its resources, the admin API, config reload and the
HTTP helpers they share (request ids, bounded body reads, error documents)."""
