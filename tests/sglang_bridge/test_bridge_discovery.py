"""(a) sglang discovers causalkv through its entry point; the allow list and the off switch.

The session plugin (`ckv_sglang_pytest`) already ran sglang's ``load_plugins()`` and
``apply_plugin_hooks()``. The allow-list and off-switch cases re-run sglang's registration
phase (``load_plugins()`` after sglang's own ``_reset_lifecycle_for_tests()``) on an emptied
hook registry and restore it afterwards; registration patches nothing.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from contextlib import contextmanager

import pytest
from sglang.multimodal_gen.runtime.platforms import plugins as sgl_plugins

import causalkv.sglang as bridge
from causalkv.sglang.hooks import HOOKS, OFF_HOOKS
from causalkv.sglang.targets import BASE, LINGBOT, LONGLIVE2, served_stages


def _causalkv_hooks() -> dict[str, list]:
    return {
        target: [h for h in hooks if h[2] is not None and h[2].dist_name == "causalkv"]
        for target, hooks in sgl_plugins.HookRegistry._hooks.items()
        if any(h[2] is not None and h[2].dist_name == "causalkv" for h in hooks)
    }


@contextmanager
def _fresh_registration():
    """sglang's registration phase from scratch; the applied hooks stay as they are."""
    saved = {t: list(h) for t, h in sgl_plugins.HookRegistry._hooks.items()}
    sgl_plugins.HookRegistry._hooks.clear()
    sgl_plugins._reset_lifecycle_for_tests()
    try:
        yield
    finally:
        sgl_plugins.HookRegistry._hooks.clear()
        sgl_plugins.HookRegistry._hooks.update(saved)
        sgl_plugins._reset_lifecycle_for_tests()
        sgl_plugins._plugin_registration.run(lambda: None)  # the session did register
        sgl_plugins._hook_application.run(lambda: None)


def test_entry_point_found_and_every_hook_applied():
    found = _causalkv_hooks()
    assert set(found) == {target for target, _ in HOOKS}
    for target, hooks in found.items():
        assert [(h[0], h[1], h[2].plugin_name) for h in hooks] == [
            (sgl_plugins.HookType.AROUND, dict(HOOKS)[target], "causalkv")
        ]
        assert target in sgl_plugins.HookRegistry._patched
    from sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising import (
        CausalDMDDenoisingStage,
    )

    wrapped = CausalDMDDenoisingStage.__dict__["_allocate_causal_kv_cache"]
    assert wrapped.__wrapped__.__qualname__ == "CausalDMDDenoisingStage._allocate_causal_kv_cache"


def test_the_builtin_plugin_serves_the_three_stages_the_hooks_wrap():
    """The built-in plugin's ``HostClassRegistration`` records for host ``sglang`` resolve to
    sglang's own classes: exactly the three whose methods the hooks wrap, per pipeline."""
    stages = served_stages()
    assert {p: f"{s.cls.__module__}.{s.cls.__qualname__}" for p, s in stages.items()} == {
        "LongLive2Pipeline": LONGLIVE2, "WanCausalDMDPipeline": BASE,
        "LingBotWorldCausalDMDPipeline": LINGBOT,
    }
    assert {s.plugin for s in stages.values()} == {"causalkv.builtin"}
    assert [p for p, s in stages.items() if s.lingbot] == ["LingBotWorldCausalDMDPipeline"]


@pytest.mark.parametrize(
    ("allow", "registered"), [("causalkv", True), ("someone-else", False), ("a, causalkv ,b", True)]
)
def test_sglang_plugins_allow_list(monkeypatch, allow, registered):
    monkeypatch.setenv("SGLANG_PLUGINS", allow)
    with _fresh_registration():
        sgl_plugins.load_plugins()
        assert bool(_causalkv_hooks()) is registered


@pytest.mark.parametrize("value", ["0", "false", "off", "NO"])
def test_off_switch_registers_only_the_warning_observer_and_says_why(monkeypatch, caplog, value):
    """Off: none of the bridge's hooks, only `OFF_HOOKS` (it warns, it changes nothing)."""
    monkeypatch.setenv(bridge.ENV_SWITCH, value)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    with _fresh_registration(), caplog.at_level(logging.INFO, logger="causalkv.sglang"):
        sgl_plugins.load_plugins()
        found = _causalkv_hooks()
        assert {t: [h[1] for h in hooks] for t, hooks in found.items()} == {
            target: [hook] for target, hook in OFF_HOOKS
        }
    lines = [r.getMessage() for r in caplog.records if r.name == "causalkv.sglang"]
    assert lines == [f"causalkv sglang bridge off: {bridge.ENV_SWITCH}={value}"]


def test_register_without_sglangs_plugin_api_does_nothing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "sglang.multimodal_gen.runtime.platforms.plugins", None)
    with caplog.at_level(logging.INFO, logger="causalkv.sglang"):
        assert bridge.register() is False
    lines = [r.getMessage() for r in caplog.records if r.name == "causalkv.sglang"]
    assert len(lines) == 1 and lines[0].startswith("causalkv sglang bridge not registered: cannot import")


def test_register_with_a_different_plugin_api_does_nothing(monkeypatch, caplog):
    import types

    fake = types.ModuleType("fake_plugins")
    fake.plugin_hook = sgl_plugins.plugin_hook
    fake.HookType = type("HookType", (), {"BEFORE": 1})  # no AROUND
    monkeypatch.setitem(sys.modules, "sglang.multimodal_gen.runtime.platforms.plugins", fake)
    with caplog.at_level(logging.INFO, logger="causalkv.sglang"):
        assert bridge.register() is False
    assert [r.getMessage() for r in caplog.records if r.name == "causalkv.sglang"] == [
        "causalkv sglang bridge not registered: sglang.multimodal_gen.runtime.platforms.plugins "
        "has no plugin_hook/HookType.AROUND"
    ]


def test_importing_causalkv_never_imports_sglang():
    code = (
        "import sys, causalkv, causalkv.caches, causalkv.sglang, causalkv.sglang.hooks\n"
        "bad = sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
