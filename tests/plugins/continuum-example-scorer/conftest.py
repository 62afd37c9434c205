"""Collect this plugin's tests only where the plugin is installed.

The router's own test run walks into ``tests/plugins/``, where the plugin is only source,
not an installed distribution with an entry point; there its tests are run by
``tests/integration/test_plugin_install.py`` after a real install instead.
"""

from importlib import metadata


def _installed() -> bool:
    try:
        metadata.distribution("continuum-example-scorer")
    except metadata.PackageNotFoundError:
        return False
    return True


collect_ignore = [] if _installed() else ["tests"]
