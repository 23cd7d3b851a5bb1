"""What the bridge hooks in sglang (the dotted names of sglang's classes), and which stages it
serves: the classes causalkv's plugin registry names for host ``sglang``.

Names only at import: this module imports no sglang (sglang imports the hooks while it loads
its plugins).

- The hooks wrap methods of `BASE` (sglang's causal DMD stage), `LONGLIVE2` and `LINGBOT`
  (`causalkv.sglang.hooks`); a subclass of them that does not override a wrapped method
  (or calls the wrapped one through ``super()``) runs the wrapped one.
- Which stage classes the hooks serve, and the cache factory building their blocks, is the
  registry's answer (`served_stages`): every ``HostClassRegistration`` of host ``sglang`` that a
  plugin not set aside registers, causalkv's built-in plugin included (its three:
  `causalkv.plugin.builtin.HOSTS`, with its cache factory ``sglang``), under
  ``CAUSALKV_PLUGINS`` and ``CAUSALKV_DISABLE_PLUGINS`` as in causalkv's runtime. Resolved once
  per process, at the first start-up check or hooked call (the pipeline's ``_load_config``,
  before any weights load), and logged in one line. Any other class, a subclass of a served
  one included, keeps sglang's behaviour: `served_stage` asks it of a stage object.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from causalkv.errors import describe_exception
from causalkv.hooks import HostClassRegistration, import_object
from causalkv.plugin import Registry, collected, get_plugin_manager
from causalkv.plugin.manager import ENV_BLOCK

__all__ = ["HOST", "ServedStage", "log_once", "qualname", "served_stage", "served_stages"]

logger = logging.getLogger(__name__)

#: the host name of the registrations this bridge serves (`HostClassRegistration.host`)
HOST = "sglang"
STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"
#: sglang's causal DMD stage (Wan causal DMD / Self-Forcing); the others subclass it
BASE = f"{STAGES}.causal_denoising.CausalDMDDenoisingStage"
LONGLIVE2 = f"{STAGES}.model_specific_stages.longlive2.LongLive2CausalDenoisingStage"
LINGBOT = (
    f"{STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
    "LingBotWorldCausalDMDDenoisingStage"
)
SERVER_ARGS = "sglang.multimodal_gen.runtime.server_args.server_args.ServerArgs"
PIPELINE_BASE = (
    "sglang.multimodal_gen.runtime.pipelines_core.composed_pipeline_base.ComposedPipelineBase"
)
ATTN_DITS = "sglang.multimodal_gen.runtime.models.dits"
WAN_ATTN = f"{ATTN_DITS}.causal_wanvideo.CausalWanSelfAttention"
LINGBOT_ATTN = f"{ATTN_DITS}.lingbot_world.LingBotWorldCausalSelfAttention"
LOCAL_ATTN = "sglang.multimodal_gen.runtime.layers.attention.layer.LocalAttention"
#: the bridge's cache: every kind of a cache factory the bridge builds derives from it
CACHE_BASE = "causalkv.sglang.cache.SGLangQVGKVCache"
#: the cache factory of a registration that names none (the built-in plugin registers it)
DEFAULT_CACHE = "sglang"

_logged: set[tuple[str, ...]] = set()


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def qualname(obj: object) -> str:
    """``module.QualName`` of the object's class."""
    return _dotted(type(obj))


def log_once(logger: logging.Logger, key: tuple[str, ...], level: int, msg: str,
             *args: Any) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


@dataclass(frozen=True)
class ServedStage:
    """A stage class the bridge serves, and the registration that names it.

    Attributes:
        cls: the stage class (a subclass of sglang's ``CausalDMDDenoisingStage``).
        registration: its ``HostClassRegistration`` (the pipelines it serves, its codec).
        plugin: the plugin that registered it.
        cache: the kind that builds each block's cache with QVG on: the loaded kind of the
            registration's cache factory (`DEFAULT_CACHE` when it names none), a subclass of
            `causalkv.sglang.cache.SGLangQVGKVCache` built with the same keywords.
        cache_name: that factory's name.
    """

    cls: type
    registration: HostClassRegistration
    plugin: str
    cache: type
    cache_name: str

    @property
    def lingbot(self) -> bool:
        """LingBot-World's stage or a subclass: sglang's own QVG cache can serve it instead."""
        return any(_dotted(c) == LINGBOT for c in self.cls.__mro__)

    def describe(self) -> str:
        codec = f", codec {self.registration.codec}" if self.registration.codec else ""
        return f"{self.cls.__name__} (plugin {self.plugin}, cache {self.cache_name}{codec})"


#: what each plugin manager (one per process; tests rebuild it) has the bridge serve
_SERVED: weakref.WeakKeyDictionary[Any, dict[str, ServedStage]] = weakref.WeakKeyDictionary()


def _served(registry: Registry, reg: HostClassRegistration, plugin: str) -> ServedStage:
    """The registered class, checked to be one the bridge's hooks reach, and the kind of its
    cache factory, checked to be built with sglang's arguments (raises what an import raises,
    ResolutionError for an unknown cache, or TypeError)."""
    cls = import_object(reg.target)
    if not (isinstance(cls, type) and any(_dotted(c) == BASE for c in cls.__mro__)):
        raise TypeError(f"{cls!r} is not a subclass of sglang's CausalDMDDenoisingStage, whose "
                        "methods the bridge's hooks wrap")
    factory = registry.cache(reg.cache or DEFAULT_CACHE).factory
    kind = factory.load() if factory.host == HOST else None
    if not (isinstance(kind, type) and any(_dotted(c) == CACHE_BASE for c in kind.__mro__)):
        raise TypeError(f"cache {factory.name!r} ({factory.target}) is not a subclass of {CACHE_BASE} declaring "
                        f"capability host:{HOST}, which the bridge builds with sglang's allocation keywords")
    return ServedStage(cls, reg, plugin, kind, factory.name)


def served_stages() -> Mapping[str, ServedStage]:
    """sglang pipeline name -> the stage class the bridge serves for it, from causalkv's plugin
    registry (`causalkv.plugin.collected`: collected once per process under the switches of
    causalkv's runtime; a plugin set aside is one warning line on stderr): the
    highest-priority ``HostClassRegistration`` of host ``sglang`` per pipeline.
    Resolved once per process; the first call logs one line naming every served stage, and one
    warning per registration it cannot serve (its class does not import, or is not a subclass
    of sglang's causal DMD stage, or its cache factory is unknown or not sglang's), which then
    keeps sglang's behaviour."""
    pm = get_plugin_manager()
    found = _SERVED.get(pm)
    if found is not None:
        return found
    found, registry = {}, collected(pm)
    for pipeline, (reg, plugin) in registry.host_classes(HOST).items():
        try:
            found[pipeline] = _served(registry, reg, plugin)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take sglang down
            logger.warning("causalkv sglang bridge: %s is not served: %s (plugin %s): %s; fix the "
                           "plugin, or turn it off with %s=%s", pipeline, reg.target, plugin,
                           describe_exception(exc), ENV_BLOCK, plugin)
    _SERVED[pm] = found
    logger.info("causalkv sglang bridge serves %s", "; ".join(
        f"{p}: {s.describe()}" for p, s in found.items()) or "nothing (no plugin registers an sglang stage)")
    return found


def served_stage(stage: object) -> ServedStage | None:
    """The served class of this stage object (its class exactly), or None: sglang's behaviour."""
    name = qualname(stage)
    return next((s for s in served_stages().values() if _dotted(s.cls) == name), None)
