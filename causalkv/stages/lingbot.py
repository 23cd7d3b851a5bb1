"""`LingBotWorldStage`: LingBot-World's interactive world model with recent-window sampling.

Sink and window come from the model config (LingBot-World fast: sink 3, window 45 frames;
other configs sink 9 / window 18 or 3 / 12), each overridable per request
(``ServerArgs.sink_frames`` / ``window_frames``). With ``recent_window_frames = r`` every
self-attention write passes ``recent_window_tokens = r * tokens_per_frame``: a chunk sees
the sink plus only the frames of the ``r`` frames before it (and itself), not the whole
window (LingBot-World samples a moving camera with 12 recent frames, a still one with 3).
"""

from __future__ import annotations

from causalkv.hooks import Preset, StageRegistration
from causalkv.stages.base import CausalDenoisingStage

__all__ = ["REGISTRATION", "LingBotWorldStage"]


class LingBotWorldStage(CausalDenoisingStage):
    """LingBot-World: the base loop with the recent window of the config or the request."""

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True


#: LingBot-World fast (Wan 2.2 14B class): sink 3, window 45 frames, 12-frame recent window
REGISTRATION = StageRegistration(
    "lingbot-world",
    LingBotWorldStage,
    models=("LingBotWorldPipeline", "LingBotWorldCausalDMDPipeline"),
    defaults={
        "frames_per_chunk": 3,
        "sink_frames": 3,
        "window_frames": 45,
        "recent_window_frames": 12,
    },
    presets=(
        Preset(
            "tiny-lingbot",
            {"frames_per_chunk": 3, "sink_frames": 3, "window_frames": 12,
             "recent_window_frames": 3, "default_frames": 12},
            seed=104,
            description="LingBot-World-style: 3-frame sink, 12-frame window, 3-frame recent window",
        ),
    ),
)
