"""A stage sglang's LongLive 2.0 pipeline could run, that causalkv does not ship (imports sglang)."""

from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2CausalDenoisingStage,
)


class ToyLongLive2Stage(LongLive2CausalDenoisingStage):
    """LongLive 2.0's stage under another name: every method the bridge wraps is inherited."""
