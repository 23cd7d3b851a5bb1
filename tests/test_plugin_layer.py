"""The plugin layer on pluggy's own machinery: the per-plugin caller, validation, name claims.

- `call_each` (the registries) and `ObserverHook` (the host's observer hooks) are one helper,
  `plugin_callers`: `ObserverHook` visits the plugins in the very order pluggy's own hook
  call does (``tryfirst``/``trylast`` included), `call_each` in the reverse (registration
  order), and a raising implementation is a `PluginHookError` naming its plugin.
- Registration validates with pluggy's ``check_pending``: an unknown hook is refused (the
  plugin left unregistered), an ``optionalhook`` one accepted, as pluggy defines them.
- An entry point claiming a registered plugin's name is a conflict naming both.
- The plugin machinery's modules import nothing inside functions (no hidden import cycle).
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
import causalkv.runtime.plugin_faults as plugin_faults
from causalkv.hooks import hookimpl
from causalkv.plugin import PluginConflictError, make_plugin_manager
from causalkv.plugin.builtin import BUILTIN_PLUGIN_NAME
from causalkv.plugin.calls import ObserverHook, call_each
from causalkv.plugin.errors import PluginHookError
from causalkv.plugin.registry import call_each as registry_call_each
from causalkv.plugin.testing import temporary_plugin


def _observer(name: str, seen: list[str], **opts):
    class Observer:
        @hookimpl(**opts)
        def causalkv_chunk_done(self, chunk_index):
            seen.append(name)
            return name

    return Observer()


def test_observer_order_is_pluggys_call_order_and_call_each_the_reverse(pm):
    seen: list[str] = []
    event = {"stage": None, "stats": {}}
    with ExitStack() as stack:
        for name, opts in [("a", {}), ("first", {"tryfirst": True}), ("b", {}), ("last", {"trylast": True})]:
            stack.enter_context(temporary_plugin(pm, _observer(name, seen, **opts), name))
        pm.hook.causalkv_chunk_done(chunk_index=0, **event)
        pluggy_order, seen[:] = list(seen), []
        ObserverHook(pm, "causalkv_chunk_done")(chunk_index=1, **event)
        assert seen == pluggy_order == ["first", "b", "a", "last"]
        results = list(call_each(pm, "causalkv_chunk_done", chunk_index=2, **event))
        assert results == [(n, n) for n in pluggy_order[::-1]]


def test_a_raising_implementation_is_a_plugin_hook_error_naming_it(pm):
    class Raising:
        @hookimpl
        def causalkv_chunk_done(self):
            raise KeyError("oops")

    with temporary_plugin(pm, Raising(), "raiser"):
        with pytest.raises(PluginHookError, match="plugin 'raiser': causalkv_chunk_done.. raised KeyError") as info:
            list(call_each(pm, "causalkv_chunk_done", stage=None, chunk_index=0, stats={}))
    assert isinstance(info.value, RuntimeError)
    assert (info.value.plugin, info.value.hook) == ("raiser", "causalkv_chunk_done")


def test_the_moved_names_stay_importable_where_they_were():
    assert plugin_faults.PluginHookError is PluginHookError
    assert plugin_faults.ObserverHook is ObserverHook
    assert registry_call_each is call_each


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


def test_an_entry_point_claiming_the_builtin_name_is_a_conflict(monkeypatch):
    mod = types.ModuleType("causalkv_tests_plugin_claims_builtin")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ep = EntryPoint(name=BUILTIN_PLUGIN_NAME, value=mod.__name__, group="causalkv")
    with pytest.raises(PluginConflictError, match=f"plugin name '{BUILTIN_PLUGIN_NAME}' is claimed twice"):
        make_plugin_manager(env={}, entry_points=[ep])


@pytest.mark.parametrize("module", [
    "hooks/__init__.py", "hooks/markers.py", "hooks/specs.py", "plugin/calls.py", "plugin/errors.py",
    "plugin/loader.py", "plugin/manager.py", "plugin/testing.py", "runtime/plugin_faults.py",
])
def test_the_plugin_machinery_imports_nothing_inside_functions(module):
    tree = ast.parse((Path(causalkv.__file__).parent / module).read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not inner, f"{module}: {fn.name}() imports at line(s) {inner}"
