"""pytest plugin for the sglang environment: the torchvision shim, then sglang's own plugin
lifecycle (``load_plugins()``, ``apply_plugin_hooks()``), which discovers causalkv through its
entry point and applies the bridge's hooks before any test module imports sglang's stages."""

from __future__ import annotations

import tvshim


def pytest_configure(config) -> None:
    tvshim.install()
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins

    load_plugins()
    apply_plugin_hooks()
