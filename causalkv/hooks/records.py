"""Records the registration hooks return: `StageRegistration` and `CacheFactory`.

Plain frozen dataclasses with no heavy imports: a ``"module:Class"`` string is imported only
by ``load()``, so registering a stage or cache costs nothing until resolution picks it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from causalkv.caches.qvg.args import QVGKVQuantArgs
    from causalkv.caches.spec import CacheCapabilities, CausalKVCache, KVCacheSpec
    from causalkv.stages.base import CausalDenoisingStage

__all__ = ["CacheFactory", "StageRegistration", "import_object"]


def import_object(path: str) -> Any:
    """Import ``"package.module:Attr"`` (``Attr`` may be dotted: ``"mod:Outer.Inner"``).

    Raises ImportError naming the path when the module or the attribute is missing.
    """
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise ImportError(f"{path!r} is not a 'package.module:Attribute' import path")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"{path!r}: module {module_name!r} has no attribute {qualname!r}"
            ) from None
    return obj


def _describe_target(target: object) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if module and qualname:
        return f"{module}:{qualname}"
    return repr(target)


def _names(value: str | Iterable[str], what: str, owner: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise TypeError(f"{owner}: {what} must be non-empty strings, got {item!r}")
    return items


@dataclass(frozen=True)
class StageRegistration:
    """A denoising stage and the models it serves.

    Attributes:
        name: unique stage name (``causalkv plugins`` lists it; ``--stage`` picks it).
        stage: a `CausalDenoisingStage` subclass, or a ``"module:Class"`` string imported
            only when the stage is chosen or listed.
        models: model names this stage serves: diffusers ``_class_name`` values from a model
            folder's ``model_index.json`` (``"WanPipeline"``) and/or preset names
            (``"tiny-wan"``). A single string is accepted and stored as a 1-tuple.
        priority: among stages serving the same model, the highest priority wins; two
            stages serving one model at the same priority are a conflict.
    """

    name: str
    stage: type[CausalDenoisingStage] | str
    models: tuple[str, ...]
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"StageRegistration.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.stage, (str, type)):
            raise TypeError(
                f"StageRegistration {self.name!r}: stage must be a class or a 'module:Class' "
                f"string, got {self.stage!r}"
            )
        object.__setattr__(
            self, "models", _names(self.models, "models", f"StageRegistration {self.name!r}")
        )
        if not isinstance(self.priority, int):
            raise TypeError(f"StageRegistration {self.name!r}: priority must be an int")

    @property
    def target(self) -> str:
        """``"module:Class"`` of the stage, without importing it."""
        return _describe_target(self.stage)

    def load(self) -> type[CausalDenoisingStage]:
        """The stage class (imports a ``"module:Class"`` string on first use)."""
        if isinstance(self.stage, str):
            return import_object(self.stage)
        return self.stage


@dataclass(frozen=True)
class CacheFactory:
    """A KV-cache implementation and the features it supports.

    Attributes:
        name: unique cache name (``--cache NAME`` forces it).
        cache: a cache class, a ``"module:Class"`` string imported only when the cache is
            built, or any callable ``(spec: KVCacheSpec, quant: QVGKVQuantArgs | None) ->
            cache``. Every cache class takes ``(spec, quant=None)``.
        capabilities: a `causalkv.caches.spec.CacheCapabilities`, or an iterable of feature
            strings converted to one (``"pinned_sink"``, ``"head_slice"``,
            ``"recent_window"``, ``"growth"``, ``"int_indices"``, ``"quant:qvg"``, or a
            feature of your own).
        priority: among the caches that qualify, the highest priority wins unless a
            ``causalkv_select_cache_factory`` hook chooses.
    """

    name: str
    cache: type | str | Callable[..., Any]
    capabilities: CacheCapabilities
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"CacheFactory.name must be a non-empty string, got {self.name!r}")
        if not (isinstance(self.cache, str) or callable(self.cache)):
            raise TypeError(
                f"CacheFactory {self.name!r}: cache must be a class, a 'module:Class' string "
                f"or a callable, got {self.cache!r}"
            )
        if not isinstance(self.priority, int):
            raise TypeError(f"CacheFactory {self.name!r}: priority must be an int")
        caps = self.capabilities
        if not hasattr(caps, "features"):
            # the contract lives in causalkv.caches.spec (which imports torch): import it
            # only when a record is built, never when causalkv.hooks is imported
            from causalkv.caches.spec import CacheCapabilities

            features = _names(caps, "capabilities", f"CacheFactory {self.name!r}")
            object.__setattr__(self, "capabilities", CacheCapabilities(frozenset(features)))

    @property
    def target(self) -> str:
        """``"module:Class"`` (or a repr of the callable), without importing it."""
        return _describe_target(self.cache)

    def load(self) -> Callable[..., Any]:
        """The cache class or callable (imports a ``"module:Class"`` string on demand)."""
        if isinstance(self.cache, str):
            return import_object(self.cache)
        return self.cache

    def build(self, spec: KVCacheSpec, quant: QVGKVQuantArgs | None = None) -> CausalKVCache:
        """Build one layer's cache: ``load()(spec, quant)``."""
        return self.load()(spec, quant)
