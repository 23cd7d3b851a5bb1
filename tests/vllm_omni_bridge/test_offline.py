"""vLLM-Omni's offline entry point, ``Omni(model=DIR).generate(...)``, runs on a CPU with
causalkv's store inside (``demo/vllm_omni/run_offline.py``, ``make run-vllm-omni``'s table, in a
fresh process: ``Omni`` sets up its own process groups): the tiny checkpoint, the CPU stand-ins
and the demo's stand-in pipeline (the DiT at the checkpoint's geometry, registered with
``register_diffusion_model``). One process, four ``Omni`` instances: ``stock`` (no
``causalkv_kv_cache``: vLLM-Omni's own cache), then the table's rows off, int4, int2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "demo" / "vllm_omni" / "run_offline.py"

# The oracle, from the checkpoint's geometry (causalkv.runtime.tools.checkpoints' lingbot-world) and the
# request (64x64 video), not from causalkv's ledger: vLLM-Omni's dense cache is K and V of
# [B, max_tokens, H, D] per layer, allocated whole, max_tokens = window frames x tokens per frame.
LAYERS, HEADS, HEAD_DIM, FLOAT32 = 2, 2, 64, 4
TOKENS_PER_FRAME = (64 // 8 // 2) ** 2  # the VAE's 8x spatial factor, then the DiT's 2x2 patches
WINDOW_FRAMES = 9
MAX_TOKENS = WINDOW_FRAMES * TOKENS_PER_FRAME  # 144
LAYER_KV = 2 * MAX_TOKENS * HEADS * HEAD_DIM * FLOAT32  # one layer's K and V
DENSE = LAYERS * LAYER_KV  # 294,912
# the largest visible K/V one call builds: a full window (4 blocks of 3 frames pass 9 frames)
DENSE_PEAK = DENSE + LAYER_KV


def test_omni_generates_the_table_off_int4_int2(tmp_path):
    """Four 3-frame blocks (45 video frames of 64x64) per instance through vLLM-Omni's engine,
    stage, worker, loader, LingBot's pre-process, DMD blocks, VAE decode and post-process.
    Each row against the oracle: dense bytes from the geometry; off holds exactly the dense
    bytes and its video equals vLLM-Omni's own cache's bit for bit (docs/vllm_omni.md, "The
    setting"); int4 and int2 hold fewer bytes and drift a finite PSNR from off, int2 the least
    bytes."""
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                             "MASTER_PORT", "CAUSALKV_VLLM_OMNI")}
    proc = subprocess.run([sys.executable, str(DEMO), "--settings", "stock,off,int4,int2",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    runs = {r["setting"]: r for r in result["runs"]}
    assert list(runs) == ["stock", "off", "int4", "int2"]
    for run in runs.values():
        assert run["outputs"] == 1
        assert run["video_shape"][-4:] == [45, 64, 64, 3]
    (stock_line,) = runs["stock"]["installed"]
    assert "keeps vLLM-Omni's KV cache" in stock_line and runs["stock"]["summary"] == []

    header, *rows = result["rows"]
    assert header[0] == "setting" and [r[0] for r in rows] == ["stock", "off", "int4", "int2"]
    assert rows[0][1] == "vLLM-Omni LingBotAttentionCache"
    for setting, row in zip(("off", "int4", "int2"), rows[1:]):
        f = runs[setting]["fields"]
        (installed,) = runs[setting]["installed"]
        described = "off" if setting == "off" else f"qvg({setting},"
        assert installed.endswith("self-attention cache QVGPackedCausalKVCache " + described) or (
            f"self-attention cache QVGPackedCausalKVCache {described} " in installed)
        assert f["cache"] == "QVGPackedCausalKVCache" and f["codec"] == setting
        assert f["layers"] == str(LAYERS)
        assert int(f["dense_bytes"]) == DENSE and int(f["dense_peak_bytes"]) == DENSE_PEAK
        peak, resident = int(f["peak_bytes"]), int(f["resident_bytes"])
        # the row prints these numbers
        assert row[1] == "causalkv QVGPackedCausalKVCache"
        assert row[2:4] == [f"{peak:,}", f"{DENSE_PEAK:,}"] and row[5:7] == [f"{resident:,}", f"{DENSE:,}"]
        if setting == "off":  # every chunk dense: vLLM-Omni's bytes exactly
            assert (peak, resident) == (DENSE_PEAK, DENSE) and row[4] == row[7] == "same"
        else:
            assert 0 < resident < DENSE and peak < DENSE_PEAK
            assert row[4].endswith("x smaller") and row[7].endswith("x smaller")
    assert int(runs["int2"]["fields"]["resident_bytes"]) < int(runs["int4"]["fields"]["resident_bytes"])

    # off: bit for bit vLLM-Omni's own cache's video, so PSNR vs off is infinite for both
    assert result["equal_to_stock"] == {"stock": True, "off": True, "int4": False, "int2": False}
    psnr = result["psnr_vs_off"]
    assert psnr["stock"] is None and psnr["off"] is None
    assert rows[0][-1] == rows[1][-1] == "identical"
    for setting, row in zip(("int4", "int2"), rows[2:]):  # packed: drift, finite
        assert 20 < psnr[setting] < 200 and row[-1] == f"{psnr[setting]:.1f} dB"
