"""The causalkv plugin system: manager, entry-point discovery, registries and resolution.

    from causalkv.plugin import collect, resolve
    collect()          # a script's one call: load the installed plugins (their codecs too)
    res = resolve("tiny-longlive2", ServerArgs(multi_shot=True))
    res.stage, res.cache_factory.name, res.reasons

The contract plugin authors implement is `causalkv.hooks`; docs/plugins.md is the guide.
"""

from causalkv.plugin.errors import (
    PluginConflictError,
    PluginHookError,
    PluginLoadFailure,
    PluginSetAsideError,
    ResolutionError,
    UnsupportedRequestError,
)
from causalkv.plugin.manager import (
    CausalKVPluginManager,
    get_plugin_manager,
    make_plugin_manager,
    reset_plugin_manager,
)
from causalkv.plugin.registry import Registry, collect, collected
from causalkv.plugin.resolver import Resolution, resolve

__all__ = [
    "CausalKVPluginManager", "PluginConflictError", "PluginHookError", "PluginLoadFailure", "PluginSetAsideError",
    "Registry", "Resolution", "ResolutionError", "UnsupportedRequestError", "collect", "collected",
    "get_plugin_manager", "make_plugin_manager", "reset_plugin_manager", "resolve",
]
