"""The bridge's AROUND hooks on sglang's causal denoising stages (dotted targets, no sglang import).

Each hook receives sglang's original method first (sglang's AROUND convention). Stages
served: `SERVED` (exact classes: LongLive 2.0, the Wan causal DMD / Self-Forcing base stage,
LingBot-World); any other subclass keeps sglang's behaviour untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["HOOKS", "SERVED", "served"]

logger = logging.getLogger(__name__)

_STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"
_BASE = f"{_STAGES}.causal_denoising.CausalDMDDenoisingStage"
_LONGLIVE2 = f"{_STAGES}.model_specific_stages.longlive2.LongLive2CausalDenoisingStage"
_LINGBOT = (
    f"{_STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
    "LingBotWorldCausalDMDDenoisingStage"
)
#: fully qualified names of the stage classes the bridge serves
SERVED = frozenset({_BASE, _LONGLIVE2, _LINGBOT})


def served(stage: object) -> bool:
    cls = type(stage)
    return f"{cls.__module__}.{cls.__qualname__}" in SERVED


def supports_qvg(original: Callable[..., bool], self: Any) -> bool:
    """``_supports_qvg_kv_cache_quantization``: True for the served stages."""
    return True if served(self) else original(self)


def _carry_quant(self: Any, server_args: Any) -> None:
    if served(self):
        quant = getattr(server_args, "kv_cache_quant_config", None)
        if quant is not None:
            self._kv_quant_args = quant


def prepare_forward_context(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """``_prepare_causal_dmd_forward_context``: every forward (offline and realtime) passes
    here before a cache exists; carry the request's quant settings as ``_kv_quant_args``."""
    _carry_quant(self, server_args)
    return original(self, batch, server_args)


def apply_overrides(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """``_apply_causal_cache_overrides`` (the realtime path and sglang's QVG guard)."""
    out = original(self, batch, server_args)
    _carry_quant(self, server_args)
    return out


def allocate(original: Callable[..., Any], self: Any, **kw: Any) -> list:
    """``_allocate_causal_kv_cache``: causalkv's cache when quantization is on.

    Quantization off: sglang's own dense cache (the bridge's cache would be equal to it bit
    for bit, so sglang's stays). On, and causalkv can pack the layout: one
    `SGLangQVGKVCache` per block, global sinks, pins and growth included. On, and it cannot
    (a head_dim the block size does not divide): LingBot-World keeps sglang's own QVG cache;
    the other stages raise ValueError naming the fix.
    """
    quant = getattr(self, "_kv_quant_args", None)
    if not served(self) or quant is None or not getattr(quant, "enabled", False):
        return original(self, **kw)
    from causalkv.sglang.cache import SGLangQVGKVCache, can_serve, causalkv_quant_args

    reason = can_serve(causalkv_quant_args(quant), kw["attention_head_dim"], kw["dtype"])
    if reason is not None:
        if f"{type(self).__module__}.{type(self).__qualname__}" == _LINGBOT:
            logger.info("causalkv sglang bridge: sglang's own QVG cache kept (%s)", reason)
            return original(self, **kw)
        raise ValueError(
            f"{type(self).__name__}: causalkv cannot pack this KV cache ({reason}); "
            f"set kv_cache_quant_block_size to a divisor of the head_dim"
        )
    import torch

    device = kw["device"]
    int_indices = kw.get("use_int_indices", False)
    return [
        SGLangQVGKVCache(
            batch_size=kw["batch_size"], cache_size=kw["kv_cache_size"],
            num_heads=kw["num_attention_heads"], head_dim=kw["attention_head_dim"],
            dtype=kw["dtype"], device=device,
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device),
            use_int_indices=int_indices, sink_tokens=kw.get("sink_tokens", 0),
            attention_window_size=kw.get("attention_window_size") or kw["kv_cache_size"],
            quant_args=quant, global_sink_tokens=kw.get("global_sink_tokens", 0),
            allow_growth=kw.get("allow_growth", False),
        )
        for _ in range(self.num_transformer_blocks)
    ]


#: (dotted target, AROUND hook) pairs registered by `causalkv.sglang.register`
HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{_BASE}._supports_qvg_kv_cache_quantization", supports_qvg),
    (f"{_BASE}._prepare_causal_dmd_forward_context", prepare_forward_context),
    (f"{_BASE}._apply_causal_cache_overrides", apply_overrides),
    (f"{_BASE}._allocate_causal_kv_cache", allocate),
    (f"{_LINGBOT}._allocate_causal_kv_cache", allocate),
)
