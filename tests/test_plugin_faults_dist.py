"""End to end: installed plugins that fail are set aside, one line each, and the run goes on.

``causalkv-faulty-plugin`` (tests/plugin_dist) declares ``raising`` (its
``causalkv_register_stages`` raises) and ``seedflag`` (its stage declares ``--seed``, a flag of
``causalkv generate`` itself). Installed with ``pip install --target`` into a temporary
folder, ``causalkv generate --model tiny-wan`` still runs, printing one line for each, and
``causalkv plugins`` lists the same two; ``--strict-plugins`` makes the first fatal (exit 2).
Blocking one plugin by its distribution name silences both. Each command runs once, in a
child forked from one interpreter that imported torch and causalkv's command line but no
plugin (`plugin_dists.run_commands`): the plugins are discovered in each child.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from plugin_dists import Command, install, run_commands

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return install("causalkv-faulty-plugin", tmp_path_factory.mktemp("faulty-dist"))


#: what ``python -m causalkv generate`` imports before any plugin loads
PRELOAD = ("causalkv.cli", "causalkv.runtime.host.compare_step", "transformers", "diffusers")


@pytest.fixture(scope="module")
def ran(site: Path, causalkv_home: str, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every command the tests read, run once: name -> its exit status, stdout and stderr."""
    metrics = tmp_path_factory.mktemp("faulty-run") / "m.json"
    commands = {
        "generate": ["generate", "--model", "tiny-wan", "--frames", "6", "--dtype", "float32", "--no-video",
                     "--quiet", "--seed", "3", "--metrics", str(metrics)],
        "strict": ["generate", "--model", "tiny-wan", "--frames", "6", "--no-video", "--strict-plugins"],
        "plugins": ["plugins", "--json"],
        "help": ["generate", "--help"],
    }
    runs = [Command(["-m", "causalkv", *argv]) for argv in commands.values()]
    runs.append(Command(["-m", "causalkv", "plugins", "--json"],
                        {"CAUSALKV_DISABLE_PLUGINS": "causalkv-faulty-plugin"}))
    done = run_commands(site, runs, ROOT, preload=PRELOAD, CAUSALKV_HOME=causalkv_home)
    return {**dict(zip([*commands, "blocked"], done, strict=True)),
            "metrics": json.loads(metrics.read_text()) if metrics.exists() else None}


RAISING = ("causalkv: warning: plugin 'raising' (from causalkv-faulty-plugin 0.1.0) is set aside: "
           "causalkv_register_stages() raised RuntimeError: the registration hook fails on purpose; "
           "fix the plugin, or turn it off with CAUSALKV_DISABLE_PLUGINS=raising")
SEEDFLAG = ("causalkv: warning: plugin 'seedflag' (from causalkv-faulty-plugin 0.1.0) is set aside: its "
            "flag --seed (seed knobs) is taken by causalkv's own flags; rename the flag, or turn the "
            "plugin off with CAUSALKV_DISABLE_PLUGINS=seedflag")


def test_generate_runs_with_one_line_per_plugin_set_aside(ran):
    out = ran["generate"]
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "warning:" in line]
    assert warnings == [RAISING, SEEDFLAG]
    assert ran["metrics"]["seed"] == 3  # --seed is the host's
    # --strict-plugins: the first plugin set aside is fatal, before anything loads
    strict = ran["strict"]
    assert strict.returncode == 2
    assert strict.stderr.splitlines()[-1].startswith(
        "causalkv generate: error: plugin 'raising' (from causalkv-faulty-plugin 0.1.0) is set aside")
    assert "--strict-plugins" in strict.stderr.splitlines()[-1]


def test_plugins_and_help_report_the_same_and_the_distribution_name_blocks_both(ran):
    report = json.loads(ran["plugins"].stdout)
    assert [f["line"] for f in report["failures"]] == [RAISING.removeprefix("causalkv: warning: "),
                                                       SEEDFLAG.removeprefix("causalkv: warning: ")]
    assert "seeded" not in {s["name"] for s in report["stages"]}
    helped = ran["help"].stdout
    assert helped.count("plugin set aside (its stages, caches and flags are not here)") == 2
    assert "plugin 'raising'" in helped and "plugin 'seedflag'" in helped
    blocked = ran["blocked"]
    assert json.loads(blocked.stdout)["failures"] == [] and blocked.stderr == ""
