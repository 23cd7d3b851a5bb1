"""The plugin contract (`causalkv.hooks`): markers, records, hookspecs, and the hook meta-test."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import causalkv.hooks as hooks
from causalkv.caches.dense import DenseCausalKVCache
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.spec import CausalCacheSpec
from causalkv.capabilities import CacheCapabilities
from causalkv.hooks import CacheFactory, StageRegistration, import_object, specs
from causalkv.stages.longlive2 import LongLive2Stage

TESTS = Path(__file__).parent


def _spec_names() -> set[str]:
    """Hookspec names as pluggy sees them (functions carrying the ``causalkv_spec`` mark)."""
    return {
        name
        for name in dir(specs)
        if getattr(getattr(specs, name), f"{hooks.NAME}_spec", None) is not None
    }


def test_one_name_drives_markers_group_and_env_prefix():
    assert hooks.NAME == "causalkv"
    assert hooks.ENTRY_POINT_GROUP == "causalkv"
    assert hooks.ENV_PREFIX == "CAUSALKV"
    assert hooks.hookspec.project_name == "causalkv"
    assert hooks.hookimpl.project_name == "causalkv"


def test_import_hooks_does_not_import_torch():
    code = (
        "import sys, causalkv.hooks\n"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy) or 'none')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "none"


def test_only_select_cache_factory_is_first_result():
    first = {n for n in _spec_names() if getattr(specs, n).causalkv_spec["firstresult"]}
    assert first == {"causalkv_select_cache_factory"}


def test_every_hookspec_has_a_test():
    """Meta-test: each hookspec's name appears in some test function's name.

    Scans tests/test_plugin*.py and tests/test_resolve*.py; adding a hookspec without a
    ``test_<hook name>...`` test fails here.
    """
    test_names: set[str] = set()
    for path in sorted(TESTS.glob("test_plugin*.py")) + sorted(TESTS.glob("test_resolve*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
                "test_"
            ):
                test_names.add(node.name)
    untested = sorted(h for h in _spec_names() if not any(h in t for t in test_names))
    assert untested == [], f"hookspecs without a test named test_<hook>...: {untested}"


def test_stage_registration_normalizes_models_and_loads_lazily():
    reg = StageRegistration("s", "causalkv.stages.longlive2:LongLive2Stage", models="tiny-x")
    assert reg.models == ("tiny-x",)
    assert reg.priority == 0
    assert reg.target == "causalkv.stages.longlive2:LongLive2Stage"
    assert reg.load() is LongLive2Stage
    direct = StageRegistration("s", LongLive2Stage, models=["a", "b"], priority=3)
    assert direct.models == ("a", "b")
    assert direct.load() is LongLive2Stage
    assert direct.target == "causalkv.stages.longlive2:LongLive2Stage"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "", "stage": "m:C", "models": ["x"]}, "non-empty string"),
        ({"name": "s", "stage": 3, "models": ["x"]}, "class or a 'module:Class'"),
        ({"name": "s", "stage": "m:C", "models": ["x", ""]}, "models must be non-empty strings"),
        ({"name": "s", "stage": "m:C", "models": ["x"], "priority": "high"}, "priority"),
    ],
)
def test_stage_registration_rejects_bad_fields(kwargs, match):
    with pytest.raises(TypeError, match=match):
        StageRegistration(**kwargs)


def test_import_object_errors_name_the_path():
    assert import_object("causalkv.hooks.records:StageRegistration.load") is StageRegistration.load
    with pytest.raises(ImportError, match="not a 'package.module:Attribute'"):
        import_object("causalkv.stages.wan.WanCausalDMDStage")
    with pytest.raises(ImportError, match="has no attribute 'NoSuchStage'"):
        import_object("causalkv.stages.wan:NoSuchStage")
    with pytest.raises(ModuleNotFoundError):
        import_object("causalkv_tests_no_such_module:Stage")


def test_cache_factory_converts_capabilities():
    f = CacheFactory("c", "causalkv.caches.dense:DenseCausalKVCache", ["pinned_sink", "x:y"])
    assert isinstance(f.capabilities, CacheCapabilities)
    assert f.capabilities.features == frozenset({"pinned_sink", "x:y"})
    caps = CacheCapabilities.of("growth")
    assert CacheFactory("c", DenseCausalKVCache, caps).capabilities is caps
    assert CacheFactory("c", DenseCausalKVCache, "growth").capabilities == caps
    assert CacheFactory("c", DenseCausalKVCache, []).capabilities.features == frozenset()
    with pytest.raises(TypeError, match="capabilities must be non-empty strings"):
        CacheFactory("c", DenseCausalKVCache, ["ok", 3])
    with pytest.raises(TypeError, match="a callable"):
        CacheFactory("c", 42, ["ok"])


def test_cache_factory_build_imports_string_and_passes_spec_and_quant():
    spec = CausalCacheSpec(batch_size=1, num_heads=2, head_dim=4, cache_size=8, dtype=torch.float32)
    f = CacheFactory("dense", "causalkv.caches.dense:DenseCausalKVCache", ["growth"])
    assert f.load() is DenseCausalKVCache
    cache = f.build(spec, None)
    assert isinstance(cache, DenseCausalKVCache)
    assert tuple(cache.k_cache.shape) == (1, 8, 2, 4)  # [B, cache_size, H, D]

    calls = []

    def factory(spec, quant):
        calls.append((spec, quant))
        return "built"

    quant = QVGKVQuantArgs(codec="int4")
    assert CacheFactory("fn", factory, ["quant:qvg"]).build(spec, quant) == "built"
    assert calls == [(spec, quant)]
    assert CacheFactory("fn", factory, []).target.endswith(
        "test_cache_factory_build_imports_string_and_passes_spec_and_quant.<locals>.factory"
    )
