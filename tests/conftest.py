"""Shared test settings and fixtures: hypothesis profiles, ``causalkv_home``, ``pm``.

Profiles (``HYPOTHESIS_PROFILE=<name>`` picks one; ``CI`` set forces ``ci``; default ``ci``):

- ``ci``: full example counts (the dense-cache contract suite runs >= 2,000 sequences),
  no deadline. The default, so that the README's test command always runs the full count.
- ``dev``: a quick local pass with a tenth of the examples (``oracle.examples``).

Torch runs on one thread in every test process (the suite's ops are tiny, and ``-n 2`` already
gives each core a worker: a second thread per worker only waits on a busy core, at many times
the CPU). The processes a test starts get one too (``OMP_NUM_THREADS=1`` unless given); the
torchrun tests take it out of their jobs' environment, so causalkv's launcher still sets it for
its ranks as it does for a user (tests/test_cli_faults_parallel.py checks torchrun's banner).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from causalkv.plugin.testing import fresh_plugin_manager

for _name in ("ci", "dev"):
    settings.register_profile(
        _name, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
    )
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=False)
def causalkv_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A session-wide temporary CAUSALKV_HOME (presets are created there once)."""
    home = str(tmp_path_factory.mktemp("causalkv-home"))
    old = os.environ.get("CAUSALKV_HOME")
    os.environ["CAUSALKV_HOME"] = home
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("CAUSALKV_HOME", None)
        else:
            os.environ["CAUSALKV_HOME"] = old


@pytest.fixture
def pm() -> Any:
    """A fresh plugin manager: the built-in plugin only, no autoload."""
    return fresh_plugin_manager()


# ---- the fault tests' fixtures (tests/fault_helpers.py) ----------------------------------------
@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The command line's plugin manager: the built-in plugin plus a chunk counter."""
    from fault_helpers import ChunkCounter

    import causalkv.plugin.manager as plugin_manager

    pm = fresh_plugin_manager()
    c = ChunkCounter()
    pm.register_plugin(c, "chunk-counter")
    monkeypatch.setattr(plugin_manager, "_default", pm)
    return c


@pytest.fixture
def empty_home(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An empty CAUSALKV_HOME of its own (a refused request must leave it empty)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("CAUSALKV_HOME", str(home))
    return home


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every attempt to build a preset or load weights (it then fails)."""
    from fault_helpers import runtime_load

    calls: list[str] = []

    def refuse(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called for a request refused up front")

        return fn

    monkeypatch.setattr(runtime_load, "load_components", refuse("load_components"))
    monkeypatch.setattr(runtime_load, "materialize_preset", refuse("materialize_preset"))
    return calls
