"""Errors and load reports of the plugin system."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PluginConflictError", "PluginLoadFailure", "ResolutionError"]


class PluginConflictError(RuntimeError):
    """Two plugins claim the same thing (stage name, cache name, or model at one priority).

    A hard error: the message names both plugins and what they claim, and how to resolve it
    (uninstall or block one with ``CAUSALKV_DISABLE_PLUGINS``, or change a priority).
    """


class ResolutionError(ValueError):
    """No stage serves the model, or no registered cache qualifies (the message lists choices)."""


@dataclass(frozen=True)
class PluginLoadFailure:
    """A plugin that failed to import or failed pluggy's validation, and was skipped.

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
