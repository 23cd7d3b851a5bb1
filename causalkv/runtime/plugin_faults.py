"""Plugin faults at run time: which plugin raised, and what the run does about it.

- A ``causalkv_configure_stage`` implementation that raises (or returns overrides the stage
  refuses) stops the run with `PluginHookError` naming the plugin and the hook
  (`configure_stage_checked`). The hook runs once the stage is built over the loaded
  components, before its caches are allocated and before the first chunk.
- An observer hook (``causalkv_chunk_done``) that raises is reported once, naming the plugin,
  and that plugin's implementation is skipped for the rest of the run, which completes
  (`ObserverHook`, from `causalkv.plugin.calls`); with ``strict=True`` (``--strict-plugins``)
  it is a `PluginHookError` instead. Each plugin's implementation is called on its own, so
  one failing plugin never keeps an event from the others.
"""

from __future__ import annotations

import inspect
from typing import Any

from causalkv.errors import CausalKVError
from causalkv.plugin.calls import ObserverHook, describe_exception, hook_failure
from causalkv.plugin.configure import configure_stage
from causalkv.plugin.errors import PluginHookError

__all__ = ["ObserverHook", "PluginHookError", "configure_stage_checked", "plugin_that_raised"]


def plugin_that_raised(exc: BaseException, impls: list[Any]) -> str | None:
    """The name of the plugin whose implementation (among ``impls``, pluggy ``HookImpl``s)
    is on ``exc``'s traceback (the innermost one), or None."""
    codes = {}
    for impl in impls:
        fn = inspect.unwrap(impl.function)
        codes[getattr(fn, "__code__", None)] = impl.plugin_name
        codes.setdefault(getattr(impl.function, "__code__", None), impl.plugin_name)
    found = None
    tb = exc.__traceback__
    while tb is not None:
        found = codes.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def configure_stage_checked(pm: Any, stage: Any, model: Any, server_args: Any) -> None:
    """Run ``causalkv_configure_stage`` on ``stage`` and apply the overrides it returns.

    Raises `PluginHookError` (naming the plugin when its implementation raised) when an
    implementation raises, returns something that is not a mapping of `ModelConfig`
    fields, or returns overrides the stage refuses.
    """
    hook = "causalkv_configure_stage"
    try:
        overrides = configure_stage(pm, stage, model, server_args)
    except Exception as exc:  # noqa: BLE001 - any fault of a plugin stops the run, named
        plugin = plugin_that_raised(exc, pm.hook.causalkv_configure_stage.get_hookimpls())
        raise PluginHookError(hook_failure(hook, plugin, exc), plugin=plugin, hook=hook) from exc
    try:
        stage.apply_overrides(overrides)
    except (CausalKVError, ValueError, TypeError) as exc:
        raise PluginHookError(
            f"the overrides {hook} returned ({overrides}) are invalid: {describe_exception(exc)}; "
            "fix the plugin that returns them (causalkv plugins lists the plugins)",
            plugin=None,
            hook=hook,
        ) from exc
