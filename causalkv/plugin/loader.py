"""Entry-point discovery under the env var controls, with soft failure on broken plugins.

Env vars (the prefix is ``causalkv.hooks.ENV_PREFIX``):

- ``CAUSALKV_PLUGINS``: comma-separated allow list of plugin (entry-point) or distribution
  names; only those load. Set but empty: no third-party plugin loads.
- ``CAUSALKV_DISABLE_PLUGINS``: comma-separated block list (plugin or distribution names;
  ``causalkv.builtin`` blocks the built-in plugin).
- ``CAUSALKV_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points at all.
- ``CAUSALKV_TRACE_PLUGINS=1``: print every hook call and its result to stderr.

An installed entry point is loaded by pluggy's own loader
(``PluginManager.load_setuptools_entrypoints(group, name=...)``, which also records its
distribution); what pluggy does not do is done around it: the allow and block lists by
plugin *or* distribution name, one plugin name claimed twice as a conflict (pluggy would
silently keep the first), and a plugin that fails to import or validate reported and skipped.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from causalkv.hooks import ENTRY_POINT_GROUP, ENV_PREFIX
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


def norm(name: str) -> str:
    """PEP 503 normalization, so ``My_Plugin`` matches distribution ``my-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_of(ep: EntryPoint) -> tuple[str | None, str | None]:
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
        keys = {norm(ep.name)} | ({norm(d)} if (d := distribution_of(ep)[0]) else set())

        def hit(names: frozenset[str]) -> bool:
            return bool(keys & {norm(n) for n in names})

        return not hit(self.block) and (self.allow is None or hit(self.allow))


def discover_entry_points() -> tuple[EntryPoint, ...]:
    """The installed entry points of group ``causalkv``."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def _where(ep: EntryPoint) -> str:
    return distribution_of(ep)[1] or repr(ep.value)


def _refuse_claimed_names(pm: CausalKVPluginManager, wanted: list[EntryPoint], eps: Iterable[EntryPoint]) -> None:
    """`PluginConflictError` when a wanted plugin's name is registered already or declared by
    another entry point (a wanted one, or an installed one pluggy's by-name loader could pick)."""
    count = Counter(ep.name for ep in eps)
    for ep in wanted:
        if pm.get_plugin(ep.name) is not None or count[ep.name] > 1:
            other = next((o for o in eps if o.name == ep.name and o is not ep), None)
            first = _where(other) if other is not None else "an already registered plugin"
            raise PluginConflictError(
                f"plugin name {ep.name!r} is claimed twice: by {first} and by {_where(ep)}. "
                f"Uninstall one, or block the name with {ENV_BLOCK}={ep.name}."
            )


def load_entry_points(
    pm: CausalKVPluginManager,
    settings: PluginSettings,
    *,
    entry_points: Iterable[EntryPoint] | None = None,
    report: Callable[[PluginLoadFailure], None] | None = None,
) -> int:
    """Import and register the wanted entry points of group ``causalkv``.

    An installed entry point goes through pluggy's ``load_setuptools_entrypoints``; one given
    in-process without a distribution (``entry_points``, e.g. in a test) is imported and
    registered the same way by hand. A plugin whose import raises, or that fails validation,
    is recorded in ``pm.load_failures``, passed to ``report`` and skipped; the others load.

    Returns:
        The number of plugins registered.

    Raises:
        PluginConflictError: two entry points, or an entry point and a registered plugin,
            claim one plugin name.
    """
    eps = [ep for ep in (discover_entry_points() if entry_points is None else entry_points)
           if ep.group == ENTRY_POINT_GROUP]
    wanted = [ep for ep in eps if settings.wants(ep) and not pm.is_blocked(ep.name)]
    _refuse_claimed_names(pm, wanted, eps)
    loaded = 0
    for ep in wanted:
        try:
            if getattr(ep, "dist", None) is not None:  # installed
                loaded += pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
            else:
                pm.register(ep.load(), name=ep.name)
                loaded += 1
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the host down
            failure = PluginLoadFailure(ep.name, distribution_of(ep)[1], f"{type(exc).__name__}: {exc}")
            pm.load_failures.append(failure)
            if report is not None:
                report(failure)
    if settings.allow is not None:
        seen = {norm(k) for ep in wanted for k in (ep.name, distribution_of(ep)[0]) if k}
        pm.missing_allowed = tuple(sorted(n for n in settings.allow if norm(n) not in seen))
    return loaded
