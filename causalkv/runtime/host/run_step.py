"""Step 3 of `causalkv.runtime.host.generate`: build the plan's stage and run its chunk loop.

`run_plan` builds the stage over the loaded components (`build_stage`: its declared sampler,
the chosen cache factory and the resolution's option records, then the run's
``causalkv_configure_stage`` hooks), logs what the built stage runs
(`causalkv.runtime.host.report.describe_stream`), draws the initial noise from one CPU
generator seeded with the request's seed (which also draws every re-noising), and runs the
stage's chunk loop with the ``causalkv_chunk_done`` observers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from causalkv.config import ModelConfig, ServerArgs
from causalkv.runtime.host.hook_calls import ObserverHook, configure_stage
from causalkv.runtime.host.load_step import load_for_plan
from causalkv.runtime.host.pipeline_records import GenerationRun, Plan
from causalkv.runtime.host.report import describe_stream
from causalkv.runtime.host.resolve import Resolution
from causalkv.runtime.model_io.components import Components
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.records import ChunkStats, ForwardRecord

__all__ = ["build_stage", "run_plan"]


def run_plan(
    plan: Plan,
    *,
    pm: Any = None,
    components: Components | None = None,
    server_args: ServerArgs | None = None,
    resolution: Resolution | None = None,
    on_chunk_done: Callable[[int, ChunkStats], None] | None = None,
    on_forward: Callable[[ForwardRecord], None] | None = None,
    strict_plugins: bool = False,
    log: Callable[[str], None] | None = None,
) -> GenerationRun:
    """Build the stage over ``components`` (what `load_for_plan` returned for the plan;
    default: loaded now) and run the chunk loop.

    ``server_args``/``resolution`` replace the plan's (`compare_unquantized` reruns without
    the cache's settings); ``pm``: the plugin manager whose hooks run (default: the plan's).
    A ``causalkv_chunk_done`` implementation that raises is reported once on stderr and
    skipped for the rest of the run, or, with ``strict_plugins``, stops it
    (`causalkv.runtime.host.hook_calls.ObserverHook`). ``log`` receives the header lines of
    the built stage's stream (`describe_stream` of ``stage.settings``:
    ``causalkv_configure_stage`` overrides included) before its first chunk.
    """
    pm = plan.plugin_set(pm).pm
    args = server_args if server_args is not None else plan.server_args
    res = resolution if resolution is not None else plan.resolution
    components = components if components is not None else load_for_plan(plan, pm=pm)
    stage = build_stage(
        res.stage, res.cache_factory, plan.model, args, components,
        negative_prompt=plan.negative_prompt, pm=pm, name=res.stage_name,
        options=res.stage_options, cache_options=res.cache_options,
    )
    if log is not None:
        for line in describe_stream(plan, stage.settings):
            log(line)
    generator = torch.Generator(device="cpu").manual_seed(int(args.seed))
    info = plan.info
    shape = (1, info.latent_channels, plan.num_frames, info.latent_height, info.latent_width)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(components.device)
    observers = ObserverHook(pm, "causalkv_chunk_done", strict=strict_plugins)

    def chunk_done(i: int, stats: ChunkStats) -> None:
        if on_chunk_done is not None:  # the caller's count first: the chunk is done
            on_chunk_done(i, stats)
        observers(stage=stage, chunk_index=i, stats=stats)

    result = stage.loop.run(
        noise, plan.chunk_prompts, generator=generator, on_chunk_done=chunk_done, on_forward=on_forward
    )
    return GenerationRun(
        latents=result.latents,
        chunk_stats=result.chunk_stats,
        stage=stage,
        kv_resident_bytes_final=stage.kv_resident_nbytes(),
        components=components,
        load_seconds=components.load_seconds,
    )


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
