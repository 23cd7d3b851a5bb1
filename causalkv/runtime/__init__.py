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

from causalkv.config import ModelConfig, ServerArgs
from causalkv.runtime.generate import (
    DEFAULT_PROMPT,
    GenerateOptions,
    GenerationRun,
    Plan,
    PluginSet,
    build_stage,
    compare_unquantized,
    generate,
    latent_psnr_db,
    plan_generation,
    run_plan,
    run_report,
    split_prompts,
    write_outputs,
)
from causalkv.runtime.model_config import ModelFolderError, ModelInfo, load_model_info
from causalkv.runtime.presets import PRESETS, materialize_preset

__all__ = [
    "DEFAULT_PROMPT",
    "PRESETS",
    "GenerateOptions",
    "GenerationRun",
    "ModelConfig",
    "ModelFolderError",
    "ModelInfo",
    "Plan",
    "PluginSet",
    "ServerArgs",
    "build_stage",
    "compare_unquantized",
    "generate",
    "latent_psnr_db",
    "load_model_info",
    "materialize_preset",
    "plan_generation",
    "run_plan",
    "run_report",
    "split_prompts",
    "write_outputs",
]
