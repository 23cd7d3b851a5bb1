"""The registered pipeline refuses a bad setting before it builds anything (no model folder
exists here: reaching vLLM-Omni's own __init__ fails differently); on the paged AR-diffusion
engine it serves the setting, refusing step execution and a vLLM-Omni lacking a seam."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from causalkv.errors import ConfigError

ENGINE = "vllm_omni.experimental.ar_diffusion.engine.ARDiffusionEngine"


def _config(setting, **kw):
    return SimpleNamespace(model="/nonexistent/lingbot", model_config={"causalkv_kv_cache": setting},
                           engine_backend=kw.get("engine_backend", "default"),
                           step_execution=kw.get("step_execution", False))


@pytest.mark.parametrize(("setting", "message"), [
    ({"kv_cache_quant": "int8"}, "got 'int8'"),
    ({"kv_cache_quant": "int2", "kv_cache_quant_block_size": 48}, "does not divide head_dim|divisible"),
    ({"kv_cache_quant": "int2", "kv_cache_quant_centroids": 0}, "> 0"),
    ({"kv_cache_quant": "int2", "typo": 1}, "unknown key"),
])
def test_bad_settings_are_refused_before_anything_loads(setting, message):
    from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline

    with pytest.raises(ConfigError, match=message):
        CausalKVLingBotWorldPipeline(od_config=_config(setting))


@pytest.mark.parametrize("quant", ["int2", "off"])
def test_the_paged_engine_passes_causalkvs_checks_and_builds_vllm_omnis_pipeline(quant):
    """On ARDiffusionEngine the setting is served (causalkv's pages, paged_pipeline): the checks
    pass and vLLM-Omni's own __init__ runs, failing here on the missing folder, not on causalkv."""
    from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline

    with pytest.raises(OSError, match="/nonexistent/lingbot"):  # the tokenizer's folder
        CausalKVLingBotWorldPipeline(od_config=_config({"kv_cache_quant": quant}, engine_backend=ENGINE))


@pytest.mark.parametrize("quant", ["int2", "off"])
def test_step_execution_is_refused_before_anything_loads(quant):
    from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline

    with pytest.raises(ConfigError, match="request-mode ticks.*step_execution=True is not supported"):
        CausalKVLingBotWorldPipeline(od_config=_config({"kv_cache_quant": quant}, engine_backend=ENGINE,
                                                        step_execution=True))


def test_a_vllm_omni_lacking_a_seam_is_refused_before_anything_loads(monkeypatch):
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache

    from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline

    monkeypatch.delattr(ARDiffusionKVCache, "allocate_token_slots")
    with pytest.raises(ConfigError, match=r"needs vllm_omni\.experimental\.ar_diffusion\.kv_cache\."
                                          r"manager\.ARDiffusionKVCache\.allocate_token_slots .*"
                                          r"read from vLLM-Omni 0\.30\.0"):
        CausalKVLingBotWorldPipeline(od_config=_config({"kv_cache_quant": "int2"}, engine_backend=ENGINE))
