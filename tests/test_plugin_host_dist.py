"""The host plugin distribution in causalkv's own host, end to end: ``causalkv-host-plugin``
(tests/plugin_dist/causalkv-host-plugin: the toy int8 codec, the cache factory ``toy-packed``, and
a host registration of host ``causalkv`` naming it for ``tiny-longlive2``) is pip-installed into
a folder that a fresh interpreter puts on PYTHONPATH, so discovery goes through
importlib.metadata as for any installed plugin. ``causalkv generate --kv-cache-quant int8`` then
runs on the plugin's cache factory with the plugin's codec, says so in its header, and holds
the bytes the planner counts from the codec's ``nbytes`` (the same request's ``causalkv memory``
row). Its twins in the other hosts: tests/sglang_bridge/test_host_plugin_e2e.py (``sglang
generate``), tests/vllm_omni_bridge/test_host_plugin_omni.py (vLLM-Omni's ``Omni.generate``).
Both commands run in children forked from one interpreter that imported torch and causalkv but
no plugin (`plugin_dists.run_commands`): the plugins are discovered in each child."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from plugin_dists import Command, install, run_commands

#: one request both the planner and the run make: tiny-longlive2, two shots, CFG (its default)
REQUEST = ["--latent-frames", "16", "--shots", "2", "--cfg", "--kv-dtype", "float32", "--host", "causalkv"]
RUN = ["--model", "tiny-longlive2", "--prompt", "a fox", "--prompt", "a city", "--frames", "16",
       "--dtype", "float32", "--no-video"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install("causalkv-host-plugin", tmp_path_factory.mktemp("host-dist"))


#: what the commands import before any plugin loads
PRELOAD = ("causalkv.cli", "causalkv.memory", "causalkv.runtime.host.compare_step", "transformers", "diffusers")


def _run(site: Path, home: Path, *commands: list[str]) -> list[subprocess.CompletedProcess]:
    done = run_commands(site, [Command(["-m", "causalkv", *argv]) for argv in commands], preload=PRELOAD,
                        cwd=home, CAUSALKV_HOME=str(home))
    for out in done:
        assert out.returncode == 0, out.stderr[-3000:]
    return done


def test_causalkv_generate_runs_the_plugins_cache_factory_and_codec(site: Path, tmp_path: Path) -> None:
    memory, out = _run(site, tmp_path, ["memory", "tiny-longlive2", *REQUEST, "--json"],
                       ["generate", *RUN, "--kv-cache-quant", "int8", "--metrics", str(tmp_path / "m.json")])
    (row,) = [r for r in json.loads(memory.stdout)
              if r["setting"] == "int8-default"]  # keep-recent 1, the run's defaults
    lines = out.stdout.splitlines()
    assert "cache: toy-packed (QVG KV-cache quantization: qvg(int8, keep_recent=1, sink=packed/chunk, sink_keep=0))" in lines
    assert ("  - cache toy-packed (plugin toy-host, priority -1): named by plugin toy-host's host registration; "
            "covers pinned_sink, quant:qvg") in lines
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["cache"], metrics["cache_settings"]["kv_cache_quant"]) == ("toy-packed", "int8")
    assert (metrics["kv_resident_bytes_max"], metrics["kv_peak_bytes"]) == (row["kv_bytes"], row["peak_bytes"])
    print(f"causalkv generate, host plugin: {lines[2]}; resident {metrics['kv_resident_bytes_max']:,} B "
          f"= planner {row['kv_bytes']:,} B, peak {metrics['kv_peak_bytes']:,} B = planner {row['peak_bytes']:,} B")
