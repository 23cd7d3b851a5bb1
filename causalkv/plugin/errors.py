"""Errors of the plugin system, and the record of a plugin set aside."""

from __future__ import annotations

from dataclasses import dataclass

from causalkv.errors import CausalKVError
from causalkv.hooks import ENV_PREFIX

__all__ = [
    "PluginConflictError", "PluginHookError", "PluginLoadFailure", "PluginSetAsideError",
    "ResolutionError", "UnsupportedRequestError",
]


class PluginConflictError(CausalKVError, RuntimeError):
    """Two plugins claim the same thing (stage name, cache name, or model at one priority).

    The message names both plugins and the fix (uninstall or block one with
    ``CAUSALKV_DISABLE_PLUGINS``, or change a priority).
    """


class PluginHookError(CausalKVError, RuntimeError):
    """A plugin's hook implementation failed; ``plugin`` and ``hook`` name it."""

    def __init__(self, message: str, *, plugin: str | None, hook: str) -> None:
        super().__init__(message)
        self.plugin, self.hook = plugin, hook


class ResolutionError(CausalKVError, ValueError):
    """No stage serves the model, an unknown name, or no cache qualifies (lists the choices)."""


class UnsupportedRequestError(CausalKVError, ValueError):
    """The chosen stage cannot serve the request (QVG or multi-shot it does not declare).

    The message starts with the reference runtime's text (``"<StageClass> does not support
    QVG KV-cache quantization"``) and names the stages that would serve it.
    """


class PluginSetAsideError(CausalKVError, RuntimeError):
    """``--strict-plugins`` (``strict=True``): a plugin that would be set aside is fatal."""


@dataclass(frozen=True)
class PluginLoadFailure:
    """A plugin set aside: it failed to import or validate, a registration hook of it raised
    or returned junk, or it claims a plugin name, a stage, cache or model, or a flag another
    holds. Every other plugin and model keeps working.

    Attributes:
        name: the entry-point (plugin) name.
        distribution: ``"<dist name> <version>"`` that declared it, or None if unknown.
        error: what went wrong (``"<ExceptionType>: <message>"`` for an exception).
        fix: how to fix it (default: fix the plugin, or turn it off by name).
    """

    name: str
    distribution: str | None
    error: str
    fix: str | None = None

    def __str__(self) -> str:
        dist = f" (from {self.distribution})" if self.distribution else ""
        fix = self.fix or f"fix the plugin, or turn it off with {ENV_PREFIX}_DISABLE_PLUGINS={self.name}"
        return f"plugin {self.name!r}{dist} is set aside: {self.error}; {fix}"
