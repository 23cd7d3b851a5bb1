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

from __future__ import annotations

from importlib import import_module
from typing import Any

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

#: each name's module: imported on first use, so ``causalkv.runtime.<light module>`` (the
#: command line's parsers, ``causalkv memory``) imports no torch
_HOMES = {
    "DEFAULT_PROMPT": "causalkv.runtime.records",
    "GenerateOptions": "causalkv.runtime.records",
    "GenerationRun": "causalkv.runtime.records",
    "ModelFolderError": "causalkv.runtime.model_config",
    "ModelInfo": "causalkv.runtime.model_config",
    "Plan": "causalkv.runtime.records",
    "PluginSet": "causalkv.runtime.records",
    "build_stage": "causalkv.runtime.load",
    "compare_unquantized": "causalkv.runtime.compare",
    "generate": "causalkv.runtime.generate",
    "latent_psnr_db": "causalkv.runtime.compare",
    "load_model_info": "causalkv.runtime.model_config",
    "materialize_preset": "causalkv.runtime.presets",
    "plan_generation": "causalkv.runtime.plan",
    "run_plan": "causalkv.runtime.run",
    "run_report": "causalkv.runtime.report",
    "write_outputs": "causalkv.runtime.write",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'causalkv.runtime' has no attribute {name!r}")
    return getattr(import_module(home), name)
