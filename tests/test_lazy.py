"""`causalkv.lazy` is the one module ``__getattr__``: every package's lazy names go through it,
keep their public import paths, and import nothing until read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from causalkv.lazy import lazy_names

ROOT = Path(__file__).resolve().parents[1]
#: the packages whose names are imported on first use
LAZY = ("causalkv.runtime", "causalkv.memory", "causalkv.stages", "causalkv.caches",
        "causalkv.caches.qvg", "causalkv.caches.codecs.prq", "causalkv.cli")


def test_no_module_defines_a_getattr_of_its_own() -> None:
    found = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "causalkv").rglob("*.py")) if path.name != "lazy.py"
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]
    assert not found, f"module __getattr__ outside causalkv/lazy.py: {found}"


@pytest.mark.parametrize("package", LAZY)
def test_each_lazy_package_uses_lazy_names(package: str) -> None:
    module = __import__(package, fromlist=["__getattr__"])
    assert module.__getattr__.__qualname__ == "lazy_names.<locals>.__getattr__"


@pytest.mark.parametrize("package", LAZY)
def test_no_lazy_name_is_also_a_submodule(package: str) -> None:
    """Importing a submodule sets it on its package, so a lazy name spelled like a submodule
    would read the module once anything imported it (``prq.quantize`` is a function: its module
    is ``quantizer``)."""
    folder = ROOT / package.replace(".", "/")
    homes = __import__(package, fromlist=["__all__"]).__all__
    shadowed = [n for n in homes if (folder / f"{n}.py").is_file() or (folder / n).is_dir()]
    assert not shadowed, f"{package}: exported names that are also its submodules: {shadowed}"


def test_a_name_is_imported_on_first_read_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    package = types.ModuleType("causalkv_lazy_probe")
    monkeypatch.setitem(sys.modules, package.__name__, package)
    package.__getattr__ = lazy_names(package.__name__, {"join": "os.path"})  # type: ignore[attr-defined]
    import os.path

    assert package.join is os.path.join and package.__dict__["join"] is os.path.join
    with pytest.raises(AttributeError, match="module 'causalkv_lazy_probe' has no attribute 'nope'"):
        package.nope  # noqa: B018


def test_the_public_paths_stay_and_import_no_torch_until_read() -> None:
    code = (
        "import sys\n"
        "import causalkv.caches, causalkv.caches.codecs, causalkv.caches.codecs.prq\n"
        "import causalkv.caches.qvg, causalkv.cli\n"
        "from causalkv.caches.qvg import QVGKVQuantArgs\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from causalkv.caches import DenseCausalKVCache, attend\n"
        "from causalkv.caches.qvg import SegmentStore\n"
        "from causalkv.caches.codecs.prq import BACKEND_ENV\n"
        "from causalkv.cli import build_parser\n"
        "assert DenseCausalKVCache.__module__ == 'causalkv.caches.dense'\n"
        "assert callable(build_parser) and BACKEND_ENV == 'CAUSALKV_QVG_BACKEND'\n"
        "for pkg, name in ((causalkv.caches, 'Nope'), (causalkv.cli, 'nope')):\n"
        "    try:\n        getattr(pkg, name)\n    except AttributeError:\n        pass\n"
        "    else:\n        raise SystemExit(f'{name} found')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
