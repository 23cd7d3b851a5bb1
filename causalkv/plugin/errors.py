"""Errors and load reports of the plugin system."""

from __future__ import annotations

from dataclasses import dataclass

from causalkv.errors import CausalKVError

__all__ = [
    "PluginConflictError",
    "PluginHookError",
    "PluginLoadFailure",
    "ResolutionError",
    "UnsupportedRequestError",
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


@dataclass(frozen=True)
class PluginLoadFailure:
    """A plugin that failed to import or failed validation, and was skipped.

    Attributes:
        name: the entry-point (plugin) name.
        distribution: ``"<dist name> <version>"`` that declared it, or None if unknown.
        error: ``"<ExceptionType>: <message>"``.
    """

    name: str
    distribution: str | None
    error: str

    def __str__(self) -> str:
        dist = f" (from {self.distribution})" if self.distribution else ""
        return f"plugin {self.name!r}{dist} failed to load and was skipped: {self.error}"
