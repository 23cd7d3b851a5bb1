"""End to end: a real plugin distribution, pip-installed from tests/plugin_dist (no network).

The distribution ``causalkv-example-plugin`` declares three entry points in group
``causalkv``: ``example`` (a stage and a cache), ``broken`` (its import raises) and
``misspelled`` (a hook name matching no hookspec). It is installed once per module with
``pip install --no-deps --no-build-isolation --no-index --target <tmp>``; each scenario runs
the ``plugins``/``resolve`` subcommands in a fresh interpreter whose PYTHONPATH holds the
target, so discovery goes through importlib.metadata exactly as for an installed plugin. (The
runner builds a parser with `causalkv.cli.plugins.register` only, so the other subcommands'
imports do not slow it down. Every scenario's command runs once, in a child forked from one
interpreter that imported torch and causalkv's command line but no plugin,
`plugin_dists.run_commands`: the plugins are discovered in each child.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from plugin_dists import Command, install, run_commands

ENTRY_POINTS = {"example", "broken", "misspelled"}
RUNNER = (
    "import argparse, sys\n"
    "from causalkv.cli import plugins as cli\n"
    "parser = argparse.ArgumentParser(prog='causalkv')\n"
    "cli.register(parser.add_subparsers())\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)
#: what the runner imports before any plugin loads (torch, through causalkv's stage base)
PRELOAD = ("argparse", "causalkv.cli.plugins", "causalkv.stages.base")


#: every scenario's command line: name -> (argv, environment variables)
COMMANDS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "plugins": (("plugins", "--json"), {}),
    "resolve-help": (("resolve", "--help"), {}),
    "resolve": (("resolve", "tiny-example", "--json"), {}),
    "resolve-int4": (("resolve", "ExamplePipeline", "--kv-cache-quant", "int4"), {}),
    "allow": (("plugins", "--json"), {"CAUSALKV_PLUGINS": "example,not-installed"}),
    "allow-broken": (("plugins", "--json"), {"CAUSALKV_PLUGINS": "broken"}),
    "block": (("plugins", "--json"), {"CAUSALKV_DISABLE_PLUGINS": "broken,misspelled"}),
    "block-distribution": (("plugins", "--json"), {"CAUSALKV_DISABLE_PLUGINS": "causalkv-example-plugin"}),
    "autoload-off": (("plugins", "--json"), {"CAUSALKV_DISABLE_PLUGIN_AUTOLOAD": "1"}),
    "autoload-off-resolve": (("resolve", "tiny-example"), {"CAUSALKV_DISABLE_PLUGIN_AUTOLOAD": "1"}),
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The pip --target folder holding the installed example distribution."""
    return install("causalkv-example-plugin", tmp_path_factory.mktemp("plugin-dist"))


@pytest.fixture(scope="module")
def ran(site: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every command of `COMMANDS`, run once: name -> its exit status, stdout and stderr."""
    commands = [Command(["-c", RUNNER, *argv], env) for argv, env in COMMANDS.values()]
    return dict(zip(COMMANDS, run_commands(site, commands, preload=PRELOAD), strict=True))


def plugins(ran: dict[str, subprocess.CompletedProcess], name: str) -> tuple[dict, str]:
    out = ran[name]
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_installed_distribution_declares_the_entry_points(site):
    info = next(site.glob("causalkv_example_plugin-0.1.0.dist-info"))
    text = (info / "entry_points.txt").read_text()
    assert "[causalkv]" in text
    assert {line.split("=")[0].strip() for line in text.splitlines() if "=" in line} == ENTRY_POINTS


def test_discovery_loads_the_plugin_and_reports_broken_ones(ran):
    report, err = plugins(ran, "plugins")
    assert report["plugins"] == [{
        "name": "example",
        "version": "0.1.0",
        "distribution": "causalkv-example-plugin",
        "hooks": ["causalkv_register_cache_factories", "causalkv_register_stages"],
        "builtin": False,
    }]
    stage = next(s for s in report["stages"] if s["name"] == "example-stage")
    assert stage["plugin"] == "example" and stage["models"] == ["tiny-example", "ExamplePipeline"]
    assert stage["features_needed"]["always"] == ["example:ring"]
    cache = next(c for c in report["caches"] if c["name"] == "example-ring")
    assert cache["plugin"] == "example" and "example:ring" in cache["capabilities"]
    failures = {f["name"]: f for f in report["failures"]}
    assert set(failures) == {"broken", "misspelled"}
    assert failures["broken"]["distribution"] == "causalkv-example-plugin 0.1.0"
    assert failures["broken"]["error"] == (
        "ImportError: causalkv_example_plugin.broken fails to import on purpose"
    )
    assert failures["misspelled"]["error"].startswith(
        "PluginValidationError: unknown hook(s) causalkv_register_stage;"
    )
    # reported on stderr, one line each, naming plugin, distribution, error and the fix
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0] == ("causalkv: warning: plugin 'broken' (from causalkv-example-plugin 0.1.0) is set "
                        "aside: ImportError: causalkv_example_plugin.broken fails to import on purpose; fix "
                        "the plugin, or turn it off with CAUSALKV_DISABLE_PLUGINS=broken")
    assert lines[1].startswith("causalkv: warning: plugin 'misspelled' (from causalkv-example-plugin 0.1.0)")


def test_help_names_each_plugin_set_aside_while_loading(ran):
    # the broken import and the misspelled hook never reach the registry; --help names them anyway
    helped = ran["resolve-help"]
    assert helped.returncode == 0, helped.stderr
    groups = helped.stdout.split("plugin set aside (its stages, caches and flags are not here):")[1:]
    assert len(groups) == 2, helped.stdout
    assert " ".join(groups[0].split()).startswith(
        "plugin 'broken' (from causalkv-example-plugin 0.1.0) is set aside: ImportError:")
    assert " ".join(groups[1].split()).startswith("plugin 'misspelled' (from causalkv-example-plugin 0.1.0)")


def test_resolution_uses_the_discovered_stage_and_cache(ran):
    out = ran["resolve"]
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["stage"]["class"] == "causalkv_example_plugin.stage:ExampleStage"
    assert d["stage"]["plugin"] == "example"
    assert d["cache"]["name"] == "example-ring"  # the only cache with example:ring
    assert d["requirements"] == ["example:ring"]
    # ExampleStage keeps the base class's answer: no QVG
    q = ran["resolve-int4"]
    assert q.returncode == 2 and q.stdout == ""
    assert "causalkv resolve: error: ExampleStage does not support QVG KV-cache quantization" in q.stderr


def test_allow_list_loads_only_the_listed_plugin(ran):
    report, err = plugins(ran, "allow")
    assert [p["name"] for p in report["plugins"]] == ["example"]
    assert report["failures"] == [] and "failed to load" not in err
    assert report["missing_allowed"] == ["not-installed"]
    report, _ = plugins(ran, "allow-broken")
    assert report["plugins"] == [] and [f["name"] for f in report["failures"]] == ["broken"]


def test_block_list_by_plugin_and_by_distribution(ran):
    report, err = plugins(ran, "block")
    assert [p["name"] for p in report["plugins"]] == ["example"]
    assert report["failures"] == [] and err == ""
    report, _ = plugins(ran, "block-distribution")
    assert report["plugins"] == [] and report["failures"] == []
    assert "example-stage" not in {s["name"] for s in report["stages"]}


def test_autoload_off_loads_no_installed_plugin(ran):
    report, err = plugins(ran, "autoload-off")
    assert report["plugins"] == [] and report["failures"] == [] and err == ""
    out = ran["autoload-off-resolve"]
    assert out.returncode == 2
    assert "no registered stage serves model tiny-example" in out.stderr
