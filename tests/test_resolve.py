"""Load-time resolution: the matrix over built-in stages, models as names, folders and
configs, QVG and multi-shot errors, cache qualification and the first-result override."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.cli.plugins import resolution_dict
from causalkv.config import ModelConfig, ServerArgs
from causalkv.errors import InvalidTypeError
from causalkv.hooks import CacheFactory, HostClassRegistration, StageRegistration, hookimpl
from causalkv.plugin import ResolutionError
from causalkv.plugin.builtin import STAGES
from causalkv.plugin.testing import RecordsPlugin, temporary_plugin
from causalkv.runtime import Resolution, resolve
from causalkv.runtime.model_io.model_config import model_ref
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.lingbot import LingBotWorldStage
from causalkv.stages.longlive import LongLiveStage
from causalkv.stages.longlive2 import LongLive2Stage
from causalkv.stages.wan import WanCausalDMDStage

# the oracle: the decisions table (stage name -> class) and the stage declarations
EXPECTED_CLASS = {
    "self-forcing-wan": WanCausalDMDStage,
    "longlive": LongLiveStage,
    "longlive2": LongLive2Stage,
    "lingbot-world": LingBotWorldStage,
}
#: LongLive 2.0 is the multi-shot model (scene cuts pin a shot sink)
MULTI_SHOT_STAGES = {"longlive2"}
QUANT_BITS = {"off": None, "int4": 4, "int2": 2}


def _args(quant: str = "off", **kw) -> ServerArgs:
    return ServerArgs(options=[QVGKVQuantArgs.from_codec_name(quant)], **kw)


class NoQVGStage(CausalDenoisingStage):
    """A stage that keeps the base class's answer: no QVG, no multi-shot."""

    stage_name: ClassVar[str] = "no-qvg"


class RingStage(CausalDenoisingStage):
    """A QVG-capable stage needing a cache feature no built-in cache has."""

    stage_name: ClassVar[str] = "ring"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True

    @classmethod
    def required_cache_features(cls, server_args, model=None):
        return super().required_cache_features(server_args, model) | {"ring:buffer"}


Plugin = RecordsPlugin


# --- the matrix: every built-in stage x quant off/int4/int2 x multi-shot on/off ---------------


@pytest.mark.parametrize("multi_shot", [False, True], ids=["single", "multi-shot"])
@pytest.mark.parametrize("quant", ["off", "int4", "int2"])
@pytest.mark.parametrize("registration", STAGES, ids=[s.name for s in STAGES])
def test_resolution_matrix(pm, registration, quant, multi_shot):
    model = registration.models[0]  # the preset name
    args = _args(quant, multi_shot=multi_shot)
    cls = EXPECTED_CLASS[registration.name]
    if multi_shot and registration.name not in MULTI_SHOT_STAGES:
        with pytest.raises(ValueError) as info:
            resolve(model, args, pm=pm)
        msg = str(info.value)
        assert not isinstance(info.value, ResolutionError)
        assert msg.startswith(f"{cls.__name__} does not support multi-shot generation (a pinned shot sink "
                              f"per scene cut) (stage '{registration.name}', plugin 'causalkv.builtin')")
        assert f"No registered stage serving {model} does (stages that do: longlive2" in msg
        assert msg.endswith("): drop --multi-shot.")
        return
    res = resolve(model, args, pm=pm)
    assert res.stage is cls
    assert res.stage_registration.name == registration.name
    expected_req = set()
    if QUANT_BITS[quant] is not None:
        expected_req.add("quant:qvg")
    if multi_shot:
        expected_req.add("pinned_sink")
    assert res.requirements == frozenset(expected_req)
    # dense (priority 10) lacks only quant:qvg; qvg (priority 0) covers everything
    assert res.cache_factory.name == ("dense" if quant == "off" else "qvg")
    assert res.model.name == model and res.model.model_class is None
    assert len(res.reasons) == 4


@pytest.mark.parametrize("registration", STAGES, ids=[s.name for s in STAGES])
def test_every_served_model_name_resolves_to_its_stage(pm, registration):
    for model in registration.models:
        assert resolve(model, pm=pm).stage is EXPECTED_CLASS[registration.name]


def test_reasons_explain_each_choice(pm):
    res = resolve("tiny-longlive2", _args("int4", multi_shot=True), pm=pm)
    assert res.reasons == (
        "model tiny-longlive2: matched by model name",
        "stage longlive2 (LongLive2Stage, plugin causalkv.builtin) serves tiny-longlive2 "
        "(priority 0)",
        "requirements: pinned_sink (several --prompt (resolve: --multi-shot)), quant:qvg (--kv-cache-quant int4)",
        "cache qvg (plugin causalkv.builtin, priority 0): covers pinned_sink, quant:qvg; "
        "the only cache that does; dense lacks quant:qvg",
    )
    off = resolve("tiny-wan", pm=pm)
    assert off.reasons[2] == "requirements: none"
    assert off.reasons[3] == (
        "cache dense (plugin causalkv.builtin, priority 10): covers the requirements (none); "
        "highest priority among qualifying dense (10), qvg (0)"
    )


def test_heads_sharded_and_recent_window_add_requirements(pm):
    res = resolve("tiny-lingbot", _args(heads_sharded=2, recent_window_frames=4), pm=pm)
    assert res.requirements == {"head_slice", "recent_window"}
    assert res.cache_factory.name == "dense"
    # the ranks as generate takes them, then as resolve does
    assert "head_slice (--nproc-per-node 2 (resolve: --heads-sharded 2))" in res.reasons[2]
    assert "recent_window (--recent-window-frames 4)" in res.reasons[2]


def test_resolution_never_imports_the_chosen_cache(pm):
    lazy = CacheFactory("lazy", "causalkv_tests_never_imported.module:Cache", ["ring:buffer"])
    ring = StageRegistration("ring", RingStage, ["RingPipeline"])
    with temporary_plugin(pm, Plugin([ring], [lazy])):
        res = resolve("RingPipeline", pm=pm)
    assert res.cache_factory is lazy
    with pytest.raises(ModuleNotFoundError):
        res.cache_factory.load()


def test_resolution_dict_is_json_serializable(pm):
    d = json.loads(json.dumps(resolution_dict(resolve("tiny-longlive", _args("int2"), pm=pm))))
    assert d["stage"] == {
        "name": "longlive",
        "class": "causalkv.stages.longlive:LongLiveStage",
        "plugin": "causalkv.builtin",
        "priority": 0,
    }
    assert d["cache"]["name"] == "qvg"
    assert d["cache"]["target"] == "causalkv.caches.qvg.packed:QVGPackedCausalKVCache"
    assert d["requirements"] == ["quant:qvg"]


# --- models: names, folders, configs ----------------------------------------------------------


def test_unknown_model_lists_served_models(pm):
    with pytest.raises(ResolutionError) as info:
        resolve("NotAPipeline", pm=pm)
    msg = str(info.value)
    assert msg.startswith("no registered stage serves model NotAPipeline. Served models: ")
    for reg in STAGES:
        for model in reg.models:
            assert model in msg


def _folder(tmp_path, class_name, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": class_name, "_diffusers_version": "0.42.0"})
    )
    return folder


def test_diffusers_folder_matches_its_class_name(pm, tmp_path):
    folder = _folder(tmp_path, "LongLive2Pipeline")
    for model in (folder, str(folder), folder / "model_index.json"):
        res = resolve(model_ref(model), _args("int4"), pm=pm)
        assert res.stage is LongLive2Stage
        assert res.model.name == str(folder) and res.model.model_class == "LongLive2Pipeline"
        assert res.reasons[0] == (
            f"model {folder} (LongLive2Pipeline): matched by {folder / 'model_index.json'} "
            "_class_name"
        )


def test_folder_errors_say_what_is_wrong(pm, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ResolutionError, match="folder without model_index.json"):
        resolve(model_ref(empty), pm=pm)
    with pytest.raises(ResolutionError, match="does not exist"):
        resolve(model_ref(str(tmp_path / "missing" / "model")), pm=pm)
    bad = _folder(tmp_path, "", name="bad")
    with pytest.raises(ResolutionError, match="has no '_class_name'"):
        resolve(model_ref(bad), pm=pm)
    unknown = _folder(tmp_path, "SomeOtherPipeline", name="other")
    with pytest.raises(ResolutionError, match="no registered stage serves model .*SomeOtherPipeline"):
        resolve(model_ref(unknown), pm=pm)
    with pytest.raises(ResolutionError, match=r"is a path: resolve a model folder as resolve\(causalkv.runtime.model_io.model_config.model_ref"):
        resolve(str(unknown), pm=pm)  # resolve reads no file: the runtime reads the folder
    with pytest.raises(InvalidTypeError, match="a model name, a ModelConfig or a ModelRef"):
        resolve(unknown, pm=pm)


def _config(model_class, name="custom", **kw):
    return ModelConfig(
        name=name, model_class=model_class, num_layers=2, num_heads=2, head_dim=64,
        tokens_per_frame=4, frames_per_chunk=3, **kw,
    )


def test_model_config_matches_class_then_name(pm):
    res = resolve(_config("CausVidPipeline"), pm=pm)
    assert res.stage is WanCausalDMDStage and res.model.model_class == "CausVidPipeline"
    assert res.model.config is not None and res.model.config.name == "custom"
    # an unknown class falls back to a served name
    assert resolve(_config("Unknown", name="tiny-longlive"), pm=pm).stage is LongLiveStage
    with pytest.raises(ResolutionError, match="custom \\(Unknown\\)"):
        resolve(_config("Unknown"), pm=pm)


def test_model_config_recent_window_is_a_requirement(pm):
    res = resolve(_config("LingBotWorldPipeline", recent_window_frames=6), pm=pm)
    assert res.requirements == {"recent_window"}
    assert "recent_window (model recent_window_frames=6)" in res.reasons[2]


# --- QVG and multi-shot declarations ------------------------------------------------------------


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_qvg_on_a_stage_without_support_names_the_fix(pm, quant):
    plugin = Plugin([StageRegistration("no-qvg", NoQVGStage, ["NoQVGPipeline"])])
    with temporary_plugin(pm, plugin):
        with pytest.raises(ValueError) as info:
            resolve("NoQVGPipeline", _args(quant), pm=pm)
        assert resolve("NoQVGPipeline", _args("off"), pm=pm).stage is NoQVGStage
    msg = str(info.value)
    assert msg.startswith("NoQVGStage does not support QVG KV-cache quantization")
    assert "No registered stage serving NoQVGPipeline does (stages that do: " in msg
    assert msg.endswith("): run with --kv-cache-quant off.")


def test_qvg_error_lists_stages_that_support_it_and_stage_override_works(pm):
    plugin = Plugin([
        StageRegistration("no-qvg", NoQVGStage, ["SharedPipeline"], priority=5),
        StageRegistration("qvg-able", LongLiveStage, ["SharedPipeline"], priority=1),
    ])
    with temporary_plugin(pm, plugin, name="shared"):
        with pytest.raises(ValueError) as info:
            resolve("SharedPipeline", _args("int4"), pm=pm)
        res = resolve("SharedPipeline", _args("int4"), pm=pm, stage="qvg-able")
    msg = str(info.value)
    assert msg.startswith("NoQVGStage does not support QVG KV-cache quantization")
    assert "Stages serving SharedPipeline that do: qvg-able (plugin shared, priority 1" in msg
    assert "--stage NAME, or run with --kv-cache-quant off." in msg
    assert res.stage is LongLiveStage and res.cache_factory.name == "qvg"
    assert "forced by --stage" in res.reasons[1]


def test_multi_shot_error_lists_stages_serving_the_model_that_do(pm):
    plugin = Plugin([StageRegistration("ll2-for-wan", LongLive2Stage, ["WanPipeline"], -1)])
    with temporary_plugin(pm, plugin, name="ll2"):
        with pytest.raises(ValueError) as info:
            resolve("WanPipeline", _args(multi_shot=True), pm=pm)
        res = resolve("WanPipeline", _args(multi_shot=True), pm=pm, stage="ll2-for-wan")
    assert "Stages serving WanPipeline that do: ll2-for-wan (plugin ll2" in str(info.value)
    assert res.stage is LongLive2Stage and res.requirements == {"pinned_sink"}


def test_forced_stage_errors(pm):
    with pytest.raises(ResolutionError, match="no stage named 'nope'. Choose one of: self-forcing-wan"):
        resolve("tiny-wan", pm=pm, stage="nope")
    with pytest.raises(ResolutionError, match="stage 'longlive' does not serve tiny-wan"):
        resolve("tiny-wan", pm=pm, stage="longlive")


def test_stage_that_cannot_be_imported_fails_only_when_chosen(pm):
    broken = StageRegistration("broken", "causalkv_tests_missing_stage:Stage", ["BrokenPipeline"])
    with temporary_plugin(pm, Plugin([broken]), name="broken-plugin"):
        assert resolve("tiny-wan", pm=pm).stage is WanCausalDMDStage
        with pytest.raises(ImportError, match="stage 'broken' \\(plugin 'broken-plugin'\\)"):
            resolve("BrokenPipeline", pm=pm)
    not_stage = StageRegistration("odd", "causalkv.config:ServerArgs", ["OddPipeline"])
    with temporary_plugin(pm, Plugin([not_stage])):
        with pytest.raises(TypeError, match="not a subclass of .*CausalDenoisingStage"):
            resolve("OddPipeline", pm=pm)


# --- caches: qualification, forcing, the first-result hook --------------------------------------


def test_no_qualifying_cache_names_what_each_lacks(pm):
    ring = StageRegistration("ring", RingStage, ["RingPipeline"])
    with temporary_plugin(pm, Plugin([ring])):
        with pytest.raises(ResolutionError) as info:
            resolve("RingPipeline", _args("int4"), pm=pm)
    msg = str(info.value)
    assert msg.startswith("no registered cache covers the requirements of stage ring "
                          "(quant:qvg, ring:buffer): ")
    assert "dense lacks quant:qvg, ring:buffer; qvg lacks ring:buffer" in msg


def test_forced_cache(pm):
    res = resolve("tiny-wan", _args(cache="qvg"), pm=pm)
    assert res.cache_factory.name == "qvg"
    assert "forced by --cache" in res.reasons[3]
    with pytest.raises(ResolutionError, match=r"cache 'dense' \(forced by --cache\) lacks quant:qvg.*Caches that qualify: qvg"):
        resolve("tiny-wan", _args("int2", cache="dense"), pm=pm)
    with pytest.raises(ResolutionError, match="no cache named 'ring'. Choose one of: dense, qvg"):
        resolve("tiny-wan", _args(cache="ring"), pm=pm)


class _HostCache(RecordsPlugin):
    """A plugin registering caches and host classes of causalkv's runtime (``host="causalkv"``)."""

    def __init__(self, caches=(), hosts=()) -> None:
        super().__init__(caches=caches)
        self.hosts = list(hosts)

    @hookimpl
    def causalkv_register_host_classes(self):
        return self.hosts


TALLY = CacheFactory("tally", "causalkv.caches.qvg.packed:QVGPackedCausalKVCache", priority=-1)
LL2 = "causalkv.stages.longlive2:LongLive2Stage"


def test_a_host_registration_of_causalkv_names_the_stages_cache(pm):
    """``HostClassRegistration("causalkv", <the stage's class>, models, cache=...)``: the named
    factory serves the model (over priority, said in the reasons), ``--cache`` wins over it, a
    registration naming another stage class or model leaves the choice as it was, and a named
    factory lacking a requirement is refused naming the registration's plugin."""
    hosts = [HostClassRegistration("causalkv", LL2, "tiny-longlive2", cache="tally"),
             HostClassRegistration("causalkv", "causalkv.stages.wan:WanCausalDMDStage", "tiny-longlive", cache="tally")]
    with temporary_plugin(pm, _HostCache([TALLY], hosts), name="hosts"):
        res = resolve("tiny-longlive2", _args("int2", multi_shot=True), pm=pm)
        assert (res.cache_factory.name, res.cache_plugin) == ("tally", "hosts")
        assert res.reasons[-1] == ("cache tally (plugin hosts, priority -1): named by plugin hosts's host "
                                   "registration; covers pinned_sink, quant:qvg")
        assert resolve("tiny-longlive2", _args("int2", cache="qvg"), pm=pm).cache_factory.name == "qvg"
        assert resolve("tiny-longlive", _args("int2"), pm=pm).cache_factory.name == "qvg"  # another class
        assert resolve("tiny-longlive2-1k", _args("int2"), pm=pm).cache_factory.name == "qvg"  # another model
    dense = [HostClassRegistration("causalkv", LL2, "tiny-longlive2", cache="dense")]
    with temporary_plugin(pm, _HostCache(hosts=dense), name="hosts"):
        with pytest.raises(ResolutionError, match=r"cache 'dense' \(named by plugin hosts's host registration\) "
                                                  r"lacks quant:qvg, which stage longlive2 needs"):
            resolve("tiny-longlive2", _args("int2"), pm=pm)


def test_a_cache_built_with_another_hosts_arguments_is_never_the_runtimes(pm):
    """The built-in ``sglang`` factory (``host:sglang``) is listed among the caches but never
    qualifies in causalkv's runtime (nor in its reasons), and forcing it names the host."""
    res = resolve("tiny-wan", _args(), pm=pm)
    assert res.cache_factory.name == "dense" and "sglang" not in res.reasons[-1]
    with pytest.raises(ResolutionError, match=r"cache 'sglang' \(forced by --cache\) builds sglang's caches, "
                                              r"not causalkv's runtime's. Caches that qualify: dense, qvg"):
        resolve("tiny-wan", _args(cache="sglang"), pm=pm)


def test_causalkv_select_cache_factory_first_result_overrides_priority(pm):
    calls = []

    class PreferQVG:
        @hookimpl
        def causalkv_select_cache_factory(self, stage, requirements, candidates):
            calls.append((stage, requirements, tuple(c.name for c in candidates)))
            return next(c for c in candidates if c.name == "qvg")

    class Never:
        @hookimpl(trylast=True)
        def causalkv_select_cache_factory(self):
            raise AssertionError("first result wins: a later implementation must not run")

    with temporary_plugin(pm, Never()), temporary_plugin(pm, PreferQVG(), name="prefer-qvg"):
        res = resolve("tiny-longlive", _args(multi_shot=False), pm=pm)
    assert res.cache_factory.name == "qvg"  # dense has the higher priority
    assert calls == [(LongLiveStage, frozenset(), ("dense", "qvg"))]
    assert res.reasons[3].startswith("cache qvg (plugin causalkv.builtin, priority 0): chosen by "
                                     "causalkv_select_cache_factory")
    assert resolve("tiny-longlive", pm=pm).cache_factory.name == "dense"  # plugins gone


def test_causalkv_select_cache_factory_none_falls_back_and_names_work(pm):
    class Abstain:
        @hookimpl
        def causalkv_select_cache_factory(self):
            return None

    class ByName:
        @hookimpl
        def causalkv_select_cache_factory(self, candidates):
            return "qvg" if len(candidates) > 1 else None

    with temporary_plugin(pm, Abstain()):
        assert resolve("tiny-wan", pm=pm).cache_factory.name == "dense"
    with temporary_plugin(pm, ByName()):
        assert resolve("tiny-wan", pm=pm).cache_factory.name == "qvg"


def test_causalkv_select_cache_factory_must_pick_a_candidate(pm):
    class Wrong:
        @hookimpl
        def causalkv_select_cache_factory(self):
            return "dense"

    with temporary_plugin(pm, Wrong()):
        with pytest.raises(ResolutionError, match="returned 'dense', which is not one of the "
                                                  "qualifying caches for stage longlive2: qvg"):
            resolve("tiny-longlive2", _args("int4"), pm=pm)


def test_resolution_fields(pm):
    res = resolve("tiny-wan", pm=pm)
    assert isinstance(res, Resolution)
    assert (res.stage_plugin, res.cache_plugin) == ("causalkv.builtin", "causalkv.builtin")
    assert res.model.config is None
