"""The plugin manager: a factory for fresh managers and a lazily built process-wide default."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Any

import pluggy

from causalkv import __version__
from causalkv.hooks import ENTRY_POINT_GROUP, HOOK_NAMES, NAME, specs
from causalkv.plugin import builtin
from causalkv.plugin.errors import PluginConflictError, PluginLoadFailure
from causalkv.plugin.loader import (
    ENV_ALLOW,
    ENV_BLOCK,
    PluginSettings,
    discover_entry_points,
    distribution_of,
    load_entry_points,
    norm,
)

__all__ = [
    "CausalKVPluginManager",
    "PluginInfo",
    "get_plugin_manager",
    "make_plugin_manager",
    "reset_plugin_manager",
    "unknown_name_warnings",
]


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, as ``causalkv plugins`` lists it.

    Attributes:
        name: the plugin name (entry-point name; ``causalkv.builtin`` for the built-in one).
        version, distribution: its distribution's, or None (a plugin registered in-process).
        hooks: the causalkv hooks it implements, sorted.
        builtin: True for causalkv's own plugin.
    """

    name: str
    version: str | None
    distribution: str | None
    hooks: tuple[str, ...]
    builtin: bool


class CausalKVPluginManager(pluggy.PluginManager):
    """A pluggy manager for project ``causalkv`` that remembers load reports.

    Attributes:
        load_failures: plugins that failed to import or validate, and were skipped.
        distributions: plugin name -> ``"<dist> <version>"`` for entry-point plugins.
        missing_allowed: names in ``CAUSALKV_PLUGINS`` that matched no installed plugin.
        settings: the env var controls this manager was built under.
    """

    def __init__(self, settings: PluginSettings | None = None) -> None:
        super().__init__(NAME)
        self.add_hookspecs(specs)
        self.settings = settings or PluginSettings()
        self.load_failures: list[PluginLoadFailure] = []
        self.missing_allowed: tuple[str, ...] = ()
        #: the lines this manager printed on stderr while it was built (load failures,
        #: unknown names in the env vars), in order
        self.reported: list[str] = []

    @property
    def distributions(self) -> dict[str, str]:
        """Plugin name -> ``"<dist> <version>"`` of the plugins loaded from entry points
        (pluggy's own record, `list_plugin_distinfo`)."""
        return {
            name: f"{dist.project_name} {dist.version}"
            for plugin, dist in self.list_plugin_distinfo()
            if (name := self.get_name(plugin)) is not None
        }

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """pluggy's ``register``, then pluggy's ``check_pending``: a hook no causalkv hookspec
        declares (a misspelled name) is a `pluggy.PluginValidationError` too, and the plugin
        is left unregistered."""
        registered = super().register(plugin, name)
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            unknown = sorted(c.name for c in self.get_hookcallers(plugin) or () if not c.has_spec())
            self.unregister(plugin)
            raise pluggy.PluginValidationError(
                plugin, f"unknown hook(s) {', '.join(unknown)}; causalkv hooks are: {', '.join(HOOK_NAMES)}"
            ) from exc
        return registered

    def register_plugin(self, plugin: object, name: str | None = None) -> str:
        """Register an in-process plugin (e.g. in a test); returns the name it got.

        Raises:
            PluginConflictError: another plugin holds ``name``.
            pluggy.PluginValidationError: the plugin's hooks do not match the hookspecs.
        """
        name = name or self.get_canonical_name(plugin)
        existing = self.get_plugin(name)
        if existing is not None and existing is not plugin:
            raise PluginConflictError(
                f"plugin name {name!r} is claimed twice: by {self.distributions.get(name) or 'an already registered plugin'}"
                f" and by {plugin!r}. Register it under another name, or block the other with {ENV_BLOCK}."
            )
        self.register(plugin, name=name)
        return name

    def plugin_infos(self) -> list[PluginInfo]:
        """Registered plugins: the built-in one first, then by name."""
        infos = []
        dists = self.distributions
        for name, plugin in self.list_name_plugin():
            if plugin is None:  # a blocked name
                continue
            hooks = tuple(sorted(c.name for c in self.get_hookcallers(plugin) or ()))
            if plugin is builtin:
                dist_name, version = NAME, __version__
            else:
                dist_name, _, version = (dists.get(name) or "").rpartition(" ")
            infos.append(PluginInfo(name, version or None, dist_name or None, hooks, plugin is builtin))
        infos.sort(key=lambda info: (not info.builtin, info.name))
        return infos


def _stderr_report(failure: PluginLoadFailure) -> None:
    print(f"{NAME}: {failure}", file=sys.stderr)


def _stderr_warn(line: str) -> None:
    print(line, file=sys.stderr)


def unknown_name_warnings(settings: PluginSettings, entry_points: Iterable[EntryPoint]) -> list[str]:
    """One warning per env var whose names match no plugin: ``CAUSALKV_DISABLE_PLUGINS``
    against the built-in plugin and every installed entry point (and its distribution),
    ``CAUSALKV_PLUGINS`` against the installed entry points; each lists the known names."""
    eps = [ep for ep in entry_points if ep.group == ENTRY_POINT_GROUP]
    installed = sorted({ep.name for ep in eps} | {d for ep in eps if (d := distribution_of(ep)[0])})
    out = []
    for var, names, known, effect in (
        (ENV_BLOCK, settings.block, [builtin.BUILTIN_PLUGIN_NAME, *installed], "blocking it does nothing"),
        (ENV_ALLOW, settings.allow or (), installed, "only the installed plugins it names load"),
    ):
        unknown = sorted(n for n in names if norm(n) not in {norm(k) for k in known})  # as the env vars match
        if unknown:
            listed = ", ".join(known) if known else "none (no causalkv plugin is installed)"
            out.append(
                f"{NAME}: warning: {var} names {', '.join(repr(n) for n in unknown)}, which no "
                f"plugin is called ({effect}); known plugins: {listed}"
            )
    return out


def _trace(pm: pluggy.PluginManager) -> None:
    """Print each hook call and its outcome to stderr, through pluggy's monitoring API."""

    def before(hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        plugins = ", ".join(i.plugin_name for i in impls) or "no implementation"
        print(f"{NAME} trace: {hook_name} (plugin {plugins}) {sorted(kwargs)}", file=sys.stderr)

    def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        exc = outcome.exception
        result = f"raised {exc!r}" if exc is not None else f"-> {outcome.get_result()!r}"
        print(f"{NAME} trace: {hook_name} {result}", file=sys.stderr)

    pm.add_hookcall_monitoring(before, after)


def make_plugin_manager(
    *,
    autoload: bool = True,
    env: Mapping[str, str] | None = None,
    entry_points: Iterable[EntryPoint] | None = None,
    report: Callable[[PluginLoadFailure], None] | None = _stderr_report,
    warn: Callable[[str], None] | None = _stderr_warn,
) -> CausalKVPluginManager:
    """A fresh manager: the hookspecs, the built-in plugin, then the installed plugins.

    Args:
        autoload: load entry points of group ``causalkv`` (also subject to
            ``CAUSALKV_DISABLE_PLUGIN_AUTOLOAD``). Tests pass False.
        env: where the ``CAUSALKV_*`` controls are read (default ``os.environ``).
        entry_points: use these instead of the installed ones (tests).
        report: called with each plugin that failed to load (default: a line on stderr).
        warn: called with a warning line for each env var naming plugins that do not exist
            (`unknown_name_warnings`; checked when entry points are loaded).

    Every line ``report`` and ``warn`` get is also kept in ``pm.reported``.
    """
    settings = PluginSettings.from_env(os.environ if env is None else env)
    pm = CausalKVPluginManager(settings)
    for name in sorted(settings.block):
        pm.set_blocked(name)
    if settings.trace:
        _trace(pm)
    if not pm.is_blocked(builtin.BUILTIN_PLUGIN_NAME):
        pm.register(builtin, name=builtin.BUILTIN_PLUGIN_NAME)
    if autoload and settings.autoload:
        eps = discover_entry_points() if entry_points is None else tuple(entry_points)

        def reported(failure: PluginLoadFailure) -> None:
            pm.reported.append(f"{NAME}: {failure}")
            if report is not None:
                report(failure)

        load_entry_points(pm, settings, entry_points=eps, report=reported)
        for line in unknown_name_warnings(settings, eps):
            pm.reported.append(line)
            if warn is not None:
                warn(line)
    return pm


_default: CausalKVPluginManager | None = None
_lock = threading.Lock()


def get_plugin_manager() -> CausalKVPluginManager:
    """The process-wide manager, built (with autoload) on first use."""
    global _default
    with _lock:
        if _default is None:
            _default = make_plugin_manager()
        return _default


def reset_plugin_manager() -> None:
    """Forget the process-wide manager; the next `get_plugin_manager()` rebuilds it."""
    global _default
    with _lock:
        _default = None
