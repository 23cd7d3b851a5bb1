"""vLLM-Omni's own plugin loader finds causalkv and puts its pipeline on LingBot-World's path."""

from __future__ import annotations

import pytest


def test_vllm_omnis_loader_registers_causalkvs_lingbot_pipeline_in_a_fresh_process(ranks):
    """`load_omni_general_plugins` (the call vLLM-Omni makes in every process), in two fresh
    processes (the Ulysses test's ranks, started without CAUSALKV_VLLM_OMNI or VLLM_PLUGINS),
    discovers the ``vllm_omni.general_plugins`` entry point; LingBot-World's pipeline then
    resolves to causalkv's subclass, and its pre/post-process functions still resolve."""
    from causalkv.vllm_omni import pipeline

    for rank in range(2):
        got = ranks["discovery"][rank]
        assert got["module"] == "causalkv.vllm_omni.pipeline"
        assert got["name"] == "CausalKVLingBotWorldPipeline"
        assert got["subclass"] is True
        assert got["entry"] == ["causalkv.vllm_omni.pipeline", "", "CausalKVLingBotWorldPipeline"]
        assert callable(getattr(pipeline, got["pre"])) and callable(getattr(pipeline, got["post"]))
        assert "causalkv vllm-omni bridge registered" in ranks["logs"][rank]


def test_switch_off_registers_nothing(monkeypatch: pytest.MonkeyPatch):
    """``CAUSALKV_VLLM_OMNI=0``: the callable returns False and vLLM-Omni's registry keeps its
    own pipeline."""
    from vllm_omni.diffusion import registry

    import causalkv.vllm_omni as bridge

    before = registry._DIFFUSION_MODELS["LingBotWorldCausalDMDPipeline"]
    monkeypatch.setenv("CAUSALKV_VLLM_OMNI", "0")
    assert bridge.register() is False
    assert registry._DIFFUSION_MODELS["LingBotWorldCausalDMDPipeline"] == before
