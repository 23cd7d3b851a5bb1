"""sglang's LongLive 2.0 pipeline running the plugin's stage, registered through sglang's own
extension point: with ``SGLANG_EXTERNAL_MODEL_PACKAGE=causalkv_host_plugin.sglang_pipeline``
sglang imports this module in each process that resolves a model, and a model folder whose
``model_index.json`` names ``ToyLongLive2Pipeline`` runs it (LongLive 2.0's configs)."""

from sglang.multimodal_gen.configs.pipeline_configs.longlive2 import LongLive2T2VConfig
from sglang.multimodal_gen.configs.sample.longlive2 import LongLive2SamplingParams
from sglang.multimodal_gen.registry import register_pipeline
from sglang.multimodal_gen.runtime.pipelines.longlive2_pipeline import LongLive2Pipeline
from sglang.multimodal_gen.runtime.pipelines_core.stages import InputValidationStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2ImageVAEEncodingStage,
    LongLive2LatentPreparationStage,
    LongLive2TextEncodingStage,
)

from causalkv_host_plugin.sglang_stage import ToyLongLive2Stage


class ToyLongLive2Pipeline(LongLive2Pipeline):
    """sglang 0.5.23's ``LongLive2Pipeline.create_pipeline_stages`` with the plugin's stage."""

    pipeline_name = "ToyLongLive2Pipeline"

    def create_pipeline_stages(self, server_args) -> None:
        self.add_stage(InputValidationStage())
        self.add_stage(LongLive2TextEncodingStage(text_encoders=[self.get_module("text_encoder")],
                                                  tokenizers=[self.get_module("tokenizer")]))
        self.add_stage(LongLive2ImageVAEEncodingStage(vae=self.get_module("vae"), component_name="vae"))
        self.add_stage(LongLive2LatentPreparationStage(scheduler=self.get_module("scheduler"),
                                                       transformer=self.get_module("transformer")))
        self.add_stage(ToyLongLive2Stage(transformer=self.get_module("transformer"),
                                         scheduler=self.get_module("scheduler")))
        self.add_standard_decoding_stage()


register_pipeline(ToyLongLive2Pipeline, sampling_param_cls=LongLive2SamplingParams,
                  pipeline_config_cls=LongLive2T2VConfig)
