"""Network addresses in config files: URLs and ``host:port`` checked one way everywhere
(router and listener), and the one redaction of the credentials a URL may carry.

The checks exist because ``urlsplit`` accepts what no socket can use — port 99999, a host
with spaces — and the mistake would otherwise surface only as a connect error at run time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urlsplit

if TYPE_CHECKING:
    from continuum.config.fields import Issues

MAX_PORT = 65535
_SECRET_PARAM = re.compile(r"pass|secret|token|key|auth|cred", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password (or a lone user-info token) and password-like query
    values replaced by ``***``: ``redis://:pw@h:6379?password=x`` →
    ``redis://:***@h:6379?password=***``.

    Works on malformed URLs too: the user info ends at the *last* ``@`` (a password may
    hold unescaped ``/``, ``?``, ``#`` or ``@``; an ``@`` further on only hides more), and a
    URL without a scheme is read the same way.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _secret = userinfo.partition(":")
        rest = f"{user}:***@{rest}" if colon else f"***@{rest}"
    head, q, query = rest.partition("?")
    if q:
        query, hash_, fragment = query.partition("#")
        params = []
        for item in query.split("&"):
            name, eq, _value = item.partition("=")
            params.append(f"{name}=***" if eq and _SECRET_PARAM.search(name) else item)
        rest = f"{head}?{'&'.join(params)}{hash_}{fragment}"
    return f"{scheme}{sep}{rest}"


def port_problem(port: str, lowest: int = 1) -> str | None:
    """Why ``port`` (the text after ``:``) is not a port from ``lowest`` to 65535, or None."""
    if port.isascii() and port.isdigit() and lowest <= int(port) <= MAX_PORT:
        return None
    return f"port must be a number from {lowest} to {MAX_PORT}, not {port!r}"


def check_url(
    path: str, value: str, issues: Issues, schemes: tuple[str, ...], what: str, *,
    host_required: bool = True,
) -> SplitResult | None:
    """Record an error at ``path`` unless ``value`` is a URL of one of ``schemes`` with a
    host free of whitespace (when ``host_required``) and, if it names a port, one from 1 to
    65535. ``what`` describes the expected URL (``"an http:// or https:// URL"``).

    Returns:
        The URL's parts, or None when an error was recorded.
    """
    if any(ch.isspace() for ch in value):
        issues.error(path, f"must be {what} without spaces (a host with spaces never "
                     "resolves)", value)
        return None
    try:
        parts = urlsplit(value)
    except ValueError as exc:  # "Invalid IPv6 URL"
        issues.error(path, f"must be {what} ({exc})", value)
        return None
    if parts.scheme not in schemes or (host_required and not parts.hostname):
        issues.error(path, f"must be {what}", value)
        return None
    port = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
    if port:
        problem = port_problem(port)
        if problem:
            issues.error(path, problem, value)
            return None
    return parts


def check_host_port(path: str, value: str, issues: Issues, *, lowest_port: int = 1,
                    unix: bool = False) -> None:
    """Record an error at ``path`` unless ``value`` is ``host:port`` (``[v6]:port`` too)
    with a port from ``lowest_port`` to 65535; ``unix`` also accepts gunicorn's
    ``unix:PATH`` and ``fd://N``."""
    if unix and value.startswith(("unix:", "fd://")):
        return
    host, colon, port = value.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not bare:
        issues.error(path, "must be host:port, e.g. 127.0.0.1:8080 (the port is required)",
                     value)
    elif ":" in bare and bare == host:
        issues.error(path, "an IPv6 host must be in brackets, e.g. [::1]:8080", value)
    elif any(ch.isspace() for ch in bare):
        issues.error(path, "host must not contain spaces", value)
    else:
        problem = port_problem(port, lowest_port)
        if problem:
            issues.error(path, problem, value)
