"""Shared fixtures and helpers of the runtime / stage / generate tests.

Imported by the other ``test_runtime*``, ``test_stages*``, ``test_generate*`` and
``test_attention_processor*`` modules (pytest puts ``tests/`` on ``sys.path``). Presets are
materialized once per test session (per xdist worker) into a temporary ``CAUSALKV_HOME``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from causalkv.caches.qvg.args import QVGKVQuantArgs
from causalkv.config import ServerArgs
from causalkv.plugin.testing import fresh_plugin_manager
from causalkv.runtime.generate import (
    GenerateOptions,
    GenerationRun,
    Plan,
    plan_generation,
    run_plan,
)

__all__ = ["causalkv_home", "make_options", "plan_and_run", "pm"]


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


def make_options(
    model: str,
    *,
    prompts: list[str] | None = None,
    frames: int | None = None,
    quant: str = "off",
    seed: int = 0,
    dtype: str = "float32",
    cache: str | None = None,
    **server: Any,
) -> GenerateOptions:
    """Options for a small float32 run (float32 is the fast dtype on CPU)."""
    args = ServerArgs(
        kv_cache_quant_config=QVGKVQuantArgs.from_bits_name(quant),
        seed=seed,
        dtype=dtype,
        cache=cache,
        **server,
    )
    return GenerateOptions(
        model=model,
        prompts=prompts or ["a lighthouse on a cliff at dusk"],
        frames=frames,
        server_args=args,
        quiet=True,
    )


def plan_and_run(options: GenerateOptions, pm: Any, **kw: Any) -> tuple[Plan, GenerationRun]:
    plan = plan_generation(options, pm=pm)
    return plan, run_plan(plan, pm=pm, **kw)


def test_fixture_home_is_temporary(causalkv_home: str) -> None:
    from causalkv.runtime.presets import causalkv_home as home

    assert str(home()) == causalkv_home
    assert os.path.basename(causalkv_home).startswith("causalkv-home")
