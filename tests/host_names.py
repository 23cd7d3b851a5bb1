"""causalkv's public class names beside a host's own (read from the installed wheel's source).

A public name of causalkv must not mean something else in a host a user drives it from: a
name shared with the host is allowed only where it is the host's own concept, the same role,
which causalkv serves or mirrors (each bridge test lists those with the reason). Model
implementations (a host's ``models/`` folder) are left out: their helper classes are private
to one model and no user meets them.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CLASS = re.compile(r"^class (\w+)\b", re.M)


def causalkv_classes() -> dict[str, list[str]]:
    """Public top-level class name -> the causalkv modules that define it."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "causalkv").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                out.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    return out


def package_folder(dotted: str) -> Path:
    """The folder of an installed package, found without importing it (only its top level)."""
    top, _, rest = dotted.partition(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.submodule_search_locations, f"{top} is not installed"
    return Path(next(iter(spec.submodule_search_locations)), *rest.split(".") if rest else ())


def shared_names(*packages: str) -> dict[str, list[str]]:
    """causalkv class name -> where ``packages`` (dotted, installed) define a class of that name,
    model implementations left out."""
    ours = causalkv_classes()
    out: dict[str, list[str]] = {}
    for dotted in packages:
        folder = package_folder(dotted)
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder.parent)
            if "models" in rel.parts[:-1] and "configs" not in rel.parts:
                continue
            for m in _CLASS.finditer(path.read_text(errors="replace")):
                if m.group(1) in ours:
                    out.setdefault(m.group(1), []).append(str(rel))
    return out
