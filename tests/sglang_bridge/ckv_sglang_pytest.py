"""pytest plugin for the sglang environment: the torchvision shim, then sglang's own plugin
lifecycle (``load_plugins()``, ``apply_plugin_hooks()``), which discovers causalkv through its
entry point and applies the bridge's hooks before any test runs.

The shim is installed at import: ``-p`` plugins are imported before the conftest files of
sglang's test tree, which import sglang (and so torchvision)."""

from __future__ import annotations

import tvshim

tvshim.install()


def pytest_configure(config) -> None:
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins

    load_plugins()
    apply_plugin_hooks()
