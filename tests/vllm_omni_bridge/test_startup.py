"""The registered pipeline refuses a bad setting, and QVG on the paged engine path, before it
builds anything (no model folder exists here: reaching vLLM-Omni's own __init__ would fail
differently)."""

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


@pytest.mark.parametrize("kw", [{"engine_backend": ENGINE}, {"step_execution": True}])
@pytest.mark.parametrize("quant", ["int2", "off"])
def test_the_paged_engine_path_is_refused_naming_the_mode_that_supports_qvg(kw, quant):
    from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline

    with pytest.raises(ConfigError, match="paged AR-diffusion engine path.*request \\(direct\\) mode"):
        CausalKVLingBotWorldPipeline(od_config=_config({"kv_cache_quant": quant}, **kw))
