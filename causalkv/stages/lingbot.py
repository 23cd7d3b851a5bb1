"""`LingBotWorldStage`: LingBot-World's interactive world model with recent-window sampling.

Sink and window come from the model config (LingBot-World fast: sink 3, window 45 frames;
other configs sink 9 / window 18 or 3 / 12), each overridable per request
(``ServerArgs.sink_frames`` / ``window_frames``). With ``recent_window_frames = r`` every
self-attention write passes ``recent_window_tokens = r * tokens_per_frame``: a chunk sees
the sink plus only the frames of the ``r`` frames before it (and itself), not the whole
window (LingBot-World samples a moving camera with 12 recent frames, a still one with 3).
"""

from __future__ import annotations

from typing import ClassVar

from causalkv.stages.base import CausalDenoisingStage

__all__ = ["LingBotWorldStage"]


class LingBotWorldStage(CausalDenoisingStage):
    """LingBot-World: the base loop with the recent window of the config or the request."""

    stage_name: ClassVar[str] = "lingbot-world"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True

    @property
    def recent_window_frames(self) -> int | None:
        """The recent window in frames this request samples with (None: the whole window)."""
        return self.settings.recent_window_frames
