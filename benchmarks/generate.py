"""End to end: a whole generation per stage with the KV cache off, int4 and int2, side by side.

For each built-in stage (``self-forcing-wan``, ``longlive``, ``longlive2``, ``lingbot-world``) this writes a model
folder with seeded random weights into a temporary ``CAUSALKV_HOME`` (nothing downloads),
plans the request with `plan_generation` (the plugin manager resolves stage and cache), loads
the components once and runs the same request (same seed) with ``--kv-cache-quant`` off, int4
and int2 through `run_plan`. Per run it reports:

- ``seconds_per_chunk``: mean wall time of a chunk (all denoising steps, the context pass and,
  with int4/int2, the packing of cold chunks), chunk 0 excluded (warm-up);
- ``kv_peak_bytes``: the largest resident KV bytes after any chunk (all layers, CFG branches);
- ``rss_peak_bytes``: peak resident set size (``ru_maxrss``) of a fresh process that loads the
  components and runs that one mode (each mode runs in its own process, so no run inherits
  another's allocations);
- each as a ratio to ``off`` measured in the same process (``time_ratio``, ``kv_ratio``,
  ``rss_ratio``).

Geometry (`GEOMETRY`): every stage keeps its real frames per chunk and sink. LongLive 2.0 runs
its real 880 tokens per frame (352x640 through this host's x8 VAE, as 704x1280 through Wan 2.2's
x16 VAE): 7,040 tokens per 8-frame chunk, two shots (the second opens with a pinned scene cut),
CFG 3.0. The 480x832 models run a quarter of their real tokens (240x416: 390 per frame, 1,170
per 3-frame chunk). Every stage has a window of four chunks, 1 transformer layer of 2 heads x
64 channels, the real 4 denoising steps plus the context pass, float32 compute over bf16 caches.
``--quick`` runs the tiny presets' 64x64 geometry (16 tokens per frame) for
a CI-sized smoke run. ``--stage`` picks stages.

Run: ``.venv/bin/python benchmarks/generate.py [--quick] [--stage longlive2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from causalkv.caches.qvg.options import QVGKVQuantArgs  # noqa: E402
from causalkv.config import ServerArgs  # noqa: E402
from causalkv.hooks import Preset  # noqa: E402
from causalkv.runtime.host.pipeline_records import GenerateOptions  # noqa: E402
from causalkv.runtime.host.plan_step import plan_generation  # noqa: E402
from causalkv.runtime.host.run_step import run_plan  # noqa: E402
from causalkv.runtime.model_io.presets import write_preset_folder  # noqa: E402

MODES: dict[str, int | None] = {"off": None, "int4": 4, "int2": 2}


@dataclass(frozen=True)
class Geometry:
    """One stage's benchmark stream (frames; pixels = tokens per side x 16)."""

    stage: str
    height: int
    width: int
    frames_per_chunk: int
    sink_frames: int
    window_frames: int
    chunks: int
    global_sink_frames: int | None = None
    recent_window_frames: int | None = None
    guidance_scale: float = 1.0
    shots: int = 1

    @property
    def tokens_per_frame(self) -> int:
        return (self.height // 16) * (self.width // 16)

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk

    def settings(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "height": self.height, "width": self.width, "frames_per_chunk": self.frames_per_chunk,
            "sink_frames": self.sink_frames, "window_frames": self.window_frames,
            "default_frames": self.chunks * self.frames_per_chunk,
            "guidance_scale": self.guidance_scale,
        }
        if self.global_sink_frames is not None:
            s["global_sink_frames"] = self.global_sink_frames
            s["rope_offset_frames_per_shot"] = self.frames_per_chunk
        if self.recent_window_frames is not None:
            s["recent_window_frames"] = self.recent_window_frames
        return s


GEOMETRY = (
    Geometry("self-forcing-wan", 240, 416, 3, 0, 12, 6),
    Geometry("longlive", 240, 416, 3, 3, 12, 6, shots=2),
    Geometry("longlive2", 352, 640, 8, 8, 32, 6, global_sink_frames=8, guidance_scale=3.0, shots=2),
    Geometry("lingbot-world", 240, 416, 3, 3, 12, 6, recent_window_frames=6),
)


def quick(g: Geometry) -> Geometry:
    """The CI-sized variant: 64x64 pixels (16 tokens per frame), 4 chunks, window of 3 chunks."""
    f = g.frames_per_chunk
    return replace(
        g, height=64, width=64, window_frames=3 * f, chunks=4,
        sink_frames=min(g.sink_frames, f),
        global_sink_frames=None if g.global_sink_frames is None else min(g.global_sink_frames, f),
        recent_window_frames=None if g.recent_window_frames is None else f,
    )


PROMPTS = ("A red fox trots through fresh snow at dawn", "A neon-lit city street at night in the rain")


def _registration(stage: str) -> Any:
    from causalkv.plugin import collect, get_plugin_manager

    return collect(get_plugin_manager()).stage(stage).registration


def _options(folder: Path, g: Geometry, bits: int | None) -> GenerateOptions:
    quant = QVGKVQuantArgs() if bits is None else QVGKVQuantArgs(codec=f"int{bits}")
    args = ServerArgs(dtype="float32", kv_cache_dtype="bfloat16", options=[quant])
    return GenerateOptions(model=str(folder), prompts=list(PROMPTS[: g.shots]), server_args=args, quiet=True)


def run_mode(folder: Path, g: Geometry, mode: str) -> dict[str, Any]:
    """One mode of one stage in this process: plan, load, run; its metrics (module docstring)."""
    torch.set_grad_enabled(False)
    plan = plan_generation(_options(folder, g, MODES[mode]))
    run = run_plan(plan)
    seconds = [float(s["seconds"]) for s in run.chunk_stats]
    timed = seconds[1:] or seconds
    return {
        "cache": plan.resolution.cache_factory.name,
        "seconds_per_chunk": sum(timed) / len(timed),
        "kv_peak_bytes": run.kv_resident_bytes_max,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "pinned_chunks": list(run.stage.report().get("pinned_chunks", [])),
    }


def bench_stage(g: Geometry, home: Path, *, layers: int = 1) -> dict[str, Any]:
    """Off / int4 / int2 runs of one stage's geometry, each in a fresh process; JSON-ready."""
    reg = _registration(g.stage)
    preset = Preset(f"bench-{g.stage}", g.settings(), seed=7,
                    transformer={"num_layers": layers, "num_attention_heads": 2})
    folder = write_preset_folder(preset, reg, home / preset.name)
    out: dict[str, Any] = {
        "geometry": {
            "tokens_per_frame": g.tokens_per_frame, "frames_per_chunk": g.frames_per_chunk,
            "tokens_per_chunk": g.tokens_per_chunk, "window_frames": g.window_frames,
            "sink_frames": g.sink_frames, "chunks": g.chunks, "shots": g.shots,
            "guidance_scale": g.guidance_scale, "layers": layers, "heads": 2, "head_dim": 64,
            "compute_dtype": "float32", "kv_dtype": "bfloat16", "threads": torch.get_num_threads(),
        },
    }
    for mode in MODES:
        spec = json.dumps({"folder": str(folder), "geometry": asdict(g), "mode": mode})
        proc = subprocess.run(
            [sys.executable, __file__, "--one", spec], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{g.stage} {mode} failed:\n{proc.stderr[-4000:]}")
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    off = out["off"]
    for mode in MODES:
        row = out[mode]
        row["time_ratio"] = row["seconds_per_chunk"] / off["seconds_per_chunk"]
        row["kv_ratio"] = row["kv_peak_bytes"] / off["kv_peak_bytes"]
        row["rss_ratio"] = row["rss_peak_bytes"] / off["rss_peak_bytes"]
    return out


def run(stages: list[str] | None = None, *, quick_run: bool = False) -> dict[str, Any]:
    """Every selected stage's `bench_stage` in a temporary ``CAUSALKV_HOME``; keyed by stage."""
    torch.set_grad_enabled(False)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="causalkv-bench-") as tmp:
        for g in GEOMETRY:
            if stages and g.stage not in stages:
                continue
            results[g.stage] = bench_stage(quick(g) if quick_run else g, Path(tmp))
    return results


def table(results: dict[str, Any]) -> str:
    lines = [f"{'stage':16s} {'tokens/chunk':>12s} {'mode':5s} {'s/chunk':>8s} {'time':>6s} "
             f"{'KV peak B':>12s} {'KV':>6s} {'RSS peak B':>12s} {'RSS':>6s}"]
    for stage, r in results.items():
        for mode in MODES:
            m = r[mode]
            lines.append(
                f"{stage:16s} {r['geometry']['tokens_per_chunk']:12,d} {mode:5s} "
                f"{m['seconds_per_chunk']:8.3f} {m['time_ratio']:5.2f}x {m['kv_peak_bytes']:12,d} "
                f"{m['kv_ratio']:5.2f}x {m['rss_peak_bytes']:12,d} {m['rss_ratio']:5.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run (64x64, 4 chunks)")
    p.add_argument("--stage", action="append", choices=[g.stage for g in GEOMETRY],
                   help="run only these stages (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one mode, JSON line
    args = p.parse_args(argv)
    if args.one is not None:
        spec = json.loads(args.one)
        row = run_mode(Path(spec["folder"]), Geometry(**spec["geometry"]), spec["mode"])
        print(json.dumps(row))
        return 0
    results = run(args.stage, quick_run=args.quick)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
