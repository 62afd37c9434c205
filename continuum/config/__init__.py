"""Configuration: one YAML file in, frozen dataclasses out.

Usage::

    config = load_config("config.yaml")          # raises ConfigError listing every problem
    result = check_config_file("config.yaml")    # errors and warnings, for `config validate`
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from continuum.config.fields import Issues, build_section, section_refused, walk
from continuum.config.fields import defaults_text as render_defaults
from continuum.config.loader import read_yaml
from continuum.config.schema import (
    AdminConfig,
    AuthConfig,
    BackendConfig,
    ClientKeyConfig,
    FleetConfig,
    GeminiContextCacheConfig,
    HealthCheckConfig,
    KvCacheIndexConfig,
    KvEventSourceConfig,
    KvScoringConfig,
    PoolConfig,
    PrefixRoutingConfig,
    RedisConfig,
    ResponseCacheConfig,
    RouterConfig,
    SemanticCacheConfig,
    ServerConfig,
    check_backend_names,
)
from continuum.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from continuum.registry import PluginRegistry

__all__ = [
    "AdminConfig",
    "AuthConfig",
    "BackendConfig",
    "CheckResult",
    "ClientKeyConfig",
    "ConfigError",
    "FleetConfig",
    "GeminiContextCacheConfig",
    "HealthCheckConfig",
    "KvCacheIndexConfig",
    "KvEventSourceConfig",
    "KvScoringConfig",
    "PoolConfig",
    "PrefixRoutingConfig",
    "RedisConfig",
    "ResponseCacheConfig",
    "RouterConfig",
    "SemanticCacheConfig",
    "ServerConfig",
    "check_config",
    "check_config_file",
    "defaults_text",
    "load_config",
    "parse_config",
    "restart_required",
]

CONFIG_ENV = "CONTINUUM_CONFIG"


@dataclass
class CheckResult:
    """Outcome of reading a config: the config (None if invalid), errors and warnings."""

    config: RouterConfig | None
    errors: list[ConfigIssue]
    warnings: list[ConfigIssue]
    source: str
    #: Some value was refused, so the checks that combine several keys (a section's own
    #: cross-field checks) did not all run: fixing ``errors`` may show more.
    incomplete: bool = False


def check_config(
    data: Any, source: str = "<config>", registry: PluginRegistry | None = None
) -> CheckResult:
    """Read a parsed YAML document; collect every error and warning."""
    issues = Issues()
    config = build_section(RouterConfig, data, "", issues)
    refused = config is not None and section_refused(config)
    if refused:  # the root's own checks did not run; these read values that were not refused
        check_backend_names(config.backends, issues)
    if config is not None and registry is not None:
        _check_plugins(config, registry, issues)
    issues.redact(RouterConfig)
    return CheckResult(None if issues.errors else config, issues.errors, issues.warnings, source,
                       incomplete=refused)


def _check_plugins(config: RouterConfig, registry: PluginRegistry, issues: Issues) -> None:
    """Look each plugin up by name, where the name was read (a refused value has its error
    already, and is None)."""
    from continuum.errors import PluginError

    def load(group: str, name: Any, path: str) -> None:
        if not isinstance(name, str):
            return
        try:
            registry.load(group, name)
        except PluginError as exc:
            issues.error(path, exc.message, name)

    load("continuum.strategies", config.selection_strategy, "selection_strategy")
    for i, name in enumerate(config.scorers or []):
        load("continuum.scorers", name, f"scorers[{i}]")
    cache, kv = config.response_cache, config.kv_cache_index
    # checked whether or not the tier is on, so a misspelt name shows before it is turned on
    if cache is not None:
        load("continuum.cache_stores", cache.backend, "response_cache.backend")
    if kv is not None:
        load("continuum.kv_indexes", kv.backend, "kv_cache_index.backend")


def check_config_file(
    path: str | os.PathLike[str], registry: PluginRegistry | None = None
) -> CheckResult:
    """Read and check a config file (``continuum-router config validate``): every issue
    carries the ``line:column`` of its key, and duplicate keys are errors."""
    try:
        doc = read_yaml(path)
    except ConfigError as exc:
        return CheckResult(None, exc.issues, [], str(path))
    result = check_config(doc.data, str(path), registry)
    errors = doc.annotate(result.errors, result.warnings)
    return CheckResult(None if errors else result.config, errors, result.warnings, str(path),
                       incomplete=result.incomplete)


def parse_config(
    data: Any, source: str = "<config>", registry: PluginRegistry | None = None
) -> RouterConfig:
    """Like :func:`check_config` but raises :class:`ConfigError` on any error."""
    result = check_config(data, source, registry)
    if result.config is None:
        raise ConfigError(result.errors, source)
    return result.config


def load_config(
    path: str | os.PathLike[str] | None = None, registry: PluginRegistry | None = None
) -> RouterConfig:
    """Load the config file at ``path`` (default: ``$CONTINUUM_CONFIG``)."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(
            [ConfigIssue("<file>", f"no config file given (use --config or ${CONFIG_ENV})")]
        )
    result = check_config_file(path, registry)
    if result.config is None:
        raise ConfigError(result.errors, str(path))
    return result.config


def restart_required(old: RouterConfig, new: RouterConfig) -> list[str]:
    """Key paths that changed between ``old`` and ``new`` but only take effect on restart."""
    old_leaves = {p: (f, v) for p, f, v in walk(old)}
    changed = []
    for path, f, value in walk(new):
        before = old_leaves.get(path)
        if before is not None and before[1] != value and f.metadata.get("restart"):
            changed.append(path)
    return changed


def defaults_text() -> str:
    """Every router key with its default and meaning, as commented YAML."""
    return render_defaults(RouterConfig)
