"""The built-in plugin: causalkv's own stages and caches, registered through the public hooks.

Nothing here is special-cased by the resolver: block it (``CAUSALKV_DISABLE_PLUGINS=
causalkv.builtin``) and a third-party plugin can supply stages and caches under the same
names. `causalkv.stages.families` holds the families' registrations (and their option
records); each cache class declares its capabilities, which the factories read when the cache
is first resolved; the ``qvg`` factory declares the QVG settings record
(`causalkv.caches.qvg.options.QVGKVQuantArgs`). Stages and caches are named as
``"module:Class"`` strings: registering them imports no torch (``causalkv --help``).
"""

from __future__ import annotations

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.hooks import CacheFactory, StageRegistration, hookimpl
from causalkv.stages import families

__all__ = ["BUILTIN_PLUGIN_NAME", "CACHES", "STAGES"]

#: the name this module is registered under in every causalkv plugin manager
BUILTIN_PLUGIN_NAME = "causalkv.builtin"

STAGES: tuple[StageRegistration, ...] = families.STAGES

#: quant off -> dense (priority 10); QVG only where the dense cache does not qualify
CACHES: tuple[CacheFactory, ...] = (
    CacheFactory("dense", "causalkv.caches.dense:DenseCausalKVCache", priority=10),
    CacheFactory("qvg", "causalkv.caches.qvg.packed:QVGPackedCausalKVCache", priority=0,
                 options=QVGKVQuantArgs),
)


@hookimpl
def causalkv_register_stages() -> tuple[StageRegistration, ...]:
    return STAGES


@hookimpl
def causalkv_register_cache_factories() -> tuple[CacheFactory, ...]:
    return CACHES
