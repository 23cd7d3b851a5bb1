"""Demo stand-in: causalkv's LingBot-World pipeline with its DiT built at the checkpoint's tiny
geometry, for vLLM-Omni's offline entry point on a CPU (``run_offline.py``). Never imported by
causalkv.

vLLM-Omni's ``LingBotWorldCausalDMDPipeline.__init__`` builds its DiT with
``CausalLingBotWorldTransformer3DModel.from_config``, which refuses every geometry but
LingBot-World v2's (40 x 40 x 128, ...). `TinyLingBotWorldPipeline` runs causalkv's pipeline
(`causalkv.vllm_omni.pipeline.CausalKVLingBotWorldPipeline`: settings, vLLM-Omni's own
``__init__``, then causalkv's store installed) with that one call answered by the DiT's own
constructor on ``transformer/config.json``'s keys, for the duration of ``__init__``; everything
else (tokenizer, text encoder, VAE, scheduler, weight loading, the DMD block runner, decode) is
vLLM-Omni's. `register` puts it in vLLM-Omni's registry under `ARCH` (``register_diffusion_model``,
LingBot-World's pre/post-process functions).
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_omni.diffusion.models.lingbot_world import transformer as lt

from causalkv.vllm_omni.pipeline import (  # noqa: F401 - re-exported for vLLM-Omni's registry
    CausalKVLingBotWorldPipeline,
    get_lingbot_world_post_process_func,
    get_lingbot_world_pre_process_func,
)

#: the architecture name the demo passes as ``model_class_name``
ARCH = "TinyLingBotWorldCausalDMDPipeline"


def _tiny_from_config(config: dict[str, Any], *, quant_config: Any = None, prefix: str = ""):
    """``from_config`` without LingBot-World v2's geometry contract: the DiT's constructor on
    the config's keys it takes."""
    cls = lt.CausalLingBotWorldTransformer3DModel
    names = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in config.items() if k in names and k not in ("quant_config", "prefix")}
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    return cls(**kwargs, quant_config=quant_config, prefix=prefix)


class TinyLingBotWorldPipeline(CausalKVLingBotWorldPipeline):
    """causalkv's LingBot-World pipeline whose DiT is built at the folder's geometry."""

    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        cls = lt.CausalLingBotWorldTransformer3DModel
        stock = cls.__dict__["from_config"]
        cls.from_config = staticmethod(_tiny_from_config)
        try:
            super().__init__(od_config=od_config, prefix=prefix)
        finally:
            cls.from_config = stock


def register() -> None:
    """Register `TinyLingBotWorldPipeline` as `ARCH` in vLLM-Omni's diffusion registry."""
    from vllm_omni.diffusion.registry import register_diffusion_model

    register_diffusion_model(ARCH, "tiny_pipeline", "TinyLingBotWorldPipeline",
                             pre_process_func_name="get_lingbot_world_pre_process_func",
                             post_process_func_name="get_lingbot_world_post_process_func")
