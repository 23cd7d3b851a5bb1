"""Step 2 of `causalkv.runtime.host.generate`: load the plan's model and build its stage.

`load_for_plan` joins the ranks of a sequence-parallel request, materializes a preset on first
use (once per node), loads the components with ``from_pretrained`` and makes the transformer
one rank of the job. `build_stage` builds the stage over them: its declared sampler, the
chosen cache factory and both option records, then ``causalkv_configure_stage``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from causalkv.config import ModelConfig, ServerArgs
from causalkv.runtime.files.file_checks import fs_error_reason
from causalkv.runtime.files.outputs import OutputWriteError
from causalkv.runtime.host.hook_calls import configure_stage
from causalkv.runtime.host.pipeline_records import DEFAULT_PROMPT, Plan
from causalkv.runtime.model_io.components import Components, load_components
from causalkv.runtime.model_io.model_config import ModelInfo
from causalkv.runtime.model_io.presets import causalkv_home, materialize_preset
from causalkv.runtime.processes.distributed import join_ranks, local_main_first
from causalkv.stages.base import CausalDenoisingStage

__all__ = ["build_stage", "load_for_plan", "make_parallel", "model_folder"]


def model_folder(info: ModelInfo, *, pm: Any = None, registry: Any = None) -> Path:
    """The folder to load from: a preset is created on first use."""
    if info.preset is not None:
        try:
            return materialize_preset(info.preset, pm=pm, registry=registry)
        except OSError as exc:  # a file system that fills up or turns read-only while it builds
            where = info.path.parent if info.path is not None else causalkv_home()
            raise OutputWriteError(
                f"could not build the preset {info.preset!r} in {str(where)!r} "
                f"({fs_error_reason(exc, where)}); nothing was left there; free some space or set "
                "CAUSALKV_HOME to a writable folder"
            ) from None
    assert info.path is not None
    return info.path


def make_parallel(components: Components, server_args: ServerArgs) -> None:
    """Make ``components``' transformer one rank of the request's sequence-parallel job (a
    no-op on one process, or when it is one already)."""
    ctx = join_ranks(server_args.heads_sharded, server_args.device)
    if ctx is not None and components.transformer.world_size == 1:
        components.transformer.enable_sequence_parallel(ctx)


def load_for_plan(plan: Plan, *, pm: Any = None) -> Components:
    """Load the plan's model components (a preset folder is built on first use, by each
    node's first rank), as one rank of the job when the request is sequence parallel."""
    args = plan.server_args
    registry = plan.plugin_set(pm).registry
    join_ranks(args.heads_sharded, args.device)  # before the preset: the ranks share one folder
    folder = local_main_first(lambda: model_folder(plan.info, registry=registry))
    components = load_components(plan.info, folder, dtype=args.dtype, device=args.device)
    # the host's own default prompt is not the user's: its cut on a tiny preset is not reported
    components.prompt_encoder.quiet_texts = frozenset({DEFAULT_PROMPT})
    make_parallel(components, args)
    return components


def build_stage(
    stage_cls: type[CausalDenoisingStage],
    cache_factory: Any,
    model: ModelConfig,
    server_args: ServerArgs,
    components: Components,
    *,
    negative_prompt: str = "",
    pm: Any = None,
    name: str | None = None,
    options: Any = None,
    cache_options: Any = ...,
) -> CausalDenoisingStage:
    """Build ``stage_cls`` over the loaded ``components`` with caches from ``cache_factory``.

    The sampler is the stage's own (``stage_cls.scheduler_spec(model).build()``, from its
    ``scheduler_spec``). ``options`` is the family's request record and ``cache_options`` the
    cache's settings record (defaults: taken from ``server_args``, `CausalDenoisingStage`).

    With a plugin manager, ``causalkv_configure_stage`` runs on the built stage: attributes
    its implementations set stay, and the `ModelConfig` overrides they return are applied
    to the same stage before its caches are allocated (once, on first use).
    """
    stage = stage_cls(
        model,
        server_args,
        denoiser=components.transformer,
        scheduler=stage_cls.scheduler_spec(model).build(),
        cache_factory=cache_factory,
        encode_prompt=components.prompt_encoder,
        negative_prompt=negative_prompt,
        name=name,
        options=options,
        cache_options=cache_options,
    )
    if pm is not None:  # a raising implementation: PluginHookError naming the plugin
        configure_stage(pm, stage, model, server_args)
    return stage
