"""Host classes in the registry (`HostClassRegistration`, ``causalkv_register_host_classes``): what
the sglang and vLLM-Omni bridges serve is the collected registrations, causalkv's built-in ones
included, under the same rules as the runtime's stages: the highest priority per host and
model wins, two at one priority set the later plugin aside, a raising hook sets its plugin
aside, a codec no plugin registers sets it aside, and the built-in ones go with the built-in
plugin. The bridges' own tests (tests/sglang_bridge/test_host_plugin_bridge.py,
tests/vllm_omni_bridge/test_host_plugin_pipeline.py) serve a plugin's class in each host."""

from __future__ import annotations

import pytest

from causalkv.caches import codecs
from causalkv.errors import InvalidTypeError
from causalkv.hooks import CacheFactory, CodecRegistration, HostClassRegistration, hookimpl
from causalkv.plugin import collect, collected, get_plugin_manager, reset_plugin_manager
from causalkv.plugin.builtin import BUILTIN_PLUGIN_NAME
from causalkv.plugin.testing import fresh_plugin_manager, temporary_plugin

SGLANG_STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"


class _Hosts:
    """A plugin registering the host classes it is given (and codecs, optionally)."""

    def __init__(self, *hosts: HostClassRegistration, codecs: tuple[CodecRegistration, ...] = ()) -> None:
        self.hosts, self.codecs = hosts, codecs

    @hookimpl
    def causalkv_register_host_classes(self):
        return self.hosts

    @hookimpl
    def causalkv_register_codecs(self):
        return self.codecs


@pytest.fixture
def codec_registry(monkeypatch):
    """causalkv's codec registry restored after the test (collect registers plugin codecs)."""
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))


def test_host_registration_normalizes_and_refuses_bad_values_naming_them():
    reg = HostClassRegistration("sglang", "pkg.stage:MyStage", "MyPipeline")
    assert (reg.models, reg.codec, reg.priority, reg.cache, reg.name) == (
        ("MyPipeline",), None, 0, None, "sglang pkg.stage:MyStage")
    for kwargs, match in [
        ({"target": "pkg.stage.MyStage"}, r"HostClassRegistration: target must be a 'module:Class' string, got 'pkg.stage.MyStage'"),
        ({"host": ""}, r"host must be a host's name such as 'sglang', got ''"),
        ({"models": ()}, r"models must be non-empty strings, got \(\)"),
        ({"codec": 8}, r"codec must be a codec setting's name or None, got 8"),
        ({"cache": ""}, r"cache must be a cache factory's name or None, got ''"),
        ({"priority": "1"}, r"priority must be an int, got '1'"),
        ({"host": "causalkv", "codec": "int8"}, r"causalkv's runtime takes the codec from --kv-cache-quant.*got codec='int8'"),
    ]:
        args = {"host": "sglang", "target": "pkg.stage:MyStage", "models": "MyPipeline", **kwargs}
        with pytest.raises(InvalidTypeError, match=match):
            HostClassRegistration(**args)


def test_causalkv_register_host_classes_of_the_builtin_plugin_are_the_bridges_classes(pm):
    registry = collect(pm, report=None)
    sglang = registry.host_classes("sglang")
    assert {m: r.target.rsplit(":", 1)[1] for m, (r, _) in sglang.items()} == {
        "LongLive2Pipeline": "LongLive2CausalDenoisingStage",
        "WanCausalDMDPipeline": "CausalDMDDenoisingStage",
        "LingBotWorldCausalDMDPipeline": "LingBotWorldCausalDMDDenoisingStage",
    }
    assert all(r.target.startswith(SGLANG_STAGES) for r, _ in sglang.values())
    ((model, (reg, plugin)),) = registry.host_classes("vllm-omni").items()
    assert (model, reg.target, plugin) == ("LingBotWorldCausalDMDPipeline",
                                           "causalkv.vllm_omni.pipeline:CausalKVLingBotWorldPipeline",
                                           BUILTIN_PLUGIN_NAME)
    assert registry.host_classes("another-host") == {}
    blocked = collect(fresh_plugin_manager(builtin=False), report=None)
    assert blocked.hosts == () and blocked.host_classes("sglang") == {}


def test_causalkv_register_host_classes_the_highest_priority_serves_a_model(pm):
    """A plugin's class for a model causalkv serves wins only at a higher priority; the other
    models stay the built-in plugin's, and another host's registrations are that host's."""
    mine = _Hosts(HostClassRegistration("sglang", "pkg.stage:Mine", ("LongLive2Pipeline", "MinePipeline"), priority=1),
                  HostClassRegistration("vllm-omni", "pkg.pipe:Mine", "MinePipeline"))
    with temporary_plugin(pm, mine, name="mine"):
        registry = collect(pm, report=None)
    sglang = registry.host_classes("sglang")
    assert {m: (r.target, p) for m, (r, p) in sglang.items() if p == "mine"} == {
        "LongLive2Pipeline": ("pkg.stage:Mine", "mine"), "MinePipeline": ("pkg.stage:Mine", "mine")}
    assert sglang["WanCausalDMDPipeline"][1] == BUILTIN_PLUGIN_NAME
    assert set(registry.host_classes("vllm-omni")) == {"LingBotWorldCausalDMDPipeline", "MinePipeline"}


def test_causalkv_register_host_classes_at_a_taken_priority_sets_the_later_plugin_aside(pm):
    clash = _Hosts(HostClassRegistration("sglang", "pkg.stage:Mine", ("MinePipeline", "LongLive2Pipeline")))
    with temporary_plugin(pm, clash, name="clash"):
        registry = collect(pm, report=None)
    (failure,) = registry.failures
    assert failure.name == "clash"
    assert failure.error == (
        "its sglang model 'LongLive2Pipeline' at priority 0 is taken by host class 'sglang "
        f"{SGLANG_STAGES}.model_specific_stages.longlive2:LongLive2CausalDenoisingStage' of plugin "
        f"'{BUILTIN_PLUGIN_NAME}'")
    assert "give the registration another priority" in str(failure)
    assert "MinePipeline" not in registry.host_classes("sglang")  # nothing of it is kept


def test_causalkv_register_host_classes_naming_an_unknown_codec_sets_the_plugin_aside(pm, codec_registry):
    """A registration's codec is one causalkv or any plugin registers (the plugin's own, or
    one registered later, counts); another name sets the plugin aside naming it."""
    int8 = CodecRegistration("int8", "toy_codec_plugin:Int8Codec")
    late = _Hosts(codecs=(int8,))
    good = _Hosts(HostClassRegistration("sglang", "pkg.stage:Good", "GoodPipeline", codec="int8"))
    bad = _Hosts(HostClassRegistration("vllm-omni", "pkg.pipe:Bad", "BadPipeline", codec="int9"))
    with temporary_plugin(pm, good, name="good"), temporary_plugin(pm, bad, name="bad"), \
            temporary_plugin(pm, late, name="late"):
        registry = collect(pm, report=None)
    assert [f.name for f in registry.failures] == ["bad"]
    assert str(registry.failures[0]) == (
        "plugin 'bad' is set aside: its host class pkg.pipe:Bad names codec 'int9', which no plugin "
        "registers (codecs: fp8, int2, int4, int8, nvfp4); name a registered codec, or turn the "
        "plugin off with CAUSALKV_DISABLE_PLUGINS=bad")
    assert registry.host_classes("sglang")["GoodPipeline"][0].codec == "int8"
    assert "BadPipeline" not in registry.host_classes("vllm-omni")


def test_the_builtin_host_classes_name_their_cache_factories(pm):
    """causalkv's own registrations name their cache factory as a plugin's do: sglang's stages
    ``sglang`` (built with sglang's arguments: ``host:sglang``), vLLM-Omni's pipeline ``qvg``."""
    registry = collect(pm, report=None)
    assert {r.cache for r, _ in registry.host_classes("sglang").values()} == {"sglang"}
    assert registry.host_classes("vllm-omni")["LingBotWorldCausalDMDPipeline"][0].cache == "qvg"
    assert registry.cache("sglang").factory.host == "sglang"
    assert registry.cache("qvg").factory.host is None


def test_causalkv_register_host_classes_naming_an_unknown_cache_sets_the_plugin_aside(pm):
    """A registration's cache factory is one causalkv or any plugin registers (a plugin's own
    counts); another name sets the plugin aside naming it, its plugin and the caches there are."""
    ring = CacheFactory("ring", "pkg.ring:Ring", capabilities=["growth"])

    class Good(_Hosts):
        @hookimpl
        def causalkv_register_cache_factories(self):
            return [ring]

    good = Good(HostClassRegistration("vllm-omni", "pkg.pipe:Good", "GoodPipeline", cache="ring"))
    bad = _Hosts(HostClassRegistration("sglang", "pkg.stage:Bad", "BadPipeline", cache="rnig"))
    with temporary_plugin(pm, good, name="good"), temporary_plugin(pm, bad, name="bad"):
        registry = collect(pm, report=None)
    assert str(registry.failures[0]) == (
        "plugin 'bad' is set aside: its host class pkg.stage:Bad names cache 'rnig', which no plugin "
        "registers (caches: dense, qvg, ring, sglang); name a registered cache, or turn the plugin off "
        "with CAUSALKV_DISABLE_PLUGINS=bad")
    assert registry.host_classes("vllm-omni")["GoodPipeline"][0].cache == "ring"
    assert "BadPipeline" not in registry.host_classes("sglang")


def test_causalkv_register_host_classes_raising_sets_the_plugin_aside(pm):
    class Raising:
        @hookimpl
        def causalkv_register_host_classes(self):
            raise RuntimeError("boom")

    with temporary_plugin(pm, Raising(), name="raising"):
        registry = collect(pm, report=None)
    assert [(f.name, f.error) for f in registry.failures] == [
        ("raising", "causalkv_register_host_classes() raised RuntimeError: boom")]
    assert len(registry.host_classes("sglang")) == 3  # the built-in plugin's, untouched


def test_collected_collects_once_per_plugin_manager(monkeypatch):
    """A bridge's one collection per process: the same registry until the manager is rebuilt."""
    monkeypatch.setenv("CAUSALKV_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugin_manager()
    try:
        first = collected()
        assert collected() is first and collected(get_plugin_manager()) is first
        reset_plugin_manager()
        assert collected() is not first
    finally:
        reset_plugin_manager()
