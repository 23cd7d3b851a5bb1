"""The vLLM-Omni bridge's light parts, in the main environment (no vLLM here): the setting,
the entry point's declaration, and that importing causalkv never imports vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from causalkv.errors import ConfigError
from causalkv.vllm_omni.settings import CONFIG_KEY, read_settings

ROOT = Path(__file__).resolve().parents[1]


def test_absent_setting_changes_nothing():
    assert read_settings({}) is None
    assert read_settings(None) is None
    assert read_settings({"lingbot_reuse_last_step_kv": True}) is None
    assert read_settings({CONFIG_KEY: None}) is None


def test_setting_reads_causalkvs_reference_keys():
    q = read_settings({CONFIG_KEY: {"kv_cache_quant": "int2", "kv_cache_quant_keep_recent": 0,
                                    "kv_cache_quant_centroids": 64}})
    assert (q.bits, q.keep_recent_chunks, q.centroids) == (2, 0, 64)
    assert read_settings({CONFIG_KEY: {"kv_cache_quant": "int4"}}).bits == 4
    assert read_settings({CONFIG_KEY: {"kv_cache_quant": "off"}}).enabled is False
    # every registered codec, the recency tier too (the codec seam: no host lists them)
    q = read_settings({CONFIG_KEY: {"kv_cache_quant": "nvfp4",
                                    "kv_cache_quant_recent_tier": "fp8"}})
    assert (q.codec, q.recent_tier) == ("nvfp4", "fp8")


@pytest.mark.parametrize(("value", "message"), [
    ("int2", "must be a mapping"),
    ({"kv_cache_quant": "int8"}, "must be one of \\['off', 'int4', 'int2', 'fp8', 'nvfp4'\\], got 'int8'"),
    ({"kv_cache_quant": "int2", "kv_cache_quant_centroids": 0}, "centroids must be > 0, got 0"),
    ({"kv_cache_quant": "int2", "kv_cache_quant_centroids": 300}, "<= 256"),
    ({"kv_cache_quant": "off", "kv_cache_quant_keep_recent": 2}, "which is off"),
    ({"kv_cache_quant": "int2", "bits": 2}, "unknown key\\(s\\) \\['bits'\\]"),
    ({"kv_cache_quant_keep_recent": 2}, "must set kv_cache_quant \\(one of \\['off', 'int4'"),
])
def test_bad_settings_are_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message) as info:
        read_settings({CONFIG_KEY: value})
    assert f"model_config.{CONFIG_KEY}" in str(info.value)
    assert isinstance(info.value, ValueError)  # vLLM-Omni's pipelines refuse config with ValueError


def test_entry_point_is_declared_for_vllm_omnis_general_plugins():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm_omni.general_plugins"] == {"causalkv": "causalkv.vllm_omni:register"}


def test_importing_causalkv_and_the_bridge_imports_no_vllm_and_register_is_quiet_without_it():
    code = (
        "import sys, causalkv, causalkv.vllm_omni as b, causalkv.vllm_omni.settings\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni')], 'vllm imported'\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('vllm_omni') is None:\n"
        "    assert b.register() is False\n"
        "import os; os.environ['CAUSALKV_VLLM_OMNI'] = '0'\n"
        "assert b.register() is False\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("row", ["off", "int4", "int2"])
def test_planner_session_bytes_equal_the_stores_own_peak_resident(row):
    """`plan_sessions` (arithmetic) against `LingBotLayerKV` run for real at a small geometry
    with the same layout rules (3-frame blocks, sink 3 / window 9 frames, 16 tokens per frame):
    the most the stores hold over a long stream, all layers, byte for byte; off is exactly
    vLLM-Omni's dense ``[B, max_tokens, H, D]`` K and V."""
    import torch

    from causalkv.caches.spec import CausalCacheSpec
    from causalkv.memory.geometry import ModelGeometry
    from causalkv.memory.records import SETTINGS
    from causalkv.vllm_omni.admission import ROWS, plan_sessions
    from causalkv.vllm_omni.lingbot_cache import allocate_layers

    geom = ModelGeometry("tiny", 2, 2, 64, vae_scale_spatial=8, vae_scale_temporal=4,
                         patch=(2, 2), frames_per_chunk=3, sink_frames=3, global_sink_frames=3,
                         window_frames=9, height=64, width=64)
    (plan,) = plan_sessions(geom=geom, rows=(row,))
    n, cap = 48, 144
    spec = CausalCacheSpec(batch_size=1, num_heads=2, head_dim=64, cache_size=cap,
                           sink_tokens=48, dtype=torch.bfloat16, device="cpu")
    layers, ledger = allocate_layers(spec, SETTINGS[ROWS[row]].quant_args(), num_layers=2)
    g = torch.Generator().manual_seed(0)
    most = 0
    for i in range(8):
        for layer in layers:
            k, v = (torch.randn(1, n, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
            layer.update(k, v, i * n, sink_tokens=48, update_cache=True)
        most = max(most, ledger.resident_nbytes)
    assert plan.session_bytes == most
    assert plan.dense_bytes == ledger.dense_bytes
    if row == "off":
        assert most == ledger.dense_bytes
    else:
        assert most < ledger.dense_bytes
