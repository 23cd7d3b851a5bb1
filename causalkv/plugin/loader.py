"""Entry-point discovery under the env var controls, with soft failure on broken plugins.

Env vars (the prefix is ``causalkv.hooks.ENV_PREFIX``):

- ``CAUSALKV_PLUGINS``: comma-separated allow list of plugin (entry-point) or distribution
  names; only those load. Set but empty: no third-party plugin loads.
- ``CAUSALKV_DISABLE_PLUGINS``: comma-separated block list (plugin or distribution names;
  ``causalkv.builtin`` blocks the built-in plugin).
- ``CAUSALKV_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all.
- ``CAUSALKV_TRACE_PLUGINS=1``: print every hook call and its result to stderr.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
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
    "register_checked",
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


def _dist(ep: EntryPoint) -> tuple[str | None, str | None]:
    """``(distribution name, "<name> <version>")`` of an entry point, or ``(None, None)``."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], f"{dist.metadata['Name']} {dist.version}"


@dataclass(frozen=True)
class PluginSettings:
    """The plugin-loading controls read from the environment.

    Attributes:
        allow: names allowed to load (None: every installed plugin).
        block: names never loaded.
        autoload: load entry points at all.
        trace: print hook calls to stderr.
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

    def wants(self, ep: EntryPoint) -> bool:
        """Is this entry point allowed and not blocked?"""
        keys = {_norm(ep.name)} | ({_norm(d)} if (d := _dist(ep)[0]) else set())

        def hit(names: frozenset[str]) -> bool:
            return bool(keys & {_norm(n) for n in names})

        return not hit(self.block) and (self.allow is None or hit(self.allow))


def discover_entry_points() -> tuple[EntryPoint, ...]:
    """The installed entry points of group ``causalkv``."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def _fmt(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
    except (PluginValidationError, ValueError) as exc:  # ValueError: object registered twice
        return PluginLoadFailure(name, distribution, _fmt(exc))
    unknown = sorted(
        {
            c.name
            for c in pm.get_hookcallers(plugin) or ()
            if not c.has_spec()
            and any(i.plugin is plugin and not i.opts.get("optionalhook") for i in c.get_hookimpls())
        }
    )
    if unknown:
        pm.unregister(plugin)
        return PluginLoadFailure(
            name,
            distribution,
            f"PluginValidationError: unknown hook(s) {', '.join(unknown)}; "
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
        dist_name, distribution = _dist(ep)
        seen |= {_norm(ep.name)} | ({_norm(dist_name)} if dist_name else set())
        try:
            failure = register_checked(pm, ep.load(), ep.name, distribution)
        except PluginConflictError:
            raise
        except Exception as exc:  # a broken plugin must not take the host down
            failure = PluginLoadFailure(ep.name, distribution, _fmt(exc))
        if failure is None:
            loaded += 1
            continue
        pm.load_failures.append(failure)
        if report is not None:
            report(failure)
    if settings.allow is not None:
        pm.missing_allowed = tuple(sorted(n for n in settings.allow if _norm(n) not in seen))
    return loaded
