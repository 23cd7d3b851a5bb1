"""Model config reading: presets, diffusers-format folders, causalkv.json, bad folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from causalkv.plugin.builtin import STAGES
from causalkv.runtime.model_io.model_config import (
    ModelFolderError,
    load_model_info,
    model_info_from_dicts,
    preset_info,
    read_model_folder,
)
from causalkv.runtime.model_io.preset_configs import preset_dir
from causalkv.runtime.model_io.presets import materialize_preset
from causalkv.stages.families import LongLive2Config

WAN21_TRANSFORMER = {"patch_size": [1, 2, 2], "num_layers": 30, "num_attention_heads": 12,
                     "attention_head_dim": 128, "in_channels": 16}
WAN21_VAE = {"dim_mult": [1, 2, 4, 4], "temperal_downsample": [False, True, True]}


def test_wan21_tokens_per_frame_matches_facts() -> None:
    # docs/design.md: Wan 2.1 1.3B at 480x832 -> 1560 tokens per latent frame (30 x 52 patches)
    info = model_info_from_dicts(
        "wan", {"_class_name": "SelfForcingWanPipeline"}, WAN21_TRANSFORMER, WAN21_VAE, None
    )
    cfg = info.config
    assert cfg.tokens_per_frame == (480 // 8 // 2) * (832 // 8 // 2) == 1560
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim) == (30, 12, 128)
    assert (cfg.frames_per_chunk, cfg.sink_frames, cfg.window_frames) == (3, 0, 21)
    assert cfg.timesteps == (1000.0, 750.0, 500.0, 250.0) and cfg.shift == 5.0


def test_longlive2_class_defaults_match_facts() -> None:
    # docs/design.md: LongLive 2.0 (Wan 2.2 TI2V, VAE x16) at 704x1280 -> 880 tokens per frame,
    # 8 frames per chunk, 8 global + 8 shot sink, window 32, RoPE offset 8 per shot
    vae = {"dim_mult": [1, 2, 4, 4], "scale_factor_spatial": 16, "scale_factor_temporal": 4}
    transformer = {**WAN21_TRANSFORMER, "num_attention_heads": 24, "in_channels": 48}
    info = model_info_from_dicts("ll2", {"_class_name": "LongLive2Pipeline"}, transformer, vae, None)
    cfg = info.config
    assert cfg.tokens_per_frame == (704 // 16 // 2) * (1280 // 16 // 2) == 880
    assert (cfg.frames_per_chunk, cfg.sink_frames, cfg.global_sink_frames) == (8, 8, 8)
    assert (cfg.window_frames, cfg.option(LongLive2Config).rope_offset_frames_per_shot) == (32, 8)


def test_causalkv_json_overrides_class_defaults() -> None:
    info = model_info_from_dicts(
        "lb", {"_class_name": "LingBotWorldPipeline"}, WAN21_TRANSFORMER, WAN21_VAE,
        {"sink_frames": 9, "window_frames": 18},
    )
    assert (info.config.sink_frames, info.config.window_frames) == (9, 18)
    assert info.config.recent_window_frames == 12  # class default kept


def test_unknown_causalkv_key_is_refused() -> None:
    with pytest.raises(ModelFolderError, match=r"unknown key\(s\) \['sink'\].*valid keys"):
        model_info_from_dicts(
            "x", {"_class_name": "WanPipeline"}, WAN21_TRANSFORMER, WAN21_VAE, {"sink": 3}
        )


def test_unknown_pipeline_without_causalkv_json_is_refused() -> None:
    with pytest.raises(ModelFolderError, match="no causalkv.json and no registered stage serves pipeline 'MyPipeline'"):
        model_info_from_dicts("x", {"_class_name": "MyPipeline"}, WAN21_TRANSFORMER, WAN21_VAE, None)


def test_resolution_not_divisible_is_refused() -> None:
    """The folder's size is refused by the rule a --height flag is (`pixel_frame_tokens`):
    Wan 2.1's VAE scale 8 x patch 2 = 16 divides neither 100 nor 90; 96/112 and 80/96 are the
    nearest multiples."""
    for key, px, near in (("height", 100, "96 or 112"), ("width", 90, "80 or 96")):
        with pytest.raises(ModelFolderError) as info:
            model_info_from_dicts(
                "x", {"_class_name": "WanPipeline"}, WAN21_TRANSFORMER, WAN21_VAE, {key: px}
            )
        assert str(info.value) == (f"x: {key} {px} is not a multiple of 16 (VAE scale 8 x patch 2 "
                                   f"of x); set {key} {near} in causalkv.json"), info.value


def test_unknown_model_names_the_presets(causalkv_home: str) -> None:
    with pytest.raises(ModelFolderError, match="unknown model 'tiny-nope'.*tiny-wan, tiny-longlive"):
        load_model_info("tiny-nope")


def test_folder_missing_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelFolderError, match="is missing transformer/config.json, vae/config.json"):
        load_model_info(str(tmp_path))


def test_preset_info_needs_no_files_and_matches_the_written_folder(causalkv_home: str) -> None:
    for name in (p.name for reg in STAGES for p in reg.presets):
        info = preset_info(name)
        assert info.config.head_dim % 64 == 0, "QVG's default block_size 64 must divide head_dim"
        # 64x64 / VAE 8 / patch 2 = 4x4; make run's preset: 128x128 / 8 / patch 1 = 16x16
        assert info.config.tokens_per_frame == (256 if name == "tiny-longlive2-1k" else 16), name
    folder = materialize_preset("tiny-longlive2")
    assert folder == preset_dir("tiny-longlive2")
    on_disk = read_model_folder(folder)
    expected = preset_info("tiny-longlive2")
    assert on_disk.config.model_class == "LongLive2Pipeline"
    for field in ("frames_per_chunk", "sink_frames", "global_sink_frames", "window_frames",
                  "tokens_per_frame", "num_layers", "num_heads", "head_dim", "options"):
        assert getattr(on_disk.config, field) == getattr(expected.config, field), field
    assert on_disk.config.option(LongLive2Config).rope_offset_frames_per_shot == 2
    assert on_disk.guidance_scale == expected.guidance_scale == 3.0
    assert "RANDOM" in (folder / "README.md").read_text()
    # a second call reuses the folder (weights are created once)
    stamp = (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    materialize_preset("tiny-longlive2")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == stamp


def test_fixture_home_is_temporary(causalkv_home: str) -> None:
    from causalkv.runtime.model_io.preset_configs import causalkv_home as home

    assert str(home()) == causalkv_home
    assert os.path.basename(causalkv_home).startswith("causalkv-home")


def test_sglang_override_keys_set_sink_and_window() -> None:
    # sglang's realtime_causal_sink_size / realtime_causal_kv_cache_num_frames (frames) win
    info = model_info_from_dicts(
        "lb", {"_class_name": "LingBotWorldCausalDMDPipeline"}, WAN21_TRANSFORMER, WAN21_VAE,
        {"realtime_causal_sink_size": 9, "realtime_causal_kv_cache_num_frames": 18,
         "sink_frames": 3},
    )
    assert (info.config.sink_frames, info.config.window_frames) == (9, 18)
    assert info.config.recent_window_frames == 12  # the LingBot family's default
    with pytest.raises(ModelFolderError, match="realtime_causal_kv_cache_num_frames must be a positive int or null, got 0"):
        model_info_from_dicts("x", {"_class_name": "WanPipeline"}, WAN21_TRANSFORMER, WAN21_VAE,
                              {"realtime_causal_kv_cache_num_frames": 0})
    with pytest.raises(ModelFolderError, match="realtime_causal_sink_size must be an int >= 0 or null, got -1"):
        model_info_from_dicts("x", {"_class_name": "WanPipeline"}, WAN21_TRANSFORMER, WAN21_VAE,
                              {"realtime_causal_sink_size": -1})
