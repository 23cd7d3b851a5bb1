"""The causalkv plugin system: manager, entry-point discovery, registries and resolution.

    from causalkv.plugin import resolve
    res = resolve("tiny-longlive2", ServerArgs(multi_shot=True))
    res.stage, res.cache_factory.name, res.reasons

The contract plugin authors implement is `causalkv.hooks`; docs/plugins.md is the guide.
"""

from causalkv.plugin.configure import configure_stage
from causalkv.plugin.errors import (
    PluginConflictError,
    PluginHookError,
    PluginLoadFailure,
    ResolutionError,
    UnsupportedRequestError,
)
from causalkv.plugin.manager import (
    CausalKVPluginManager,
    PluginInfo,
    get_plugin_manager,
    make_plugin_manager,
    reset_plugin_manager,
)
from causalkv.plugin.registry import CacheEntry, Registry, StageEntry, collect
from causalkv.plugin.resolver import ModelRef, Resolution, model_ref, resolve

__all__ = [
    "CacheEntry",
    "CausalKVPluginManager",
    "ModelRef",
    "PluginConflictError",
    "PluginHookError",
    "PluginInfo",
    "PluginLoadFailure",
    "Registry",
    "Resolution",
    "ResolutionError",
    "StageEntry",
    "UnsupportedRequestError",
    "collect",
    "configure_stage",
    "get_plugin_manager",
    "make_plugin_manager",
    "model_ref",
    "reset_plugin_manager",
    "resolve",
]
