"""The layer contracts (pyproject.toml ``[tool.importlinter]``, run by ``make test``) catch what
they promise: a copy of the package with one upward import or one cycle breaks them."""

from __future__ import annotations

import ast
import os
import re
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


#: (file, line appended to it, what lint-imports must then say): one break of each kind
BREAKS = [
    # an upward import: the dense cache reaching into the host
    ("causalkv/caches/dense.py", "import causalkv.runtime.model_io.components  # noqa",
     "causalkv.caches is not allowed to import causalkv.runtime"),
    # the core reaching into a bridge: the runtime's request checks importing the sglang bridge
    ("causalkv/runtime/host/request_checks.py", "import causalkv.sglang  # noqa",
     "causalkv.runtime is not allowed to import causalkv.sglang"),
    # the core importing a host itself: a cache reaching into vLLM
    ("causalkv/caches/attention.py", "import vllm  # noqa",
     "causalkv.caches is not allowed to import vllm"),
    # a cycle between siblings two levels down, hidden in a function body
    ("causalkv/caches/codecs/prq/format.py",
     "def _f():\n    from causalkv.caches.codecs.prq import torch_impl  # noqa",
     "No cycles are allowed in causalkv.caches.codecs.prq"),
    # the codec layer reaching into the store that packs with it
    ("causalkv/caches/codecs/fp8.py", "import causalkv.caches.qvg.options  # noqa",
     "causalkv.caches.codecs is not allowed to import causalkv.caches.qvg"),
]


def test_the_contracts_hold_and_each_kind_of_break_fails(tree: Path) -> None:
    assert LINT.exists(), f"{LINT} missing: import-linter is in the test extra (pip install -e '.[test]')"
    assert _lint(tree).returncode == 0
    for path, line, said in BREAKS:  # each alone: the tree is restored after each
        original = (tree / path).read_text()
        _append(tree / path, line)
        out = _lint(tree)
        (tree / path).write_text(original)
        assert out.returncode == 1 and said in out.stdout, (path, out.stdout[-2000:])


# ---- the lowest layers, by their syntax trees (import-linter cannot see importlib strings) ----
PKG = ROOT / "causalkv"
#: module (or package) -> what it may import from causalkv: itself and the layers below it
BELOW = {
    "causalkv.errors": (),
    "causalkv.lazy": (),
    "causalkv.env": ("causalkv.errors",),
    "causalkv.options": ("causalkv.errors", "causalkv.capabilities"),
    "causalkv.config": ("causalkv.options", "causalkv.errors", "causalkv.capabilities"),
    "causalkv.hooks": ("causalkv.config", "causalkv.options", "causalkv.errors", "causalkv.capabilities"),
}
_IMPORTERS = {"import_module", "__import__", "import_object", "find_spec"}


def _names_imported(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``tree``: statements (TYPE_CHECKING ones and
    those inside functions included, relative ones resolved), calls of importlib.import_module,
    __import__, import_object and find_spec with a literal name, and any other string literal
    that names a causalkv module (``"causalkv.stages.longlive2:ShotRequest"``)."""
    out: list[tuple[int, str]] = []
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    package = module if (PKG / module.removeprefix("causalkv.").replace(".", "/")).is_dir() else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn in _IMPORTERS and node.args and isinstance(node.args[0], ast.Constant):
                out.append((node.lineno, str(node.args[0].value).partition(":")[0]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            m = re.fullmatch(r"(causalkv(?:\.\w+)+)(?::[\w.]+)?", node.value.strip())
            if m and _is_module(m[1]):
                out.append((node.lineno, m[1]))
    return out


def _is_module(name: str) -> bool:
    rel = PKG.parent / name.replace(".", "/")
    return rel.is_dir() or rel.with_suffix(".py").is_file()


def _sources(layer: str) -> list[tuple[str, Path]]:
    rel = layer.removeprefix("causalkv.").replace(".", "/")
    if (PKG / rel).is_dir():
        return [(f"{layer}.{p.stem}" if p.stem != "__init__" else layer, p) for p in sorted((PKG / rel).glob("*.py"))]
    return [(layer, PKG / f"{rel}.py")]


def _above(layer: str, name: str) -> bool:
    allowed = (layer, *BELOW[layer])
    return (name == "causalkv" or name.startswith("causalkv.")) and not any(
        name == a or name.startswith(a + ".") for a in allowed
    )


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_the_lowest_layers_import_nothing_above_them_by_any_mechanism(layer: str) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for module, path in _sources(layer)
        for line, name in _names_imported(ast.parse(path.read_text()), module)
        if _above(layer, name)
    ]
    assert not found, "\n".join(found)


def test_the_scan_sees_every_mechanism(tmp_path: Path) -> None:
    code = (
        "import importlib\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from causalkv.stages.base import CausalDenoisingStage\n"
        "def f():\n    from ..runtime import plan\n"
        "    importlib.import_module('causalkv.caches.qvg.options')\n"
        "    __import__('causalkv.cli')\n"
        "MOVED = {'ShotRequest': 'causalkv.stages.longlive2:ShotRequest'}\n"
        "from causalkv.options import Options\n"
    )
    names = [n for _, n in _names_imported(ast.parse(code), "causalkv.hooks.records")]
    above = [n for n in names if _above("causalkv.hooks", n)]
    assert set(above) == {
        "causalkv.stages.base.CausalDenoisingStage", "causalkv.runtime.plan",
        "causalkv.caches.qvg.options", "causalkv.cli", "causalkv.stages.longlive2",
    }
    assert "causalkv.options.Options" in names and not _above("causalkv.hooks", "causalkv.options.Options")


def test_the_caches_print_nothing() -> None:
    """The cache layer logs, prints, warns and writes to stdout/stderr nothing: it records the fact (e.g.
    `AttendStats.decode_reasons`) and the host that called it reports it."""
    found = []
    for path in sorted((PKG / "caches").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in ("logging", "warnings")]
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls print")
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("sys.stdout", "sys.stderr"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} writes {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_the_caches_name_no_host() -> None:
    """caches/ is the core every host drives: no host's name in its code, strings or docstrings
    (a rule is named for what it decides, a policy by its rule; docs/hosts.md)."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((PKG / "caches").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"sglang|vllm|omni", line, re.I)]
    assert not found, "\n".join(found)
