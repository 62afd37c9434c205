"""The HTTP layer: the Falcon app, its resources, the admin API and config reload."""
