"""A codec from one plugin module (`toy_codec_plugin`): the flags, the cache, the planner, the
metrics' settings and ``causalkv plugins`` all know it, touching no causalkv file."""

from __future__ import annotations

import argparse

import pytest
import torch
import toy_codec_plugin
from test_memory_planner import TINY, _drive_marked, _tiny_spec

from causalkv.caches import codecs
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.segments import PackedKV
from causalkv.cli.plugins import plugins_report
from causalkv.hooks import CodecRegistration, hookimpl
from causalkv.plugin import collect
from causalkv.plugin.testing import temporary_plugin
from causalkv.runtime.memory import STREAM_CACHE, MemoryRequest, plan_setting, stream_layout
from causalkv.runtime.memory.records import Setting


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
    # causalkv plugins
    report = plugins_report(pm, include_builtin=False)
    assert {"name": "int8", "target": "toy_codec_plugin:Int8Codec", "params": {},
            "help": "int8 with a float32 scale per token and head (a toy)",
            "plugin": name} in report["codecs"]


def test_the_cache_and_the_planner_count_the_plugin_codec_alike(toy):
    """The planner's bytes equal the real caches' (2 layers sharing a scratch, 8 chunks),
    with the plugin codec as the main codec and fp8 on the recency tier."""
    setting = Setting("int8-recent-fp8", "int8", 1, "fp8")
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
    assert names == {"int8", "fp8"}
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
