"""What `make run` shows: the tiny-longlive2-1k preset's geometry, bf16 caches under float32
compute (``kv_cache_dtype``), and the end-of-run comparison table."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_options, plan_and_run

from causalkv.cli.generate import compare_table
from causalkv.config import ConfigError, ServerArgs
from causalkv.runtime.model_config import load_model_info


def test_make_run_preset_has_about_a_thousand_tokens_per_chunk(pm, causalkv_home) -> None:
    info = load_model_info("tiny-longlive2-1k", pm=pm)
    cfg = info.config
    # 128x128 pixels / VAE 8 = 16x16 latents, 1x1 patches: 256 tokens per frame, 4 frames
    assert cfg.tokens_per_frame == 256 and cfg.frames_per_chunk == 4
    assert cfg.tokens_per_chunk == 1024
    assert cfg.window_frames // cfg.frames_per_chunk == 6  # the window holds six chunks


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="int8")


def test_float32_compute_with_bf16_caches_stores_bf16_bytes(pm, causalkv_home) -> None:
    opts = make_options("tiny-longlive2", dtype="float32", kv_cache_dtype="bfloat16")
    _plan, run = plan_and_run(opts, pm)
    cache = run.stage.caches.kv[0]
    assert run.stage.denoiser.dtype == torch.float32
    assert cache.spec.dtype == torch.bfloat16
    _plan32, run32 = plan_and_run(make_options("tiny-longlive2", dtype="float32"), pm)
    # the same stream in float32 caches holds exactly twice the bytes
    assert run32.kv_resident_bytes_max == 2 * run.kv_resident_bytes_max


def test_compare_table_reports_ratios_from_the_metrics() -> None:
    metrics = {
        "cache_options": "qvg(int2, centroids=128, block=64)",
        "kv_cache_dtype": "bfloat16",
        "kv_resident_bytes_max": 1_000_000,
        "reference_kv_resident_bytes_max": 4_000_000,
        "latent_psnr_db": 31.25,
        "seconds_per_chunk_mean": 3.0,
        "reference_seconds_per_chunk_mean": 2.0,
    }
    table = compare_table(metrics)
    lines = table.splitlines()
    assert len(lines) == 4
    assert "off (bfloat16)" in lines[0] and "int2" in lines[0]
    assert "4,000,000" in lines[1] and "1,000,000" in lines[1] and "4.00x smaller" in lines[1]
    assert "31.2 dB" in lines[2]
    assert "2.00" in lines[3] and "3.00" in lines[3] and "1.50x time" in lines[3]
    assert "identical" in compare_table({**metrics, "latent_psnr_db": None})
