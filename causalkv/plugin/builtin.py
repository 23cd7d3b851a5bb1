"""The built-in plugin: causalkv's own stages and caches, registered through the public hooks.

Nothing here is special-cased by the resolver: block it (``CAUSALKV_DISABLE_PLUGINS=
causalkv.builtin``) and a third-party plugin can supply stages and caches under the same
names. Classes are given as ``"module:Class"`` strings, so registering imports nothing; the
QVG cache module is imported only when a QVG cache is built.
"""

from __future__ import annotations

from functools import cache

from causalkv.hooks import CacheFactory, StageRegistration, hookimpl

__all__ = ["BUILTIN_PLUGIN_NAME", "STAGES", "builtin_caches"]

#: the name this module is registered under in every causalkv plugin manager
BUILTIN_PLUGIN_NAME = "causalkv.builtin"

_CACHE_FEATURES = ("pinned_sink", "head_slice", "recent_window", "growth", "int_indices")

STAGES: tuple[StageRegistration, ...] = (
    StageRegistration(
        "self-forcing-wan",
        "causalkv.stages.wan:WanCausalDMDStage",
        models=("tiny-wan", "SelfForcingWanPipeline", "CausVidPipeline", "WanPipeline"),
    ),
    StageRegistration(
        "longlive",
        "causalkv.stages.longlive:LongLiveStage",
        models=("tiny-longlive", "LongLivePipeline"),
    ),
    StageRegistration(
        "longlive2",
        "causalkv.stages.longlive2:LongLive2Stage",
        models=("tiny-longlive2", "LongLive2Pipeline"),
    ),
    StageRegistration(
        "lingbot-world",
        "causalkv.stages.lingbot:LingBotWorldStage",
        models=("tiny-lingbot", "LingBotWorldPipeline"),
    ),
)


@cache
def builtin_caches() -> tuple[CacheFactory, ...]:
    """The dense (priority 10) and QVG (priority 0) cache factories: quant off -> dense."""
    # built on first call: CacheFactory converts capabilities with causalkv.caches.spec,
    # which imports torch; keep `import causalkv.plugin.builtin` itself light
    return (
        CacheFactory(
            "dense",
            "causalkv.caches.dense:DenseCausalKVCache",
            capabilities=_CACHE_FEATURES,
            priority=10,
        ),
        CacheFactory(
            "qvg",
            "causalkv.caches.qvg.packed:QVGPackedCausalKVCache",
            capabilities=(*_CACHE_FEATURES, "quant:qvg"),
            priority=0,
        ),
    )


@hookimpl
def causalkv_register_stages() -> tuple[StageRegistration, ...]:
    return STAGES


@hookimpl
def causalkv_register_cache_factories() -> tuple[CacheFactory, ...]:
    return builtin_caches()
