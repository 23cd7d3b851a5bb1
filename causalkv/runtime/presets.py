"""Tiny presets: real diffusers/transformers components with seeded RANDOM weights.

Each preset (``tiny-wan``, ``tiny-longlive``, ``tiny-longlive2``, ``tiny-lingbot``) is a
complete diffusers-format model folder: a 2-layer ``WanTransformer3DModel`` (2 heads x 64,
so QVG's 64-channel blocks fit), a small ``AutoencoderKLWan``, a 2-layer
``UMT5EncoderModel`` and a byte-level tokenizer built in code. On first use the components
are created from a fixed seed and written with ``save_pretrained`` into
``$CAUSALKV_HOME/presets/<name>`` (default ``~/.cache/causalkv``); every run then loads
them with ``from_pretrained``, so the real loading path runs every time. Nothing is
downloaded. The weights are random: the videos are noise-like patterns, useful to exercise
the caches, the stages and the loading code, not to look at.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from causalkv.runtime.model_config import CAUSALKV_FILE, ModelInfo, model_info_from_dicts
from causalkv.runtime.text import BYTE_TOKENIZER_VOCAB_SIZE, build_byte_tokenizer

__all__ = ["PRESETS", "Preset", "causalkv_home", "materialize_preset", "preset_dir", "preset_info"]

#: bump when the preset definitions change: old cache folders are rebuilt
PRESET_FORMAT = 1
_MARKER = ".causalkv-preset.json"

_TEXT_DIM = 32

_TRANSFORMER: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 64,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": _TEXT_DIM,
    "freq_dim": 32,
    "ffn_dim": 256,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

_VAE: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 4,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.0, 0.0, 0.0, 0.0],
    "latents_std": [1.0, 1.0, 1.0, 1.0],
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}

_TEXT_ENCODER: dict[str, Any] = {
    "vocab_size": BYTE_TOKENIZER_VOCAB_SIZE,
    "d_model": _TEXT_DIM,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 32,
    "feed_forward_proj": "gated-gelu",
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}

#: shared by all presets: 64x64 video = 8x8 latents = 16 tokens per latent frame
_COMMON: dict[str, Any] = {
    "height": 64,
    "width": 64,
    "text_max_length": 32,
    "fps": 16,
    "timesteps": [1000.0, 750.0, 500.0, 250.0],
    "shift": 5.0,
    "context_noise": 0.0,
}


@dataclass(frozen=True)
class Preset:
    """A tiny preset: pipeline class (picks the stage), causalkv.json, and a seed."""

    name: str
    model_class: str
    causalkv: dict[str, Any]
    seed: int
    description: str
    transformer: dict[str, Any] = field(default_factory=lambda: dict(_TRANSFORMER))

    def model_index(self) -> dict[str, Any]:
        return {
            "_class_name": self.model_class,
            "_diffusers_version": _diffusers_version(),
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        }


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-wan",
            "SelfForcingWanPipeline",
            {**_COMMON, "frames_per_chunk": 3, "sink_frames": 0, "window_frames": 9,
             "default_frames": 12},
            seed=101,
            description="Self-Forcing-style Wan, 3 frames/chunk, 9-frame rolling window, no sink",
        ),
        Preset(
            "tiny-longlive",
            "LongLivePipeline",
            {**_COMMON, "frames_per_chunk": 3, "sink_frames": 3, "window_frames": 9,
             "default_frames": 12},
            seed=102,
            description="LongLive 1.0-style: 3-frame sink, 9-frame window, re-cache on prompt switch",
        ),
        Preset(
            "tiny-longlive2",
            "LongLive2Pipeline",
            {**_COMMON, "frames_per_chunk": 2, "sink_frames": 2, "global_sink_frames": 2,
             "window_frames": 8, "rope_offset_frames_per_shot": 2, "guidance_scale": 3.0,
             "default_frames": 8},
            seed=103,
            description="LongLive 2.0-style: 2-frame global + pinned shot sink, 8-frame window, "
            "CFG 3.0, RoPE +2 frames per shot",
        ),
        Preset(
            "tiny-lingbot",
            "LingBotWorldPipeline",
            {**_COMMON, "frames_per_chunk": 3, "sink_frames": 3, "window_frames": 12,
             "recent_window_frames": 3, "default_frames": 12},
            seed=104,
            description="LingBot-World-style: 3-frame sink, 12-frame window, 3-frame recent window",
        ),
    )
}


def causalkv_home() -> Path:
    """``$CAUSALKV_HOME`` or ``~/.cache/causalkv``."""
    return Path(os.environ.get("CAUSALKV_HOME") or Path.home() / ".cache" / "causalkv").expanduser()


def preset_dir(name: str) -> Path:
    return causalkv_home() / "presets" / name


def _get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def preset_info(name: str) -> ModelInfo:
    """The preset's `ModelInfo`, from its definition (no files needed)."""
    p = _get(name)
    return model_info_from_dicts(
        name, p.model_index(), p.transformer, _VAE, p.causalkv, path=preset_dir(name), preset=name
    )


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == PRESET_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def materialize_preset(name: str) -> Path:
    """Create the preset's folder on first use (seeded random weights); return its path.

    Written into a temporary sibling and renamed, so a crash never leaves a half-written
    preset; an existing complete folder is returned as is.
    """
    p = _get(name)
    folder = preset_dir(name)
    if _is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    tmp.chmod(0o755)
    try:
        _write_preset(p, tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _write_preset(p: Preset, out: Path) -> None:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p.seed)
        transformer = WanTransformer3DModel(**p.transformer)
        vae = AutoencoderKLWan(**_VAE)
        text_encoder = UMT5EncoderModel(UMT5Config(**_TEXT_ENCODER))
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    build_byte_tokenizer(p.causalkv["text_max_length"]).save_pretrained(out / "tokenizer")
    (out / "model_index.json").write_text(json.dumps(p.model_index(), indent=2) + "\n")
    (out / CAUSALKV_FILE).write_text(json.dumps(p.causalkv, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# {p.name} (causalkv preset)\n\n{p.description}.\n\n"
        f"The weights are RANDOM (seed {p.seed}): this folder exercises the loading path and "
        "the caches; its videos are not meaningful.\n"
    )
    (out / _MARKER).write_text(json.dumps({"format": PRESET_FORMAT, "name": p.name}) + "\n")
