"""The built-in plugin: causalkv's own stages, caches and served host classes, registered
through the public hooks.

Nothing here is special-cased by the resolver: block it (``CAUSALKV_DISABLE_PLUGINS=
causalkv.builtin``) and a third-party plugin can supply stages and caches under the same
names. `causalkv.stages.families` holds the families' registrations (and their option
records); each cache class declares its capabilities, which the factories read when the cache
is first resolved; the ``qvg`` factory declares the QVG settings record
(`causalkv.caches.qvg.options.QVGKVQuantArgs`). Stages and caches are named as
``"module:Class"`` strings: registering them imports no torch (``causalkv --help``).

`HOSTS` are the classes of other hosts the bridges serve (`HostClassRegistration`: names only,
imported by that host's bridge alone), each with the cache factory that builds its caches:
sglang's three causal stages (whose methods `causalkv.sglang.hooks` wraps) with ``sglang``
(`causalkv.sglang.cache.SGLangQVGKVCache`), and, in vLLM-Omni, LingBot-World's pipeline replaced
by causalkv's subclass, with ``qvg``.
"""

from __future__ import annotations

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.hooks import CacheFactory, HostClassRegistration, StageRegistration, hookimpl
from causalkv.stages import families

__all__ = ["BUILTIN_PLUGIN_NAME", "CACHES", "HOSTS", "STAGES"]

#: the name this module is registered under in every causalkv plugin manager
BUILTIN_PLUGIN_NAME = "causalkv.builtin"

STAGES: tuple[StageRegistration, ...] = families.STAGES

#: quant off -> dense (priority 10); QVG only where the dense cache does not qualify. ``sglang``
#: builds sglang's blocks (``host:sglang``: never causalkv's runtime's; its capabilities are
#: given, so listing it imports no sglang)
CACHES: tuple[CacheFactory, ...] = (
    CacheFactory("dense", "causalkv.caches.dense:DenseCausalKVCache", priority=10),
    CacheFactory("qvg", "causalkv.caches.qvg.packed:QVGPackedCausalKVCache", priority=0,
                 options=QVGKVQuantArgs),
    CacheFactory("sglang", "causalkv.sglang.cache:SGLangQVGKVCache",
                 capabilities=("host:sglang", "quant:qvg", "pinned_sink", "growth", "probe_commit")),
)

_SGLANG = "sglang.multimodal_gen.runtime.pipelines_core.stages"
HOSTS: tuple[HostClassRegistration, ...] = (
    HostClassRegistration("sglang", f"{_SGLANG}.model_specific_stages.longlive2:LongLive2CausalDenoisingStage",
                     "LongLive2Pipeline", cache="sglang"),
    HostClassRegistration("sglang", f"{_SGLANG}.causal_denoising:CausalDMDDenoisingStage", "WanCausalDMDPipeline",
                     cache="sglang"),
    HostClassRegistration("sglang", f"{_SGLANG}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising:"
                     "LingBotWorldCausalDMDDenoisingStage", "LingBotWorldCausalDMDPipeline", cache="sglang"),
    HostClassRegistration("vllm-omni", "causalkv.vllm_omni.pipeline:CausalKVLingBotWorldPipeline",
                     "LingBotWorldCausalDMDPipeline", cache="qvg"),
)


@hookimpl
def causalkv_register_stages() -> tuple[StageRegistration, ...]:
    return STAGES


@hookimpl
def causalkv_register_cache_factories() -> tuple[CacheFactory, ...]:
    return CACHES


@hookimpl
def causalkv_register_host_classes() -> tuple[HostClassRegistration, ...]:
    return HOSTS
