"""The reference host runtime: model config, loading (diffusers/transformers), generation, CLI.

    from causalkv.runtime import GenerateOptions, generate
    metrics, run = generate(GenerateOptions(model="tiny-longlive2", prompts=["a", "b"]))

Sub-packages, by job (each imports only those after it: `host` | `tools` > `files` >
`model_io` > `processes`, a layers contract in pyproject.toml):

- `host`: the reference host's pipeline (`host.resolve` picks the stage and the cache from the
  plugin registry before any weights load; `host.generate` runs the steps `plan_step`,
  `load_step`, `run_step`, `compare_step`, `write_step`, with `request_checks`, `report`,
  `hook_calls` and the steps' records, `pipeline_records`);
- `tools`: tools beside the host (`tools.checkpoints`: tiny checkpoints in sglang's and
  vLLM-Omni's own formats);
- `files`: the files a run reads and writes (`outputs`, `video`, `file_checks`);
- `model_io`: the model's config, presets and components (`model_config`, `preset_configs`,
  `geometry`: a model's geometry for the planner `causalkv.memory`,
  `presets`, `components`, `causal_wan`: causal processors for diffusers' Wan transformer,
  `prompt_encoding`: the UMT5 prompt encoder);
- `processes`: sequence parallelism over torch.distributed (`distributed`) and the torchrun
  supervisor (`launch`, torch-free: also the one reader of torchrun's environment,
  `env_world`).

The command line is `causalkv.cli`.
"""

from __future__ import annotations

from causalkv.lazy import lazy_names

#: each name's module: imported on first use, so ``causalkv.runtime.<light module>`` (the
#: command line's parsers, ``causalkv memory``) imports no torch
_HOMES = {
    "DEFAULT_PROMPT": "causalkv.runtime.host.pipeline_records",
    "GenerateOptions": "causalkv.runtime.host.pipeline_records",
    "GenerationRun": "causalkv.runtime.host.pipeline_records",
    "ModelFolderError": "causalkv.runtime.model_io.model_config",
    "Plan": "causalkv.runtime.host.pipeline_records",
    "PluginSet": "causalkv.runtime.host.pipeline_records",
    "Resolution": "causalkv.runtime.host.resolve",
    "RuntimeModelInfo": "causalkv.runtime.model_io.model_config",
    "resolve": "causalkv.runtime.host.resolve",
    "build_stage": "causalkv.runtime.host.run_step",
    "compare_unquantized": "causalkv.runtime.host.compare_step",
    "generate": "causalkv.runtime.host.generate",
    "latent_psnr_db": "causalkv.runtime.host.compare_step",
    "load_model_info": "causalkv.runtime.model_io.model_config",
    "materialize_preset": "causalkv.runtime.model_io.presets",
    "plan_generation": "causalkv.runtime.host.plan_step",
    "run_plan": "causalkv.runtime.host.run_step",
    "run_report": "causalkv.runtime.host.report",
    "write_outputs": "causalkv.runtime.host.write_step",
}


__all__ = sorted(_HOMES)

__getattr__ = lazy_names(__name__, _HOMES)
