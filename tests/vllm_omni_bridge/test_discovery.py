"""vLLM-Omni's own plugin loader finds causalkv and puts its pipeline on LingBot-World's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import json, logging
from vllm_omni.plugins import load_omni_general_plugins
from vllm_omni.diffusion import registry
load_omni_general_plugins()
cls = registry.DiffusionModelRegistry._try_load_model_cls("LingBotWorldCausalDMDPipeline")
from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline
print("RESULT " + json.dumps({
    "module": cls.__module__, "name": cls.__name__,
    "subclass": issubclass(cls, LingBotWorldCausalDMDPipeline),
    "entry": registry._DIFFUSION_MODELS["LingBotWorldCausalDMDPipeline"],
    "pre": registry._DIFFUSION_PRE_PROCESS_FUNCS["LingBotWorldCausalDMDPipeline"],
    "post": registry._DIFFUSION_POST_PROCESS_FUNCS["LingBotWorldCausalDMDPipeline"],
}))
"""


def test_vllm_omnis_loader_registers_causalkvs_lingbot_pipeline_in_a_fresh_process():
    """`load_omni_general_plugins` (the call vLLM-Omni makes in every process) discovers the
    ``vllm_omni.general_plugins`` entry point; LingBot-World's pipeline then resolves to
    causalkv's subclass, and its pre/post-process functions still resolve (re-exported)."""
    env = dict(os.environ)
    env.pop("CAUSALKV_VLLM_OMNI", None)
    env.pop("VLLM_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["module"] == "causalkv.vllm_omni.pipeline"
    assert got["name"] == "CausalKVLingBotWorldPipeline"
    assert got["subclass"] is True
    assert got["entry"] == ["causalkv.vllm_omni.pipeline", "", "CausalKVLingBotWorldPipeline"]
    from causalkv.vllm_omni import pipeline

    assert callable(getattr(pipeline, got["pre"])) and callable(getattr(pipeline, got["post"]))
    assert "causalkv vllm-omni bridge registered" in out.stdout + out.stderr


def test_switch_off_registers_nothing(monkeypatch: pytest.MonkeyPatch):
    """``CAUSALKV_VLLM_OMNI=0``: the callable returns False and vLLM-Omni's registry keeps its
    own pipeline."""
    from vllm_omni.diffusion import registry

    import causalkv.vllm_omni as bridge

    before = registry._DIFFUSION_MODELS["LingBotWorldCausalDMDPipeline"]
    monkeypatch.setenv("CAUSALKV_VLLM_OMNI", "0")
    assert bridge.register() is False
    assert registry._DIFFUSION_MODELS["LingBotWorldCausalDMDPipeline"] == before
