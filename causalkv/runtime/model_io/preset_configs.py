"""The tiny presets as data: the base configs every preset of every family starts from, where
preset folders live, and a preset with what building it needs (`PresetSpec`, found by
`causalkv.runtime.model_io.model_config.resolve_preset`).

Read by `causalkv.runtime.model_io.model_config` (a preset's `RuntimeModelInfo`, no files needed) and by
`causalkv.runtime.model_io.presets` (which writes the folders), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from causalkv.env import text as env_text
from causalkv.hooks import Preset
from causalkv.runtime.model_io.prompt_encoding import BYTE_TOKENIZER_VOCAB_SIZE

__all__ = [
    "TINY_COMMON",
    "TINY_TEXT_ENCODER",
    "TINY_TRANSFORMER",
    "TINY_VAE",
    "PresetSpec",
    "ENV_HOME",
    "causalkv_home",
    "preset_dir",
]

#: the folder presets are built in (default ``~/.cache/causalkv``)
ENV_HOME = "CAUSALKV_HOME"
TINY_TEXT_DIM = 32

TINY_TRANSFORMER: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 64,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": TINY_TEXT_DIM,
    "freq_dim": 32,
    "ffn_dim": 256,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

TINY_VAE: dict[str, Any] = {
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

TINY_TEXT_ENCODER: dict[str, Any] = {
    "vocab_size": BYTE_TOKENIZER_VOCAB_SIZE,
    "d_model": TINY_TEXT_DIM,
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
TINY_COMMON: dict[str, Any] = {
    "height": 64,
    "width": 64,
    "text_max_length": 32,
    "fps": 16,
    "timesteps": [1000.0, 750.0, 500.0, 250.0],
    "shift": 5.0,
    "context_noise": 0.0,
}


@dataclass(frozen=True)
class PresetSpec:
    """A preset with the stage registration that declares it: its family (pipeline class
    ``models[0]``, ``defaults``, ``config`` record of ``causalkv.json`` keys of its own)."""

    preset: Preset
    registration: Any

    @property
    def model_class(self) -> str:
        return self.registration.models[0]

    @property
    def settings(self) -> dict[str, Any]:
        return {**TINY_COMMON, **self.preset.settings}

    @property
    def transformer(self) -> dict[str, Any]:
        return {**TINY_TRANSFORMER, **self.preset.transformer}


def causalkv_home() -> Path:
    """``$CAUSALKV_HOME`` (`ENV_HOME`) or, unset or blank, ``~/.cache/causalkv``."""
    return Path(env_text(ENV_HOME) or Path.home() / ".cache" / "causalkv").expanduser()


def preset_dir(name: str) -> Path:
    return causalkv_home() / "presets" / name
