"""Checks of a planned request that need no weights: run before anything loads.

`check_before_load` is called by `causalkv.runtime.generate.plan_generation`, so every fault
knowable up front fails there, in milliseconds, before a preset is built, a weight is read or
a chunk runs:

- frames: the last chunk's RoPE frames (frames plus the stage's per-shot RoPE offsets) must
  fit the transformer's ``rope_max_seq_len``, and the latents must fit in memory;
- seed: within the range a torch generator takes;
- device and dtype: the device exists in this torch build and on this machine, and a small
  matmul in the dtype runs on it;
- output files (video, metrics, saved latents): not a folder, not a special file, in a
  folder that exists (or can be created) and is writable, distinct from each other, and a
  video suffix an installed encoder writes;
- the model folder's files (for a preset: once it exists): every JSON file parses and every
  safetensors file is as long as its header says (a truncated download fails here, not after
  the text encoder has loaded).

Each failure raises `ConfigError` (bad request) or `ModelFolderError` (unreadable model
folder), one line naming the value and the fix.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from causalkv.errors import ConfigError
from causalkv.runtime.model_config import ModelFolderError, ModelInfo

if TYPE_CHECKING:
    from causalkv.runtime.generate import GenerateOptions, Plan

__all__ = [
    "MAX_SEED",
    "WEIGHT_SUFFIXES",
    "check_before_load",
    "check_device",
    "check_frames",
    "check_model_files",
    "check_output_files",
    "check_writable_file",
    "rope_frame_ends",
]

#: the largest seed ``torch.Generator.manual_seed`` accepts
MAX_SEED = 2**64 - 1

#: the default of diffusers' ``WanTransformer3DModel(rope_max_seq_len=...)``, used when a
#: transformer config omits the key
DIFFUSERS_WAN_ROPE_MAX_SEQ_LEN = 1024

#: files a component folder may keep its weights in
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")

_WEIGHTED_COMPONENTS = ("transformer", "vae", "text_encoder")


def check_before_load(plan: Plan, options: GenerateOptions, *, pm: Any = None) -> None:
    """Every check of the module docstring, on a plan `plan_generation` has built."""
    args = plan.server_args
    if args.seed > MAX_SEED:
        raise ConfigError(f"--seed must be at most 2**64 - 1 = {MAX_SEED}, got {args.seed}; pass a smaller --seed")
    check_device(args.device, args.dtype)
    check_model_files(plan.info)
    check_frames(plan, pm=pm)
    check_output_files(
        output=options.output,
        metrics=getattr(options, "metrics", None),
        save_latents=getattr(options, "save_latents", None),
    )


# ---- device ---------------------------------------------------------------------------------
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_device(device: str, dtype: str) -> torch.device:
    """``device`` parsed, after checking it exists here and runs ``dtype``; else `ConfigError`.

    The dtype probe is one 8x8 matmul on the device (it initializes CUDA on a GPU, which the
    run would do anyway).
    """
    from causalkv.runtime.loading import parse_dtype

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {device!r} is not a torch device; use cpu, cuda, cuda:N or mps") from None
    reason = None
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            reason = f"this torch build ({torch.__version__}) has no CUDA support"
        elif not torch.cuda.is_available():
            reason = "no CUDA device is visible"
        elif dev.index is not None and dev.index >= torch.cuda.device_count():
            reason = f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            reason = "MPS is not available on this machine"
    elif dev.type == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            reason = "no XPU device is visible"
    elif dev.type != "cpu":
        reason = f"causalkv generates on cpu, cuda, mps or xpu, not on {dev.type!r}"
    if reason is not None:
        raise ConfigError(f"--device {device!r} is not available: {reason}; use --device cpu")
    torch_dtype = parse_dtype(dtype)
    try:
        x = torch.ones(8, 8, dtype=torch_dtype, device=dev)
        float((x @ x).sum().item())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ConfigError(
            f"--dtype {dtype} does not run on --device {device} ({_first_line(exc)}); "
            "use --dtype float32"
        ) from None
    return dev


# ---- frames ---------------------------------------------------------------------------------
def _transformer_config(info: ModelInfo, pm: Any) -> dict[str, Any]:
    if info.preset is not None:
        from causalkv.runtime.presets import preset_transformer_config

        return preset_transformer_config(info.preset, pm=pm)
    assert info.path is not None
    return json.loads((info.path / "transformer" / "config.json").read_text())


def rope_frame_ends(plan: Plan) -> list[int]:
    """The end (exclusive, in latent frames) of each chunk's RoPE frames, as the stage's
    chunk loop will compute them: ``chunk start + frames per chunk + rope_frame_offset``.

    The stage's per-chunk policy (``begin_chunk``, ``rope_frame_offset``) runs on an empty
    probe stage that has no caches and no model, so a stage that needs more than its
    config and stream state to place RoPE (a stage of a plugin) is given no offset here; its
    chunk loop still refuses a position beyond the limit when it reaches it.
    """
    fpc = plan.settings.frames_per_chunk
    stage_cls = plan.resolution.stage
    probe = stage_cls.__new__(stage_cls)
    probe.name, probe.model, probe.server_args = "probe", plan.model, plan.server_args
    probe.settings, probe._cache_sets = plan.settings, None
    ends = []
    try:
        probe._reset_stream()
        for i, prompt in enumerate(plan.chunk_prompts):
            probe.begin_chunk(i, prompt, None)  # no frames cached yet: no cache work
            ends.append(i * fpc + int(probe.rope_frame_offset(i, prompt)) + fpc)
    except Exception:  # noqa: BLE001 - a policy that needs a built stage: no offsets known
        ends = [(i + 1) * fpc for i in range(plan.num_chunks)]
    return ends


def _physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def check_frames(plan: Plan, *, pm: Any = None) -> None:
    """Refuse a frame count beyond the RoPE limit or whose latents cannot fit in memory."""
    info, fpc, n = plan.info, plan.settings.frames_per_chunk, plan.num_frames
    cfg = _transformer_config(info, pm)
    limit = int(cfg.get("rope_max_seq_len", DIFFUSERS_WAN_ROPE_MAX_SEQ_LEN))
    p_t = int(cfg.get("patch_size", (1, 2, 2))[0])
    where = f"{info.config.name}'s transformer/config.json"
    if n // p_t > limit:  # no offsets needed to know (and no per-chunk walk of a huge request)
        raise ConfigError(
            f"--frames {n} exceeds the RoPE limit: rope_max_seq_len={limit} in {where}; "
            f"pass --frames {(limit * p_t) // fpc * fpc} or fewer"
        )
    for i, end in enumerate(rope_frame_ends(plan)):
        start = end - fpc
        if start // p_t + fpc // p_t > limit:
            offset = start - i * fpc
            best = max(0, (limit * p_t - offset) // fpc * fpc)
            raise ConfigError(
                f"--frames {n}: chunk {i} would use RoPE frames up to {end} (its frames plus a "
                f"per-shot RoPE offset of {offset}), beyond rope_max_seq_len={limit} in {where}; "
                + (f"pass --frames {best} or fewer" if best >= fpc else "pass fewer shots")
            )
    latent_bytes = 4 * n * info.latent_channels * info.latent_height * info.latent_width
    memory = _physical_memory_bytes()
    if memory is not None and 2 * latent_bytes > memory:  # noise + output, float32
        raise ConfigError(
            f"--frames {n} needs {2 * latent_bytes / 2**30:.1f} GiB for the latents alone, more than "
            f"this machine's {memory / 2**30:.1f} GiB of memory; pass fewer --frames"
        )


# ---- output files ---------------------------------------------------------------------------
def check_writable_file(path: str | Path, flag: str) -> Path:
    """``path`` (absolute) if a file can be written there: not a folder or a special file,
    its folder exists or can be created, and a file can be created in it. Else `ConfigError`.

    Writability is probed by creating and removing a temporary file in the nearest existing
    folder (nothing is left behind).
    """
    text = str(path)
    p = Path(os.path.abspath(Path(text).expanduser()))
    if text.endswith(("/", os.sep)) or p.is_dir():
        raise ConfigError(f"{flag} {text!r} is a folder; name a file in it")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag} {text!r} exists and is not a regular file; name a regular file")
    folder = p.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {text!r}: {str(folder)!r} is a file, not a folder; choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".causalkv-probe-", dir=folder)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {text!r}: cannot create files in {str(folder)!r} ({exc.strerror or exc}); "
            f"choose a writable folder for {flag}"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return p


def check_output_files(
    *,
    output: str | Path | None,
    metrics: str | Path | None = None,
    save_latents: str | Path | None = None,
) -> None:
    """Check the video (``--output``), metrics (``--metrics``) and ``--save-latents`` targets
    (`check_writable_file`; the video's suffix must be one an installed encoder writes,
    saved latents end in ``.safetensors``) and that no two name the same file, the file
    kept for the latents of a video that fails to encode included."""
    from causalkv.runtime.outputs import latents_path_for
    from causalkv.runtime.video import check_video_suffix

    named: list[tuple[str, Path]] = []
    if output is not None:
        named.append(("--output", check_writable_file(output, "--output")))
        check_video_suffix(output)
    if metrics is not None:
        named.append(("--metrics", check_writable_file(metrics, "--metrics")))
    if save_latents is not None:
        if Path(save_latents).suffix.lower() != ".safetensors":
            raise ConfigError(
                f"--save-latents {str(save_latents)!r} must end in .safetensors (it is written as a "
                "safetensors file)"
            )
        named.append(("--save-latents", check_writable_file(save_latents, "--save-latents")))
    if output is not None:
        kept = Path(os.path.abspath(latents_path_for(Path(str(output)).expanduser())))
        if save_latents is None or Path(os.path.abspath(Path(str(save_latents)).expanduser())) != kept:
            named.append(("the latents kept if the video fails to encode", kept))
    _check_distinct(named)


def _check_distinct(named: Sequence[tuple[str, Path]]) -> None:
    for i, (flag_a, a) in enumerate(named):
        for flag_b, b in named[i + 1 :]:
            if a == b:
                raise ConfigError(f"{flag_a} and {flag_b} name the same file {str(a)!r}; give them different names")


# ---- model files ----------------------------------------------------------------------------
def _check_json(path: Path, fix: str) -> None:
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"cannot read {path} ({_first_line(exc)}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path} is not valid JSON ({exc}); {fix}") from None


def _check_safetensors(path: Path, fix: str) -> None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(n)) if 0 <= n <= size - 8 else None
    except OSError as exc:
        raise ModelFolderError(f"cannot read {path} ({_first_line(exc)}); {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path} is not a safetensors file (its header is unreadable); {fix}")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise ModelFolderError(f"{path} is not a safetensors file (its header is malformed); {fix}") from None
    if 8 + n + end != size:
        raise ModelFolderError(
            f"{path} is truncated or corrupt: its header describes {8 + n + end:,} bytes, the file "
            f"has {size:,}; {fix}"
        )


def _check_shards(index: Path, fix: str) -> None:
    weight_map = json.loads(index.read_text()).get("weight_map")
    shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
    missing = [s for s in shards if not (index.parent / str(s)).is_file()]
    if missing:
        raise ModelFolderError(f"{index} lists shard(s) that are missing: {', '.join(missing)}; {fix}")


def check_model_files(info: ModelInfo) -> None:
    """Refuse a model folder whose files are unreadable (`ModelFolderError`): every JSON file
    of ``model_index.json`` and its component folders parses, every safetensors file is
    complete, the transformer, VAE and text encoder each have weights. A preset is checked
    once its folder is complete (before that, it is built on first use)."""
    folder = info.path
    if folder is None:
        return
    if info.preset is not None:
        from causalkv.runtime.presets import is_complete_preset

        if not is_complete_preset(folder):
            return
        fix = f"delete the preset folder {str(folder)!r}; it is rebuilt on the next run"
    else:
        fix = "restore the file (re-download or re-convert the model)"
    _check_json(folder / "model_index.json", fix)
    index = json.loads((folder / "model_index.json").read_text())
    components = [k for k, v in index.items() if isinstance(v, list) and (folder / k).is_dir()]
    for name in components:
        sub = folder / name
        files = sorted(f for f in sub.rglob("*") if f.is_file())
        for f in files:
            if f.suffix == ".json":
                _check_json(f, fix)
                if f.name.endswith(".index.json"):
                    _check_shards(f, fix)
            elif f.suffix == ".safetensors":
                _check_safetensors(f, fix)
        if name in _WEIGHTED_COMPONENTS and not any(f.suffix in WEIGHT_SUFFIXES for f in files):
            raise ModelFolderError(
                f"{sub} has no weights (no {', '.join('*' + s for s in WEIGHT_SUFFIXES)} file); {fix}"
            )
