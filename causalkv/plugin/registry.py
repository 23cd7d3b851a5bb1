"""Collect stage registrations and cache factories from every plugin, and detect conflicts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pluggy

from causalkv.hooks import CacheFactory, StageRegistration
from causalkv.plugin.errors import PluginConflictError
from causalkv.plugin.loader import ENV_BLOCK

__all__ = ["CacheEntry", "Registry", "StageEntry", "call_each", "collect"]


@dataclass(frozen=True)
class StageEntry:
    """A stage registration and the plugin that returned it."""

    registration: StageRegistration
    plugin: str

    @property
    def name(self) -> str:
        return self.registration.name


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
    """Every registered stage and cache, in plugin registration order."""

    stages: tuple[StageEntry, ...]
    caches: tuple[CacheEntry, ...]

    def stage(self, name: str) -> StageEntry | None:
        return next((e for e in self.stages if e.name == name), None)

    def cache(self, name: str) -> CacheEntry | None:
        return next((e for e in self.caches if e.name == name), None)

    def serving(self, model: str) -> tuple[StageEntry, ...]:
        """Stages serving ``model``, highest priority first (registration order breaks ties)."""
        found = [e for e in self.stages if model in e.registration.models]
        return tuple(sorted(found, key=lambda e: -e.registration.priority))

    def served_models(self) -> list[str]:
        return sorted({m for e in self.stages for m in e.registration.models})


def call_each(
    pm: pluggy.PluginManager, hook_name: str, **kwargs: Any
) -> Iterator[tuple[str, Any]]:
    """Call each implementation of a hook and yield ``(plugin name, result)``.

    pluggy's own call merges results and forgets who returned what; registries need the
    plugin of every record to name both sides of a conflict. Implementations run in the
    order pluggy lists them (registration order; ``trylast`` ones first, ``tryfirst`` ones
    last); wrappers are skipped. A raising implementation is re-raised naming its plugin.
    """
    caller = getattr(pm.hook, hook_name)
    names = {id(plugin): name for name, plugin in pm.list_name_plugin()}
    for impl in caller.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        name = names.get(id(impl.plugin)) or repr(impl.plugin)
        trace = pm.trace.root.get("hook")  # same lines as pluggy's enable_tracing()
        trace.root.indent += 1
        trace(f"{hook_name} (plugin {name})", kwargs)
        try:
            result = impl.function(*(kwargs[arg] for arg in impl.argnames))
        except Exception as exc:
            trace.root.indent -= 1
            raise RuntimeError(
                f"plugin {name!r}: {hook_name}() raised {type(exc).__name__}: {exc}"
            ) from exc
        trace("finish", hook_name, "-->", result)
        trace.root.indent -= 1
        yield name, result


def _records(plugin: str, hook_name: str, result: Any, kind: type) -> Iterable[Any]:
    if result is None:
        return ()
    items = (result,) if isinstance(result, kind) else result
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(
            f"plugin {plugin!r}: {hook_name}() must return an iterable of {kind.__name__}, "
            f"got {result!r}"
        ) from None
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(
                f"plugin {plugin!r}: {hook_name}() returned {item!r}; expected "
                f"{kind.__name__} records (from causalkv.hooks import {kind.__name__})"
            )
    return items


def _conflict(what: str, a: str, b: str, fix: str) -> PluginConflictError:
    return PluginConflictError(
        f"{what} by both plugin {a!r} and plugin {b!r}. Fix: {fix}, or uninstall one plugin, "
        f"or block it with {ENV_BLOCK}={b}."
    )


def collect(pm: pluggy.PluginManager) -> Registry:
    """Run the registration hooks of every plugin and check for conflicts.

    Raises:
        PluginConflictError: two stages share a name, two stages serve one model at the
            same priority, or two caches share a name; the message names both plugins.
    """
    stages: list[StageEntry] = []
    by_name: dict[str, StageEntry] = {}
    by_model: dict[tuple[str, int], StageEntry] = {}
    for plugin, result in call_each(pm, "causalkv_register_stages"):
        for reg in _records(plugin, "causalkv_register_stages", result, StageRegistration):
            entry = StageEntry(reg, plugin)
            if reg.name in by_name:
                other = by_name[reg.name]
                raise _conflict(
                    f"stage {reg.name!r} is registered ({other.registration.target} and "
                    f"{reg.target})",
                    other.plugin,
                    plugin,
                    "rename one stage",
                )
            by_name[reg.name] = entry
            for model in reg.models:
                key = (model, reg.priority)
                if key in by_model:
                    other = by_model[key]
                    raise _conflict(
                        f"model {model!r} is served at priority {reg.priority} by stage "
                        f"{other.name!r} and by stage {reg.name!r}, registered",
                        other.plugin,
                        plugin,
                        "give one registration a different priority (the higher wins)",
                    )
                by_model[key] = entry
            stages.append(entry)
    caches: list[CacheEntry] = []
    by_cache: dict[str, CacheEntry] = {}
    for plugin, result in call_each(pm, "causalkv_register_cache_factories"):
        for factory in _records(plugin, "causalkv_register_cache_factories", result, CacheFactory):
            if factory.name in by_cache:
                other = by_cache[factory.name]
                raise _conflict(
                    f"cache {factory.name!r} is registered ({other.factory.target} and "
                    f"{factory.target})",
                    other.plugin,
                    plugin,
                    "rename one cache",
                )
            entry = CacheEntry(factory, plugin)
            by_cache[factory.name] = entry
            caches.append(entry)
    return Registry(tuple(stages), tuple(caches))
