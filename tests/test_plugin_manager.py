"""Plugin manager, discovery controls, soft failure, conflicts, and the run-time hooks.

Each test builds a fresh manager without autoload and registers temporary plugins that are
unregistered in ``finally`` (`causalkv.plugin.testing.temporary_plugin`).
"""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pluggy
import pytest

from causalkv.cli.plugins import plugin_rows
from causalkv.config import ModelConfig, ServerArgs
from causalkv.hooks import CacheFactory, StageRegistration, hookimpl
from causalkv.plugin import (
    PluginConflictError,
    PluginHookError,
    ResolutionError,
    collect,
    get_plugin_manager,
    make_plugin_manager,
    reset_plugin_manager,
)
from causalkv.plugin.builtin import BUILTIN_PLUGIN_NAME, STAGES
from causalkv.plugin.manager import PluginSettings
from causalkv.plugin.testing import RecordsPlugin, temporary_plugin
from causalkv.runtime import resolve
from causalkv.runtime.host.hook_calls import configure_stage
from causalkv.stages.longlive import LongLiveStage

BUILTIN_CACHES = ("dense", "qvg", "sglang")


StagesPlugin = RecordsPlugin


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    return mod


def _ep(name: str, module: str) -> EntryPoint:
    return EntryPoint(name=name, value=module, group="causalkv")


# --- the manager and the built-in plugin ---------------------------------------------------


def test_builtin_plugin_registers_through_the_public_hooks(pm):
    rows = plugin_rows(pm)
    assert [row["name"] for row in rows] == [BUILTIN_PLUGIN_NAME]
    assert rows[0]["builtin"] and rows[0]["distribution"] == "causalkv"
    assert rows[0]["hooks"] == ["causalkv_register_cache_factories", "causalkv_register_host_classes",
                                "causalkv_register_stages"]
    reg = collect(pm)
    assert [e.name for e in reg.stages] == [
        "self-forcing-wan",
        "longlive",
        "longlive2",
        "lingbot-world",
    ]
    assert [e.name for e in reg.caches] == list(BUILTIN_CACHES)
    assert {e.plugin for e in (*reg.stages, *reg.caches)} == {BUILTIN_PLUGIN_NAME}
    dense, qvg = reg.cache("dense").factory, reg.cache("qvg").factory
    assert (dense.priority, qvg.priority) == (10, 0)
    # registered as "module:Class" strings: the capabilities are the classes', read on first use
    assert qvg.capabilities is None and dense.capabilities is None
    assert qvg.features().missing(dense.features().features) == frozenset()
    assert qvg.features().features - dense.features().features == {"quant:qvg", "probe_commit"}


def test_builtin_stage_table():
    table = {s.name: (s.target, s.served) for s in STAGES}
    assert table == {
        "self-forcing-wan": (
            "causalkv.stages.wan:WanCausalDMDStage",
            ("SelfForcingWanPipeline", "CausVidPipeline", "WanPipeline", "WanCausalDMDPipeline",
             "tiny-wan"),
        ),
        "longlive": ("causalkv.stages.longlive:LongLiveStage", ("LongLivePipeline", "tiny-longlive")),
        "longlive2": (
            "causalkv.stages.longlive2:LongLive2Stage",
            ("LongLive2Pipeline", "tiny-longlive2", "tiny-longlive2-1k"),
        ),
        "lingbot-world": (
            "causalkv.stages.lingbot:LingBotWorldStage",
            ("LingBotWorldPipeline", "LingBotWorldCausalDMDPipeline", "tiny-lingbot"),
        ),
    }


def test_default_manager_is_lazy_and_process_wide(monkeypatch):
    monkeypatch.setenv("CAUSALKV_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_plugin_manager()
    try:
        first = get_plugin_manager()
        assert get_plugin_manager() is first
        assert first.has_plugin(BUILTIN_PLUGIN_NAME)
        reset_plugin_manager()
        assert get_plugin_manager() is not first
    finally:
        reset_plugin_manager()


def test_temporary_plugin_is_unregistered_even_on_error(pm):
    plugin = StagesPlugin(stages=[StageRegistration("tmp", LongLiveStage, ["tmp-model"])])
    with pytest.raises(RuntimeError, match="boom"):
        with temporary_plugin(pm, plugin) as name:
            assert pm.get_plugin(name) is plugin
            raise RuntimeError("boom")
    assert not pm.is_registered(plugin)
    assert "tmp" not in [e.name for e in collect(pm).stages]


def test_register_plugin_rejects_unknown_hook_names(pm):
    class Typo:
        @hookimpl
        def causalkv_register_stage(self):  # missing "s"
            return []

    with pytest.raises(pluggy.PluginValidationError, match="unknown hook.*causalkv_register_stage"):
        pm.register_plugin(Typo(), name="typo")
    assert not pm.has_plugin("typo")


# --- env controls and entry-point loading ----------------------------------------------------


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, PluginSettings(None, frozenset(), True, False)),
        ({"CAUSALKV_PLUGINS": "a, b,,"}, PluginSettings(frozenset({"a", "b"}), frozenset(), True, False)),
        ({"CAUSALKV_PLUGINS": ""}, PluginSettings(frozenset(), frozenset(), True, False)),
        ({"CAUSALKV_DISABLE_PLUGINS": "x"}, PluginSettings(None, frozenset({"x"}), True, False)),
        ({"CAUSALKV_DISABLE_PLUGIN_AUTOLOAD": "1"}, PluginSettings(None, frozenset(), False, False)),
        ({"CAUSALKV_DISABLE_PLUGIN_AUTOLOAD": "0"}, PluginSettings(None, frozenset(), True, False)),
        ({"CAUSALKV_TRACE_PLUGINS": "true"}, PluginSettings(None, frozenset(), True, True)),
    ],
)
def test_settings_from_env(env, expected):
    assert PluginSettings.from_env(env) == expected


@pytest.fixture
def fake_plugins(monkeypatch):
    """Three importable plugin modules and one entry point whose module does not exist."""
    mods = {}
    for name in ("alpha", "beta"):
        stage = StageRegistration(f"{name}-stage", LongLiveStage, [f"{name}-model"])

        def register(stage=stage):
            return [stage]

        mods[name] = _module(
            f"causalkv_tests_plugin_{name}", causalkv_register_stages=hookimpl(register)
        )
        monkeypatch.setitem(sys.modules, mods[name].__name__, mods[name])

    def causalkv_register_stages(unexpected_argument):
        return []

    bad = _module("causalkv_tests_plugin_badargs", causalkv_register_stages=hookimpl(causalkv_register_stages))
    monkeypatch.setitem(sys.modules, bad.__name__, bad)
    return [
        _ep("alpha", "causalkv_tests_plugin_alpha"),
        _ep("beta", "causalkv_tests_plugin_beta"),
        _ep("badargs", "causalkv_tests_plugin_badargs"),
        _ep("missing", "causalkv_tests_plugin_does_not_exist"),
    ]


def _load(env, eps):
    lines = []
    pm = make_plugin_manager(env=env, entry_points=eps, warn=lines.append)
    names = sorted(
        n for n, p in pm.list_name_plugin() if p is not None and n != BUILTIN_PLUGIN_NAME
    )
    failures = [f"causalkv: warning: {f}" for f in pm.load_failures]
    assert lines[:len(failures)] == failures  # one line each, before any env var warning
    return pm, names, pm.load_failures


def test_broken_plugins_are_reported_and_skipped(fake_plugins):
    pm, names, reports = _load({}, fake_plugins)
    assert names == ["alpha", "beta"]
    by_name = {f.name: f for f in reports}
    assert set(by_name) == {"badargs", "missing"}
    assert by_name["missing"].error.startswith("ModuleNotFoundError:")
    assert "causalkv_tests_plugin_does_not_exist" in by_name["missing"].error
    assert by_name["badargs"].error.startswith("PluginValidationError:")
    assert "unexpected_argument" in by_name["badargs"].error
    assert str(by_name["missing"]).startswith("plugin 'missing' is set aside: ModuleNotFoundError")
    assert str(by_name["missing"]).endswith("; fix the plugin, or turn it off with CAUSALKV_DISABLE_PLUGINS=missing")
    # the others work
    assert resolve("beta-model", pm=pm).stage is LongLiveStage


def test_allow_list_loads_only_listed_plugins(fake_plugins):
    pm, names, reports = _load({"CAUSALKV_PLUGINS": "beta,gamma"}, fake_plugins)
    assert names == ["beta"]
    assert reports == []
    assert pm.missing_allowed == ("gamma",)
    _, names, _ = _load({"CAUSALKV_PLUGINS": ""}, fake_plugins)
    assert names == []


def test_block_list_skips_listed_plugins_and_can_block_builtin(fake_plugins):
    pm, names, reports = _load({"CAUSALKV_DISABLE_PLUGINS": "alpha,missing,badargs"}, fake_plugins)
    assert names == ["beta"]
    assert reports == []
    assert pm.is_blocked("alpha")
    pm, names, _ = _load({"CAUSALKV_DISABLE_PLUGINS": BUILTIN_PLUGIN_NAME, "CAUSALKV_PLUGINS": "alpha"}, fake_plugins)
    assert not pm.has_plugin(BUILTIN_PLUGIN_NAME)
    assert names == ["alpha"]
    assert collect(pm).caches == ()


def test_autoload_off_loads_no_entry_points(fake_plugins):
    _, names, reports = _load({"CAUSALKV_DISABLE_PLUGIN_AUTOLOAD": "1"}, fake_plugins)
    assert names == [] and reports == []
    pm = make_plugin_manager(autoload=False, env={}, entry_points=fake_plugins)
    assert [n for n, _ in pm.list_name_plugin()] == [BUILTIN_PLUGIN_NAME]


def test_two_entry_points_claiming_one_plugin_name_are_set_aside(fake_plugins):
    twice = [fake_plugins[0], _ep("alpha", "causalkv_tests_plugin_beta"), fake_plugins[1]]
    pm, names, reports = _load({}, twice)
    assert names == ["beta"]  # the others load
    assert [f.name for f in reports] == ["alpha", "alpha"]
    assert all("plugin name 'alpha' is claimed twice" in str(f) and "uninstall one" in str(f) for f in reports)


def test_trace_env_var_traces_hook_calls_to_stderr(capsys):
    pm = make_plugin_manager(autoload=False, env={"CAUSALKV_TRACE_PLUGINS": "1"})
    resolve("tiny-wan", pm=pm)
    err = capsys.readouterr().err
    assert f"causalkv_register_stages (plugin {BUILTIN_PLUGIN_NAME})" in err
    assert f"causalkv_register_cache_factories (plugin {BUILTIN_PLUGIN_NAME})" in err
    assert "causalkv_select_cache_factory" in err
    quiet = make_plugin_manager(autoload=False, env={})
    resolve("tiny-wan", pm=quiet)
    assert capsys.readouterr().err == ""


# --- registration hooks and conflicts -------------------------------------------------------


def test_causalkv_register_stages_adds_a_model(pm):
    plugin = StagesPlugin(stages=[StageRegistration("extra", LongLiveStage, ["ExtraPipeline"])])
    with temporary_plugin(pm, plugin, name="extra-plugin"):
        entry = collect(pm).stage("extra")
        assert entry.plugin == "extra-plugin"
        assert resolve("ExtraPipeline", pm=pm).stage is LongLiveStage
    with pytest.raises(ResolutionError, match="no stage named 'extra'. Choose one of: self-forcing-wan"):
        collect(pm).stage("extra")


def test_causalkv_register_cache_factories_adds_a_cache(pm):
    factory = CacheFactory("mine", "causalkv.caches.dense:DenseCausalKVCache", ["growth"], 20)
    with temporary_plugin(pm, StagesPlugin(caches=[factory]), name="mine-plugin"):
        entry = collect(pm).cache("mine")
        assert entry.factory is factory and entry.plugin == "mine-plugin"
        # priority 20 beats dense's 10 when nothing is required
        assert resolve("tiny-wan", pm=pm).cache_factory is factory


def test_registration_hooks_accept_a_single_record_or_none(pm):
    class Single:
        @hookimpl
        def causalkv_register_stages(self):
            return StageRegistration("single", LongLiveStage, "single-model")

        @hookimpl
        def causalkv_register_cache_factories(self):
            return None

    with temporary_plugin(pm, Single()):
        assert collect(pm).stage("single").registration.models == ("single-model",)


def test_registration_hook_returning_junk_names_the_plugin(pm):
    with temporary_plugin(pm, StagesPlugin(stages=[("not", "a", "record")]), name="junk"):
        assert [f.name for f in collect(pm, report=None).failures] == ["junk"]
        with pytest.raises(TypeError, match="plugin 'junk' is set aside: causalkv_register_stages.*StageRegistration"):
            collect(pm, strict=True)


def test_registration_hook_raising_names_the_plugin(pm):
    class Raising:
        @hookimpl
        def causalkv_register_cache_factories(self):
            raise KeyError("oops")

    with temporary_plugin(pm, Raising(), name="raiser"):
        assert [c.name for c in collect(pm, report=None).caches] == list(BUILTIN_CACHES)
        with pytest.raises(RuntimeError, match="plugin 'raiser' is set aside: causalkv_register_cache_factories"):
            collect(pm, strict=True)


def test_conflict_same_stage_name_names_both_plugins(pm):
    dup = StagesPlugin(stages=[StageRegistration("longlive", LongLiveStage, ["OtherPipeline"])])
    with temporary_plugin(pm, dup, name="copycat"):
        registry = collect(pm, report=None)
        with pytest.raises(PluginConflictError) as info:
            collect(pm, strict=True)
    assert registry.stage("longlive").plugin == BUILTIN_PLUGIN_NAME  # the built-in keeps it
    assert "OtherPipeline" not in registry.served_models()  # the whole plugin is set aside
    msg = str(registry.failures[0])
    assert msg == str(info.value).removesuffix(" (--strict-plugins)")
    assert "stage name 'longlive' is taken by stage 'longlive'" in msg
    assert f"plugin '{BUILTIN_PLUGIN_NAME}'" in msg and "plugin 'copycat'" in msg
    assert "CAUSALKV_DISABLE_PLUGINS=copycat" in msg


def test_conflict_same_model_same_priority_names_both_plugins(pm):
    same = StagesPlugin(stages=[StageRegistration("wan2", LongLiveStage, ["WanPipeline"])])
    with temporary_plugin(pm, same, name="wan-fork"):
        assert resolve("WanPipeline", pm=pm).stage_registration.name == "self-forcing-wan"
        with pytest.raises(PluginConflictError) as info:
            collect(pm, strict=True)
    msg = str(info.value)
    assert "model 'WanPipeline' at priority 0 is taken by stage 'self-forcing-wan'" in msg
    assert "give the registration another priority" in msg
    assert f"plugin '{BUILTIN_PLUGIN_NAME}'" in msg and "plugin 'wan-fork'" in msg


def test_same_model_at_a_higher_priority_wins_without_conflict(pm):
    better = StagesPlugin(stages=[StageRegistration("wan2", LongLiveStage, ["WanPipeline"], 1)])
    with temporary_plugin(pm, better, name="wan-fork"):
        res = resolve("WanPipeline", pm=pm)
        assert res.stage is LongLiveStage and res.stage_plugin == "wan-fork"
        assert "also serving: self-forcing-wan" in res.reasons[1]
        # the other models of the built-in stage are untouched
        assert resolve("tiny-wan", pm=pm).stage_registration.name == "self-forcing-wan"


def test_conflict_same_cache_name_names_both_plugins(pm):
    dup = StagesPlugin(caches=[CacheFactory("dense", "x.y:Z", ["growth"])])
    with temporary_plugin(pm, dup, name="dense-fork"):
        with pytest.raises(PluginConflictError) as info:
            collect(pm, strict=True)
    msg = str(info.value)
    assert "cache 'dense'" in msg
    assert f"plugin '{BUILTIN_PLUGIN_NAME}'" in msg and "plugin 'dense-fork'" in msg


# --- run-time hooks ----------------------------------------------------------------------------


MODEL = ModelConfig(
    name="tiny", model_class="WanPipeline", num_layers=2, num_heads=2, head_dim=8,
    tokens_per_frame=4, frames_per_chunk=3, sink_frames=1, window_frames=6,
)


def test_causalkv_configure_stage_merges_overrides(pm):
    seen = []

    class Late:
        @hookimpl
        def causalkv_configure_stage(self, stage, model):
            seen.append(("late", stage, model.name))
            return {"sink_frames": 2, "window_frames": 9}

    class First:
        @hookimpl(tryfirst=True)
        def causalkv_configure_stage(self, server_args):
            seen.append(("first", server_args.multi_shot))
            return {"window_frames": 12}

    class Silent:
        @hookimpl
        def causalkv_configure_stage(self, stage):
            stage.tag = "configured"  # implementations may also set attributes

    applied = []
    stage = types.SimpleNamespace(name="a built stage", apply_overrides=applied.append)
    with temporary_plugin(pm, Silent()), temporary_plugin(pm, Late()), temporary_plugin(pm, First()):
        overrides = configure_stage(pm, stage, MODEL, ServerArgs(multi_shot=True))
    # the tryfirst implementation is called first and wins "window_frames"
    assert overrides == {"sink_frames": 2, "window_frames": 12} and applied == [overrides]
    assert seen == [("first", True), ("late", stage, "tiny")]
    assert stage.tag == "configured"
    assert MODEL.with_overrides(overrides).window_frames == 12


def test_causalkv_configure_stage_rejects_unknown_fields(pm):
    class Bad:
        @hookimpl
        def causalkv_configure_stage(self):
            return {"window": 3}

    with temporary_plugin(pm, Bad(), name="bad-override"):
        with pytest.raises(PluginHookError) as info:
            configure_stage(pm, types.SimpleNamespace(), MODEL, ServerArgs())
    # names the plugin and lists only what an override may change
    assert str(info.value) == (
        "plugin 'bad-override' failed in causalkv_configure_stage (unknown override(s) window; the "
        "overrides are: frames_per_chunk, sink_frames, global_sink_frames, window_frames, cache_frames, "
        "recent_window_frames, timesteps, shift, context_noise); fix it, or turn it off with "
        "CAUSALKV_DISABLE_PLUGINS=bad-override"
    )
    assert info.value.plugin == "bad-override"


def test_causalkv_chunk_done_reaches_every_plugin(pm):
    events = []

    class Metrics:
        @hookimpl
        def causalkv_chunk_done(self, stage, chunk_index, stats):
            events.append(("metrics", stage.name, chunk_index, stats["frames"]))

    class Progress:
        @hookimpl
        def causalkv_chunk_done(self, chunk_index):
            events.append(("progress", chunk_index))

    stage = types.SimpleNamespace(name="a built stage")
    with temporary_plugin(pm, Metrics()), temporary_plugin(pm, Progress()):
        for i in range(3):
            pm.hook.causalkv_chunk_done(stage=stage, chunk_index=i, stats={"frames": 3 * (i + 1)})
    assert sorted(events, key=str) == sorted(
        [("metrics", "a built stage", i, 3 * (i + 1)) for i in range(3)]
        + [("progress", i) for i in range(3)],
        key=str,
    )
    pm.hook.causalkv_chunk_done(stage=stage, chunk_index=3, stats={})  # plugins gone
    assert len(events) == 6


def test_blocking_one_claimant_by_its_distribution_name_loads_the_other(fake_plugins):
    """Two distributions declare entry point ``alpha``: blocking one by its distribution name
    (as docs/plugins.md allows) leaves the other, which loads (a blocked one claims nothing)."""
    installed = types.SimpleNamespace(name="alpha", value="causalkv_tests_plugin_alpha", group="causalkv",
                                      dist=types.SimpleNamespace(metadata={"Name": "dist-a"}, version="1.0"))
    in_process = _ep("alpha", "causalkv_tests_plugin_beta")
    pm, names, reports = _load({"CAUSALKV_DISABLE_PLUGINS": "dist-a"}, [installed, in_process])
    assert names == ["alpha"] and reports == []
    assert resolve("beta-model", pm=pm).stage_plugin == "alpha"  # the in-process one, beta's module
