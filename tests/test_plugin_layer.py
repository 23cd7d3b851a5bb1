"""The plugin layer on pluggy's own machinery: the per-plugin caller, validation, name claims.

- The registries and the host's run-time hook calls (`causalkv.runtime.host.hook_calls`:
  `configure_stage`, `ObserverHook`) use one
  helper, `plugin_callers`: `ObserverHook` visits the plugins in the very order pluggy's own
  hook call does (``tryfirst``/``trylast`` included), `plugin_callers` lists them in the
  reverse (registration order), and a raising implementation is pinned on its plugin.
- Registration validates with pluggy's ``check_pending``: an unknown hook is refused (the
  plugin left unregistered), an ``optionalhook`` one accepted, as pluggy defines them.
- An entry point claiming a registered plugin's name is set aside, naming both.
- The plugin machinery's modules import nothing inside functions, and no two of them import
  each other (not even under TYPE_CHECKING).
"""

from __future__ import annotations

import ast
import sys
import types
from contextlib import ExitStack
from importlib.metadata import EntryPoint
from pathlib import Path

import pluggy
import pytest

import causalkv
from causalkv.hooks import hookimpl
from causalkv.plugin import PluginSetAsideError, collect, make_plugin_manager
from causalkv.plugin.builtin import BUILTIN_PLUGIN_NAME
from causalkv.plugin.calls import plugin_callers
from causalkv.plugin.errors import PluginHookError
from causalkv.plugin.testing import temporary_plugin
from causalkv.runtime.host.hook_calls import ObserverHook


def _observer(name: str, seen: list[str], **opts):
    class Observer:
        @hookimpl(**opts)
        def causalkv_chunk_done(self, chunk_index):
            seen.append(name)
            return name

    return Observer()


def test_observer_order_is_pluggys_call_order_and_plugin_callers_the_reverse(pm):
    seen: list[str] = []
    event = {"stage": None, "stats": {}}
    with ExitStack() as stack:
        for name, opts in [("a", {}), ("first", {"tryfirst": True}), ("b", {}), ("last", {"trylast": True})]:
            stack.enter_context(temporary_plugin(pm, _observer(name, seen, **opts), name))
        pm.hook.causalkv_chunk_done(chunk_index=0, **event)
        pluggy_order, seen[:] = list(seen), []
        ObserverHook(pm, "causalkv_chunk_done")(chunk_index=1, **event)
        assert seen == pluggy_order == ["first", "b", "a", "last"]
        results = [(n, call(chunk_index=2, **event)) for n, call in plugin_callers(pm, "causalkv_chunk_done")]
        assert results == [(n, [n]) for n in pluggy_order[::-1]]


def test_a_raising_registration_hook_sets_its_plugin_aside_naming_it(pm):
    class Raising:
        @hookimpl
        def causalkv_register_stages(self):
            raise KeyError("oops")

    lines = []
    with temporary_plugin(pm, Raising(), "raiser"):
        registry = collect(pm, report=lines.append)
        assert [e.plugin for e in registry.stages] == [BUILTIN_PLUGIN_NAME] * 4  # the others work
        assert [str(f) for f in lines] == [
            "plugin 'raiser' is set aside: causalkv_register_stages() raised KeyError: 'oops'; fix the "
            "plugin, or turn it off with CAUSALKV_DISABLE_PLUGINS=raiser"
        ]
        with pytest.raises(PluginSetAsideError, match="plugin 'raiser' is set aside.*--strict-plugins"):
            collect(pm, strict=True)


def test_a_raising_observer_is_a_plugin_hook_error_naming_it(pm):
    class Raising:
        @hookimpl
        def causalkv_chunk_done(self):
            raise KeyError("oops")

    with temporary_plugin(pm, Raising(), "raiser"):
        with pytest.raises(PluginHookError, match="plugin 'raiser' failed in causalkv_chunk_done at chunk 0 .KeyError") as info:
            ObserverHook(pm, "causalkv_chunk_done", strict=True)(stage=None, chunk_index=0, stats={})
    assert isinstance(info.value, RuntimeError)
    assert (info.value.plugin, info.value.hook) == ("raiser", "causalkv_chunk_done")


def test_unknown_hooks_are_refused_and_optional_ones_accepted(pm):
    class Typo:
        @hookimpl
        def causalkv_chunk_don(self):
            return None

    class Optional:
        @hookimpl(optionalhook=True)
        def causalkv_some_future_hook(self):
            return None

    with pytest.raises(pluggy.PluginValidationError, match="unknown hook.s. causalkv_chunk_don; causalkv hooks are"):
        pm.register(Typo(), name="typo")
    assert not pm.has_plugin("typo")
    pm.check_pending()  # nothing left half-registered
    assert pm.register(Optional(), name="optional") == "optional"


def test_an_entry_point_claiming_the_builtin_name_is_set_aside(monkeypatch):
    mod = types.ModuleType("causalkv_tests_plugin_claims_builtin")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ep = EntryPoint(name=BUILTIN_PLUGIN_NAME, value=mod.__name__, group="causalkv")
    lines: list[str] = []
    pm = make_plugin_manager(env={}, entry_points=[ep], warn=lines.append)
    assert pm.get_plugin(BUILTIN_PLUGIN_NAME).__name__ == "causalkv.plugin.builtin"
    assert len(lines) == 1 and f"plugin name '{BUILTIN_PLUGIN_NAME}' is claimed twice" in lines[0]


@pytest.mark.parametrize("module", [
    "hooks/__init__.py", "hooks/markers.py", "hooks/records.py", "hooks/specs.py", "plugin/calls.py",
    "plugin/errors.py", "plugin/manager.py", "plugin/registry.py", "plugin/testing.py",
    "runtime/host/resolve.py",
])
def test_the_plugin_machinery_imports_nothing_inside_functions(module):
    tree = ast.parse((Path(causalkv.__file__).parent / module).read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not inner, f"{module}: {fn.name}() imports at line(s) {inner}"


def test_no_two_plugin_modules_import_each_other_even_for_annotations():
    """The plugin layer's modules form no import cycle, TYPE_CHECKING imports included."""
    root = Path(causalkv.__file__).parent
    graph = {}
    for path in [*sorted((root / "plugin").glob("*.py")), *sorted((root / "hooks").glob("*.py"))]:
        module = f"causalkv.{path.parent.name}" + ("" if path.stem == "__init__" else f".{path.stem}")
        graph[module] = {f"{n.module}.{a.name}" if (root.parent / n.module.replace(".", "/") / f"{a.name}.py").exists()
                         else n.module for n in ast.walk(ast.parse(path.read_text()))
                         if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("causalkv.") for a in n.names}
    assert "causalkv.plugin.loader" not in graph  # merged into manager: it imported manager back
    for a, deps in graph.items():
        for b in deps:
            if b in graph and b != a and a in graph[b]:
                pytest.fail(f"{a} and {b} import each other")


def test_the_plugin_layer_stays_small():
    """hooks/ + plugin/ (the registry every host reads) within 800 lines of code by
    benchmarks/loc.py's count; a host's own resolution lives in that host
    (`causalkv.runtime.resolve`, the bridges' `Registry.host_classes` lookups)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_causalkv_loc", Path(causalkv.__file__).parents[1] / "benchmarks" / "loc.py")
    loc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loc)
    root = Path(causalkv.__file__).parent
    total = sum(loc.code_lines(p) for d in ("hooks", "plugin") for p in (root / d).glob("*.py"))
    assert total <= 800, f"the plugin layer has {total} lines of code (at most 800)"
