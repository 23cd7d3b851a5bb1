"""The plugin manager: the env var controls, entry-point discovery, and broken plugins set aside.

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
plugin *or* distribution name, and a plugin that fails to import or validate, or claims a
name another plugin holds, set aside with one line (`PluginLoadFailure`) while the others load.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from causalkv import env as envvars
from causalkv.errors import print_stderr
from causalkv.hooks import ENTRY_POINT_GROUP, ENV_PREFIX, HOOK_NAMES, NAME, specs
from causalkv.plugin import builtin
from causalkv.plugin.errors import PluginConflictError, PluginLoadFailure

__all__ = [
    "ENV_ALLOW", "ENV_AUTOLOAD_OFF", "ENV_BLOCK", "ENV_TRACE", "SWITCHES", "CausalKVPluginManager", "PluginSettings",
    "discover_entry_points", "get_plugin_manager", "make_plugin_manager",
    "reset_plugin_manager", "unknown_name_warnings",
]

ENV_ALLOW = f"{ENV_PREFIX}_PLUGINS"
ENV_BLOCK = f"{ENV_PREFIX}_DISABLE_PLUGINS"
ENV_AUTOLOAD_OFF = f"{ENV_PREFIX}_DISABLE_PLUGIN_AUTOLOAD"
ENV_TRACE = f"{ENV_PREFIX}_TRACE_PLUGINS"
#: the plugin switches the ``causalkv`` command refuses up front when set to another value
#: (`causalkv.env.check_switches`); `PluginSettings.from_env` reads them leniently
SWITCHES = (
    envvars.Switch(ENV_TRACE, envvars.FLAG_VALUES, "1 prints every plugin hook call, 0 (or unset) does not"),
    envvars.Switch(ENV_AUTOLOAD_OFF, envvars.FLAG_VALUES,
                   "1 loads no plugin entry point, 0 (or unset) loads them"),
)


def norm(name: str) -> str:
    """PEP 503 normalization, so ``My_Plugin`` matches distribution ``my-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_of(ep: EntryPoint) -> tuple[str | None, str | None]:
    """``(distribution name, "<name> <version>")`` of an entry point, or ``(None, None)``."""
    dist = getattr(ep, "dist", None)  # an EntryPoint made in-process has none
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
        """The controls in ``env`` (`causalkv.env`'s rules; a switch set to a value it does not
        take reads as unset here: the ``causalkv`` command refuses it up front)."""
        return cls(
            allow=envvars.names(ENV_ALLOW, env),
            block=envvars.names(ENV_BLOCK, env) or frozenset(),
            autoload=not envvars.flag(ENV_AUTOLOAD_OFF, default=False, environ=env, strict=False),
            trace=envvars.flag(ENV_TRACE, default=False, environ=env, strict=False),
        )

    def wants(self, ep: EntryPoint) -> bool:
        """Is this entry point allowed and not blocked (by its name or its distribution's)?"""
        keys = {norm(ep.name)} | ({norm(d)} if (d := distribution_of(ep)[0]) else set())
        hit = lambda names: bool(keys & {norm(n) for n in names})  # noqa: E731
        return not hit(self.block) and (self.allow is None or hit(self.allow))


def discover_entry_points() -> tuple[EntryPoint, ...]:
    """The installed entry points of group ``causalkv``."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


class CausalKVPluginManager(pluggy.PluginManager):
    """A pluggy manager for project ``causalkv`` that sets broken plugins aside.

    Attributes:
        load_failures: plugins set aside while loading (import, validation, a claimed name).
        missing_allowed: names in ``CAUSALKV_PLUGINS`` that matched no installed plugin.
        settings: the env var controls this manager was built under.
    """

    def __init__(self, settings: PluginSettings | None = None) -> None:
        super().__init__(NAME)
        self.add_hookspecs(specs)
        self.settings = settings or PluginSettings()
        self.load_failures: list[PluginLoadFailure] = []
        self.missing_allowed: tuple[str, ...] = ()

    @property
    def distributions(self) -> dict[str, str]:
        """Plugin name -> ``"<dist> <version>"`` of the plugins loaded from entry points."""
        return {name: f"{dist.project_name} {dist.version}" for plugin, dist in self.list_plugin_distinfo()
                if (name := self.get_name(plugin)) is not None}

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

    def claimed(self, name: str, by: str, holder: str | None = None) -> str | None:
        """The one name-conflict check: why ``by`` cannot take plugin name ``name``, held by
        ``holder`` or by a registered plugin (None: it can)."""
        if holder is None and self.get_plugin(name) is not None:
            holder = self.distributions.get(name) or "an already registered plugin"
        return None if holder is None else f"plugin name {name!r} is claimed twice: by {holder} and by {by}"

    def register_plugin(self, plugin: object, name: str | None = None) -> str:
        """Register an in-process plugin (e.g. in a test); returns the name it got.

        Raises:
            PluginConflictError: another plugin holds ``name``.
            pluggy.PluginValidationError: the plugin's hooks do not match the hookspecs.
        """
        name = name or self.get_canonical_name(plugin)
        if self.get_plugin(name) is not plugin and (why := self.claimed(name, repr(plugin))):
            raise PluginConflictError(f"{why}. Register it under another name, or block the other with {ENV_BLOCK}.")
        self.register(plugin, name=name)
        return name

    def load_entry_points(self, eps: Iterable[EntryPoint]) -> None:
        """Import and register the wanted entry points of group ``causalkv``; each one that
        fails to import or validate, or claims a name another holds, is set aside (recorded in
        ``load_failures``) while the others load."""
        eps = [ep for ep in eps if ep.group == ENTRY_POINT_GROUP]
        wanted = [ep for ep in eps if self.settings.wants(ep) and not self.is_blocked(ep.name)]
        # blocked ones claim nothing: two distributions declaring one name, one blocked, load
        where = lambda ep: distribution_of(ep)[1] or repr(ep.value)  # noqa: E731
        for ep in wanted:
            other = next((where(o) for o in wanted if o.name == ep.name and o is not ep), None)
            why = self.claimed(ep.name, where(ep), other)
            try:
                if why:
                    raise PluginConflictError(why)
                if distribution_of(ep)[0] is not None:  # installed: pluggy's loader
                    self.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
                else:
                    self.register(ep.load(), name=ep.name)
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the host down
                fix = f"uninstall one, or block one distribution with {ENV_BLOCK}=<its name>" if why else None
                self.load_failures.append(PluginLoadFailure(ep.name, distribution_of(ep)[1], f"{type(exc).__name__}: {exc}", fix))
        self.missing_allowed = tuple(_unknown(self.settings.allow or (), _installed(eps)))


def _installed(eps: Iterable[EntryPoint]) -> list[str]:
    """The plugin and distribution names of ``eps`` (of group ``causalkv``), sorted."""
    eps = [ep for ep in eps if ep.group == ENTRY_POINT_GROUP]
    return sorted({ep.name for ep in eps} | {d for ep in eps if (d := distribution_of(ep)[0])})


def _unknown(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """``names`` that match none of ``known``, as the env vars match (`norm`), sorted."""
    return sorted(n for n in names if norm(n) not in {norm(k) for k in known})


def unknown_name_warnings(settings: PluginSettings, entry_points: Iterable[EntryPoint]) -> list[str]:
    """One warning per env var whose names match no plugin: ``CAUSALKV_DISABLE_PLUGINS``
    against the built-in plugin and every installed entry point (and its distribution),
    ``CAUSALKV_PLUGINS`` against the installed entry points; each lists the known names."""
    installed, out = _installed(entry_points), []
    for var, names, known, effect in (
        (ENV_BLOCK, settings.block, [builtin.BUILTIN_PLUGIN_NAME, *installed], "blocking it does nothing"),
        (ENV_ALLOW, settings.allow or (), installed, "only the installed plugins it names load"),
    ):
        if unknown := _unknown(names, known):
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
        print_stderr(f"{NAME} trace: {hook_name} (plugin {plugins}) {sorted(kwargs)}")

    def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        exc = outcome.exception
        result = f"raised {exc!r}" if exc is not None else f"-> {outcome.get_result()!r}"
        print_stderr(f"{NAME} trace: {hook_name} {result}")

    pm.add_hookcall_monitoring(before, after)


def make_plugin_manager(
    *,
    autoload: bool = True,
    env: Mapping[str, str] | None = None,
    entry_points: Iterable[EntryPoint] | None = None,
    warn: Callable[[str], None] | None = print_stderr,
) -> CausalKVPluginManager:
    """A fresh manager: the hookspecs, the built-in plugin, then the installed plugins.

    Args:
        autoload: load entry points of group ``causalkv`` (also subject to
            ``CAUSALKV_DISABLE_PLUGIN_AUTOLOAD``). Tests pass False.
        env: where the ``CAUSALKV_*`` controls are read (default ``os.environ``).
        entry_points: use these instead of the installed ones (tests).
        warn: called with each line (None: silent): a plugin set aside (the records are in
            ``pm.load_failures``), an env var naming plugins that do not exist
            (`unknown_name_warnings`).
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
        pm.load_entry_points(eps)
        lines = [f"{NAME}: warning: {f}" for f in pm.load_failures] + unknown_name_warnings(settings, eps)
        for line in lines if warn is not None else ():
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
