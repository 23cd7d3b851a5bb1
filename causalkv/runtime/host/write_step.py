"""Step 5 of `causalkv.runtime.host.generate`: write the run's files, in order ``--save-latents``,
``--output`` (the video, decoded with the model's VAE), ``--metrics``.

Each file is written atomically (`causalkv.runtime.files.outputs`); the first that fails stops the
step with `OutputWriteError` naming the files already complete, which are kept. On a
sequence-parallel run only rank 0 writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from causalkv.runtime.files.outputs import OutputLog, keep_latents, save_latents, write_json_atomic
from causalkv.runtime.files.video import decode_latents, write_video
from causalkv.runtime.host.load_step import model_folder
from causalkv.runtime.host.pipeline_records import GenerateOptions, GenerationRun, Plan
from causalkv.runtime.host.report import latents_metadata
from causalkv.runtime.model_io.components import load_vae
from causalkv.runtime.processes.distributed import is_main_rank

__all__ = ["write_files", "write_outputs"]


def write_outputs(plan: Plan, run: GenerationRun, output: str | Path, *, pm: Any = None) -> dict[str, Any]:
    """Decode the run's latents with the model's VAE and write the video; its metrics.

    The video is written atomically. If decoding or writing fails, the latents are saved to
    ``NAME.latents.safetensors`` next to ``output`` and `OutputWriteError` names that file.
    """
    device = run.components.device if run.components is not None else plan.server_args.device
    try:
        vae = load_vae(model_folder(plan.info, registry=plan.plugin_set(pm).registry), device=device)
        frames = decode_latents(vae, run.latents)
        written = write_video(frames, output, fps=plan.info.fps)
    except Exception as exc:  # noqa: BLE001 - a finished generation is kept whatever failed
        raise keep_latents(output, run.latents, exc, metadata=latents_metadata(plan)) from exc
    return {
        "output": str(written),
        "video_frames": int(frames.shape[0]),
        "video_size": [int(frames.shape[1]), int(frames.shape[2])],
    }


def write_files(
    plan: Plan,
    run: GenerationRun,
    options: GenerateOptions,
    metrics: dict[str, Any],
    *,
    started: float,
    say: Callable[[str], None],
    on_written: Callable[[Path], None] | None = None,
) -> None:
    """Write ``options``' files (latents, video, metrics) and add what they are to
    ``metrics`` (``latents``, ``output``, ``video_frames``, ``video_size``, then
    ``seconds_total`` since ``started``, a ``time.perf_counter()``, before the metrics file).
    ``on_written`` gets each file once it is complete; ``say`` the lines naming them."""
    outputs = OutputLog(on_written)
    main = is_main_rank()
    if options.save_latents is not None and main:
        path = options.save_latents
        metrics["latents"] = str(outputs.write(
            "--save-latents", path, lambda: save_latents(path, run.latents, latents_metadata(plan))
        ))
        say(f"latents: {metrics['latents']}")
    if options.output is not None and main:
        output = options.output
        video = outputs.write("--output", output, lambda: write_outputs(plan, run, output))
        metrics.update(video)
        h, w = video["video_size"]
        say(f"wrote {video['output']} ({video['video_frames']} frames, {w}x{h})")
    metrics["seconds_total"] = time.perf_counter() - started
    if options.metrics is not None and main:
        outputs.write("--metrics", options.metrics, lambda: write_json_atomic(options.metrics, metrics))
