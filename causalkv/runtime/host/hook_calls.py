"""The hooks the host calls while a request runs, one plugin at a time.

`configure_stage` calls ``causalkv_configure_stage`` on a built stage (a fault stops the run,
naming the plugin); `ObserverHook` calls an observer hook such as ``causalkv_chunk_done`` (a
failing plugin is reported once and skipped, never keeping an event from the others). Both
reach each plugin through `causalkv.plugin.calls.plugin_callers`, the one way a result or a
failure is pinned on a plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pluggy

from causalkv.config import ModelConfig, ServerArgs
from causalkv.errors import CausalKVError, describe_exception
from causalkv.hooks import ENV_PREFIX, Stage
from causalkv.plugin.calls import plugin_callers
from causalkv.plugin.errors import PluginHookError
from causalkv.runtime.model_io.prompt_encoding import warn_line

__all__ = ["ObserverHook", "configure_stage", "hook_failure"]


def hook_failure(hook: str, plugin: str, exc: BaseException | str, where: str = "") -> str:
    """The one line that reports ``plugin``'s failure in ``hook`` and how to turn it off."""
    what = exc if isinstance(exc, str) else describe_exception(exc)
    return (f"plugin {plugin!r} failed in {hook}{where} ({what}); fix it, or turn it off with "
            f"{ENV_PREFIX}_DISABLE_PLUGINS={plugin}")


def configure_stage(pm: pluggy.PluginManager, stage: Stage, model: ModelConfig, server_args: ServerArgs) -> dict[str, Any]:
    """Call each plugin's ``causalkv_configure_stage`` on ``stage`` (built, its caches not
    allocated), merge the `ModelConfig` overrides they return and apply them to the stage
    (``stage.apply_overrides``); return the merged overrides.

    Implementations run in pluggy's call order (``tryfirst`` first, then the most recently
    registered); on a key two return, the one called earlier wins.

    Raises:
        PluginHookError: naming the plugin: its implementation raised, returned something
            other than a mapping or None, a key that is no override (the message lists
            `ModelConfig.override_keys`), or overrides the stage refuses.
    """
    hook, merged, by = "causalkv_configure_stage", {}, {}
    for name, caller in plugin_callers(pm, hook)[::-1]:
        try:
            results = caller(stage=stage, model=model, server_args=server_args)
        except Exception as exc:  # noqa: BLE001 - any fault of a plugin stops the run, named
            raise PluginHookError(hook_failure(hook, name, exc), plugin=name, hook=hook) from exc
        result, problem = results[0] if results else None, None
        if result is not None and not isinstance(result, Mapping):
            problem = f"it returned {result!r}, not a mapping of ModelConfig overrides or None"
        elif unknown := sorted(set(result or ()) - set(model.override_keys())):
            problem = f"unknown override(s) {', '.join(unknown)}; the overrides are: {', '.join(model.override_keys())}"
        if problem:
            raise PluginHookError(hook_failure(hook, name, problem), plugin=name, hook=hook)
        for key, value in (result or {}).items():
            merged.setdefault(key, value)
            by.setdefault(key, name)
    try:
        stage.apply_overrides(merged)  # type: ignore[attr-defined]
    except (CausalKVError, ValueError, TypeError) as exc:
        names = sorted(set(by.values()))
        raise PluginHookError(hook_failure(hook, names[0], f"the overrides {merged} are invalid: {describe_exception(exc)}"),
                              plugin=names[0], hook=hook) from exc
    return merged


class ObserverHook:
    """Calls an observer hook's implementations one plugin at a time, isolating failures.

    ``ObserverHook(pm, "causalkv_chunk_done")(stage=..., chunk_index=i, stats=...)`` calls
    every plugin's implementation in pluggy's order. An ``Exception`` from one is reported
    once on stderr (`warn_line`: one line naming the plugin) and that plugin is skipped from then
    on; with ``strict`` it raises `PluginHookError` instead. ``KeyboardInterrupt`` and other
    ``BaseException``s propagate.

    Attributes:
        disabled: plugin name -> the line reported when it was disabled.
    """

    def __init__(self, pm: pluggy.PluginManager, hook: str, *, strict: bool = False) -> None:
        self.hook, self.strict = hook, strict
        self.disabled: dict[str, str] = {}
        self._callers = plugin_callers(pm, hook)[::-1]  # pluggy's call order

    def __call__(self, **kwargs: Any) -> None:
        for name, caller in self._callers:
            if name in self.disabled:
                continue
            try:
                caller(**kwargs)
            except Exception as exc:  # noqa: BLE001 - an observer's fault must not end the run
                where = f" at chunk {kwargs['chunk_index']}" if "chunk_index" in kwargs else ""
                message = hook_failure(self.hook, name, exc, where)
                if self.strict:
                    raise PluginHookError(message, plugin=name, hook=self.hook) from exc
                self.disabled[name] = message
                warn_line(f"{message}; it is skipped for the rest of the run (--strict-plugins makes this fatal)")
