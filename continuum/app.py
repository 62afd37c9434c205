"""The WSGI entry point gunicorn loads: ``continuum.app:get_app()``.

The application itself lives in :mod:`continuum.web.app`; this name is kept because
deployments and process managers spell it.
"""

from continuum.web.app import get_app

__all__ = ["get_app"]
