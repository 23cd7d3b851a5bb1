"""``causalkv plugins`` and ``causalkv resolve`` (in-process, on the default manager)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import ClassVar

import pytest

from causalkv.cli import plugins as plugin_cli
from causalkv.hooks import CacheFactory, HostClassRegistration, StageRegistration, hookimpl
from causalkv.plugin import get_plugin_manager, reset_plugin_manager
from causalkv.plugin.testing import temporary_plugin
from causalkv.stages.base import CausalDenoisingStage


@pytest.fixture(autouse=True)
def default_manager(monkeypatch):
    """A fresh process-wide manager that ignores installed plugins."""
    monkeypatch.setenv("CAUSALKV_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in ("CAUSALKV_PLUGINS", "CAUSALKV_DISABLE_PLUGINS", "CAUSALKV_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="causalkv")
    plugin_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


class PlainStage(CausalDenoisingStage):
    stage_name: ClassVar[str] = "plain"


class ThirdParty:
    @hookimpl
    def causalkv_register_stages(self):
        return [StageRegistration("plain", PlainStage, ["PlainPipeline"])]

    @hookimpl
    def causalkv_register_cache_factories(self):
        return [CacheFactory("tiny-ring", "pkg.ring:Ring", ["growth", "ring:buffer"], 1)]


def test_causalkv_cli_exposes_both_subcommands():
    from causalkv.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"plugins", "resolve"} <= set(sub.choices)


def test_plugins_json_lists_plugins_stages_and_caches(capsys):
    pm = get_plugin_manager()
    with temporary_plugin(pm, ThirdParty(), name="third-party"):
        rc, out, err = run(["plugins", "--json"], capsys)
        rc_all, out_all, _ = run(["plugins", "--json", "--all"], capsys)
    assert rc == 0 and rc_all == 0 and err == ""
    report = json.loads(out)
    assert [p["name"] for p in report["plugins"]] == ["third-party"]
    assert report["plugins"][0]["hooks"] == [
        "causalkv_register_cache_factories",
        "causalkv_register_stages",
    ]
    assert report["hidden_builtin"] == 1
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["self-forcing-wan", "longlive", "longlive2", "lingbot-world", "plain"]
    assert stages["plain"]["qvg"] is False and stages["plain"]["plugin"] == "third-party"
    assert "--kv-cache-quant" not in stages["plain"]["features_needed"]
    ll2 = stages["longlive2"]
    assert ll2["qvg"] is True and ll2["multi_shot"] is True
    assert ll2["models"] == ["LongLive2Pipeline", "tiny-longlive2", "tiny-longlive2-1k"]
    assert ll2["features_needed"] == {
        "always": [],
        "--kv-cache-quant": ["quant:qvg"],
        "several --prompt (resolve: --multi-shot)": ["pinned_sink"],
        "--nproc-per-node N > 1 (resolve: --heads-sharded N)": ["head_slice"],
        "--recent-window-frames": ["recent_window"],
    }
    assert "several --prompt (resolve: --multi-shot)" not in stages["longlive"]["features_needed"]
    # every trigger names a flag of generate (a resolve-only flag only after "resolve:")
    from causalkv.cli.commands import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    for trigger in ll2["features_needed"]:
        for flag in re.findall(r"--[\w-]+", trigger.split("(resolve:")[0]):
            assert flag in sub["generate"]._option_string_actions, trigger
        for flag in re.findall(r"--[\w-]+", trigger.split("(resolve:")[-1] if "(resolve:" in trigger else ""):
            assert flag in sub["resolve"]._option_string_actions, trigger
    caches = {c["name"]: c for c in report["caches"]}
    assert caches["tiny-ring"] == {
        "name": "tiny-ring",
        "target": "pkg.ring:Ring",
        "capabilities": ["growth", "ring:buffer"],
        "priority": 1,
        "plugin": "third-party",
    }
    assert "quant:qvg" in caches["qvg"]["capabilities"]
    assert report["failures"] == []
    full = json.loads(out_all)
    assert [p["name"] for p in full["plugins"]] == ["causalkv.builtin", "third-party"]
    assert full["plugins"][0]["builtin"] is True and full["hidden_builtin"] == 0


def test_plugins_text_output(capsys):
    rc, out, _ = run(["plugins"], capsys)
    assert rc == 0
    assert "the built-in plugin is hidden; --all lists it" in out
    assert "  longlive2 (causalkv.stages.longlive2:LongLive2Stage, plugin causalkv.builtin" in out
    assert "QVG: yes   multi-shot: yes" in out
    rc, out, _ = run(["plugins", "--all"], capsys)
    assert "  causalkv.builtin (causalkv " in out


class Hosts:
    @hookimpl
    def causalkv_register_host_classes(self):
        return [HostClassRegistration("causalkv", "causalkv.stages.longlive2:LongLive2Stage", "tiny-longlive2",
                                 cache="qvg"),
                HostClassRegistration("causalkv", "pkg.gone:Stage", "GonePipeline", priority=2)]


def test_plugins_lists_host_classes_and_marks_one_that_does_not_import(capsys):
    """Each host registration: host, class, models, cache factory, codec and plugin; a class
    that does not import is marked with the error, one whose host is not installed here is
    marked unchecked (this environment has neither sglang nor vLLM-Omni)."""
    with temporary_plugin(get_plugin_manager(), Hosts(), name="hosts"):
        rc, out, _ = run(["plugins", "--json"], capsys)
        assert rc == 0
        hosts = json.loads(out)["hosts"]
        _, text, _ = run(["plugins"], capsys)
    builtin, mine, gone = hosts[0], hosts[-2], hosts[-1]
    assert (builtin["host"], builtin["models"], builtin["cache"], builtin["plugin"]) == (
        "sglang", ["LongLive2Pipeline"], "sglang", "causalkv.builtin")
    assert builtin["unchecked"] == "host sglang is not installed here (no module 'sglang')"
    assert mine == {"host": "causalkv", "target": "causalkv.stages.longlive2:LongLive2Stage",
                    "models": ["tiny-longlive2"], "codec": None, "cache": "qvg", "priority": 0, "plugin": "hosts"}
    assert gone["error"] == ("pkg.gone:Stage (plugin hosts) cannot be imported: ModuleNotFoundError: "
                             "No module named 'pkg'")
    assert ("  causalkv pkg.gone:Stage (plugin hosts, priority 2)\n"
            "      models: GonePipeline   cache: (the host default)   codec: (the host default)\n"
            "      error: pkg.gone:Stage (plugin hosts) cannot be imported: ModuleNotFoundError: "
            "No module named 'pkg'\n") in text


def test_resolve_prints_stage_cache_and_reasons(capsys):
    rc, out, err = run(["resolve", "tiny-longlive2", "--multi-shot", "--kv-cache-quant", "int4"], capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "model: tiny-longlive2"
    assert lines[1].startswith("stage: longlive2 (causalkv.stages.longlive2:LongLive2Stage")
    assert lines[2].startswith("cache: qvg (causalkv.caches.qvg.packed:QVGPackedCausalKVCache")
    assert lines[3] == "requirements: pinned_sink, quant:qvg"
    assert lines[4] == "reasons:" and len(lines) == 9


def test_resolve_json_and_flags(capsys):
    rc, out, _ = run(
        ["resolve", "tiny-lingbot", "--heads-sharded", "2", "--recent-window-frames", "3",
         "--cache", "qvg", "--json"],
        capsys,
    )
    assert rc == 0
    d = json.loads(out)
    assert d["stage"]["name"] == "lingbot-world"
    assert d["cache"]["name"] == "qvg"
    assert d["requirements"] == ["head_slice", "recent_window"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["resolve", "tiny-wan", "--multi-shot"], "WanCausalDMDStage does not support multi-shot "
         "generation (a pinned shot sink per scene cut) (stage 'self-forcing-wan', plugin 'causalkv.builtin')"),
        (["resolve", "Nope"], "no registered stage serves model Nope. Served models: "),
        (["resolve", "tiny-wan", "--kv-cache-quant", "int2", "--cache", "dense"],
         "cache 'dense' (forced by --cache) lacks quant:qvg"),
        (["resolve", "tiny-wan", "--kv-cache-quant", "int4", "--kv-cache-quant-centroids", "300"],
         "kv-cache-quant-centroids must be <= 256"),
        (["resolve", "tiny-wan", "--heads-sharded", "0"], "--heads-sharded must be a positive int, got 0"),
    ],
)
def test_resolve_failure_exits_2_with_the_error_on_stderr(capsys, argv, message):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("causalkv resolve: error: ")
    assert message in err


def test_resolve_qvg_error_on_a_third_party_stage(capsys):
    with temporary_plugin(get_plugin_manager(), ThirdParty()):
        rc, _, err = run(["resolve", "PlainPipeline", "--kv-cache-quant", "int4"], capsys)
    assert rc == 2
    assert err.startswith(
        "causalkv resolve: error: PlainStage does not support QVG KV-cache quantization"
    )
    assert "--kv-cache-quant off" in err


def test_commands_load_no_weights_and_no_diffusers_or_transformers():
    code = (
        "import argparse, sys\n"
        "from causalkv.cli import plugins as cli\n"
        "p = argparse.ArgumentParser(); cli.register(p.add_subparsers())\n"
        "for argv in (['plugins', '--json'], ['resolve', 'tiny-wan', '--kv-cache-quant', 'int4']):\n"
        "    a = p.parse_args(argv); assert a.func(a) == 0\n"
        "heavy = [m for m in ('diffusers', 'transformers') if m in sys.modules]\n"
        "print('HEAVY=' + (','.join(heavy) or 'none'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAUSALKV_")}
    env["CAUSALKV_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "HEAVY=none"
