"""The reference host: plan a request (JSON only), load, run, compare, write, report.

`generate` is four steps, each usable alone:

1. `plan_generation` reads the model's config files, resolves the stage and cache through the
   plugin system and validates the request (the stage splits the prompts into chunks): every
   bad input is refused there, before any weights load.
2. `run_plan` loads the components (materializing a preset on first use), builds the stage
   (`build_stage`: ``causalkv_configure_stage`` applies to that one stage before its caches
   are allocated) and runs the chunk loop.
3. `compare_unquantized` reruns with quantization off and measures the latent PSNR.
4. `write_outputs` decodes and writes the video; `run_report` assembles the metrics, with
   the stage's own entries (`CausalDenoisingStage.report`).

Sequence parallel (``server_args.heads_sharded = N > 1``, N torchrun ranks): the plan refuses
what cannot be split (`causalkv.runtime.distributed.check_parallel_request`), `run_plan`
joins the process group and makes the transformer one rank of it before the stage allocates
its caches (each rank caches ``H/N`` heads), every rank runs the same loop and ends with the
same latents; `generate` logs and writes the video on rank 0 only.

The host imports no model-specific module: everything a model family adds comes from its
stage and registration.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from causalkv.config import ModelConfig, ServerArgs, check_prompts
from causalkv.errors import ConfigError
from causalkv.options import CacheOptions
from causalkv.runtime.checks import check_before_load
from causalkv.runtime.loading import Components, load_components, load_vae
from causalkv.runtime.model_config import ModelInfo, load_model_info
from causalkv.runtime.outputs import OutputLog, keep_latents, save_latents, write_json_atomic
from causalkv.runtime.plugin_faults import ObserverHook, configure_stage_checked
from causalkv.runtime.presets import materialize_preset
from causalkv.stages.base import CausalDenoisingStage, ForwardRecord, StreamSettings
from causalkv.stages.records import ChunkStats

if TYPE_CHECKING:
    from causalkv.plugin import Resolution

__all__ = [
    "DEFAULT_PROMPT",
    "GenerateOptions",
    "GenerationRun",
    "Plan",
    "build_stage",
    "compare_unquantized",
    "generate",
    "latent_psnr_db",
    "latents_metadata",
    "plan_generation",
    "run_plan",
    "run_report",
    "split_prompts",
    "write_outputs",
]

DEFAULT_PROMPT = "A red fox trots through fresh snow in a pine forest at dawn, cinematic light."


@dataclass
class GenerateOptions:
    """One ``causalkv generate`` request.

    Attributes:
        model: preset name or model folder.
        prompts: one prompt per shot; the stage splits them into chunk prompts.
        frames: latent frames (None: the model's ``default_frames``).
        server_args: quant config, sink/window overrides, seed, dtype, device, ``--cache``.
        guidance_scale: CFG scale (None: the model's default; used by LongLive 2.0).
        negative_prompt: negative CFG text (None: the model's default).
        stage: force a stage by registration name (None: resolution picks).
        compare_bf16: also run with quantization off (same seed) and report latent PSNR.
        output: the video file (None: do not decode).
        quiet: no progress bar.
        metrics: write the metrics JSON here (atomically; None: do not write).
        save_latents: save the latents ``[B, C, F, h, w]`` to this ``.safetensors`` file.
        strict_plugins: a ``causalkv_chunk_done`` implementation that raises stops the run
            (`causalkv.runtime.plugin_faults.PluginHookError`) instead of being reported
            once and skipped.
    """

    model: str = "tiny-wan"
    prompts: Sequence[str] = (DEFAULT_PROMPT,)
    frames: int | None = None
    server_args: ServerArgs = field(default_factory=ServerArgs)
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    stage: str | None = None
    compare_bf16: bool = False
    output: str | Path | None = None
    quiet: bool = False
    metrics: str | Path | None = None
    save_latents: str | Path | None = None
    strict_plugins: bool = False


@dataclass
class Plan:
    """A validated request: model, effective server args, resolution, per-chunk prompts."""

    info: ModelInfo
    server_args: ServerArgs
    resolution: Resolution
    num_frames: int
    prompts: list[str]
    chunk_prompts: list[str]
    settings: StreamSettings
    stage_name: str | None = None
    negative_prompt: str = ""

    @property
    def model(self) -> ModelConfig:
        return self.info.config

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_prompts)


@dataclass
class GenerationRun:
    """The outcome of one chunk loop: latents ``[B, C, F, h, w]``, one `ChunkStats` per
    chunk, the stage."""

    latents: torch.Tensor
    chunk_stats: list[ChunkStats]
    stage: CausalDenoisingStage
    kv_resident_bytes_final: int
    components: Components | None = None
    load_seconds: float = 0.0

    @property
    def seconds_per_chunk(self) -> list[float]:
        return [float(s.seconds) for s in self.chunk_stats]

    @property
    def seconds_per_chunk_mean(self) -> float:
        seconds = self.seconds_per_chunk
        return sum(seconds) / max(1, len(seconds))

    @property
    def kv_resident_bytes_max(self) -> int:
        return max([*(int(s.kv_resident_bytes) for s in self.chunk_stats), self.kv_resident_bytes_final])


def split_prompts(prompts: Sequence[str], num_chunks: int, *, scene_cuts: bool) -> list[str]:
    """One prompt per chunk, as the base stage splits them; with ``scene_cuts`` as the
    highest-priority registered multi-shot stage does for a multi-shot request (compatibility
    wrapper of `CausalDenoisingStage.plan_chunks`)."""
    from causalkv.plugin import get_plugin_manager
    from causalkv.plugin.registry import collect

    stage: type[CausalDenoisingStage] = CausalDenoisingStage
    if scene_cuts:
        registry = collect(get_plugin_manager())
        multi = [e for e in registry.stages if e.supports("multi_shot")]
        if not multi:
            raise ConfigError("no registered stage supports multi-shot generation (scene cuts)")
        stage = max(multi, key=lambda e: e.registration.priority).load()
    return stage.plan_chunks(prompts, num_chunks, ServerArgs(multi_shot=scene_cuts))


def plan_generation(options: GenerateOptions, *, pm: Any = None) -> Plan:
    """Read the model config, resolve stage and cache, validate the request (no weights).

    Multi-shot is automatic: with more than one prompt and a stage that supports it
    (LongLive 2.0), unless multi-shot sinks are off or the sink is empty, the request is
    resolved again with ``multi_shot=True`` (the cache must then support a pinned shot
    sink). The stage's `plan_chunks` expands the prompts with the request's shot fields
    (``server_args.shots``) and checks its motion signal (``server_args.motion``).
    Everything else knowable without weights is checked too
    (`causalkv.runtime.checks.check_before_load`: RoPE limit, device and dtype, output paths
    and formats, the model folder's files). Raises a `causalkv.errors.CausalKVError` (a
    ValueError) naming the bad value and the fix.
    """
    from causalkv.plugin import get_plugin_manager, resolve

    pm = pm if pm is not None else get_plugin_manager()
    prompts = check_prompts(options.prompts)
    info = load_model_info(options.model, pm=pm)
    model = info.config
    guidance = options.guidance_scale if options.guidance_scale is not None else info.guidance_scale
    args = replace(options.server_args, guidance_scale=float(guidance))
    num_frames = options.frames if options.frames is not None else info.default_frames
    res = resolve(model, args, pm=pm, stage=options.stage)
    if res.stage.wants_multi_shot(model, args, len(prompts)):
        args = replace(args, multi_shot=True)
        res = resolve(model, args, pm=pm, stage=options.stage)
    settings = res.stage.check_request(model, args, num_frames)
    if args.heads_sharded > 1:
        from causalkv.runtime.distributed import check_parallel_request

        check_parallel_request(args.heads_sharded, num_heads=model.num_heads,
                               tokens_per_chunk=settings.tokens_per_chunk, device=args.device)
    chunk_prompts = res.stage.plan_chunks(prompts, num_frames // settings.frames_per_chunk, args)
    res.stage.check_request(model, args, num_frames, chunk_prompts)
    negative = options.negative_prompt if options.negative_prompt is not None else info.negative_prompt
    plan = Plan(
        info=info,
        server_args=args,
        resolution=res,
        num_frames=num_frames,
        prompts=prompts,
        chunk_prompts=chunk_prompts,
        settings=settings,
        stage_name=options.stage,
        negative_prompt=negative,
    )
    check_before_load(plan, options, pm=pm)
    return plan


def model_folder(info: ModelInfo, *, pm: Any = None) -> Path:
    """The folder to load from: a preset is created on first use."""
    if info.preset is not None:
        return materialize_preset(info.preset, pm=pm)
    assert info.path is not None
    return info.path


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

    The sampler is the stage's own (``stage_cls.make_scheduler(model)``; the base stage's is
    the flow-matching Euler scheduler ``components.scheduler`` also holds).

    With a plugin manager, ``causalkv_configure_stage`` runs on the built stage: attributes
    its implementations set stay, and the `ModelConfig` overrides they return are applied
    to the same stage before its caches are allocated (once, on first use).
    """
    stage = stage_cls(
        model,
        server_args,
        denoiser=components.transformer,
        scheduler=stage_cls.make_scheduler(model),
        cache_factory=cache_factory,
        encode_prompt=components.prompt_encoder,
        negative_prompt=negative_prompt,
        name=name,
        options=options,
        cache_options=cache_options,
    )
    if pm is not None:  # a raising implementation: PluginHookError naming the plugin
        configure_stage_checked(pm, stage, model, server_args)
    return stage


def load_for_plan(plan: Plan, *, pm: Any = None) -> Components:
    """Load the plan's model components (a preset folder is built on first use)."""
    from causalkv.runtime.distributed import local_main_first

    args = plan.server_args
    folder = local_main_first(lambda: model_folder(plan.info, pm=pm))  # ranks share one preset folder
    return load_components(plan.info, folder, dtype=args.dtype, device=args.device)


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
) -> GenerationRun:
    """Load (unless ``components`` are given), build the stage, run the chunk loop.

    ``server_args``/``resolution`` replace the plan's (`compare_unquantized` reruns with
    the quantization off). The initial noise and every re-noising draw come from one CPU
    generator seeded with ``server_args.seed``. A ``causalkv_chunk_done`` implementation
    that raises is reported once on stderr and skipped for the rest of the run, or, with
    ``strict_plugins``, stops it (`causalkv.runtime.plugin_faults.ObserverHook`).
    """
    from causalkv.plugin import get_plugin_manager

    pm = pm if pm is not None else get_plugin_manager()
    args = server_args if server_args is not None else plan.server_args
    res = resolution if resolution is not None else plan.resolution
    load_seconds = 0.0
    parallel = _join_ranks(args)
    if components is None:
        t0 = time.perf_counter()
        components = load_for_plan(plan, pm=pm)
        load_seconds = time.perf_counter() - t0
    if parallel is not None and components.transformer.world_size == 1:
        components.transformer.enable_sequence_parallel(parallel)
    stage = build_stage(
        res.stage, res.cache_factory, plan.model, args, components,
        negative_prompt=plan.negative_prompt, pm=pm, name=res.stage_name,
        options=res.stage_options, cache_options=res.cache_options,
    )
    generator = torch.Generator(device="cpu").manual_seed(int(args.seed))
    info = plan.info
    shape = (1, info.latent_channels, plan.num_frames, info.latent_height, info.latent_width)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(components.device)
    observers = ObserverHook(pm, "causalkv_chunk_done", strict=strict_plugins)

    def chunk_done(i: int, stats: ChunkStats) -> None:
        if on_chunk_done is not None:  # the caller's count first: the chunk is done
            on_chunk_done(i, stats)
        observers(stage=stage, chunk_index=i, stats=stats)

    result = stage.generate(
        noise, plan.chunk_prompts, generator=generator, on_chunk_done=chunk_done, on_forward=on_forward
    )
    return GenerationRun(
        latents=result.latents,
        chunk_stats=result.chunk_stats,
        stage=stage,
        kv_resident_bytes_final=stage.kv_resident_nbytes(),
        components=components,
        load_seconds=load_seconds,
    )


def _join_ranks(args: ServerArgs) -> Any:
    """The `ParallelContext` of a sequence-parallel request (joins torchrun's process group
    on first use), None on one process. `ConfigError` when the ranks do not match the request."""
    if args.heads_sharded <= 1:
        return None
    from causalkv.runtime.distributed import current, init_parallel, launched_by_torchrun

    ctx = current()
    if ctx is None and launched_by_torchrun():
        ctx = init_parallel(args.device)
    if ctx is None or ctx.world_size != args.heads_sharded:
        have = 1 if ctx is None else ctx.world_size
        raise ConfigError(
            f"heads_sharded={args.heads_sharded} needs as many torchrun ranks, this job has {have}; "
            f"run `causalkv generate --nproc-per-node {args.heads_sharded} ...` or torchrun"
        )
    return ctx


def _is_main_rank() -> bool:
    from causalkv.runtime.distributed import current

    ctx = current()
    return ctx is None or ctx.is_main


def latent_psnr_db(latents: torch.Tensor, reference: torch.Tensor) -> float | None:
    """PSNR of ``latents`` against ``reference`` in dB (None when they are identical).

    Peak = ``reference.max() - reference.min()``; PSNR = 10 log10(peak^2 / MSE), in float64.
    """
    ref = reference.double()
    mse = float(((latents.double() - ref) ** 2).mean())
    if mse == 0.0:
        return None
    peak = float(ref.max() - ref.min())
    return 10.0 * math.log10(peak * peak / mse)


def compare_unquantized(plan: Plan, run: GenerationRun, *, pm: Any = None) -> dict[str, Any]:
    """Rerun ``plan`` with quantization off (same seed, same components); the comparison metrics."""
    from causalkv.plugin import resolve

    ref_args = replace(plan.server_args.without_options(CacheOptions), cache=None)
    ref_res = resolve(plan.model, ref_args, pm=pm, stage=plan.stage_name)
    ref = run_plan(plan, pm=pm, components=run.components, server_args=ref_args, resolution=ref_res)
    psnr = latent_psnr_db(run.latents, ref.latents)
    return {
        "reference_cache": ref_res.cache_factory.name,
        "latent_psnr_db": psnr,
        "latent_identical": psnr is None,
        "latent_max_abs_diff": float((run.latents - ref.latents).abs().max()),
        "reference_kv_resident_bytes_max": ref.kv_resident_bytes_max,
        "reference_seconds_per_chunk_mean": ref.seconds_per_chunk_mean,
        "kv_compression_vs_reference": ref.kv_resident_bytes_max / max(1, run.kv_resident_bytes_max),
    }


def latents_metadata(plan: Plan) -> dict[str, str]:
    """What a saved latents file records about its run (safetensors header strings)."""
    res, args = plan.resolution, plan.server_args
    return {
        "model": plan.model.name, "stage": res.stage_name, "cache": res.cache_factory.name,
        "kv_cache_quant": cache_description(res), "seed": str(args.seed),
        "frames": str(plan.num_frames), "fps": str(plan.info.fps), "layout": "B,C,F,h,w",
    }


def write_outputs(plan: Plan, run: GenerationRun, output: str | Path, *, pm: Any = None) -> dict[str, Any]:
    """Decode the run's latents with the model's VAE and write the video; its metrics.

    The video is written atomically. If decoding or writing fails, the latents are saved to
    ``NAME.latents.safetensors`` next to ``output`` and `OutputWriteError` names that file.
    """
    from causalkv.runtime.video import decode_latents, write_video

    device = run.components.device if run.components is not None else plan.server_args.device
    try:
        vae = load_vae(model_folder(plan.info, pm=pm), device=device)
        frames = decode_latents(vae, run.latents)
        written = write_video(frames, output, fps=plan.info.fps)
    except Exception as exc:  # noqa: BLE001 - a finished generation is kept whatever failed
        raise keep_latents(output, run.latents, exc, metadata=latents_metadata(plan)) from exc
    return {
        "output": str(written),
        "video_frames": int(frames.shape[0]),
        "video_size": [int(frames.shape[1]), int(frames.shape[2])],
    }


def run_report(plan: Plan, run: GenerationRun) -> dict[str, Any]:
    """The run's metrics: request, stream settings, per-chunk timings and KV bytes, and the
    stage's own entries (`CausalDenoisingStage.report`)."""
    res, s, args = plan.resolution, plan.settings, plan.server_args
    return {
        "model": plan.model.name,
        "model_class": plan.model.model_class,
        "stage": res.stage_name,
        "stage_class": f"{res.stage.__module__}:{res.stage.__qualname__}",
        "cache": res.cache_factory.name,
        "kv_cache_quant": cache_description(res),
        "requirements": sorted(res.requirements),
        "reasons": list(res.reasons),
        "prompts": plan.prompts,
        "chunk_prompts": plan.chunk_prompts,
        "multi_shot": args.multi_shot,
        "guidance_scale": args.guidance_scale,
        "seed": args.seed,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype or args.dtype,
        "device": args.device,
        "frames": plan.num_frames,
        "frames_per_chunk": s.frames_per_chunk,
        "tokens_per_frame": s.tokens_per_frame,
        "sink_frames": s.sink_frames,
        "global_sink_frames": s.global_sink_frames,
        "window_frames": s.window_frames,
        "cache_frames": s.cache_frames,
        "recent_window_frames": s.recent_window_frames,
        "chunks": plan.num_chunks,
        "latent_shape": list(run.latents.shape),
        "seconds_per_chunk": run.seconds_per_chunk,
        "seconds_per_chunk_mean": run.seconds_per_chunk_mean,
        "load_seconds": run.load_seconds,
        "kv_resident_bytes_per_chunk": [int(st.kv_resident_bytes) for st in run.chunk_stats],
        "kv_resident_bytes_max": run.kv_resident_bytes_max,
        "kv_resident_bytes_final": run.kv_resident_bytes_final,
        "kv_packing": packing_summary(run.stage),
        **_rank_metrics(run),
        **run.stage.report(),
    }


def packing_summary(stage: CausalDenoisingStage) -> dict[str, Any] | None:
    """What the stage's packed caches did, all layers and branches summed: chunks packed, chunks
    kept dense by reason (``"recent"``, ``"not smaller than dense"``, ...), centroids used.
    None when no cache reports packing (a dense cache)."""
    reports = [
        cache.packing_report()
        for cs in stage.cache_sets()
        for cache in cs.kv
        if callable(getattr(cache, "packing_report", None))
    ]
    if not reports:
        return None
    return type(reports[0]).merge(reports).to_dict()
def _rank_metrics(run: GenerationRun) -> dict[str, Any]:
    """``world_size`` and the KV bytes of every rank (``kv_resident_bytes_max`` is this
    rank's; one collective on a sequence-parallel run, so every rank must call it)."""
    from causalkv.runtime.distributed import current, gather_ints

    ctx = current()
    world = int(getattr(run.stage.denoiser, "world_size", 1))
    per_rank = [run.kv_resident_bytes_max]
    if ctx is not None and world > 1:
        per_rank = gather_ints(run.kv_resident_bytes_max, ctx)
    return {
        "world_size": world,
        "kv_heads_per_rank": int(run.stage.denoiser.num_heads),
        "kv_resident_bytes_max_per_rank": per_rank,
        "kv_resident_bytes_max_total": sum(per_rank),
    }


def cache_description(res: Resolution) -> str:
    """The chosen cache's settings in one line (``kv_cache_quant`` of the metrics): its
    options record's `describe` (``"qvg(int2, ...)"``), ``"off"`` for a cache without one."""
    return res.cache_options.describe() if res.cache_options is not None else "off"


def describe_plan(plan: Plan) -> list[str]:
    """The human-readable header of a run: model, stage, cache, reasons, stream."""
    res, s = plan.resolution, plan.settings
    lines = [
        f"model: {plan.model.name} ({plan.model.model_class})",
        f"stage: {res.stage_name} ({res.stage.__module__}:{res.stage.__qualname__})",
        f"cache: {res.cache_factory.name} (kv-cache-quant {cache_description(res)})",
        *(f"  - {line}" for line in res.reasons),
    ]
    describe = getattr(res.cache_factory.load(), "describe_request", None)
    if callable(describe):
        lines += [f"  - {line}" for line in describe(
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


def _progress(total: int, quiet: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="chunk", desc="chunks", disable=quiet or not sys.stderr.isatty())


def generate(
    options: GenerateOptions,
    *,
    pm: Any = None,
    log: Callable[[str], None] | None = None,
    on_plan: Callable[[Plan], None] | None = None,
    on_chunk_done: Callable[[int, ChunkStats], None] | None = None,
    on_written: Callable[[Path], None] | None = None,
) -> tuple[dict[str, Any], GenerationRun]:
    """Plan, load and run, optionally compare with an unquantized run, write, report.

    Returns ``(metrics, run)``. ``log`` receives the human-readable lines (stage, cache,
    reasons, where the video went); ``on_plan`` the validated plan, ``on_chunk_done`` each
    chunk of the main run (the command line counts them for its interruption message),
    ``on_written`` each output file once it is complete. With ``options.save_latents`` the
    latents are saved after the run; with ``options.metrics`` the metrics JSON is written
    last (atomically). The first output that fails stops the run with `OutputWriteError`
    naming the files already written, which are kept (`causalkv.runtime.outputs.OutputLog`).
    On a sequence-parallel run only rank 0 logs and writes files.
    """
    from causalkv.plugin import get_plugin_manager

    def say(line: str) -> None:  # rank 0 alone logs
        if log is not None and _is_main_rank():
            log(line)

    pm = pm if pm is not None else get_plugin_manager()
    t_start = time.perf_counter()
    plan = plan_generation(options, pm=pm)
    if on_plan is not None:
        on_plan(plan)
    for line in describe_plan(plan):
        say(line)
    bar = _progress(plan.num_chunks, options.quiet or not _is_main_rank())

    def chunk_done(i: int, stats: ChunkStats) -> None:
        bar.update(1)
        if on_chunk_done is not None:
            on_chunk_done(i, stats)

    try:
        run = run_plan(plan, pm=pm, on_chunk_done=chunk_done, strict_plugins=options.strict_plugins)
    finally:
        bar.close()
    metrics = run_report(plan, run)
    if options.compare_bf16:
        say("reference run: kv-cache-quant off, same seed")
        metrics.update(compare_unquantized(plan, run, pm=pm))
        psnr = metrics["latent_psnr_db"]
        say(
            "latent PSNR vs the unquantized run: "
            + ("identical" if psnr is None else f"{psnr:.2f} dB")
            + f"; KV bytes max {run.kv_resident_bytes_max:,} vs "
            f"{metrics['reference_kv_resident_bytes_max']:,}"
        )
    outputs = OutputLog(on_written)  # after every run: no generation can fail once a file is written
    if options.save_latents is not None and _is_main_rank():
        path = options.save_latents
        metrics["latents"] = str(outputs.write(
            "--save-latents", path, lambda: save_latents(path, run.latents, latents_metadata(plan))
        ))
        say(f"latents: {metrics['latents']}")
    if options.output is not None and _is_main_rank():
        metrics.update(outputs.write("--output", options.output, lambda: write_outputs(plan, run, options.output, pm=pm)))
        w, h = metrics["video_size"][1], metrics["video_size"][0]
        say(f"wrote {metrics['output']} ({metrics['video_frames']} frames, {w}x{h})")
    metrics["seconds_total"] = time.perf_counter() - t_start
    if options.metrics is not None and _is_main_rank():
        outputs.write("--metrics", options.metrics, lambda: write_json_atomic(options.metrics, metrics))
    return metrics, run
