"""The causalkv plugin system: manager, entry-point discovery and the registry every host reads.

    from causalkv.plugin import collect
    collect()          # a script's one call: load the installed plugins (their codecs too)

Each host resolves what serves a request from the registry itself: causalkv's own runtime
with `causalkv.runtime.resolve` (a stage and a cache per model), the sglang and vLLM-Omni
bridges with `Registry.host_classes`. The contract plugin authors implement is
`causalkv.hooks`; docs/plugins.md is the guide.
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

__all__ = [
    "CausalKVPluginManager", "PluginConflictError", "PluginHookError", "PluginLoadFailure", "PluginSetAsideError",
    "Registry", "ResolutionError", "UnsupportedRequestError", "collect", "collected",
    "get_plugin_manager", "make_plugin_manager", "reset_plugin_manager",
]
