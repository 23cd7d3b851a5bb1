"""Checks of a planned request that need no weights: run before anything loads.

`check_before_load` is called by `causalkv.runtime.host.plan_step.plan_generation`, so every fault
knowable up front fails there, in milliseconds, before a preset is built, a weight is read or
a chunk runs:

- classifier-free guidance: ``--guidance-scale``/``--negative-prompt`` (or the model's) only
  on a stage with CFG, a negative prompt only while guidance is on (`check_guidance`);
- the chosen cache's settings: what its class checks before the load (``check_request``; the
  QVG cache: the block layout fits ``head_dim``, the codec backend ``CAUSALKV_QVG_BACKEND``
  exists and runs on the device) (the last check: the device and the rest are
  good by then); settings that would do nothing, and those of a stage or cache that was not
  chosen, are refused by the resolution;
- frames: the last chunk's RoPE frames (frames plus the stage's per-shot RoPE offsets) must
  fit the transformer's ``rope_max_seq_len`` (the frames alone: `check_sizes`);
- memory: the latents, KV caches, one chunk's activations and the RoPE tables fit the
  device's memory (`memory_floor`, a lower bound; `check_sizes`);
- seed: within the range a torch generator takes;
- device and dtype: the device exists in this torch build and on this machine, and a small
  matmul in the dtype runs on it;
- the files (`causalkv.runtime.files.file_checks`): ``CAUSALKV_HOME`` can hold a preset not built
  yet, the output files can be written and have room, the model folder's files are whole.

Each failure raises `ConfigError` (bad request) or `ModelFolderError` (unreadable model
folder), one line naming the value and the fix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from causalkv.capabilities import QUANT_QVG
from causalkv.config import check_text
from causalkv.errors import ConfigError, first_line
from causalkv.memory.records import format_bytes
from causalkv.options import CacheOptions
from causalkv.runtime.files import file_checks

if TYPE_CHECKING:
    from causalkv.runtime.host.pipeline_records import GenerateOptions, Plan

__all__ = [
    "check_before_load",
    "check_request_effect",
    "check_sizes",
    "host_memory_bytes",
    "memory_floor",
    "video_nbytes_floor",
    "rope_frame_ends",
]

#: the largest seed ``torch.Generator.manual_seed`` accepts
MAX_SEED = 2**64 - 1

#: the default of diffusers' ``WanTransformer3DModel(rope_max_seq_len=...)``, used when a
#: transformer config omits the key
DIFFUSERS_WAN_ROPE_MAX_SEQ_LEN = 1024



def check_before_load(plan: Plan, options: GenerateOptions) -> None:
    """Every check of the module docstring but `check_sizes`' (run on the plan before its chunk
    list is built), on a plan `plan_generation` has built (presets are looked up in the plan's
    plugins)."""
    args = plan.server_args
    if args.seed > MAX_SEED:
        raise ConfigError(f"--seed must be at most 2**64 - 1 = {MAX_SEED}, got {args.seed}; pass a smaller --seed")
    _check_guidance(plan, options)
    _check_device(args.device, args.dtype)
    file_checks.check_model_files(plan.info)
    file_checks.check_home(plan.info)
    _check_frames(plan)
    file_checks.check_output_files(
        output=options.output,
        metrics=options.metrics,
        save_latents=options.save_latents,
        latents_nbytes=_latents_nbytes(plan),
        video_nbytes=video_nbytes_floor(plan),
        # the metrics JSON: its fixed keys, then 8 B at least a number of its five per-chunk lists
        metrics_nbytes=file_checks.FILE_OVERHEAD_BYTES + 5 * 8 * plan.num_chunks,
        force=options.force,
    )
    # last, once the device, the files, the frames and the memory are known good: what the
    # chosen cache kind checks before any weights load (`causalkv.hooks.CacheKind.check_request`;
    # the QVG cache: its block layout and codec backend), the one check that runs its code
    res = plan.resolution
    if _cache_class(plan) is not None:
        res.cache_factory.check_request(
            res.cache_options, head_dim=plan.model.head_dim, device=args.device
        )


def check_sizes(plan: Plan) -> None:
    """The sizes a request implies, checked before anything proportional to them is built
    (the per-chunk prompt list included): the frame count against the RoPE limit, then every
    part of `memory_floor` against the device's memory. ``plan.chunk_prompts`` may be empty
    (the frames alone, no per-shot offsets: `check_before_load` checks those)."""
    fpc, n = plan.settings.frames_per_chunk, plan.num_frames
    limit, p_t, where = _rope_limit(plan)
    if n // p_t > limit:
        raise ConfigError(
            f"--frames {n} exceeds the RoPE limit: rope_max_seq_len={limit} in {where}; "
            f"pass --frames {(limit * p_t) // fpc * fpc} or fewer"
        )
    _check_memory(plan)


# ---- options that would change nothing -------------------------------------------------------
def check_request_effect(plan: Plan, options: GenerateOptions) -> None:
    """Refuse what the request asks for that would do nothing (`ConfigError` naming why and
    the fix), and add a `Plan.warnings` line for what runs differently from what was asked.

    - a guidance scale below 1 on a CFG stage: the negative branch runs only above 1, so any
      scale <= 1 samples exactly as 1 (guidance off);
    - ``--compare-bf16`` while no cache setting is given: the reference would be the same run;
    - ``--recent-window-frames`` of at least the window less a chunk: a chunk sees no more
      than that anyway;
    - a cache setting about the sink (its flag names the sink) while the sink is empty;
    - ``--window-frames`` longer than the video: a warning (the preallocated cache holds
      frames the video never has).
    """
    args, s, res = plan.server_args, plan.settings, plan.resolution
    if res.stage.supports_guidance() and args.guidance_scale < 1.0:
        where = (f"--guidance-scale {options.guidance_scale:g}" if options.guidance_scale is not None
                 else f"guidance_scale {plan.info.guidance_scale:g} in {plan.model.name}'s causalkv.json")
        raise ConfigError(
            f"{where} does nothing: stage {res.stage_name!r} runs the negative CFG branch only "
            "above 1, so a scale <= 1 samples exactly as 1 (guidance off); pass a scale > 1, or 1 "
            "to turn guidance off"
        )
    given = [r for r in args.options if isinstance(r, CacheOptions) and r.changed()]
    if options.compare_bf16 and not given and args.cache is None:
        raise ConfigError(
            f"--compare-bf16 compares the run with the same run without the cache's settings, and "
            f"this request gives none (cache {res.cache_factory.name!r}, kv-cache-quant off): both "
            "runs would be the same; pass --kv-cache-quant int4 or int2, or drop --compare-bf16"
        )
    recent, fpc = args.recent_window_frames, s.frames_per_chunk
    if recent is not None and recent > s.window_frames - fpc:
        raise ConfigError(
            f"--recent-window-frames {recent} does nothing: a chunk sees at most the "
            f"{s.window_frames - fpc} frames before it that the {s.window_frames}-frame window "
            f"holds besides the chunk; pass --recent-window-frames {s.window_frames - fpc} or "
            "fewer, or drop it"
        )
    sink = [label if label.startswith("-") else f"--{label}"
            for record in given for label in record.given_labels() if "sink" in label]
    if s.sink_frames == 0 and sink:
        raise ConfigError(
            f"{sink[0]} sets how the cache keeps the sink, and this request has no sink "
            f"(sink 0 frames on {plan.model.name}): it would do nothing; drop it or pass "
            "--sink-frames N"
        )
    if args.window_frames is not None and args.window_frames > plan.num_frames:
        floor = memory_floor(plan)["kv_caches"]
        plan.warnings.append(
            f"--window-frames {args.window_frames} is longer than the video ({plan.num_frames} "
            f"frames): attention sees every frame, as with --window-frames {plan.num_frames}, but "
            f"the caches hold room for {args.window_frames} frames ({format_bytes(floor)} of "
            f"KV); pass --window-frames {plan.num_frames} for the same video in less memory"
        )


# ---- options the stage cannot use --------------------------------------------------------------
def _check_guidance(plan: Plan, options: GenerateOptions) -> None:
    """Classifier-free guidance settings the request or the model asks for, checked by the
    stage (`CausalDenoisingStage.check_guidance`): a stage without CFG refuses them, a CFG
    stage refuses a negative prompt while guidance is off."""
    info = plan.info
    where = "causalkv.json" if info.preset is None else f"preset {info.preset!r}'s settings"
    asked: dict[str, object] = {}
    if options.guidance_scale is not None:
        asked["--guidance-scale"] = options.guidance_scale
    elif info.guidance_scale != 1.0:
        asked[f"guidance_scale in {where}"] = info.guidance_scale
    if options.negative_prompt is not None:
        asked["--negative-prompt"] = check_text(options.negative_prompt, "--negative-prompt")
    elif info.negative_prompt:
        asked[f"negative_prompt in {where}"] = info.negative_prompt
    plan.resolution.stage.check_guidance(
        asked, guidance_scale=plan.server_args.guidance_scale, stage_name=plan.resolution.stage_name
    )


# ---- the chosen cache ---------------------------------------------------------------------------
def _cache_class(plan: Plan) -> type | None:
    """The chosen cache's class, None when its module does not import (the build names it)."""
    try:
        return plan.resolution.cache_factory.load()
    except ImportError:
        return None




# ---- device ---------------------------------------------------------------------------------
def _check_device(device: str, dtype: str) -> None:
    """`ConfigError` unless ``device`` exists here and runs ``dtype``.

    The dtype probe is one 8x8 matmul on the device (it initializes CUDA on a GPU, which the
    run would do anyway).
    """
    import torch  # torch loads with a command that runs, not for its --help

    from causalkv.runtime.model_io.components import parse_dtype
    from causalkv.runtime.processes.distributed import cuda_problem

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {device!r} is not a torch device; use cpu, cuda, cuda:N or mps") from None
    problems = {  # per device type: why it cannot run here, None when it can
        # torch accepts any index for the CPU and ignores it
        "cpu": lambda: None if dev.index in (None, 0) else f"the CPU is one device, cpu or cpu:0, not cpu:{dev.index}",
        "cuda": lambda: cuda_problem(dev.index or 0),
        "mps": lambda: None if torch.backends.mps.is_available() else "MPS is not available on this machine",
        "xpu": lambda: None if hasattr(torch, "xpu") and torch.xpu.is_available() else "no XPU device is visible",
    }
    other = f"causalkv generates on cpu, cuda, mps or xpu, not on {dev.type!r}"
    if (reason := problems.get(dev.type, lambda: other)()) is not None:
        raise ConfigError(f"--device {device!r} is not available: {reason}; use --device cpu")
    try:
        x = torch.ones(8, 8, dtype=parse_dtype(dtype), device=dev)
        float((x @ x).sum().item())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ConfigError(
            f"--dtype {dtype} does not run on --device {device} ({first_line(exc)}); "
            "use --dtype float32"
        ) from None


# ---- frames ---------------------------------------------------------------------------------
def rope_frame_ends(plan: Plan) -> list[int]:
    """The end (exclusive, in latent frames, rounded up) of each chunk's RoPE frames, as the
    stage's chunk loop will place them (``plan.rope_frame_starts``, planned by the stage)."""
    fpc = plan.settings.frames_per_chunk
    return [math.ceil(start) + fpc for start in plan.rope_frame_starts]


def _physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def _rope_limit(plan: Plan) -> tuple[int, int, str]:
    """``(rope_max_seq_len, temporal patch, where it is set)`` of the plan's transformer."""
    cfg = plan.info.transformer
    limit = int(cfg.get("rope_max_seq_len", DIFFUSERS_WAN_ROPE_MAX_SEQ_LEN))
    p_t = int(cfg.get("patch_size", (1, 2, 2))[0])
    return limit, p_t, f"{plan.info.config.name}'s transformer/config.json"


def _check_frames(plan: Plan) -> None:
    """Refuse a frame count whose chunks' RoPE frames (per-shot offsets included) go beyond
    the RoPE limit; the hint is the frame count, or the per-shot offset, that fits."""
    fpc, n = plan.settings.frames_per_chunk, plan.num_frames
    limit, p_t, where = _rope_limit(plan)
    for i, end in enumerate(rope_frame_ends(plan)):
        start = end - fpc
        if start // p_t + fpc // p_t > limit:
            offset = start - i * fpc
            best = max(0, (limit * p_t - offset) // fpc * fpc)
            # with best < fpc the offsets alone pass the limit: the hint is the per-shot offset that fits
            fix = f"pass --frames {best} or fewer" if best >= fpc else _offset_fix(plan, limit * p_t)
            raise ConfigError(
                f"--frames {n}: chunk {i} would use RoPE frames up to {end} (its frames plus a "
                f"per-shot RoPE offset of {offset}), beyond rope_max_seq_len={limit} in {where}; {fix}"
            )


def _offset_fix(plan: Plan, frames_limit: int) -> str:
    """The hint when the per-shot RoPE offsets alone pass the limit: the largest per-shot
    offset the last chunk fits with (chunk ``L`` of shot ``K`` starts at ``L fpc + K off``)."""
    fpc = plan.settings.frames_per_chunk
    starts = plan.rope_frame_starts
    offsets = [start - i * fpc for i, start in enumerate(starts)]
    steps = sorted({round(o, 6) for o in offsets})
    per_shot = min((b - a for a, b in zip(steps, steps[1:]) if b - a > 0), default=0.0)
    last = len(starts) - 1
    if per_shot <= 0 or offsets[last] <= 0:
        return "pass fewer shots"
    shots = round(offsets[last] / per_shot)
    room = max(0, frames_limit - last * fpc - fpc) / max(1, shots)
    return (f"lower the per-shot RoPE offset (--multi-shot-rope-offset, now {per_shot:g}) to at most "
            f"{math.floor(room * 1000) / 1000:g}, or pass fewer --frames or shots")


# ---- memory ---------------------------------------------------------------------------------
def _latents_nbytes(plan: Plan) -> int:
    """Bytes of the run's float32 latents ``[1, C, F, h, w]``."""
    info = plan.info
    return 4 * plan.num_frames * info.latent_channels * info.latent_height * info.latent_width


def _address_space_left() -> int | None:
    """Bytes this process may still map under its ``RLIMIT_AS`` (``ulimit -v``), or None."""
    try:
        import resource  # POSIX only: without it there is no address-space limit to read
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        mapped = int(Path("/proc/self/statm").read_text().split()[0]) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(0, int(soft) - mapped)


def host_memory_bytes() -> int | None:
    """The memory a run on the CPU can have: the physical memory, or less under an
    address-space limit."""
    known = [m for m in (_physical_memory_bytes(), _address_space_left()) if m is not None]
    return min(known) if known else None


def _device_memory_bytes(device: str) -> int | None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):  # `check_device` names it
        return None
    if dev.type == "cpu":
        return host_memory_bytes()
    if dev.type == "cuda":  # a device this machine lacks: `check_device` names it
        from causalkv.runtime.processes.distributed import cuda_problem

        if cuda_problem(dev.index or 0) is None:
            return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
    return None


def memory_floor(plan: Plan) -> dict[str, int]:
    """Bytes a run needs at least, by part (a floor: weights, the text encoder, attention
    temporaries and the VAE come on top):

    - ``latents``: the noise and the output, float32 (on the host);
    - ``kv_caches``: K and V of every layer and branch, in the cache dtype, of the tokens the
      caches hold by the last chunk, for this rank's heads: a cache that preallocates its
      buffer (``preallocates = True``, the dense cache) its whole ``cache_frames``, whatever
      the video's length; one that grows ``min(frames, cache_frames)``; QVG the chunk being
      written, which stays unpacked;
    - ``activations``: one chunk's q, k, v and attention output in the compute dtype;
    - ``rope_tables``: the float32 cos and sin tables of ``rope_max_seq_len`` positions the
      transformer allocates when it loads.
    """
    from causalkv.runtime.model_io.components import parse_dtype

    s, args, model = plan.settings, plan.server_args, plan.model
    heads = model.num_heads // max(1, args.heads_sharded)
    kv_item = parse_dtype(args.kv_cache_dtype or args.dtype).itemsize
    item = parse_dtype(args.dtype).itemsize
    frames = min(plan.num_frames, s.cache_frames)
    if QUANT_QVG in plan.resolution.requirements:  # packed: only the chunk being written is dense
        frames = min(frames, s.frames_per_chunk)
    elif getattr(_cache_class(plan), "preallocates", False):  # the dense cache: its whole buffer
        frames = s.cache_frames
    branches = plan.resolution.stage.branches_for(args.guidance_scale)
    kv_tokens = frames * s.tokens_per_frame
    return {
        "latents": 2 * _latents_nbytes(plan),
        "kv_caches": branches * model.num_layers * 2 * kv_tokens * heads * model.head_dim * kv_item,
        "activations": 4 * s.tokens_per_chunk * model.num_heads * model.head_dim * item,
        "rope_tables": 2 * _rope_limit(plan)[0] * model.head_dim * 4,
    }


def _check_memory(plan: Plan) -> None:
    """Refuse a run whose `memory_floor` exceeds the device's memory (the host's RAM on CPU),
    naming the largest part and the setting that drives it."""
    floor = memory_floor(plan)
    memory = _device_memory_bytes(plan.server_args.device)
    total = sum(floor.values())
    if memory is None or total <= memory:
        return
    part = max(floor, key=floor.__getitem__)
    fix = {
        "latents": "pass fewer --frames",
        "kv_caches": (
            f"lower height and width ({plan.info.height}x{plan.info.width}, "
            f"{plan.settings.tokens_per_frame:,} tokens per frame) or the window "
            "(--window-frames), or pass --kv-cache-quant int4/int2"
        ),
        "activations": f"lower height and width ({plan.info.height}x{plan.info.width}) or frames_per_chunk",
        "rope_tables": f"lower rope_max_seq_len in {_rope_limit(plan)[2]} (diffusers' default is 1024)",
    }[part]
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in floor.items())
    raise ConfigError(
        f"the request needs at least {format_bytes(total)} of memory ({parts}), more than the "
        f"{format_bytes(memory)} of --device {plan.server_args.device}; {fix}"
    )


#: the video floor's compression: an encoded video is at least raw RGB / this (H.264 of the
#: tiny presets' noise compresses about 14x, of natural video 50-100x; a floor, not a guess)
VIDEO_FLOOR_COMPRESSION = 200


def video_nbytes_floor(plan: Plan) -> int:
    """The least bytes the video of ``plan`` takes: its RGB frames (`RuntimeModelInfo.video_frames`:
    ``1 + 4 (F - 1)`` for Wan's causal VAE) over `VIDEO_FLOOR_COMPRESSION`, plus
    `FILE_OVERHEAD_BYTES`."""
    info = plan.info
    frames = info.video_frames(plan.num_frames)
    return file_checks.FILE_OVERHEAD_BYTES + frames * info.height * info.width * 3 // VIDEO_FLOOR_COMPRESSION
