"""`LongLive2Stage`."""

from __future__ import annotations

from typing import ClassVar

from causalkv.stages.base import CausalDenoisingStage


class LongLive2Stage(CausalDenoisingStage):
    stage_name: ClassVar[str] = "longlive2"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return True
