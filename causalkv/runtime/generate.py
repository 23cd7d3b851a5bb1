"""The reference host: plan a request (JSON only), resolve it, load, generate, decode, measure.

`plan_generation` reads the model's config files, resolves the stage and cache through the
plugin system and validates the request: every bad input is refused there, before any
weights load. `run_plan` loads the components (materializing a preset on first use),
builds the stage, calls the plugin hooks and runs the chunk loop. `generate` does both,
decodes and writes the video, and returns the metrics.

The part after resolution takes the stage class and the cache factory explicitly
(`build_stage`), so it is testable without the plugin system.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from causalkv.config import ModelConfig, ServerArgs
from causalkv.runtime.loading import Components, load_components, load_vae, parse_dtype
from causalkv.runtime.model_config import ModelInfo, load_model_info
from causalkv.runtime.presets import materialize_preset
from causalkv.stages.base import CausalDenoisingStage, ForwardRecord, StreamSettings
from causalkv.stages.longlive2 import SCENE_CUT_PREFIX

if TYPE_CHECKING:
    from causalkv.plugin import Resolution

__all__ = [
    "DEFAULT_PROMPT",
    "GenerateOptions",
    "GenerationRun",
    "Plan",
    "build_stage",
    "generate",
    "latent_psnr_db",
    "plan_generation",
    "run_plan",
    "split_prompts",
]

DEFAULT_PROMPT = "A red fox trots through fresh snow in a pine forest at dawn, cinematic light."


@dataclass
class GenerateOptions:
    """One ``causalkv generate`` request.

    Attributes:
        model: preset name or model folder.
        prompts: one prompt per shot; frames are split evenly between shots.
        frames: latent frames (None: the model's ``default_frames``).
        server_args: quant config, sink/window overrides, seed, dtype, device, ``--cache``.
        guidance_scale: CFG scale (None: the model's default; used by LongLive 2.0).
        negative_prompt: negative CFG text (None: the model's default).
        stage: force a stage by registration name (None: resolution picks).
        compare_bf16: also run with quantization off (same seed) and report latent PSNR.
        output: the video file (None: do not decode).
        quiet: no progress bar.
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
    """The outcome of one chunk loop: latents ``[B, C, F, h, w]``, per-chunk stats, the stage."""

    latents: torch.Tensor
    chunk_stats: list[dict[str, Any]]
    stage: CausalDenoisingStage
    kv_resident_bytes_final: int

    @property
    def kv_resident_bytes_max(self) -> int:
        peaks = [int(s["kv_resident_bytes"]) for s in self.chunk_stats]
        return max([*peaks, self.kv_resident_bytes_final])


def split_prompts(prompts: Sequence[str], num_chunks: int, *, scene_cuts: bool) -> list[str]:
    """One prompt per chunk: shots get ``num_chunks // len(prompts)`` chunks (earlier shots
    one more while chunks remain). With ``scene_cuts`` the first chunk of every shot after
    the first starts with `SCENE_CUT_PREFIX` (LongLive 2.0 pins it as the shot sink).
    """
    if len(prompts) == 0:
        raise ValueError("the prompt list is empty; pass at least one --prompt TEXT")
    if num_chunks < len(prompts):
        raise ValueError(
            f"{len(prompts)} prompts need at least {len(prompts)} chunks, the request has "
            f"{num_chunks}; pass more --frames or fewer --prompt"
        )
    base, extra = divmod(num_chunks, len(prompts))
    out: list[str] = []
    for k, prompt in enumerate(prompts):
        n = base + (1 if k < extra else 0)
        first = prompt
        if scene_cuts and k > 0 and not prompt.startswith(SCENE_CUT_PREFIX):
            first = SCENE_CUT_PREFIX + prompt
        out.extend([first] + [prompt] * (n - 1))
    return out


def _check_prompts(prompts: Sequence[str]) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("the prompt list is empty; pass at least one --prompt TEXT")
    for p in prompts:
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompts must be non-empty text, got {p!r}; fix the --prompt value")
    return prompts


def plan_generation(options: GenerateOptions, *, pm: Any = None) -> Plan:
    """Read the model config, resolve stage and cache, validate the request (no weights).

    Multi-shot is automatic: with more than one prompt and a stage that supports it
    (LongLive 2.0) the request is resolved again with ``multi_shot=True`` (the cache must
    then support a pinned shot sink). Raises ValueError (or the plugin system's
    ResolutionError, a ValueError too) naming the bad value and the fix.
    """
    from causalkv.plugin import resolve

    prompts = _check_prompts(options.prompts)
    info = load_model_info(options.model)
    model = info.config
    args = replace(options.server_args)
    parse_dtype(args.dtype)
    args.guidance_scale = (
        float(options.guidance_scale) if options.guidance_scale is not None else info.guidance_scale
    )
    if not math.isfinite(args.guidance_scale) or args.guidance_scale < 0:
        raise ValueError(f"guidance scale must be a finite number >= 0, got {args.guidance_scale}")
    num_frames = options.frames if options.frames is not None else info.default_frames
    res = resolve(model, args, pm=pm, stage=options.stage)
    if len(prompts) > 1 and res.stage.supports_multi_shot() and not args.multi_shot:
        args.multi_shot = True
        res = resolve(model, args, pm=pm, stage=options.stage)
    settings = res.stage.check_request(model, args, num_frames)
    chunk_prompts = split_prompts(
        prompts, num_frames // settings.frames_per_chunk, scene_cuts=args.multi_shot
    )
    res.stage.check_request(model, args, num_frames, chunk_prompts)
    return Plan(
        info=info,
        server_args=args,
        resolution=res,
        num_frames=num_frames,
        prompts=prompts,
        chunk_prompts=chunk_prompts,
        settings=settings,
        stage_name=options.stage,
        negative_prompt=(
            options.negative_prompt if options.negative_prompt is not None else info.negative_prompt
        ),
    )


def model_folder(info: ModelInfo) -> Path:
    """The folder to load from: a preset is created on first use."""
    if info.preset is not None:
        return materialize_preset(info.preset)
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
) -> CausalDenoisingStage:
    """Build ``stage_cls`` over the loaded ``components`` with caches from ``cache_factory``.

    With a plugin manager, ``causalkv_configure_stage`` runs right after; if it returns
    `ModelConfig` overrides the stage is rebuilt with them (and they are validated).
    """

    def make(m: ModelConfig) -> CausalDenoisingStage:
        return stage_cls(
            m,
            server_args,
            denoiser=components.transformer,
            scheduler=components.scheduler,
            cache_factory=cache_factory,
            encode_prompt=components.prompt_encoder,
            negative_prompt=negative_prompt,
        )

    stage = make(model)
    if pm is not None:
        from causalkv.plugin import configure_stage

        overrides = configure_stage(pm, stage, model, server_args)
        if overrides:
            stage = make(replace(model, **overrides))
    return stage


def run_plan(
    plan: Plan,
    *,
    pm: Any = None,
    components: Components | None = None,
    server_args: ServerArgs | None = None,
    resolution: Resolution | None = None,
    on_chunk_done: Callable[[int, Mapping[str, Any]], None] | None = None,
    on_forward: Callable[[ForwardRecord], None] | None = None,
) -> GenerationRun:
    """Load (unless ``components`` are given), build the stage, run the chunk loop.

    ``server_args``/``resolution`` replace the plan's (``--compare-bf16`` reruns with the
    quantization off). The initial noise and every re-noising draw come from one CPU
    generator seeded with ``server_args.seed``.
    """
    from causalkv.plugin import get_plugin_manager

    pm = pm if pm is not None else get_plugin_manager()
    args = server_args if server_args is not None else plan.server_args
    res = resolution if resolution is not None else plan.resolution
    if components is None:
        components = load_components(
            plan.info, model_folder(plan.info), dtype=args.dtype, device=args.device
        )
    stage = build_stage(
        res.stage,
        res.cache_factory,
        plan.model,
        args,
        components,
        negative_prompt=plan.negative_prompt,
        pm=pm,
    )
    generator = torch.Generator(device="cpu").manual_seed(int(args.seed))
    info = plan.info
    shape = (1, info.latent_channels, plan.num_frames, info.latent_height, info.latent_width)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(components.device)

    def chunk_done(i: int, stats: Mapping[str, Any]) -> None:
        pm.hook.causalkv_chunk_done(stage=stage, chunk_index=i, stats=stats)
        if on_chunk_done is not None:
            on_chunk_done(i, stats)

    result = stage.generate(
        noise, plan.chunk_prompts, generator=generator, on_chunk_done=chunk_done, on_forward=on_forward
    )
    return GenerationRun(
        latents=result.latents,
        chunk_stats=result.chunk_stats,
        stage=stage,
        kv_resident_bytes_final=stage.kv_resident_nbytes(),
    )


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


def _progress(total: int, quiet: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="chunk", desc="chunks", disable=quiet or not sys.stderr.isatty())


def generate(
    options: GenerateOptions,
    *,
    pm: Any = None,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], GenerationRun]:
    """Plan, load, generate, optionally compare with an unquantized run, decode and write.

    Returns ``(metrics, run)``. ``log`` receives the human-readable lines (stage, cache,
    reasons, where the video went).
    """
    from causalkv.plugin import get_plugin_manager, resolve

    say = log or (lambda _line: None)
    pm = pm if pm is not None else get_plugin_manager()
    t_start = time.perf_counter()
    plan = plan_generation(options, pm=pm)
    res = plan.resolution
    quant = plan.server_args.kv_cache_quant_config
    say(f"model: {plan.model.name} ({plan.model.model_class})")
    say(f"stage: {res.stage.stage_name} ({res.stage.__module__}:{res.stage.__qualname__})")
    say(f"cache: {res.cache_factory.name} (kv-cache-quant {quant.describe()})")
    for line in res.reasons:
        say(f"  - {line}")
    s = plan.settings
    say(
        f"stream: {plan.num_frames} latent frames in {plan.num_chunks} chunks of "
        f"{s.frames_per_chunk}; sink {s.sink_frames}, window {s.window_frames}, cache "
        f"{s.cache_frames} frames"
        + (f", recent window {s.recent_window_frames}" if s.recent_window_frames is not None else "")
        + (f"; multi-shot ({len(plan.prompts)} shots)" if plan.server_args.multi_shot else "")
    )
    t_load = time.perf_counter()
    folder = model_folder(plan.info)
    components = load_components(
        plan.info, folder, dtype=plan.server_args.dtype, device=plan.server_args.device
    )
    load_seconds = time.perf_counter() - t_load

    bar = _progress(plan.num_chunks, options.quiet)
    try:
        run = run_plan(
            plan, pm=pm, components=components, on_chunk_done=lambda i, st: bar.update(1)
        )
    finally:
        bar.close()
    seconds = [float(st["seconds"]) for st in run.chunk_stats]
    metrics: dict[str, Any] = {
        "model": plan.model.name,
        "model_class": plan.model.model_class,
        "stage": res.stage.stage_name,
        "stage_class": f"{res.stage.__module__}:{res.stage.__qualname__}",
        "cache": res.cache_factory.name,
        "kv_cache_quant": quant.describe(),
        "requirements": sorted(res.requirements),
        "reasons": list(res.reasons),
        "prompts": plan.prompts,
        "chunk_prompts": plan.chunk_prompts,
        "multi_shot": plan.server_args.multi_shot,
        "guidance_scale": plan.server_args.guidance_scale,
        "seed": plan.server_args.seed,
        "dtype": plan.server_args.dtype,
        "device": plan.server_args.device,
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
        "seconds_per_chunk": seconds,
        "seconds_per_chunk_mean": sum(seconds) / len(seconds),
        "load_seconds": load_seconds,
        "kv_resident_bytes_per_chunk": [int(st["kv_resident_bytes"]) for st in run.chunk_stats],
        "kv_resident_bytes_max": run.kv_resident_bytes_max,
        "kv_resident_bytes_final": run.kv_resident_bytes_final,
        "pinned_chunks": list(getattr(run.stage, "pinned_chunks", [])),
        "recache_chunks": list(getattr(run.stage, "recache_events", [])),
    }
    if options.compare_bf16:
        ref_args = replace(
            plan.server_args, kv_cache_quant_config=replace(quant, bits=None), cache=None
        )
        ref_res = resolve(plan.model, ref_args, pm=pm, stage=options.stage)
        say(f"reference run: cache {ref_res.cache_factory.name}, kv-cache-quant off, same seed")
        ref = run_plan(plan, pm=pm, components=components, server_args=ref_args, resolution=ref_res)
        psnr = latent_psnr_db(run.latents, ref.latents)
        metrics["reference_cache"] = ref_res.cache_factory.name
        metrics["latent_psnr_db"] = psnr
        metrics["latent_identical"] = psnr is None
        metrics["latent_max_abs_diff"] = float((run.latents - ref.latents).abs().max())
        metrics["reference_kv_resident_bytes_max"] = ref.kv_resident_bytes_max
        metrics["kv_compression_vs_reference"] = ref.kv_resident_bytes_max / max(
            1, run.kv_resident_bytes_max
        )
        say(
            "latent PSNR vs the unquantized run: "
            + ("identical" if psnr is None else f"{psnr:.2f} dB")
            + f"; KV bytes max {run.kv_resident_bytes_max:,} vs {ref.kv_resident_bytes_max:,}"
        )
    if options.output is not None:
        from causalkv.runtime.video import decode_latents, write_video

        vae = load_vae(folder, device=components.device)
        frames = decode_latents(vae, run.latents)
        written = write_video(frames, options.output, fps=plan.info.fps)
        metrics["output"] = str(written)
        metrics["video_frames"] = int(frames.shape[0])
        metrics["video_size"] = [int(frames.shape[1]), int(frames.shape[2])]
        say(f"wrote {written} ({frames.shape[0]} frames, {frames.shape[2]}x{frames.shape[1]})")
    metrics["seconds_total"] = time.perf_counter() - t_start
    return metrics, run
