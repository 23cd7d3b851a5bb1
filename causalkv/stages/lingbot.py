"""`LingBotWorldStage`."""

from __future__ import annotations

from typing import ClassVar

from causalkv.stages.base import CausalDenoisingStage


class LingBotWorldStage(CausalDenoisingStage):
    stage_name: ClassVar[str] = "lingbot-world"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True
