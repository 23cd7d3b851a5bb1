"""A codec from one plugin module (`toy_codec_plugin`): the flags, the cache, the planner, the
metrics' settings and ``causalkv plugins`` all know it, touching no causalkv file."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import toy_codec_plugin
from test_memory_planner import TINY, _drive_marked, _tiny_spec

from causalkv.caches import codecs
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.segments import PackedKV
from causalkv.cli import main
from causalkv.cli.plugins import plugins_report
from causalkv.hooks import CodecRegistration, hookimpl
from causalkv.memory import (
    SETTINGS,
    STREAM_CACHE,
    MemoryRequest,
    plan_setting,
    stream_layout,
)
from causalkv.memory.records import Setting
from causalkv.plugin import PluginConflictError, collect
from causalkv.plugin.testing import temporary_plugin


@pytest.fixture
def toy(pm, monkeypatch):
    """The plugin registered and collected; the codec registry restored afterwards."""
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    with temporary_plugin(pm, toy_codec_plugin, name="toy-codec") as name:
        registry = collect(pm, report=None)
        yield registry, name


def test_causalkv_register_codecs_reaches_everywhere_a_user_picks_a_codec(toy, pm):
    registry, name = toy
    assert [(r.name, p) for r, p in registry.codecs] == [("int8", name)]
    assert codecs.codec_setting("int8").source == name
    # --help and the flags
    parser = argparse.ArgumentParser()
    QVGKVQuantArgs.add_arguments(parser)
    assert "int8" in parser.format_help()
    ns = parser.parse_args(["--kv-cache-quant", "int8", "--kv-cache-quant-recent-tier", "int8"])
    q = QVGKVQuantArgs(**QVGKVQuantArgs.given_in(ns))
    assert (q.codec, q.recent_tier, q.describe().split(",")[0]) == ("int8", "int8", "qvg(int8")
    assert q.to_mapping()["kv_cache_quant"] == "int8"  # the metrics' cache_settings
    # which show only the knobs a codec in use reads: PRQ's with int2 (or an int4 tier), not int8's
    prq_knobs = {"kv_cache_quant_centroids", "kv_cache_quant_block_size", "kv_cache_quant_stages"}
    assert not prq_knobs & set(q.to_mapping())
    assert prq_knobs <= set(QVGKVQuantArgs(codec="int2").to_mapping())
    assert prq_knobs <= set(QVGKVQuantArgs(codec="int8", recent_tier="int4").to_mapping())
    assert "centroids" not in q.describe() and "centroids=128" in QVGKVQuantArgs(codec="int2").describe()
    # causalkv plugins
    report = plugins_report(pm, include_builtin=False)
    assert {"name": "int8", "target": "toy_codec_plugin:Int8Codec", "params": {},
            "help": "int8 with a float32 scale per token and head (a toy)",
            "plugin": name} in report["codecs"]


@pytest.mark.parametrize("setting", [Setting("int8-recent-fp8", "int8", 1, "fp8"),
                                     Setting("int2-recent-int8", "int2", 1, "int8")], ids=lambda s: s.name)
def test_the_cache_and_the_planner_count_the_plugin_codec_alike(toy, setting):
    """The planner's bytes equal the real caches' (2 layers sharing a scratch, 8 chunks),
    with the plugin codec as the main codec (fp8 on the recency tier), or on the recency tier
    (int2 the main codec)."""
    lay = stream_layout(TINY, MemoryRequest(latent_frames=16, shots=2))
    plan = plan_setting(TINY, lay, setting, cache=STREAM_CACHE, attention="gathered")
    q = setting.quant_args()
    spec = _tiny_spec(lay)
    caches = []

    def make(marker):
        caches.append(QVGPackedCausalKVCache(spec, q, marker=marker))
        return caches[-1]

    resident, _ = _drive_marked(lay, make, TINY.num_layers)
    assert resident == [TINY.num_layers * r for r in plan.resident_per_chunk]
    assert max(resident) == plan.kv_bytes
    names = {s.storage.codec.name for c in caches for s in c.store.segments
             if isinstance(s.storage, PackedKV)}
    assert names == {setting.codec, setting.recent_tier}
    seg = next(s for s in caches[0].store.segments if isinstance(s.storage, PackedKV)
               and s.storage.codec.name == "int8")
    got = seg.storage.decoded(torch.device("cpu"), torch.float32).k
    assert got.abs().max() > 0


class _Clash:
    @hookimpl
    def causalkv_register_codecs(self):
        return [CodecRegistration("fp8", "toy_codec_plugin:Int8Codec")]


def test_causalkv_register_codecs_taking_a_builtin_name_sets_the_plugin_aside(pm, monkeypatch):
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    with temporary_plugin(pm, _Clash(), name="clash"):
        registry = collect(pm, report=None)
    assert registry.codecs == ()
    (failure,) = registry.failures
    assert failure.name == "clash" and "'fp8' is registered twice" in failure.error
    assert codecs.codec_setting("fp8").target == "causalkv.caches.codecs.fp8:FP8Codec"


class _SecondCodecClashes:
    @hookimpl
    def causalkv_register_codecs(self):
        return [CodecRegistration("int8a", "toy_codec_plugin:Int8Codec"),
                CodecRegistration("fp8", "toy_codec_plugin:Int8Codec")]


class _NameTwice:
    @hookimpl
    def causalkv_register_codecs(self):
        return [CodecRegistration("int8b", "toy_codec_plugin:Int8Codec"),
                CodecRegistration("int8b", "causalkv.caches.codecs.fp8:FP8Codec")]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("plugin", "error"), [
    (_SecondCodecClashes(), "'fp8' is registered twice"),  # refused by the codec registry itself
    (_NameTwice(), "its codec setting 'int8b' is taken by codec 'int8b' of plugin 'half'"),
], ids=["registry-refuses-the-second", "the-plugin-names-one-twice"])
def test_a_plugin_set_aside_keeps_none_of_its_codec_settings(pm, monkeypatch, plugin, error, strict):
    """A plugin set aside registers no codec (docs/plugins.md), even one it offered before the
    record that set it aside: the codec registry is as it was before `collect`."""
    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    before = dict(codecs._SETTINGS)
    with temporary_plugin(pm, plugin, name="half"):
        if strict:
            with pytest.raises(PluginConflictError, match=error):
                collect(pm, report=None, strict=True)
        else:
            registry = collect(pm, report=None)
            (failure,) = registry.failures
            assert registry.codecs == () and failure.name == "half" and error in failure.error
    assert codecs._SETTINGS == before


def test_causalkv_memory_gives_every_registered_codec_its_rows(toy, capsys):
    """The planner's rows are the codec registry's: the plugin's codec gets ``int8-default``
    and ``int8-recent0`` after causalkv's own rows, ``--setting`` takes them and
    ``--kv-cache-quant`` picks a codec's rows (validated as the codec options validate)."""
    from test_memory_planner import NAMES

    assert list(SETTINGS) == [*NAMES, "int8-default", "int8-recent0"]
    assert [(s.codec, s.keep_recent_chunks, s.recent_tier) for s in
            (SETTINGS["int8-default"], SETTINGS["int8-recent0"])] == [("int8", 1, "bf16"), ("int8", 0, "bf16")]
    assert SETTINGS["int8-default"].help.startswith("int8 (int8 with a float32 scale per token and head (a toy))")
    argv = ["memory", "tiny-longlive2", "--host", "causalkv", "--latent-frames", "16", "--shots", "2"]
    assert main([*argv, "--json", "--setting", "int2-recent0", "--kv-cache-quant", "int8"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["setting"] for r in rows] == ["int2-recent0", "int8-default", "int8-recent0"]
    assert rows[2]["kv_bytes"] < rows[1]["kv_bytes"] < rows[1]["dense_bytes"]
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    assert "int8-recent0      int8, keep-recent 0 (every context chunk packed)" in capsys.readouterr().out
    assert main([*argv, "--kv-cache-quant", "i8tok"]) == 2
    assert capsys.readouterr().err == (
        "causalkv memory: error: kv-cache-quant must be one of ['off', 'int4', 'int2', 'fp8', "
        "'nvfp4', 'int8'], got 'i8tok'; see causalkv memory --help\n")


def test_collect_with_no_manager_is_a_scripts_one_call_to_load_the_plugins(pm, monkeypatch):
    """``collect()`` collects the process-wide manager's plugins (`get_plugin_manager`: the
    installed ones, under the CAUSALKV_* switches): their codecs join the registry."""
    from causalkv.plugin import manager

    monkeypatch.setattr(codecs, "_SETTINGS", dict(codecs._SETTINGS))
    monkeypatch.setattr(manager, "_default", pm)
    with temporary_plugin(pm, toy_codec_plugin, name="toy-codec"):
        assert "int8" not in codecs.codec_names()
        registry = collect()
    assert [(r.name, p) for r, p in registry.codecs] == [("int8", "toy-codec")]
    assert codecs.codec_names()[-1] == "int8" and QVGKVQuantArgs(codec="int8").codec == "int8"


def test_a_codec_setting_with_quantization_off_names_every_registered_codec(toy):
    """The refusal of a codec option while quantization is off lists the codecs there are."""
    from causalkv.errors import ConfigError

    with pytest.raises(ConfigError, match=r"pass --kv-cache-quant with a codec \(int4, int2, fp8, "
                                          r"nvfp4, int8\), or drop them"):
        QVGKVQuantArgs(centroids=64).check_used()


def test_causalkv_memory_leaves_out_a_broken_codec_and_names_it(toy, capsys):
    """One broken plugin codec (a decode that writes zeros, a target that does not import)
    does not hide the other rows: `plan_memory` over every setting leaves its rows out and
    names them with why; named with ``--setting`` it is refused, naming the codec."""
    codecs.register_codec("i8zeros", "toy_codec_plugin:WritesZeros")
    codecs.register_codec("i8gone", "no_such_module_anywhere:Codec")
    argv = ["memory", "tiny-longlive2", "--host", "causalkv", "--latent-frames", "16", "--shots", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert {line.split()[0] for line in table} >= {"off", "int2-recent0", "int8-default"}
    left = [line for line in table if line.startswith("left out: ")]
    assert [line.split(":")[1].strip() for line in left] == [
        "i8zeros-default", "i8zeros-recent0", "i8gone-default", "i8gone-recent0"]
    assert "conformance check 'bound'" in left[0] and "cannot import 'no_such_module_anywhere:Codec'" in left[2]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert "i8zeros-default" not in captured.out and "left out: i8gone-recent0" in captured.err
    assert main([*argv, "--setting", "i8zeros-default"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("causalkv memory: error: ") and "'i8zeros'" in err and "check 'bound'" in err
