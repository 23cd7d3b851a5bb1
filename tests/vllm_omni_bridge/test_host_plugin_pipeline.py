"""A plugin serves a vLLM-Omni pipeline causalkv does not ship: with the ``causalkv-host-plugin``
distribution installed, its ``toy-host`` plugin registers ``ToyLingBotWorldPipeline`` (a
subclass of causalkv's LingBot-World pipeline) under ``ToyLingBotWorldPipeline``, packing with
``toy-codec``'s int8. The bridge's ``register`` (vLLM-Omni's general-plugin callable) registers
every pipeline the registry names with vLLM-Omni's ``register_diffusion_model`` and logs one line
naming them; vLLM-Omni's own model registry then resolves the name to the plugin's class, whose
transformer gets the caches its registration's cache factory (``toy-packed``) builds, packing
with the registration's codec. The plugin switches
of causalkv's runtime hold: a blocked plugin's pipeline is not registered; a plugin whose
registration raises (``raising-host``) is set aside with one line, every other one served.

The distribution is pip-installed into a folder put on ``sys.path`` and found through
importlib.metadata by a fresh process-wide plugin manager (`plugin_dists.found_in_process`);
vLLM-Omni's registry is restored after each test. vLLM-Omni's own pipeline ``__init__`` needs
LingBot-World v2's checkpoint, so the stock part of the build is the tiny DiT
(`tiny_lingbot.build_transformer`, as test_transformer.py runs it): no engine, no weights."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_lingbot as tl
import torch
from vllm_omni.diffusion import registry as vreg
from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline

import causalkv.vllm_omni as bridge
from causalkv.caches.qvg.segments import PackedKV
from causalkv.plugin.manager import ENV_BLOCK
from causalkv.vllm_omni.lingbot_cache import LingBotLayerKV
from causalkv.vllm_omni.settings import CONFIG_KEY

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # plugin_dists, the test distributions' installer
    sys.path.insert(0, str(TESTS))
from plugin_dists import found_in_process, install  # noqa: E402

TOY = "ToyLingBotWorldPipeline"
BUILTIN_LINE = ("LingBotWorldCausalDMDPipeline -> causalkv.vllm_omni.pipeline.CausalKVLingBotWorldPipeline "
                "(plugin causalkv.builtin, cache qvg)")
TOY_LINE = (f"{TOY} -> causalkv_host_plugin.vllm_omni_pipeline.ToyLingBotWorldPipeline "
            "(plugin toy-host, cache toy-packed, codec int8)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install("causalkv-host-plugin", tmp_path_factory.mktemp("host-dist"))


@pytest.fixture
def installed(site: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """The distribution found as installed by this process (`found_in_process`), vLLM-Omni's
    registry restored afterwards, and the bridge's log lines captured (the bridge's logger may
    be routed to vLLM's, which does not propagate)."""
    monkeypatch.setattr(vreg.DiffusionModelRegistry, "models", dict(vreg.DiffusionModelRegistry.models))
    for table in ("_DIFFUSION_MODELS", "_DIFFUSION_PRE_PROCESS_FUNCS", "_DIFFUSION_POST_PROCESS_FUNCS"):
        monkeypatch.setattr(vreg, table, dict(getattr(vreg, table)))
    log = logging.getLogger("causalkv.vllm_omni")
    log.addHandler(caplog.handler)
    try:
        with found_in_process(site, monkeypatch), caplog.at_level(logging.INFO, logger="causalkv.vllm_omni"):
            yield
    finally:
        log.removeHandler(caplog.handler)


def _lines(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.INFO) -> list[str]:
    """The distinct messages holding ``text`` at ``level`` or above (vLLM's handlers, when the
    bridge's logger is routed to them, may hand a record to the capture twice)."""
    return sorted({r.getMessage() for r in caplog.records if text in r.getMessage() and r.levelno >= level})


def _registered(caplog: pytest.LogCaptureFixture) -> str:
    (line,) = _lines(caplog, "bridge registered")
    return line


def _tiny_stock_init(self, *, od_config, prefix=""):
    """vLLM-Omni's pipeline ``__init__`` as far as causalkv reads it: the DiT, at the tiny size."""
    torch.nn.Module.__init__(self)
    self.transformer = tl.build_transformer()


def test_a_plugins_pipeline_is_registered_served_with_its_codec_and_logged(installed, runtime, caplog,
                                                                           monkeypatch):
    assert bridge.register() is True
    assert _registered(caplog) == f"causalkv vllm-omni bridge registered: {BUILTIN_LINE}; {TOY_LINE}"
    assert vreg._DIFFUSION_MODELS[TOY] == ("causalkv_host_plugin.vllm_omni_pipeline", "", TOY)
    assert vreg._DIFFUSION_PRE_PROCESS_FUNCS[TOY] == "get_lingbot_world_pre_process_func"
    assert vreg._DIFFUSION_POST_PROCESS_FUNCS[TOY] == "get_lingbot_world_post_process_func"
    cls = vreg.DiffusionModelRegistry._try_load_model_cls(TOY)  # what vLLM-Omni's initialize_model builds
    from causalkv_host_plugin.vllm_omni_pipeline import ToyLingBotWorldPipeline

    assert cls is ToyLingBotWorldPipeline
    monkeypatch.setattr(LingBotWorldCausalDMDPipeline, "__init__", _tiny_stock_init)
    od_config = SimpleNamespace(model_class_name=TOY, model_config={CONFIG_KEY: {}},  # no kv_cache_quant
                                engine_backend="default", step_execution=False)
    pipe = cls(od_config=od_config)
    assert (pipe.causalkv_name, pipe.causalkv_quant.codec) == (TOY, "int8")  # the registration's codec
    (line,) = _lines(caplog, "self-attention cache")
    assert line.startswith("causalkv: LingBotWorldCausalDMDPipeline self-attention cache ToyPackedCache qvg(int8,")
    assert line.endswith(f"(cache toy-packed, plugin toy-host) (served as {TOY}, plugin toy-host)")
    h, w = tl.LATENT_HW
    cache = pipe.transformer.allocate_cache(batch_size=1, latent_height=h, latent_width=w,
                                            device=torch.device("cpu"), dtype=torch.float32)
    assert all(type(layer) is LingBotLayerKV for layer in cache.self_attention)
    from causalkv_host_plugin.caches import ToyPackedCache

    # built by the registration's cache factory, toy-packed
    assert all(type(layer.cache) is ToyPackedCache for layer in cache.self_attention)
    tl.run_blocks(pipe.transformer, cache, 4)
    store = cache.self_attention[0].cache.store
    packed = [s.storage for s in store.segments if isinstance(s.storage, PackedKV)]
    assert packed and {s.codec.name for s in packed} == {"int8"}
    assert all(s.nbytes == 2 * s.codec.nbytes(s.k.shape) for s in packed)  # K and V, as it predicts
    # a setting naming its codec keeps it
    named = cls(od_config=SimpleNamespace(**{**vars(od_config), "model_config": {CONFIG_KEY: {"kv_cache_quant": "int2"}}}))
    assert named.causalkv_quant.codec == "int2"


def test_a_blocked_plugins_pipeline_is_not_registered(installed, caplog, monkeypatch):
    """``CAUSALKV_DISABLE_PLUGINS=toy-host`` (as in ``causalkv generate``): vLLM-Omni does not
    know the name; causalkv's own pipeline is still registered."""
    monkeypatch.setenv(ENV_BLOCK, "toy-host")
    assert bridge.register() is True
    assert _registered(caplog) == f"causalkv vllm-omni bridge registered: {BUILTIN_LINE}"
    assert TOY not in vreg._DIFFUSION_MODELS
    assert vreg.DiffusionModelRegistry._try_load_model_cls(TOY) is None


def test_a_raising_registration_sets_its_plugin_aside_and_the_others_are_served(installed, caplog, capsys):
    assert bridge.register() is True
    assert _registered(caplog).endswith(TOY_LINE)
    assert ("causalkv: warning: plugin 'raising-host' (from causalkv-host-plugin 0.1.0) is set aside: "
            "causalkv_register_host_classes() raised RuntimeError: the host-class registration fails "
            "on purpose; fix the plugin, or turn it off with CAUSALKV_DISABLE_PLUGINS=raising-host"
            ) in capsys.readouterr().err
