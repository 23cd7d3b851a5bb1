"""Plugin faults at run time: which plugin raised, and what the run does about it.

- A ``causalkv_configure_stage`` implementation that raises (or returns overrides the stage
  refuses) stops the run with `PluginHookError` naming the plugin and the hook
  (`configure_stage_checked`). The hook runs once the stage is built over the loaded
  components, before its caches are allocated and before the first chunk.
- An observer hook (``causalkv_chunk_done``) that raises is reported once, naming the plugin,
  and that plugin's implementation is skipped for the rest of the run, which completes
  (`ObserverHook`); with ``strict=True`` (``--strict-plugins``) it is a `PluginHookError`
  instead. Each plugin's implementation is called on its own, so one failing plugin never
  keeps an event from the others.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from causalkv.errors import CausalKVError

__all__ = ["ObserverHook", "PluginHookError", "configure_stage_checked", "plugin_that_raised"]


class PluginHookError(CausalKVError, RuntimeError):
    """A plugin's hook implementation failed; ``plugin`` and ``hook`` name it."""

    def __init__(self, message: str, *, plugin: str | None, hook: str) -> None:
        super().__init__(message)
        self.plugin, self.hook = plugin, hook


def _impls(pm: Any, hook: str) -> list[Any]:
    return list(getattr(pm.hook, hook).get_hookimpls())


def plugin_that_raised(exc: BaseException, impls: list[Any]) -> str | None:
    """The name of the plugin whose implementation (among ``impls``, pluggy ``HookImpl``s)
    is on ``exc``'s traceback (the innermost one), or None."""
    import inspect

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


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _failure(hook: str, plugin: str | None, exc: BaseException, where: str = "") -> str:
    who = f"plugin {plugin!r}" if plugin else "a plugin"
    fix = (
        f"fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS={plugin}"
        if plugin
        else "fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS (causalkv plugins lists them)"
    )
    return f"{who} failed in {hook}{where} ({_describe(exc)}); {fix}"


def configure_stage_checked(pm: Any, stage: Any, model: Any, server_args: Any) -> None:
    """Run ``causalkv_configure_stage`` on ``stage`` and apply the overrides it returns.

    Raises `PluginHookError` (naming the plugin when its implementation raised) when an
    implementation raises, returns something that is not a mapping of `ModelConfig`
    fields, or returns overrides the stage refuses.
    """
    from causalkv.plugin import configure_stage

    hook = "causalkv_configure_stage"
    try:
        overrides = configure_stage(pm, stage, model, server_args)
    except Exception as exc:  # noqa: BLE001 - any fault of a plugin stops the run, named
        plugin = plugin_that_raised(exc, _impls(pm, hook))
        raise PluginHookError(_failure(hook, plugin, exc), plugin=plugin, hook=hook) from exc
    try:
        stage.apply_overrides(overrides)
    except (CausalKVError, ValueError, TypeError) as exc:
        raise PluginHookError(
            f"the overrides {hook} returned ({overrides}) are invalid: {_describe(exc)}; fix the "
            "plugin that returns them (causalkv plugins lists the plugins)",
            plugin=None,
            hook=hook,
        ) from exc


def _warn(line: str) -> None:
    print(f"causalkv: warning: {line}", file=sys.stderr, flush=True)


class ObserverHook:
    """Calls an observer hook's implementations one plugin at a time, isolating failures.

    ``ObserverHook(pm, "causalkv_chunk_done")(stage=..., chunk_index=i, stats=...)`` calls
    every plugin's implementation in pluggy's order. An ``Exception`` from one is reported
    once through ``report`` (one line naming the plugin) and that plugin is skipped from then
    on; with ``strict`` it raises `PluginHookError` instead. ``KeyboardInterrupt`` and other
    ``BaseException``s propagate.

    Attributes:
        disabled: plugin name -> the line reported when it was disabled.
    """

    def __init__(
        self,
        pm: Any,
        hook: str,
        *,
        strict: bool = False,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.hook, self.strict = hook, strict
        self.report = report if report is not None else _warn
        self.disabled: dict[str, str] = {}
        impls = _impls(pm, hook)
        plugins: dict[str, Any] = {}
        for impl in reversed(impls):  # pluggy calls the last registered (and tryfirst) first
            plugins.setdefault(impl.plugin_name, impl.plugin)
        self._callers = [
            (name, pm.subset_hook_caller(hook, remove_plugins=[p for n, p in plugins.items() if n != name]))
            for name in plugins
        ]

    def __call__(self, **kwargs: Any) -> None:
        for name, caller in self._callers:
            if name in self.disabled:
                continue
            try:
                caller(**kwargs)
            except Exception as exc:  # noqa: BLE001 - an observer's fault must not end the run
                where = f" at chunk {kwargs['chunk_index']}" if "chunk_index" in kwargs else ""
                message = _failure(self.hook, name, exc, where)
                if self.strict:
                    raise PluginHookError(message, plugin=name, hook=self.hook) from exc
                self.disabled[name] = message
                self.report(f"{message}; it is skipped for the rest of the run (--strict-plugins makes this fatal)")
