"""Step 1 of `causalkv.runtime.host.generate`: plan a request, before any weights load.

`plan_generation` reads the model's config files (JSON only), resolves the stage and the
cache through the plugin registry (which also routes the request's option records to them),
lets the stage split the prompts into chunks, validate the request and place each chunk's RoPE
frames (the stage's planning, all in one place), and runs every check that needs no weights on
the plan (`causalkv.runtime.host.request_checks.check_before_load`, which asks the stage
nothing). Every bad input is refused here, in milliseconds.

Bounds before cost: the only part of a plan proportional to the request, the per-chunk prompt
list (a reference per chunk), is built after `causalkv.runtime.host.request_checks.check_sizes` has held
the frames to the RoPE limit and every size to the memory (the RoPE tables of that limit,
8 x head_dim bytes a position, cost more than the list's 8 bytes a chunk), so planning never
holds more than the run would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from causalkv.config import check_prompts
from causalkv.runtime.host.pipeline_records import GenerateOptions, Plan, PluginSet
from causalkv.runtime.host.request_checks import (
    check_before_load,
    check_request_effect,
    check_sizes,
)
from causalkv.runtime.host.resolve import resolve
from causalkv.runtime.model_io.model_config import load_model_info
from causalkv.runtime.processes.distributed import check_parallel_request

__all__ = ["plan_generation"]


def plan_generation(options: GenerateOptions, *, pm: Any = None, plugins: PluginSet | None = None) -> Plan:
    """Read the model config, resolve stage and cache, validate the request (no weights).

    ``plugins``: the run's plugins (default: collected from ``pm``, default the process-wide
    manager); the plan carries them to the later steps. Multi-shot is automatic: with more
    than one prompt and a stage that wants it (`CausalDenoisingStage.wants_multi_shot`:
    LongLive 2.0, unless multi-shot sinks are off or the sink is empty), the request is
    resolved again with ``multi_shot=True`` (the cache must then support a pinned shot
    sink). The stage's `plan_chunks` expands the prompts with its own option record. Raises
    a `causalkv.errors.CausalKVError` (a ValueError) naming the bad value and the fix.
    """
    plugins = plugins if plugins is not None else PluginSet.collect(pm)
    if options.strict_plugins:
        plugins.refuse_failures()
    pm, registry = plugins.pm, plugins.registry
    prompts = check_prompts(options.prompts)
    info = load_model_info(options.model, registry=registry)
    model = info.config
    guidance = options.guidance_scale if options.guidance_scale is not None else info.guidance_scale
    args = replace(options.server_args, guidance_scale=float(guidance))
    num_frames = options.frames if options.frames is not None else info.default_frames
    res = resolve(model, args, pm=pm, stage=options.stage, registry=registry)
    if res.stage.wants_multi_shot(model, args, len(prompts)):
        args = replace(args, multi_shot=True)
        res = resolve(model, args, pm=pm, stage=options.stage, registry=registry)
    settings = res.stage.check_request(model, args, num_frames)
    check_parallel_request(args.heads_sharded, num_heads=model.num_heads,
                           tokens_per_chunk=settings.tokens_per_chunk, device=args.device)
    negative = options.negative_prompt if options.negative_prompt is not None else info.negative_prompt
    plan = Plan(
        info=info,
        server_args=args,
        resolution=res,
        num_frames=num_frames,
        prompts=prompts,
        chunk_prompts=[],
        settings=settings,
        negative_prompt=negative,
        plugins=plugins,
    )
    # bounds before cost: the frame count against the RoPE limit and every size against the
    # memory, before the per-chunk prompt list (one entry per chunk) is built
    check_sizes(plan)
    check_request_effect(plan, options)
    # the stage plans the chunks in one place: one prompt per chunk, checked, and where each
    # chunk's RoPE frames start; the checks below read them from the plan
    chunk_prompts = res.stage.plan_chunks(prompts, num_frames // settings.frames_per_chunk, args)
    res.stage.check_request(model, args, num_frames, chunk_prompts)
    plan.chunk_prompts = chunk_prompts
    plan.rope_frame_starts = res.stage.planned_rope_frame_starts(model, args, settings, chunk_prompts)
    check_before_load(plan, options)
    return plan
