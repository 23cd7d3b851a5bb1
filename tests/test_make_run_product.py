"""What `make run` shows: the tiny-longlive2-1k preset's geometry, bf16 caches under float32
compute (``kv_cache_dtype``), and the end-of-run comparison table."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import make_options, plan_and_run

from causalkv.config import ConfigError, ServerArgs
from causalkv.runtime.host.compare_step import compare_table
from causalkv.runtime.model_io.model_config import load_model_info


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
        "model": "tiny-longlive2-1k",
        "random_weights": True,
        "cache": "qvg",
        "reference_cache": "dense",
        "cache_class": "causalkv.caches.qvg.packed:QVGPackedCausalKVCache",
        "reference_cache_class": "causalkv.caches.dense:DenseCausalKVCache",
        "cache_options": "qvg(int2, centroids=128, block=64)",
        "cache_settings": {"kv_cache_quant": "int2", "kv_cache_quant_centroids": 128},
        "kv_cache_dtype": "bfloat16",
        "kv_resident_bytes_max": 1_000_000,
        "reference_kv_resident_bytes_max": 4_000_000,
        "kv_peak_bytes": 1_250_000,
        "reference_kv_peak_bytes": 4_000_000,
        "latent_psnr_db": 31.25,
        "seconds_per_chunk_mean": 9.0,  # timed once: not what the table shows
        "reference_seconds_per_chunk_mean": 1.0,
        "timing_repeats": 3,
        "seconds_per_chunk_best": 3.0,
        "reference_seconds_per_chunk_best": 2.0,
        "seconds_per_chunk_runs": [3.5, 3.0, 3.25],
        "reference_seconds_per_chunk_runs": [2.0, 2.5, 2.125],
    }
    lines = compare_table(metrics).splitlines()
    assert len(lines) == 9
    assert lines[0].startswith("causalkv generate --compare-bf16 on tiny-longlive2-1k (a preset: RANDOM weights)")
    assert "off (bfloat16)" in lines[1] and "int2" in lines[1]  # the reference dtype by default
    assert "off (float32)" in compare_table({**metrics, "reference_kv_cache_dtype": "float32"})
    assert lines[2].startswith("causalkv cache")
    assert "dense: DenseCausalKVCache" in lines[2] and "qvg: QVGPackedCausalKVCache" in lines[2]
    # binary units (4,000,000 B = 3.81 MiB, 1,000,000 B = 976.56 KiB), ratios of the exact bytes
    assert "3.81 MiB" in lines[3] and "976.56 KiB" in lines[3] and "4.00x smaller" in lines[3]
    assert lines[4].startswith("KV bytes (peak")
    assert "3.81 MiB" in lines[4] and "1.19 MiB" in lines[4] and "3.20x smaller" in lines[4]
    assert "31.2 dB" in lines[5] and "(*)" in lines[5]
    assert "least of 3 warm runs, alternating" in lines[6]
    assert "2.000" in lines[6] and "3.000" in lines[6] and "1.50x time" in lines[6]
    assert "spread of the 3 warm runs" in lines[7]
    assert "2.000-2.500" in lines[7] and "3.000-3.500" in lines[7]
    assert lines[8].startswith("(*) the weights are random")
    assert "identical" in compare_table({**metrics, "latent_psnr_db": None})
    # no timed repeats: no time row; real weights: no random-weights note
    untimed = compare_table({**metrics, "timing_repeats": 0, "seconds_per_chunk_best": None,
                             "reference_seconds_per_chunk_best": None, "random_weights": False})
    assert "seconds per chunk" not in untimed and "random" not in untimed.lower()
    assert "(its own weights)" in untimed.splitlines()[0]


def test_compare_times_both_settings_warm_and_alike(pm, causalkv_home, monkeypatch) -> None:
    """`compare_unquantized` reruns each setting ``repeats`` times after the warm-up pair,
    alternating, and reports each setting's least seconds per chunk over its repeats."""
    from causalkv.runtime.host import compare_step

    plan, run = plan_and_run(make_options("tiny-longlive2", quant="int2"), pm)
    calls: list[bool] = []
    real = compare_step.run_plan

    def counting(plan_, **kw):
        calls.append("resolution" in kw)  # the reference run passes its own resolution
        return real(plan_, **kw)

    monkeypatch.setattr(compare_step, "run_plan", counting)
    metrics = compare_step.compare_unquantized(plan, run, pm=pm, repeats=2)
    assert calls == [True, False, True, False, True]  # reference, then (int2, off) x 2
    assert metrics["timing_repeats"] == 2
    assert metrics["seconds_per_chunk_best"] > 0 and metrics["reference_seconds_per_chunk_best"] > 0
    # the least is the least of the timed runs it reports (N of each, the spread the table shows)
    assert len(metrics["seconds_per_chunk_runs"]) == len(metrics["reference_seconds_per_chunk_runs"]) == 2
    assert metrics["seconds_per_chunk_best"] == min(metrics["seconds_per_chunk_runs"])
    assert metrics["reference_seconds_per_chunk_best"] == min(metrics["reference_seconds_per_chunk_runs"])
    assert metrics["cache_class"].endswith(":QVGPackedCausalKVCache")
    assert metrics["reference_cache_class"].endswith(":DenseCausalKVCache")
    assert metrics["random_weights"] is True


def test_compare_bf16_compares_with_bf16_caches_unless_told(pm, causalkv_home) -> None:
    """A float32 run without --kv-cache-dtype: the reference is still a bf16 cache (the flag
    says bf16), so its bytes are half a float32 reference's; ``reference_dtype`` names another."""
    from causalkv.runtime.host.compare_step import compare_unquantized

    plan, run = plan_and_run(make_options("tiny-longlive2", quant="int2", dtype="float32"), pm)
    bf16 = compare_unquantized(plan, run, pm=pm, repeats=0)
    f32 = compare_unquantized(plan, run, pm=pm, repeats=0, reference_dtype="float32")
    assert bf16["reference_kv_cache_dtype"] == "bfloat16" and f32["reference_kv_cache_dtype"] == "float32"
    assert f32["reference_kv_resident_bytes_max"] == 2 * bf16["reference_kv_resident_bytes_max"]
    assert "off (bfloat16)" in compare_table({**run_report_stub(run), **bf16})


def run_report_stub(run) -> dict:
    """The run's own keys `compare_table` reads besides the comparison's."""
    return {"kv_resident_bytes_max": run.kv_resident_bytes_max, "kv_peak_bytes": run.stage.kv_peak_nbytes(),
            "cache": "qvg", "cache_options": "qvg(int2)"}
