"""The reference host runtime: model config, loading (diffusers/transformers), generation, CLI.

    from causalkv.runtime import GenerateOptions, generate
    metrics, run = generate(GenerateOptions(model="tiny-longlive2", prompts=["a", "b"]))

Submodules: `records` (the host's records), the pipeline's steps `plan`, `load`, `run`,
`compare`, `write` (with `report` and `checks`) and `generate` running them in order;
`model_config` (reading a model folder or preset), `presets` and `preset_configs` (tiny models
with random weights), `attention` (causal processors for diffusers' Wan transformer), `text`
(UMT5 prompt encoding), `loading`, `video`, `outputs`, `distributed` and `launch`. The command
line is `causalkv.cli`.
"""

from causalkv.runtime.compare import compare_unquantized, latent_psnr_db
from causalkv.runtime.generate import generate
from causalkv.runtime.load import build_stage
from causalkv.runtime.model_config import ModelFolderError, ModelInfo, load_model_info
from causalkv.runtime.plan import plan_generation
from causalkv.runtime.presets import materialize_preset
from causalkv.runtime.records import DEFAULT_PROMPT, GenerateOptions, GenerationRun, Plan, PluginSet
from causalkv.runtime.report import run_report
from causalkv.runtime.run import run_plan
from causalkv.runtime.write import write_outputs

__all__ = [
    "DEFAULT_PROMPT",
    "GenerateOptions",
    "GenerationRun",
    "ModelFolderError",
    "ModelInfo",
    "Plan",
    "PluginSet",
    "build_stage",
    "compare_unquantized",
    "generate",
    "latent_psnr_db",
    "load_model_info",
    "materialize_preset",
    "plan_generation",
    "run_plan",
    "run_report",
    "write_outputs",
]
