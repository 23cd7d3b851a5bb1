"""The example stage: a CausalDenoisingStage that needs the ``example:ring`` cache feature."""

from causalkv.stages.base import CausalDenoisingStage

from causalkv_example_plugin import RING_FEATURE


class ExampleStage(CausalDenoisingStage):
    stage_name = "example-stage"

    @classmethod
    def required_cache_features(cls, server_args, model=None):
        return super().required_cache_features(server_args, model) | {RING_FEATURE}
