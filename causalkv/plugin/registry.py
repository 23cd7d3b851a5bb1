"""Collect stage registrations, cache factories, codec settings and host classes from every
plugin; set a faulty plugin aside.

A plugin whose registration hook raises or returns junk, or whose records claim a stage,
cache or model (at one priority) another plugin holds, or a flag another record or the host
holds, is set aside as a whole (`PluginLoadFailure`, one line naming it and the fix); the
plugins before it, the built-in one first, keep everything they registered. This is the one
conflict check of the registries, and causalkv's runtime and its bridges (sglang, vLLM-Omni)
read the same `Registry`: a host class (`HostClassRegistration`) is served in its host when a
plugin that is not set aside registers it (`Registry.host_classes`). Codec settings join
`causalkv.caches.codecs`'s registry (the one the options, the caches and the planner read), a
name taken there sets the plugin aside too, as does a host class naming a codec or a cache factory
no plugin registers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from causalkv.caches.codecs import codec_names, register_codec, unregister_codec
from causalkv.errors import (
    ConfigError,
    ImportPathError,
    InvalidTypeError,
    describe_exception,
    print_stderr,
)
from causalkv.hooks import (
    NAME,
    CacheFactory,
    CodecRegistration,
    HostClassRegistration,
    Preset,
    StageRegistration,
)
from causalkv.plugin.calls import plugin_callers
from causalkv.plugin.errors import (
    PluginConflictError,
    PluginLoadFailure,
    PluginSetAsideError,
    ResolutionError,
)
from causalkv.plugin.manager import ENV_BLOCK, CausalKVPluginManager, get_plugin_manager

if TYPE_CHECKING:
    from causalkv.stages.base import CausalDenoisingStage

__all__ = ["CacheEntry", "Registry", "StageEntry", "collect", "collected"]


#: the base every stage derives from, by name: a loaded stage class brought it in, so the
#: check needs no import of it (`causalkv.stages.base` imports torch; collecting does not)
STAGE_BASE = "causalkv.stages.base.CausalDenoisingStage"


@dataclass(frozen=True)
class StageEntry:
    """A stage registration and the plugin that returned it."""

    registration: StageRegistration
    plugin: str

    @property
    def name(self) -> str:
        return self.registration.name

    def load(self) -> type[CausalDenoisingStage]:
        """The stage class, checked to be a `CausalDenoisingStage` subclass.

        Raises:
            ImportError: the ``"module:Class"`` cannot be imported (names stage and plugin).
            TypeError: the target is not a `CausalDenoisingStage` subclass.
        """
        reg = self.registration
        try:
            cls = reg.load()
        except ImportError as exc:
            raise ImportPathError(
                f"stage {reg.name!r} (plugin {self.plugin!r}) cannot be imported from {reg.target!r}: {exc}"
            ) from exc
        if not (isinstance(cls, type) and any(f"{c.__module__}.{c.__qualname__}" == STAGE_BASE for c in cls.__mro__)):
            raise InvalidTypeError(
                f"stage {reg.name!r} (plugin {self.plugin!r}): {reg.target!r} is {cls!r}, not "
                f"a subclass of causalkv.stages.base.CausalDenoisingStage"
            )
        return cls

    def supports(self, feature: str) -> bool:
        """Does the stage declare ``feature`` (``"qvg"`` or ``"multi_shot"``)? False if it cannot load."""
        try:
            cls = self.load()
        except (ImportError, TypeError):
            return False
        return cls._supports_qvg_kv_cache_quantization() if feature == "qvg" else cls.supports_multi_shot()

    def describe(self) -> str:
        reg = self.registration
        return f"{self.name} (plugin {self.plugin}, priority {reg.priority}, serves {', '.join(reg.served)})"


@dataclass(frozen=True)
class CacheEntry:
    """A cache factory and the plugin that returned it."""

    factory: CacheFactory
    plugin: str

    @property
    def name(self) -> str:
        return self.factory.name


@dataclass(frozen=True)
class Registry:
    """Every registered stage and cache, in plugin registration order, and the plugins set
    aside while collecting them (``failures``)."""

    stages: tuple[StageEntry, ...]
    caches: tuple[CacheEntry, ...]
    failures: tuple[PluginLoadFailure, ...] = ()
    #: (codec registration, plugin) of the plugins' codec settings (the built-ins are
    #: `causalkv.caches.codecs`'s own)
    codecs: tuple[tuple[CodecRegistration, str], ...] = ()
    #: (host registration, plugin) of the classes of other hosts causalkv serves there
    hosts: tuple[tuple[HostClassRegistration, str], ...] = ()

    def _named(self, kind: str, name: str, entries: tuple[Any, ...]) -> Any:
        found = next((e for e in entries if e.name == name), None)
        if found is None:
            choices = ", ".join(e.name for e in entries) or "(none)"
            raise ResolutionError(f"no {kind} named {name!r}. Choose one of: {choices}")
        return found

    def stage(self, name: str) -> StageEntry:
        """The stage registered as ``name``; ResolutionError listing the stages otherwise."""
        return self._named("stage", name, self.stages)

    def cache(self, name: str) -> CacheEntry:
        """The cache registered as ``name``; ResolutionError listing the caches otherwise."""
        return self._named("cache", name, self.caches)

    def serving(self, *models: str) -> tuple[StageEntry, ...]:
        """Stages serving any of ``models``, best first: the highest priority, then the
        earliest of ``models`` served, then registration order."""
        found = [e for e in self.stages if set(models) & set(e.registration.served)]
        first = lambda e: min(models.index(m) for m in models if m in e.registration.served)  # noqa: E731
        return tuple(sorted(found, key=lambda e: (-e.registration.priority, first(e))))  # stable

    def served_models(self) -> list[str]:
        return sorted({m for e in self.stages for m in e.registration.served})

    def host_classes(self, host: str) -> dict[str, tuple[HostClassRegistration, str]]:
        """What ``host``'s bridge serves: each model (host pipeline name) -> the registration
        of the highest priority serving it there, and its plugin."""
        ranked = sorted((e for e in self.hosts if e[0].host == host), key=lambda e: e[0].priority)
        return {m: e for e in ranked for m in e[0].models}

    def presets(self) -> dict[str, tuple[StageEntry, Preset]]:
        """Preset name -> (the stage entry registering it, the preset), in registration order."""
        return {p.name: (e, p) for e in self.stages for p in e.registration.presets}


def _records(hook: str, result: Any, kind: type) -> tuple[Any, ...]:
    """A registration hook's result (None, one record or an iterable of them) as a tuple."""
    try:
        items = () if result is None else (result,) if isinstance(result, kind) else tuple(result)
    except TypeError:  # not iterable: refused below
        items = (result,)
    if bad := [item for item in items if not isinstance(item, kind)]:
        raise InvalidTypeError(
            f"{hook}() returned {bad[0]!r}; expected an iterable of {kind.__name__} records "
            f"(from causalkv.hooks import {kind.__name__})"
        )
    return items


#: each record kind: the registration hook returning it, what a set-aside message calls it
_KINDS = {StageRegistration: ("causalkv_register_stages", "stage"),
          CacheFactory: ("causalkv_register_cache_factories", "cache"),
          HostClassRegistration: ("causalkv_register_host_classes", "host class"),
          CodecRegistration: ("causalkv_register_codecs", "codec")}


def _claims(
    r: StageRegistration | CacheFactory | CodecRegistration | HostClassRegistration,
) -> list[tuple[tuple[Any, ...], str, str]]:
    """``(key, what it is, the fix)`` of each thing a record claims: its name, the models it
    serves at its priority (a stage; a host class, in its host), the flags of its options record."""
    if isinstance(r, CodecRegistration):
        return [(("codec", r.name), f"codec setting {r.name!r}", "rename the codec setting")]
    if isinstance(r, HostClassRegistration):
        return [(("host", r.host, m, r.priority), f"{r.host} model {m!r} at priority {r.priority}",
                 "give the registration another priority (the higher wins)") for m in r.models]
    if isinstance(r, StageRegistration):
        out = [(("stage", r.name), f"stage name {r.name!r}", "rename the stage")]
        out += [(("model", m, r.priority), f"model {m!r} at priority {r.priority}",
                 "give the registration another priority (the higher wins)") for m in r.served]
    else:
        out = [(("cache", r.name), f"cache name {r.name!r}", "rename the cache")]
    flags = r.options.flags() if r.options is not None else ()
    return out + [(("flag", f), f"flag {f} ({r.options.title})", "rename the flag") for f in flags]


def collect(
    pm: CausalKVPluginManager | None = None,
    *,
    reserved_flags: Iterable[str] = (),
    strict: bool = False,
    report: Callable[[PluginLoadFailure], None] | None = lambda f: print_stderr(f"{NAME}: warning: {f}"),
) -> Registry:
    """Run the registration hooks of every plugin of ``pm`` (default: the process-wide manager,
    `get_plugin_manager`, which loads the installed plugins under the ``CAUSALKV_*`` switches);
    set aside each plugin that fails or clashes (module docstring; ``reserved_flags``: the
    host's own flags, e.g. ``--seed``), passing each to ``report`` (default: one line on
    stderr). ``collect()`` is how a script loads the plugins: their codec settings join the
    codec registry, so every API that takes a codec name takes theirs.

    Raises:
        PluginConflictError, InvalidTypeError, PluginSetAsideError: with ``strict``, for the
            first plugin that would be set aside (the message names it and the fix).
    """
    pm = get_plugin_manager() if pm is None else pm
    found: dict[str, list[Any]] = {}
    failed: dict[str, PluginLoadFailure] = {}

    def set_aside(plugin: str, error: str, fix: str | None, kind: type[Exception]) -> None:
        failure = PluginLoadFailure(plugin, pm.distributions.get(plugin), error, fix)
        if strict:
            raise kind(f"{failure} (--strict-plugins)")
        failed.setdefault(plugin, failure)

    for kind, (hook, _) in _KINDS.items():
        for plugin, caller in plugin_callers(pm, hook):
            try:
                results = caller()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the host down
                set_aside(plugin, f"{hook}() raised {describe_exception(exc)}", None, PluginSetAsideError)
                continue
            try:
                found.setdefault(plugin, []).extend(_records(hook, results[0] if results else None, kind))
            except InvalidTypeError as exc:
                set_aside(plugin, str(exc), None, InvalidTypeError)
    held = {("flag", f): (f"{NAME}'s own flags", None) for f in reserved_flags}
    # every codec and cache a host class may name: causalkv's, and those any plugin's records register
    known = {"codec": {*codec_names(), *(r.name for rs in found.values() for r in rs if isinstance(r, CodecRegistration))},
             "cache": {r.name for rs in found.values() for r in rs if isinstance(r, CacheFactory)}}
    kept: list[tuple[Any, str]] = []  # (record, plugin) of the plugins not set aside
    for plugin, records in found.items():
        mine: dict[tuple[Any, ...], tuple[str, Any]] = {}
        clash = None
        for r in records if plugin not in failed else ():
            for key, what, fix in _claims(r):
                other = held.get(key) or mine.get(key)
                options = getattr(r, "options", None)
                if other is not None and not (key[0] == "flag" and other[1] is options):
                    clash = clash or (f"its {what} is taken by {other[0]}", fix)
                mine[key] = (f"{_KINDS[type(r)][1]} {r.name!r} of plugin {plugin!r}", options)
            for what in ("codec", "cache") if isinstance(r, HostClassRegistration) else ():
                if (name := getattr(r, what)) is not None and name not in known[what]:
                    clash = clash or (f"its host class {r.target} names {what} {name!r}, which no plugin registers "
                                      f"({what}s: {', '.join(sorted(known[what]))})", f"name a registered {what}")
        added: list[str] = []  # the codec settings this plugin adds: all of them, or none
        for r in records if clash is None and plugin not in failed else ():
            if isinstance(r, CodecRegistration) and clash is None:
                new = r.name not in codec_names()  # the same setting again is a no-op, kept
                try:
                    register_codec(r.name, r.codec, help=r.help, source=plugin, **dict(r.params))
                    added += [r.name] if new else []
                except ConfigError as exc:
                    clash = (str(exc), "rename the codec setting")
        if clash is not None:
            for name in added:
                unregister_codec(name)
            set_aside(plugin, clash[0], f"{clash[1]}, or turn the plugin off with {ENV_BLOCK}={plugin}", PluginConflictError)
        if plugin in failed:
            continue
        held.update(mine)
        kept += [(r, plugin) for r in records]
    for failure in failed.values() if report is not None else ():
        report(failure)
    of = lambda kind: tuple((r, p) for r, p in kept if isinstance(r, kind))  # noqa: E731
    return Registry(tuple(StageEntry(*e) for e in of(StageRegistration)), tuple(CacheEntry(*e) for e in of(CacheFactory)),
                    tuple(failed.values()), of(CodecRegistration), of(HostClassRegistration))


#: the registry `collected` made for each plugin manager (one per process; tests rebuild it)
_COLLECTED: weakref.WeakKeyDictionary[CausalKVPluginManager, Registry] = weakref.WeakKeyDictionary()


def collected(pm: CausalKVPluginManager | None = None) -> Registry:
    """`collect` once per plugin manager (default: the process-wide one), then the same
    `Registry`: what a host's bridge reads all process long (its codec settings, the host
    classes it serves), collected at its first need, before any weights load."""
    pm = get_plugin_manager() if pm is None else pm
    if pm not in _COLLECTED:
        _COLLECTED[pm] = collect(pm)
    return _COLLECTED[pm]
