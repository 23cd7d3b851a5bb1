"""Run-time hook helpers the runtime may call: merged stage overrides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from causalkv.config import ModelConfig, ServerArgs
from causalkv.errors import ConfigError, InvalidTypeError

if TYPE_CHECKING:
    import pluggy

__all__ = ["configure_stage"]


def configure_stage(
    pm: pluggy.PluginManager, stage: object, model: ModelConfig, server_args: ServerArgs
) -> dict[str, Any]:
    """Call ``causalkv_configure_stage`` and merge the `ModelConfig` overrides it returns.

    Implementations run in pluggy's call order (``tryfirst`` first, then the most recently
    registered); on a key two return, the one called earlier wins. Apply the result with
    ``dataclasses.replace(model, **overrides)``.

    Raises:
        TypeError: an implementation returned something other than a mapping or None.
        ValueError: a key is not a `ModelConfig` field (the message lists the fields).
    """
    results = pm.hook.causalkv_configure_stage(stage=stage, model=model, server_args=server_args)
    valid = {f.name for f in fields(ModelConfig)}
    merged: dict[str, Any] = {}
    for result in reversed(results):
        if not isinstance(result, Mapping):
            raise InvalidTypeError(
                f"causalkv_configure_stage must return a mapping of ModelConfig overrides or "
                f"None, got {result!r}"
            )
        unknown = sorted(set(result) - valid)
        if unknown:
            raise ConfigError(
                f"causalkv_configure_stage returned unknown ModelConfig field(s) "
                f"{', '.join(unknown)}; choose among: {', '.join(sorted(valid))}"
            )
        merged.update(result)
    return merged
