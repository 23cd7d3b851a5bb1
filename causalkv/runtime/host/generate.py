"""The reference host, as a pipeline: plan -> load -> run -> compare -> write.

`generate` runs the steps in order, each from its own module:

1. plan (`causalkv.runtime.host.plan_step.plan_generation`): read the model's config files, resolve the
   stage and the cache through the plugin registry, validate the request: every bad input is
   refused there, before any weights load;
2. load (`causalkv.runtime.host.load_step.load_for_plan`): the components, materializing a preset on
   first use, as one rank of a sequence-parallel job when the request is one;
3. run (`causalkv.runtime.host.run_step.run_plan`): build the stage (``causalkv_configure_stage`` applies
   to it before its caches are allocated) and run the chunk loop;
4. compare (`causalkv.runtime.host.compare_step.compare_unquantized`, ``--compare-bf16``): the same
   request without the cache's settings, and the latent PSNR;
5. write (`causalkv.runtime.host.write_step.write_files`): latents, video, metrics
   (`causalkv.runtime.host.report.run_report`, with the stage's own entries).

The records they pass along live in `causalkv.runtime.host.pipeline_records`; the plugins are collected once
per run (`PluginSet`) and travel in the plan. Sequence parallel (``server_args.heads_sharded =
N > 1``, N torchrun ranks): the plan refuses what cannot be split, every rank runs the same
steps and ends with the same latents, rank 0 alone logs and writes.

The host imports no model-specific module: everything a model family or a cache adds comes
from its registration and its option records. Each step's names are imported from the step's
own module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from causalkv.memory.records import format_bytes
from causalkv.runtime.host.compare_step import compare_unquantized
from causalkv.runtime.host.load_step import load_for_plan
from causalkv.runtime.host.pipeline_records import GenerateOptions, GenerationRun, Plan, PluginSet
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.host.report import (
    cache_description,
    describe_plan,
    run_report,
)
from causalkv.runtime.host.run_step import run_plan
from causalkv.runtime.host.write_step import write_files
from causalkv.runtime.model_io.prompt_encoding import warn_line
from causalkv.runtime.processes.distributed import is_main_rank
from causalkv.stages.records import ChunkStats

__all__ = ["generate"]


def generate(
    options: GenerateOptions,
    *,
    pm: Any = None,
    plugins: PluginSet | None = None,
    log: Callable[[str], None] | None = None,
    on_plan: Callable[[Plan], None] | None = None,
    on_chunk_done: Callable[[int, ChunkStats], None] | None = None,
    on_written: Callable[[Path], None] | None = None,
    on_loaded: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], GenerationRun]:
    """Plan, load, run, optionally compare with the run without the cache's settings, write.

    Returns ``(metrics, run)``. ``plugins``: the run's plugins, collected once (default: from
    ``pm``, default the process-wide manager). ``log`` receives the human-readable lines
    (stage, cache, reasons, where the video went); ``on_plan`` the validated plan,
    ``on_chunk_done`` each chunk of the main run (the command line counts them for its
    interruption message), ``on_loaded`` the end of the load, ``on_written`` each output
    file once it is complete. What the run changes of the request (`Plan.warnings`) and
    cache settings that packed nothing (`unused_cache_settings`) are one ``causalkv:
    warning:`` line each on stderr (rank 0). The first
    output that fails stops the run with `OutputWriteError` naming the files already
    written, which are kept (`causalkv.runtime.files.outputs.OutputLog`).
    """

    def say(line: str) -> None:  # rank 0 alone logs
        if log is not None and is_main_rank():
            log(line)

    started = time.perf_counter()
    plan = plan_generation(options, pm=pm, plugins=plugins)
    if on_plan is not None:
        on_plan(plan)
    for line in describe_plan(plan):
        say(line)
    for line in plan.warnings:
        warn_line(line)
    components = load_for_plan(plan)
    if on_loaded is not None:
        on_loaded()
    # the progress bar: off when quiet, on other ranks, or without a terminal
    bar = tqdm(total=plan.num_chunks, unit="chunk", desc="chunks",
               disable=options.quiet or not is_main_rank() or not sys.stderr.isatty())

    def chunk_done(i: int, stats: ChunkStats) -> None:
        bar.update(1)
        if on_chunk_done is not None:
            on_chunk_done(i, stats)

    try:
        run = run_plan(plan, components=components, on_chunk_done=chunk_done,
                       strict_plugins=options.strict_plugins, log=say)
    finally:
        bar.close()
    metrics = run_report(plan, run)
    unused = unused_cache_settings(plan, metrics)
    if unused is not None:
        warn_line(unused)
    if options.compare_bf16:
        say(f"reference run: kv-cache-quant off, {options.compare_dtype} caches, same seed")
        comparison = compare_unquantized(plan, run, reference_dtype=options.compare_dtype)
        metrics.update(comparison)
        psnr = comparison["latent_psnr_db"]
        say(
            "latent PSNR vs the unquantized run: "
            + ("identical" if psnr is None else f"{psnr:.2f} dB")
            + f"; KV bytes max {format_bytes(run.kv_resident_bytes_max)} vs "
            f"{format_bytes(comparison['reference_kv_resident_bytes_max'])}"
        )
    write_files(plan, run, options, metrics, started=started, say=say, on_written=on_written)
    return metrics, run


def unused_cache_settings(plan: Plan, metrics: dict[str, Any]) -> str | None:
    """The warning when the request gave the cache settings and the cache packed no chunk
    with them (``kv_packing``: ``chunks_packed`` 0): it held what an unquantized cache holds.
    The reasons are the cache's own (``chunks_dense``: reason -> chunk writes)."""
    packing = metrics.get("kv_packing")
    if not isinstance(packing, dict) or packing.get("chunks_packed", 1) != 0:
        return None
    reasons = packing.get("chunks_dense") or {}
    why = ", ".join(f"{n} {reason}" for reason, n in reasons.items()) or "none completed"
    return (
        f"the cache {plan.resolution.cache_factory.name!r} packed no chunk with its settings "
        f"({cache_description(plan.resolution)}): every chunk stayed unquantized (chunk writes "
        f"kept dense: {why}), so the run used the memory of an unquantized cache; change the "
        "settings named by those reasons (a smaller keep-recent count, fewer stages) or more --frames"
    )
