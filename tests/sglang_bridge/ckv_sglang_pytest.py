"""pytest plugin for the sglang environment: the torchvision stand-in
(``demo/sglang/cpu_stand_ins/tvshim.py``, which run.py puts on ``sys.path``), then sglang's own
plugin lifecycle (``load_plugins()``, ``apply_plugin_hooks()``), which discovers causalkv through
its entry point and applies the bridge's hooks before any test runs.

The stand-in is installed at import (a no-op when run.py's start-up already did): ``-p``
plugins are imported before the conftest files of sglang's test tree, which import sglang (and
so torchvision)."""

from __future__ import annotations

import tvshim

tvshim.install()


def pytest_configure(config) -> None:
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins

    load_plugins()
    apply_plugin_hooks()
