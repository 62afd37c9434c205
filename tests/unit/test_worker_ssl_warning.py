"""The worker's filter for gevent's late-ssl warning: silent when redis-py's unused asyncio
client is the only module it would name, as before for any other module. Each case is a
fresh interpreter that imports, filters (or not) and monkey-patches as a worker does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WARNING = "MonkeyPatchWarning: Monkey-patching ssl after ssl has already been imported"


def _patch_after(imports: str, tmp_path: Path, *, filtered: bool = True) -> str:
    """stderr of an interpreter that runs ``imports``, then the worker's filter (when
    ``filtered``), then gevent's ``patch_all``."""
    (tmp_path / "holds_sslcontext.py").write_text("from ssl import SSLContext\n")
    code = "\n".join([
        imports,
        "from continuum.gunicorn_worker import _ignore_redis_asyncio_ssl_warning",
        "_ignore_redis_asyncio_ssl_warning()" if filtered else "",
        "from gevent import monkey",
        "monkey.patch_all()",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, cwd=tmp_path)
    return proc.stderr


def test_redis_imported_before_the_patch_gives_no_warning(tmp_path: Path) -> None:
    unfiltered = _patch_after("import redis", tmp_path, filtered=False)
    assert WARNING in unfiltered and "redis.asyncio.connection" in unfiltered
    assert WARNING not in _patch_after("import redis", tmp_path)


def test_another_module_holding_sslcontext_is_still_named(tmp_path: Path) -> None:
    stderr = _patch_after("import redis\nimport holds_sslcontext", tmp_path)
    assert WARNING in stderr and "holds_sslcontext" in stderr
