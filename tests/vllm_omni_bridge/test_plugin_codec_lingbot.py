"""A plugin's codec inside vLLM-Omni: with the ``causalkv-codec-plugin`` distribution installed
(its toy int8 codec, registered through ``causalkv_register_codecs``), ``model_config.
causalkv_kv_cache`` takes ``kv_cache_quant: int8`` and ``kv_cache_quant_recent_tier: int8``,
LingBot-World's pipeline passes causalkv's start-up checks with it, and the self-attention
cache packs with the plugin's codec, its records as many bytes as its ``nbytes`` says; the plugin
switches of causalkv's runtime hold here too (a blocked plugin's codec is refused).

The distribution is pip-installed into a folder put on ``sys.path`` and found through
importlib.metadata by a fresh process-wide plugin manager, as in a vLLM-Omni process where it
is installed; the cache is fed LingBot's DMD order (probes, then the commit) as in
test_lingbot_cache.py (no model, no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_lingbot_cache import CAP, SINK, B, D, H, N, _chunk, _schedule
from test_startup import _config

from causalkv.caches import codecs
from causalkv.caches.qvg.segments import PackedKV
from causalkv.caches.spec import CausalCacheSpec
from causalkv.errors import ConfigError
from causalkv.plugin.manager import reset_plugin_manager
from causalkv.vllm_omni.lingbot_cache import allocate_layers
from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline, check_engine_mode
from causalkv.vllm_omni.settings import CONFIG_KEY, read_settings

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # plugin_dists, the test distributions' installer
    sys.path.insert(0, str(TESTS))
from plugin_dists import found_in_process, install  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install("causalkv-codec-plugin", tmp_path_factory.mktemp("codec-dist"))


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch):
    """The distribution found as an installed plugin by this process (`found_in_process`)."""
    with found_in_process(site, monkeypatch):
        yield


@pytest.mark.parametrize(("setting", "packed"), [
    ({"kv_cache_quant": "int8"}, {"int8"}),
    # int2 packs the cold chunks, the plugin's codec holds the recent one
    ({"kv_cache_quant": "int2", "kv_cache_quant_recent_tier": "int8"}, {"int2", "int8"}),
], ids=["codec", "recent-tier"])
def test_kv_cache_quant_takes_a_plugin_codec(installed, monkeypatch, setting, packed):
    assert "int8" not in codecs.codec_names()  # nothing loaded the plugins yet
    quant = read_settings({CONFIG_KEY: setting})
    assert (quant.codec, quant.recent_tier) == (setting["kv_cache_quant"],
                                                setting.get("kv_cache_quant_recent_tier", "bf16"))
    quant.check_layout(64)  # the pipeline's start-up checks, before anything loads
    check_engine_mode(_config(setting), quant)
    spec = CausalCacheSpec(batch_size=B, num_heads=H, head_dim=D, cache_size=CAP,
                           sink_tokens=SINK, dtype=torch.float32, device="cpu")
    layers, ledger = allocate_layers(spec, quant, num_layers=1)
    layer = layers[0]
    for i, step, commit in _schedule(7):
        k, v = _chunk(i, step)
        layer.update(k, v, i * N, sink_tokens=SINK, update_cache=commit)
    segments = [s.storage for s in layer.cache.store.segments if isinstance(s.storage, PackedKV)]
    assert {s.codec.name for s in segments} == packed
    mine = [s for s in segments if s.codec.name == "int8"]
    assert type(mine[0].codec).__module__ == "toy_codec_plugin"
    assert all(s.nbytes == 2 * s.codec.nbytes(s.k.shape) for s in mine)  # K and V, as it predicts
    assert layer.cache.resident_nbytes() < ledger.dense_bytes


def test_the_plugin_switches_of_causalkvs_runtime_hold_in_the_bridge(installed, monkeypatch):
    """``CAUSALKV_DISABLE_PLUGINS`` (as in ``causalkv generate``): the blocked plugin's codec is
    refused by the pipeline before anything loads, naming the codecs there are; unblocked (a
    new process: a new manager), it is read."""
    monkeypatch.setenv("CAUSALKV_DISABLE_PLUGINS", "toy-codec")
    with pytest.raises(ConfigError, match=r"must be one of \['off', 'int4', 'int2', 'fp8', 'nvfp4'\], "
                                          r"got 'int8'"):
        CausalKVLingBotWorldPipeline(od_config=_config({"kv_cache_quant": "int8"}))
    monkeypatch.delenv("CAUSALKV_DISABLE_PLUGINS")
    reset_plugin_manager()
    assert read_settings({CONFIG_KEY: {"kv_cache_quant": "int8"}}).codec == "int8"


def test_a_broken_plugin_codec_is_refused_at_the_pipelines_start_up(monkeypatch):
    """``kv_cache_quant`` naming a codec that decodes zeros: the pipeline's start-up check (the
    codec's layout at the model's head_dim, before any weights load) stops with one line
    naming the setting and the conformance check it failed."""
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    codecs.register_codec("i8zeros", "toy_codec_plugin:WritesZeros")  # decodes zeros
    quant = read_settings({CONFIG_KEY: {"kv_cache_quant": "i8zeros"}})
    with pytest.raises(ConfigError) as e:
        quant.check_layout(64)
    line = str(e.value)
    assert "\n" not in line and "setting 'i8zeros'" in line and "conformance check 'bound'" in line
