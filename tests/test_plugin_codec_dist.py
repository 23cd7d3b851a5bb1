"""An installed plugin's codec works wherever a built-in does, in causalkv's own host: the
``causalkv-codec-plugin`` distribution (the toy int8 codec of tests/toy_codec_plugin.py) is
pip-installed into a folder that fresh interpreters put on PYTHONPATH, so discovery goes
through importlib.metadata as for any installed plugin (the bridges' twins:
tests/sglang_bridge/test_plugin_codec_bridge.py, tests/vllm_omni_bridge/test_plugin_codec_lingbot.py).

- ``causalkv memory`` prints the codec's rows, takes ``--setting int8-recent0`` and
  ``--kv-cache-quant int8``, and ``causalkv generate --kv-cache-quant int8`` holds the bytes
  the row says (its ``nbytes`` formula, counted by the planner);
- a script loads the plugins with one call, ``causalkv.plugin.collect()``, then plans and
  generates with the codec on the recency tier, the planner's bytes the run's.

The commands run once, in one ``CAUSALKV_HOME``, each in a child forked from one interpreter
that imported torch and causalkv but no plugin (`plugin_dists.run_commands`): the plugins are
discovered in each child.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from plugin_dists import Command, install, run_commands
from test_memory_planner import NAMES

#: one request both the planner and the run make: tiny-longlive2, two shots, CFG (its default)
REQUEST = ["--latent-frames", "16", "--shots", "2", "--cfg", "--kv-dtype", "float32", "--host", "causalkv"]
RUN = ["--model", "tiny-longlive2", "--prompt", "a fox", "--prompt", "a city", "--frames", "16",
       "--dtype", "float32", "--no-video", "--quiet"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install("causalkv-codec-plugin", tmp_path_factory.mktemp("codec-dist"))


#: what the commands import before any plugin loads
PRELOAD = ("causalkv.cli", "causalkv.memory", "causalkv.runtime", "causalkv.runtime.host.compare_step",
           "transformers", "diffusers")


@pytest.fixture(scope="module")
def ran(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every command the tests read, run once: name -> its answer (exit status 0 checked)."""
    home = tmp_path_factory.mktemp("codec-home")
    commands = {
        "rows": ["-m", "causalkv", "memory", "tiny-longlive2", *REQUEST, "--json"],
        "picked": ["-m", "causalkv", "memory", "tiny-longlive2", *REQUEST, "--json", "--setting", "int8-recent0",
                   "--kv-cache-quant", "int8"],
        "generate": ["-m", "causalkv", "generate", *RUN, "--kv-cache-quant", "int8", "--metrics", str(home / "m.json")],
        "script": ["-c", SCRIPT],
    }
    done = run_commands(site, [Command(argv) for argv in commands.values()], preload=PRELOAD, cwd=home,
                        CAUSALKV_HOME=str(home))
    ran: dict[str, Any] = dict(zip(commands, done, strict=True))
    for name, out in ran.items():
        assert out.returncode == 0, (name, out.stderr[-3000:])
    ran["metrics"] = json.loads((home / "m.json").read_text())
    return ran


def test_causalkv_memory_rows_and_a_generate_run_agree_on_the_plugin_codec(ran: dict[str, Any]) -> None:
    rows = json.loads(ran["rows"].stdout)
    assert [r["setting"] for r in rows] == [*NAMES, "int8-default", "int8-recent0"]
    picked = json.loads(ran["picked"].stdout)
    assert picked == [rows[-1], rows[-2]]  # --setting's first, then the codec's other row
    metrics = ran["metrics"]
    assert metrics["cache_settings"]["kv_cache_quant"] == "int8"
    row = rows[-2]  # int8-default: keep-recent 1, the run's defaults
    assert (metrics["kv_resident_bytes_max"], metrics["kv_peak_bytes"]) == (row["kv_bytes"], row["peak_bytes"])


SCRIPT = """
import json, sys
from causalkv.caches.codecs import codec_names
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.config import ServerArgs
from causalkv.errors import ConfigError
from causalkv.plugin import collect
from causalkv.runtime import GenerateOptions, generate
from causalkv.memory import STREAM_CACHE, MemoryRequest, Setting, plan_setting, stream_layout
from causalkv.runtime.model_io.geometry import resolve_model

before = "int8" in codec_names()
collect()  # the one call: the installed plugins loaded, their codecs registered
quant = QVGKVQuantArgs(codec="int2", recent_tier="int8")
geom = resolve_model("tiny-longlive2")
req = MemoryRequest(latent_frames=16, shots=2, cfg=True, dtype="float32")
plan = plan_setting(geom, stream_layout(geom, req), Setting("int2-recent-int8", "int2", 1, "int8"),
                    cache=STREAM_CACHE, dtype="float32")
metrics, run = generate(GenerateOptions(model="tiny-longlive2", prompts=["a fox", "a city"], frames=16,
                                        server_args=ServerArgs(options=[quant], dtype="float32")))
json.dump({"before": before, "after": "int8" in codec_names(), "plan": [plan.kv_bytes, plan.peak_bytes],
           "run": [metrics["kv_resident_bytes_max"], metrics["kv_peak_bytes"]],
           "options": metrics["cache_options"]}, sys.stdout)
"""


def test_a_script_loads_the_plugins_with_collect_and_plans_and_runs_the_recency_tier(
        ran: dict[str, Any]) -> None:
    out = json.loads(ran["script"].stdout.splitlines()[-1])
    assert (out["before"], out["after"]) == (False, True)
    assert out["options"].endswith("recent_tier=int8)")
    assert out["run"] == out["plan"]
