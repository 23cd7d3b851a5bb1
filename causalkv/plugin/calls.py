"""Calling a hook one plugin at a time: the one way a result or a failure is pinned on a plugin.

`plugin_callers` is the one helper: a pluggy subset caller per plugin implementing a hook.
The registries use it (`causalkv.plugin.registry.collect`: a plugin whose registration hook
raises is set aside), and so does the host for the hooks it calls while a request runs
(`causalkv.runtime.host.hook_calls`: ``causalkv_configure_stage`` and the observer hooks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["plugin_callers"]


def plugin_callers(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, Callable[..., list[Any]]]]:
    """``(plugin name, caller of that plugin's implementation alone)`` for every plugin
    implementing ``hook`` (wrappers aside), in pluggy's implementation order: registration
    order, ``trylast`` ones first and ``tryfirst`` ones last (pluggy calls them in reverse).
    Each caller is pluggy's own ``subset_hook_caller``, so hook monitoring sees the calls."""
    impls = getattr(pm.hook, hook).get_hookimpls()
    return [(i.plugin_name, pm.subset_hook_caller(hook, [o.plugin for o in impls if o.plugin_name != i.plugin_name]))
            for i in impls if not (i.hookwrapper or i.wrapper)]
