"""Helpers of the runtime / stage / generate tests: small float32 requests, plan-and-run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.config import ServerArgs
from causalkv.options import Options
from causalkv.runtime.host.pipeline_records import GenerateOptions, GenerationRun, Plan
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.host.run_step import run_plan

__all__ = ["make_options", "plan_and_run"]


def make_options(
    model: str,
    *,
    prompts: list[str] | None = None,
    frames: int | None = None,
    quant: str = "off",
    seed: int = 0,
    dtype: str = "float32",
    cache: str | None = None,
    options: Sequence[Options] = (),
    **server: Any,
) -> GenerateOptions:
    """Options for a small float32 run (float32 is the fast dtype on CPU); ``options``: the
    stage family's records (`ShotRequest`, `MotionOptions`, ...) next to the QVG settings."""
    args = ServerArgs(
        options=[QVGKVQuantArgs.from_codec_name(quant), *options],
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
