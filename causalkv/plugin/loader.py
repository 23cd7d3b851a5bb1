"""Entry-point discovery under the env var controls, with soft failure on broken plugins.

Env vars (the prefix is ``causalkv.hooks.ENV_PREFIX``):

- ``CAUSALKV_PLUGINS``: comma-separated allow list of plugin (entry-point) or distribution
  names; only those load. Set but empty: no third-party plugin loads.
- ``CAUSALKV_DISABLE_PLUGINS``: comma-separated block list (plugin or distribution names;
  ``causalkv.builtin`` blocks the built-in plugin).
- ``CAUSALKV_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all.
- ``CAUSALKV_TRACE_PLUGINS=1``: trace every hook call to stderr.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import TYPE_CHECKING

from pluggy import PluginValidationError

from causalkv.hooks import ENTRY_POINT_GROUP, ENV_PREFIX, HOOK_NAMES
from causalkv.plugin.errors import PluginConflictError, PluginLoadFailure

if TYPE_CHECKING:
    from causalkv.plugin.manager import CausalKVPluginManager

__all__ = [
    "ENV_ALLOW",
    "ENV_AUTOLOAD_OFF",
    "ENV_BLOCK",
    "ENV_TRACE",
    "PluginSettings",
    "discover_entry_points",
    "load_entry_points",
]

ENV_ALLOW = f"{ENV_PREFIX}_PLUGINS"
ENV_BLOCK = f"{ENV_PREFIX}_DISABLE_PLUGINS"
ENV_AUTOLOAD_OFF = f"{ENV_PREFIX}_DISABLE_PLUGIN_AUTOLOAD"
ENV_TRACE = f"{ENV_PREFIX}_TRACE_PLUGINS"

_TRUE = {"1", "true", "yes", "on"}


def _names(raw: str) -> frozenset[str]:
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _norm(name: str) -> str:
    """PEP 503 normalization, so ``My_Plugin`` matches distribution ``my-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PluginSettings:
    """The plugin-loading controls read from the environment.

    Attributes:
        allow: names allowed to load (None: every installed plugin).
        block: names never loaded.
        autoload: load entry points at all.
        trace: trace hook calls to stderr.
    """

    allow: frozenset[str] | None = None
    block: frozenset[str] = frozenset()
    autoload: bool = True
    trace: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PluginSettings:
        allow_raw = env.get(ENV_ALLOW)
        return cls(
            allow=None if allow_raw is None else _names(allow_raw),
            block=_names(env.get(ENV_BLOCK, "")),
            autoload=env.get(ENV_AUTOLOAD_OFF, "").strip().lower() not in _TRUE,
            trace=env.get(ENV_TRACE, "").strip().lower() in _TRUE,
        )

    def _matches(self, names: frozenset[str], ep: EntryPoint) -> bool:
        dist = _dist_name(ep)
        wanted = {_norm(n) for n in names}
        return _norm(ep.name) in wanted or (dist is not None and _norm(dist) in wanted)

    def wants(self, ep: EntryPoint) -> bool:
        """Is this entry point allowed and not blocked?"""
        if self._matches(self.block, ep):
            return False
        return self.allow is None or self._matches(self.allow, ep)


def _dist_name(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else dist.metadata["Name"]


def _dist_label(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else f"{dist.metadata['Name']} {dist.version}"


def discover_entry_points() -> tuple[EntryPoint, ...]:
    """The installed entry points of group ``causalkv`` (one per distribution and name)."""
    from importlib.metadata import entry_points

    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def _fmt(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unknown_hooks(pm: CausalKVPluginManager, plugin: object) -> list[str]:
    """Hook implementations of ``plugin`` that match no causalkv hookspec (typos)."""
    unknown = []
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.has_spec():
            continue
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and not impl.opts.get("optionalhook"):
                unknown.append(caller.name)
    return unknown


def register_checked(
    pm: CausalKVPluginManager, plugin: object, name: str, distribution: str | None
) -> PluginLoadFailure | None:
    """Register ``plugin`` under ``name``; a validation failure is returned, not raised.

    A name already taken by another plugin is a conflict (`PluginConflictError`). A plugin
    whose hooks fail pluggy's validation (wrong argument names, a hook name matching no
    hookspec) is left unregistered and described by the returned `PluginLoadFailure`.
    """
    existing = pm.get_plugin(name)
    if existing is not None and existing is not plugin:
        other = pm.distributions.get(name)
        raise PluginConflictError(
            f"plugin name {name!r} is claimed twice: by {other or 'an already registered plugin'}"
            f" and by {distribution or repr(plugin)}. Uninstall one, or block it with "
            f"{ENV_BLOCK}=<distribution name>."
        )
    try:
        pm.register(plugin, name=name)
    except PluginValidationError as exc:
        return PluginLoadFailure(name, distribution, _fmt(exc))
    except ValueError as exc:  # pluggy: the same object is already registered under another name
        return PluginLoadFailure(name, distribution, _fmt(exc))
    unknown = _unknown_hooks(pm, plugin)
    if unknown:
        pm.unregister(plugin)
        return PluginLoadFailure(
            name,
            distribution,
            f"PluginValidationError: unknown hook(s) {', '.join(sorted(set(unknown)))}; "
            f"causalkv hooks are: {', '.join(HOOK_NAMES)}",
        )
    if distribution is not None:
        pm.distributions[name] = distribution
    return None


def load_entry_points(
    pm: CausalKVPluginManager,
    settings: PluginSettings,
    *,
    entry_points: Iterable[EntryPoint] | None = None,
    report: Callable[[PluginLoadFailure], None] | None = None,
) -> int:
    """Import and register the wanted entry points of group ``causalkv``.

    A plugin whose import raises, or that fails validation, is recorded in
    ``pm.load_failures``, passed to ``report`` and skipped; the others load.

    Returns:
        The number of plugins registered.
    """
    eps = discover_entry_points() if entry_points is None else tuple(entry_points)
    loaded = 0
    seen: set[str] = set()
    for ep in eps:
        if ep.group != ENTRY_POINT_GROUP or not settings.wants(ep) or pm.is_blocked(ep.name):
            continue
        seen.add(_norm(ep.name))
        dist_name = _dist_name(ep)
        if dist_name is not None:
            seen.add(_norm(dist_name))
        distribution = _dist_label(ep)
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must not take the host down
            failure: PluginLoadFailure | None = PluginLoadFailure(ep.name, distribution, _fmt(exc))
        else:
            failure = register_checked(pm, plugin, ep.name, distribution)
        if failure is not None:
            pm.load_failures.append(failure)
            if report is not None:
                report(failure)
            continue
        loaded += 1
    if settings.allow is not None:
        pm.missing_allowed = tuple(sorted(n for n in settings.allow if _norm(n) not in seen))
    return loaded
