"""`CausalDenoisingStage`: the chunk-by-chunk denoising loop and its load-time declarations."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from causalkv.caches.spec import HEAD_SLICE, PINNED_SINK, QUANT_QVG, RECENT_WINDOW

if TYPE_CHECKING:
    from causalkv.config import ModelConfig, ServerArgs

__all__ = ["CausalDenoisingStage"]


class CausalDenoisingStage:
    """Base stage: runs a causal transformer chunk by chunk over per-layer KV caches.

    Load-time declarations (read by the resolver before any weights load):

    - `_supports_qvg_kv_cache_quantization()`: may this stage run on a QVG-packed cache?
      False here; a stage opts in by overriding it.
    - `supports_multi_shot()`: may a request pin shot sinks (LongLive 2.0 scene cuts)?
    - `uses_recent_window(server_args, model)`: does it sample a recent window?
    - `required_cache_features(server_args, model)`: the cache capabilities it needs.
    """

    #: human-readable stage name (registrations use it too)
    stage_name: ClassVar[str] = "causal-denoising"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return False

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return False

    @classmethod
    def uses_recent_window(cls, server_args: ServerArgs, model: ModelConfig | None = None) -> bool:
        if server_args.recent_window_frames is not None:
            return True
        return model is not None and model.recent_window_frames is not None

    @classmethod
    def required_cache_features(
        cls, server_args: ServerArgs, model: ModelConfig | None = None
    ) -> frozenset[str]:
        """Cache capabilities this stage needs under ``server_args``."""
        req: set[str] = set()
        if server_args.kv_cache_quant_config.enabled:
            req.add(QUANT_QVG)
        if server_args.multi_shot:
            req.add(PINNED_SINK)
        if server_args.heads_sharded > 1:
            req.add(HEAD_SLICE)
        if cls.uses_recent_window(server_args, model):
            req.add(RECENT_WINDOW)
        return frozenset(req)
