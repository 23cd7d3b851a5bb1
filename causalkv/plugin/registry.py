"""Collect stage registrations and cache factories from every plugin, and detect conflicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from causalkv.errors import ImportPathError, InvalidTypeError
from causalkv.hooks import CacheFactory, Preset, StageRegistration
from causalkv.plugin.calls import call_each
from causalkv.plugin.errors import PluginConflictError, ResolutionError
from causalkv.plugin.loader import ENV_BLOCK
from causalkv.stages.base import CausalDenoisingStage

__all__ = ["CacheEntry", "Registry", "StageEntry", "call_each", "collect"]


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
                f"stage {reg.name!r} (plugin {self.plugin!r}) cannot be imported from "
                f"{reg.target!r}: {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, CausalDenoisingStage)):
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


def _named(kind: str, name: str, entries: tuple[Any, ...]) -> Any:
    for e in entries:
        if e.name == name:
            return e
    choices = ", ".join(e.name for e in entries) or "(none)"
    raise ResolutionError(f"no {kind} named {name!r}. Choose one of: {choices}")


@dataclass(frozen=True)
class Registry:
    """Every registered stage and cache, in plugin registration order."""

    stages: tuple[StageEntry, ...]
    caches: tuple[CacheEntry, ...]

    def stage(self, name: str) -> StageEntry:
        """The stage registered as ``name``; ResolutionError listing the stages otherwise."""
        return _named("stage", name, self.stages)

    def cache(self, name: str) -> CacheEntry:
        """The cache registered as ``name``; ResolutionError listing the caches otherwise."""
        return _named("cache", name, self.caches)

    def serving(self, model: str) -> tuple[StageEntry, ...]:
        """Stages serving ``model``, highest priority first (registration order breaks ties)."""
        found = [e for e in self.stages if model in e.registration.served]
        return tuple(sorted(found, key=lambda e: -e.registration.priority))

    def served_models(self) -> list[str]:
        return sorted({m for e in self.stages for m in e.registration.served})

    def presets(self) -> dict[str, tuple[StageEntry, Preset]]:
        """Preset name -> (the stage entry registering it, the preset), in registration order."""
        return {p.name: (e, p) for e in self.stages for p in e.registration.presets}

    def defaults(self, model: str) -> Mapping[str, Any] | None:
        """Model-config defaults of the best stage serving ``model`` (None if none serves it)."""
        serving = self.serving(model)
        return serving[0].registration.defaults if serving else None


def _records(plugin: str, hook_name: str, result: Any, kind: type) -> Iterable[Any]:
    if result is None:
        return ()
    try:
        items = (result,) if isinstance(result, kind) else tuple(result)
    except TypeError:
        items = (result,)
    for item in items:
        if not isinstance(item, kind):
            raise InvalidTypeError(
                f"plugin {plugin!r}: {hook_name}() returned {item!r}; expected an iterable of "
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
    stages: dict[str, StageEntry] = {}
    by_model: dict[tuple[str, int], StageEntry] = {}
    for plugin, result in call_each(pm, "causalkv_register_stages"):
        for reg in _records(plugin, "causalkv_register_stages", result, StageRegistration):
            entry = StageEntry(reg, plugin)
            if reg.name in stages:
                other = stages[reg.name]
                what = f"stage {reg.name!r} is registered ({other.registration.target} and {reg.target})"
                raise _conflict(what, other.plugin, plugin, "rename one stage")
            stages[reg.name] = entry
            for model in reg.served:
                other = by_model.setdefault((model, reg.priority), entry)
                if other is not entry:
                    what = (
                        f"model {model!r} is served at priority {reg.priority} by stage "
                        f"{other.name!r} and by stage {reg.name!r}, registered"
                    )
                    raise _conflict(
                        what, other.plugin, plugin,
                        "give one registration a different priority (the higher wins)",
                    )
    caches: dict[str, CacheEntry] = {}
    for plugin, result in call_each(pm, "causalkv_register_cache_factories"):
        for factory in _records(plugin, "causalkv_register_cache_factories", result, CacheFactory):
            if factory.name in caches:
                other = caches[factory.name]
                what = f"cache {factory.name!r} is registered ({other.factory.target} and {factory.target})"
                raise _conflict(what, other.plugin, plugin, "rename one cache")
            caches[factory.name] = CacheEntry(factory, plugin)
    return Registry(tuple(stages.values()), tuple(caches.values()))
