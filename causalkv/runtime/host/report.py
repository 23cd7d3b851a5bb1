"""What a run reports: the metrics (`run_report`, the keys docs/usage.md lists), the run's
header lines (`describe_plan`, `describe_stream`) and the header of saved latents (`latents_metadata`).

Read from the typed records: the plan, the `GenerationRun` and its `ChunkStats`, the
stage's own `report()`, the chosen cache's settings record (`cache_description`) and its
kind's `causalkv.hooks.CacheKind` calls (``describe_request``, ``packing_report``), through
the factory; nothing here names a stage family or a cache.
"""

from __future__ import annotations

from typing import Any

from causalkv.runtime.host.pipeline_records import GenerationRun, Plan
from causalkv.runtime.host.resolve import Resolution
from causalkv.runtime.processes.distributed import current, gather_ints
from causalkv.stages.settings import StreamSettings

__all__ = [
    "cache_description",
    "describe_plan",
    "describe_stream",
    "latents_metadata",
    "run_report",
]


def run_report(plan: Plan, run: GenerationRun) -> dict[str, Any]:
    """The run's metrics: request, stream settings, per-chunk timings and KV bytes, and the
    stage's own entries (`CausalDenoisingStage.report`).

    The stream settings are the ones the stage ran with (``run.stage.settings``), so a
    ``causalkv_configure_stage`` override (``window_frames``, ...) shows here, not the plan's."""
    res, s, args = plan.resolution, run.stage.settings, plan.server_args
    # the KV bytes of every rank (``kv_resident_bytes_max`` is this rank's): one collective on a
    # sequence-parallel run, so every rank must call it
    ctx, world, mine = current(), int(getattr(run.stage.denoiser, "world_size", 1)), run.kv_resident_bytes_max
    per_rank = gather_ints(mine, ctx) if ctx is not None and world > 1 else [mine]
    return {
        "model": plan.model.name,
        "model_class": plan.model.model_class,
        "stage": res.stage_name,
        "stage_class": f"{res.stage.__module__}:{res.stage.__qualname__}",
        "cache": res.cache_factory.name,
        "cache_options": cache_description(res),
        # the same settings as data (config key -> value: kv_cache_quant names the codec)
        "cache_settings": res.cache_options.to_mapping() if res.cache_options is not None else None,
        "requirements": sorted(res.requirements),
        "reasons": list(res.reasons),
        "prompts": plan.prompts,
        "chunk_prompts": plan.chunk_prompts,
        **{k: getattr(args, k) for k in ("multi_shot", "guidance_scale", "seed", "dtype")},
        "kv_cache_dtype": args.kv_cache_dtype or args.dtype,
        "device": args.device,
        "frames": plan.num_frames,
        # the stream settings the stage ran with
        **{k: getattr(s, k) for k in ("frames_per_chunk", "tokens_per_frame", "sink_frames",
                                      "global_sink_frames", "window_frames", "cache_frames",
                                      "recent_window_frames")},
        "chunks": plan.num_chunks,
        "latent_shape": list(run.latents.shape),
        "seconds_per_chunk": run.seconds_per_chunk,
        "seconds_per_chunk_mean": run.seconds_per_chunk_mean,
        "load_seconds": run.load_seconds,
        "kv_resident_bytes_per_chunk": [int(st.kv_resident_bytes) for st in run.chunk_stats],
        "kv_resident_bytes_max": run.kv_resident_bytes_max,
        "kv_resident_bytes_final": run.kv_resident_bytes_final,
        "kv_peak_bytes": run.stage.kv_peak_nbytes(),
        # what the caches did, all layers and branches merged (QVG: chunks packed, chunks kept
        # dense by reason, centroids used); None when no cache reports (a dense cache)
        "kv_packing": res.cache_factory.packing_report([c for cs in run.stage.cache_sets() for c in cs.kv]),
        "world_size": world,
        "kv_heads_per_rank": int(run.stage.denoiser.num_heads),
        "kv_resident_bytes_max_per_rank": per_rank,
        "kv_resident_bytes_max_total": sum(per_rank),
        **run.stage.report(),
    }


def cache_description(res: Resolution) -> str:
    """The chosen cache's settings in one line (``cache_options`` of the metrics): its
    options record's `describe` (``"qvg(int2, ...)"``), ``"none"`` for a cache without one."""
    return res.cache_options.describe() if res.cache_options is not None else "none"


def describe_plan(plan: Plan) -> list[str]:
    """The first lines of a run's human-readable header, known before any weights load:
    model, stage, cache, reasons (the rest: `describe_stream`)."""
    res, record = plan.resolution, plan.resolution.cache_options
    settings = "no settings" if record is None else f"{type(record).title}: {record.describe()}"
    return [
        f"model: {plan.model.name} ({plan.model.model_class})",
        f"stage: {res.stage_name} ({res.stage.__module__}:{res.stage.__qualname__})",
        f"cache: {res.cache_factory.name} ({settings})",
        *(f"  - {line}" for line in res.reasons),
    ]


def describe_stream(plan: Plan, s: StreamSettings) -> list[str]:
    """The rest of the header, which depends on the stream settings ``s``: the cache's
    description of the request (``describe_request``) and the ``stream:`` line.
    `causalkv.runtime.host.run_step.run_plan` logs them once the stage is built, for the
    settings it runs with (``stage.settings``: ``causalkv_configure_stage`` overrides included)."""
    res = plan.resolution
    lines = [f"  - {line}" for line in res.cache_factory.describe_request(
        res.cache_options, tokens_per_chunk=s.tokens_per_chunk,
        sink_tokens=s.sink_frames * s.tokens_per_frame,
    )]
    lines.append(
        f"stream: {plan.num_frames} latent frames in {plan.num_chunks} chunks of "
        f"{s.frames_per_chunk}; sink {s.sink_frames}, window {s.window_frames}, cache "
        f"{s.cache_frames} frames"
        + (f", recent window {s.recent_window_frames}" if s.recent_window_frames is not None else "")
        + (f"; multi-shot ({len(plan.prompts)} shots)" if plan.server_args.multi_shot else "")
    )
    return lines


def latents_metadata(plan: Plan) -> dict[str, str]:
    """What a saved latents file records about its run (safetensors header strings)."""
    res, args = plan.resolution, plan.server_args
    return {
        "model": plan.model.name, "stage": res.stage_name, "cache": res.cache_factory.name,
        "cache_options": cache_description(res), "seed": str(args.seed),
        "frames": str(plan.num_frames), "fps": str(plan.info.fps), "layout": "B,C,F,h,w",
    }
