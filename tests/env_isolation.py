"""Two clones share cached layers, never each other's code: the check each suite runs in its
own environment (``tests/test_envs.py``, ``tests/sglang_bridge/test_envs.py``,
``tests/vllm_omni_bridge/test_envs.py``).

The environment a suite runs in is a checkout's own venv made by ``tools/env.py`` over a layer
cached outside the checkout. The check makes a second clone beside this one, gives it the same
environment (reusing the same layer), and shows that each clone's interpreter imports its own
``causalkv`` and reads its own entry points, that the layer holds no causalkv at all, and that
deleting the second clone leaves this one working.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what a clone needs to make an environment and install causalkv from itself
TREE = ("pyproject.toml", "README.md", "causalkv", "tools", "requirements")

PROBE = """
import importlib.metadata as md, json, sys
import causalkv
dist = md.distribution("causalkv")
eps = sorted(f"{e.group}={e.value}" for e in dist.entry_points)
print(json.dumps({"file": causalkv.__file__, "clone": getattr(causalkv, "_CLONE", None),
                  "prefix": sys.prefix, "entry_points": eps,
                  "direct_url": dist.read_text("direct_url.json")}))
"""


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def probe(python: Path, cwd: Path) -> dict:
    """What ``python`` imports as causalkv, run from ``cwd`` (not a checkout: the current
    folder comes first on ``sys.path``), with no ``PYTHONPATH``."""
    out = subprocess.run([str(python), "-c", PROBE], cwd=cwd, env=_clean_env(), check=True,
                         capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_two_clones(name: str, tmp_path: Path) -> None:
    """The whole check for environment ``name`` (main, sglang, vllm-omni), run from a suite
    whose interpreter is this checkout's environment for it."""
    here = Path(sys.prefix)
    marker = json.loads((here / ".causalkv-env.json").read_text())
    layer = Path(marker["layer"])
    assert Path(marker["checkout"]) == ROOT, (marker, ROOT)
    assert layer.name.startswith(f"{name}-") and ROOT not in layer.parents, layer
    away = tmp_path / "elsewhere"
    away.mkdir()

    # the cached layer holds no causalkv: not importable, no distribution, no path to a clone
    out = subprocess.run([str(layer / "bin" / "python"), "-c",
                          "import importlib.util, importlib.metadata as md\n"
                          "print(importlib.util.find_spec('causalkv'))\n"
                          "print([d.metadata['Name'] for d in md.distributions()"
                          " if d.metadata['Name'] == 'causalkv'])"],
                         cwd=away, env=_clean_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "[]"], out.stdout

    mine = probe(here / "bin" / "python", away)
    assert Path(mine["file"]).is_relative_to(ROOT) and mine["clone"] is None, mine

    # clone B: the same tree, its causalkv marked, its environment over the same layer
    clone = tmp_path / "clone-b"
    clone.mkdir()
    for item in TREE:
        src = ROOT / item
        if src.is_dir():
            shutil.copytree(src, clone / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, clone / item)
    with open(clone / "causalkv" / "__init__.py", "a") as f:
        f.write('\n_CLONE = "B"\n')
    dest = clone / here.name
    base = getattr(sys, "_base_executable", sys.executable)
    made = subprocess.run([base, str(clone / "tools" / "env.py"), name, str(dest)], cwd=clone,
                          env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "layer reused" in made.stdout, made.stdout
    assert json.loads((dest / ".causalkv-env.json").read_text())["layer"] == str(layer)

    theirs = probe(dest / "bin" / "python", away)
    assert Path(theirs["file"]).is_relative_to(clone) and theirs["clone"] == "B", theirs
    assert clone.as_uri() in theirs["direct_url"] and ROOT.as_uri() not in theirs["direct_url"]
    assert theirs["entry_points"] == mine["entry_points"] and mine["entry_points"]
    # this clone is untouched by B's install
    again = probe(here / "bin" / "python", away)
    assert again == mine, (again, mine)

    # B deleted: this clone still imports its own causalkv and its code runs
    shutil.rmtree(clone)
    assert probe(here / "bin" / "python", away) == mine
    subprocess.run([str(here / "bin" / "python"), "-c", "import causalkv.caches"], cwd=away,
                   env=_clean_env(), check=True, timeout=300)
