"""`SchedulerSpec`: the sampler a stage declares, as data (a class path and its config).

A stage says which diffusers scheduler it drives (``CausalDenoisingStage.scheduler_spec``);
`SchedulerSpec.build` imports the class only when the stage is built, so declaring it loads
neither diffusers nor the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from causalkv.hooks.records import import_object

__all__ = ["FLOW_MATCH_EULER", "SchedulerSpec", "flow_match"]

#: diffusers' flow-matching Euler scheduler (the DMD loop reads its ``sigmas``/``timesteps``)
FLOW_MATCH_EULER = "diffusers:FlowMatchEulerDiscreteScheduler"


@dataclass(frozen=True)
class SchedulerSpec:
    """A scheduler as data: ``target`` (``"module:Class"``) and its constructor ``config``."""

    target: str
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    def build(self) -> Any:
        """A new scheduler: ``Class(**config)`` (imports ``target`` now)."""
        return import_object(self.target)(**self.config)


def flow_match(shift: float) -> SchedulerSpec:
    """diffusers' flow-matching Euler scheduler with ``shift`` (Wan: 5.0), 1000 train steps."""
    return SchedulerSpec(FLOW_MATCH_EULER, {"num_train_timesteps": 1000, "shift": float(shift)})
