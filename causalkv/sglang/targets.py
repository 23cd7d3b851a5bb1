"""What the bridge hooks in sglang: the dotted names of sglang's classes, and which stages it serves.

Names only: this module imports no sglang (sglang imports the hooks while it loads its plugins).

- `SERVED`: the exact stage classes whose caches the bridge serves (LongLive 2.0, the Wan
  causal DMD / Self-Forcing base stage, LingBot-World); any other subclass keeps sglang's
  behaviour. `served` asks it of a stage object.
- `SERVED_PIPELINES`: sglang's pipeline name -> the served stage its denoising runs in (the
  start-up checks know the pipeline, not the stage).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["SERVED", "SERVED_PIPELINES", "log_once", "qualname", "served"]

STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"
#: sglang's causal DMD stage (Wan causal DMD / Self-Forcing); the others subclass it
BASE = f"{STAGES}.causal_denoising.CausalDMDDenoisingStage"
LONGLIVE2 = f"{STAGES}.model_specific_stages.longlive2.LongLive2CausalDenoisingStage"
LINGBOT = (
    f"{STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
    "LingBotWorldCausalDMDDenoisingStage"
)
SERVER_ARGS = "sglang.multimodal_gen.runtime.server_args.server_args.ServerArgs"
PIPELINE_BASE = (
    "sglang.multimodal_gen.runtime.pipelines_core.composed_pipeline_base.ComposedPipelineBase"
)
ATTN_DITS = "sglang.multimodal_gen.runtime.models.dits"
WAN_ATTN = f"{ATTN_DITS}.causal_wanvideo.CausalWanSelfAttention"
LINGBOT_ATTN = f"{ATTN_DITS}.lingbot_world.LingBotWorldCausalSelfAttention"
LOCAL_ATTN = "sglang.multimodal_gen.runtime.layers.attention.layer.LocalAttention"

#: fully qualified names of the stage classes the bridge serves
SERVED = frozenset({BASE, LONGLIVE2, LINGBOT})
#: sglang pipeline name -> the served stage its denoising runs in
SERVED_PIPELINES: Mapping[str, str] = {
    "LongLive2Pipeline": LONGLIVE2,
    "WanCausalDMDPipeline": BASE,
    "LingBotWorldCausalDMDPipeline": LINGBOT,
}

_logged: set[tuple[str, ...]] = set()


def qualname(obj: object) -> str:
    """``module.QualName`` of the object's class (what `SERVED` holds)."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def served(stage: object) -> bool:
    """True when the bridge serves this stage object (its class exactly in `SERVED`)."""
    return qualname(stage) in SERVED


def log_once(logger: logging.Logger, key: tuple[str, ...], level: int, msg: str,
             *args: Any) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)
