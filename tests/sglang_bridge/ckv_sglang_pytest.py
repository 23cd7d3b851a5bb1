"""pytest plugin for the sglang environment: the torchvision stand-in
(``demo/sglang/cpu_stand_ins/tvshim.py``, which run.py puts on ``sys.path``), then sglang's own
plugin lifecycle (``load_plugins()``, ``apply_plugin_hooks()``), which discovers causalkv through
its entry point and applies the bridge's hooks before any test runs, and the deselection of
sglang's tests that assert a refusal the bridge removes (run.py's ``DESELECTED``).

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
    # sglang's test files lie outside the rootdir, so pyproject.toml's markers are not read
    config.addinivalue_line("markers", "slow: the longer runs of `make test-long`")


def pytest_collection_modifyitems(config, items) -> None:
    """Deselects run.py's ``DESELECTED`` tests of sglang's, matched by the file's path inside
    sglang's test package and the test's name: the package lies in a cached layer outside
    the checkout, where pytest's node ids (relative to the rootdir) are no stable key."""
    from run import DESELECTED, sglang_unit_dir

    unit = sglang_unit_dir()
    wanted = set(DESELECTED)
    keep, dropped = [], []
    for item in items:
        try:
            rel = item.path.relative_to(unit).as_posix()
        except ValueError:
            keep.append(item)
            continue
        name = "::".join([rel, *item.nodeid.split("::")[1:]])
        (dropped if name in wanted else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
