"""The layer contracts (pyproject.toml ``[tool.importlinter]``, run by ``make test``) catch what
they promise: a copy of the package with one upward import or one cycle breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT)], cwd=tree, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "causalkv", tmp_path / "causalkv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_contracts_hold_and_each_kind_of_break_fails(tree: Path) -> None:
    assert LINT.exists(), f"{LINT} missing: import-linter is in the test extra (pip install -e '.[test]')"
    assert _lint(tree).returncode == 0
    # an upward import: the dense cache reaching into the host
    dense = tree / "causalkv/caches/dense.py"
    original = dense.read_text()
    _append(dense, "import causalkv.runtime.loading  # noqa")
    out = _lint(tree)
    assert out.returncode == 1 and "causalkv.caches is not allowed to import causalkv.runtime" in out.stdout
    dense.write_text(original)
    # a cycle between siblings two levels down, hidden in a function body
    _append(tree / "causalkv/caches/qvg/format.py",
            "def _f():\n    from causalkv.caches.qvg import torch_impl  # noqa")
    out = _lint(tree)
    assert out.returncode == 1 and "No cycles are allowed in causalkv.caches.qvg" in out.stdout
