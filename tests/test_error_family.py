"""One error family: every error causalkv raises on purpose derives from `CausalKVError`.

The source is scanned (so a future ``raise ValueError(...)`` fails here, not in a user's
``except CausalKVError``): a ``raise`` of a builtin exception type is refused unless it is
listed in `JUSTIFIED` with the reason, and every exception class the package defines derives
from `CausalKVError` unless it is listed in `NOT_ERRORS`. Each family member also derives
from the builtin it replaced, so ``except ValueError`` code keeps catching it.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import causalkv
from causalkv.errors import CausalKVError

ROOT = Path(causalkv.__file__).parent

#: the sglang bridge raises sglang's own exception types and texts on purpose: sglang's callers
#: (and its unit tests, run against the bridge) match them, so that package keeps them
EXCLUDED_PACKAGES = {
    "sglang": "raises sglang's own types and texts, which sglang's callers match",
    "vllm_omni": "raises vLLM-Omni's own types and texts (its LingBot cache's ValueErrors), which "
                 "vLLM-Omni's callers match; it imports vllm_omni, absent from this environment",
}

#: (module path, enclosing function, builtin type) -> why that raise stays a builtin
JUSTIFIED = {
    ("lazy.py", "__getattr__", "AttributeError"):
        "the lazy exports of causalkv.runtime, causalkv.memory, causalkv.stages, "
        "causalkv.caches, causalkv.caches.qvg and causalkv.cli (PEP 562, no torch for --help): "
        "a missing name must raise AttributeError",
    ("stages/records.py", "__getitem__", "KeyError"):
        "ChunkStats is a read-only Mapping: a missing key must raise KeyError (Mapping.get, "
        "`in` and dict() rely on it)",
    ("runtime/model_io/components.py", "_all_weights_loaded", "ValueError"):
        "raised only inside reading_component, which turns it into a ModelFolderError naming "
        "the component and the fix (the message users see quotes this ValueError)",
}

#: exception classes the package defines that are not errors
NOT_ERRORS = {
    "causalkv.cli.Terminated":
        "SIGTERM turned into an exception to unwind the run; a BaseException so `except "
        "Exception` cleanup code lets it through",
}

BUILTIN_EXCEPTIONS = {
    name for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _modules() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py"))
            if p.relative_to(ROOT).parts[0] not in EXCLUDED_PACKAGES]


def _builtin_raises(path: Path) -> list[tuple[str, str, int]]:
    """``(enclosing function, builtin type, line)`` of every ``raise`` of a builtin in ``path``."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTIN_EXCEPTIONS:
                    found.append((func, exc.id, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_no_deliberate_raise_of_a_bare_builtin():
    bad, used = [], set()
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        for func, exc, line in _builtin_raises(path):
            if (rel, func, exc) in JUSTIFIED:
                used.add((rel, func, exc))
            else:
                bad.append(f"causalkv/{rel}:{line} ({func}): raise {exc}")
    assert not bad, (
        "raise an error of the causalkv.errors.CausalKVError family instead (e.g. ConfigError "
        "for a ValueError, UsageError for a RuntimeError, InvalidTypeError for a TypeError), "
        "or justify it in JUSTIFIED:\n" + "\n".join(bad)
    )
    assert used == set(JUSTIFIED), f"stale JUSTIFIED entries: {set(JUSTIFIED) - used}"


def test_the_scan_sees_a_bare_raise(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(x):\n    if x:\n        raise ValueError('bad')\n    raise CausalKVError('ok')\n")
    assert _builtin_raises(sample) == [("f", "ValueError", 3)]


def _package_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(ROOT)], prefix="causalkv."):
        if info.name.split(".")[1] not in EXCLUDED_PACKAGES and not info.name.endswith("__main__"):
            names.append(info.name)  # __main__ runs the command line when imported
    return names


def test_every_exception_class_the_package_defines_is_in_the_family():
    bad = []
    seen = set()
    for name in _package_modules():
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
                continue
            if cls.__module__ != name:
                continue
            qual = f"{name}.{cls.__qualname__}"
            seen.add(qual)
            if qual not in NOT_ERRORS and not issubclass(cls, CausalKVError):
                bad.append(qual)
    assert not bad, f"exception classes outside the CausalKVError family: {bad}"
    assert set(NOT_ERRORS) <= seen


@pytest.mark.parametrize(("name", "builtin"), [
    ("ConfigError", ValueError), ("InvalidTypeError", TypeError),
    ("ImportPathError", ImportError), ("UsageError", RuntimeError),
])
def test_each_family_member_is_also_its_builtin(name, builtin):
    cls = getattr(importlib.import_module("causalkv.errors"), name)
    assert issubclass(cls, CausalKVError) and issubclass(cls, builtin)
