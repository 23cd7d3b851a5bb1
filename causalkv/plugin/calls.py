"""Calling a hook one plugin at a time, so a result or a failure is known by its plugin.

`plugin_callers` is the one helper: a pluggy subset caller per plugin implementing a hook.
The registries use it through `call_each` (each record names the plugin that returned it,
so a conflict names both sides); the host's observer hooks through `ObserverHook` (a
failing plugin is reported and skipped, never keeping an event from the others).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pluggy

from causalkv.plugin.errors import PluginHookError

__all__ = ["ObserverHook", "call_each", "describe_exception", "hook_failure", "plugin_callers"]


def plugin_callers(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, Callable[..., list[Any]]]]:
    """``(plugin name, caller of that plugin's implementation alone)`` for every plugin
    implementing ``hook`` (wrappers aside), in pluggy's implementation order: registration
    order, ``trylast`` ones first and ``tryfirst`` ones last (pluggy calls them in reverse).
    Each caller is pluggy's own ``subset_hook_caller``, so hook monitoring sees the calls."""
    impls = getattr(pm.hook, hook).get_hookimpls()
    plugins = {impl.plugin_name: impl.plugin for impl in impls}
    return [
        (i.plugin_name, pm.subset_hook_caller(hook, [p for n, p in plugins.items() if n != i.plugin_name]))
        for i in impls
        if not (i.hookwrapper or i.wrapper)
    ]


def call_each(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
    """Call each plugin's implementation of a hook; yield ``(plugin name, result)``.

    Raises:
        PluginHookError (a RuntimeError): an implementation raised; the message names its
            plugin, the hook and the error.
    """
    for name, caller in plugin_callers(pm, hook_name):
        try:
            results = caller(**kwargs)
        except Exception as exc:
            raise PluginHookError(
                f"plugin {name!r}: {hook_name}() raised {type(exc).__name__}: {exc}", plugin=name, hook=hook_name
            ) from exc
        yield name, results[0] if results else None


def describe_exception(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def hook_failure(hook: str, plugin: str | None, exc: BaseException, where: str = "") -> str:
    """The one line that reports ``plugin``'s failure in ``hook`` and how to turn it off."""
    who = f"plugin {plugin!r}" if plugin else "a plugin"
    fix = (
        f"fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS={plugin}"
        if plugin
        else "fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS (causalkv plugins lists them)"
    )
    return f"{who} failed in {hook}{where} ({describe_exception(exc)}); {fix}"


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
        pm: pluggy.PluginManager,
        hook: str,
        *,
        strict: bool = False,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.hook, self.strict = hook, strict
        self.report = report if report is not None else _warn
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
                self.report(f"{message}; it is skipped for the rest of the run (--strict-plugins makes this fatal)")
