"""`LongLiveStage`."""

from __future__ import annotations

from typing import ClassVar

from causalkv.stages.base import CausalDenoisingStage


class LongLiveStage(CausalDenoisingStage):
    stage_name: ClassVar[str] = "longlive"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True
