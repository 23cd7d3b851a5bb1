"""``make run-vllm-omni``: vLLM-Omni's offline entry point on a CPU, ``Omni(model=DIR).generate``
on the tiny LingBot-World checkpoint (``causalkv vllm-omni-checkpoint``, RANDOM weights), once
per setting of causalkv's store (off, int4, int2), and one table.

What runs is vLLM-Omni 0.30.0's own path: ``Omni`` -> its engine and orchestrator -> the
single diffusion stage (inline client, uniproc executor, ``DiffusionWorker``, model runner) ->
``DiffusersPipelineLoader`` (builds the pipeline, loads the folder's weights) -> LingBot's
pre-process, request-mode DMD blocks (four probes and a commit each), VAE decode and
post-process. Two stand-ins: the CPU ones of ``cpu_stand_ins/`` (on ``PYTHONPATH``: vLLM-Omni
has no CPU platform) and ``tiny_pipeline.TinyLingBotWorldPipeline``, registered with vLLM-Omni's
``register_diffusion_model`` and named by ``model_class_name``: causalkv's pipeline with the
DiT built at the checkpoint's geometry, which vLLM-Omni's ``from_config`` refuses (it takes
LingBot-World v2's 40 x 40 x 128 only).

The setting is the stage's ``model_config`` (``causalkv_kv_cache``), fixed when the engine
starts, so each setting is one ``Omni`` instance, one after the other in this one process (the
imports, most of the time, are paid once), each shut down before the next starts. Same request
and seed for all. ``stock`` (``--settings stock,...``) is an instance without
``causalkv_kv_cache``: vLLM-Omni's own ``LingBotAttentionCache``.

The table: per run, the cache class (from the pipeline's log line), the KV bytes from the
request's ``causalkv kv-cache summary`` line (peak and resident, all layers) against vLLM-Omni's
dense cache for the same request, and the video's PSNR against the ``off`` run's, which on
random weights is drift, not quality. ``--json FILE`` writes the runs for the test.

    PYTHONPATH=demo/vllm_omni/cpu_stand_ins .venv-vllm-omni/bin/python demo/vllm_omni/run_offline.py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

#: latent frames per block (LingBot) and the VAE's temporal factor: num_frames for N blocks
_BLOCK, _TEMPORAL = 3, 4


def choices() -> tuple[str, ...]:
    """What ``--settings`` takes: ``stock`` (no causalkv_kv_cache) or a ``kv_cache_quant`` value
    (``off`` or any codec setting registered, a plugin's too: the plugins are loaded first)."""
    from causalkv.caches.qvg.options import quant_choices
    from causalkv.plugin import collect

    collect()
    return ("stock", *quant_choices())


SEED = 42


class _Lines(logging.Handler):
    """Keeps causalkv's pipeline log lines (the worker runs in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _actions(root: Path, frames: int) -> None:
    """A camera trajectory in vLLM-Omni's format (``poses.npy`` [F, 4, 4], ``intrinsics.npy``
    [F, 4]) under ``root/walk``: a slow walk forward."""
    import numpy as np

    (root / "walk").mkdir(parents=True, exist_ok=True)
    poses = np.stack([np.eye(4, dtype=np.float32)] * frames)
    poses[:, 2, 3] = np.linspace(0.0, 1.0, frames, dtype=np.float32)
    np.save(root / "walk" / "poses.npy", poses)
    np.save(root / "walk" / "intrinsics.npy", np.tile(np.float32([50, 50, 32, 32]), (frames, 1)))


def _video(out):
    """The generated video as one array, wherever the output keeps it."""
    import numpy as np

    for value in (getattr(out, "multimodal_output", None) or {}).values():
        if hasattr(value, "shape"):
            return np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
        if isinstance(value, list) and value and hasattr(value[0], "shape"):
            return np.stack([np.asarray(v) for v in value])
    if getattr(out, "images", None):
        return np.stack([np.asarray(v) for v in out.images])
    raise RuntimeError(f"no video in the output: {out!r}")


def psnr(x, ref) -> float:
    """PSNR in dB of ``x`` against ``ref`` over ``ref``'s value range (inf when equal)."""
    import numpy as np

    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    mse = float(np.mean((x - ref) ** 2))
    span = float(ref.max() - ref.min())
    return float("inf") if mse == 0 else 10 * float(np.log10(span * span / mse))


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                  ).rstrip()
        for r in rows
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="off,int4,int2",
                        help="comma-separated runs, each stock or a kv_cache_quant value "
                             "(default off,int4,int2; the PSNR needs off)")
    parser.add_argument("--blocks", type=int, default=4, help="causal blocks of 3 latent frames")
    parser.add_argument("--dir", help="checkpoint folder, kept (default: a temporary one, removed)")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    settings, known = args.settings.split(","), choices()
    if not settings or any(s not in known for s in settings) or len(set(settings)) != len(settings):
        parser.error(f"--settings: distinct names from {', '.join(known)}, got {args.settings!r}")
    work = Path(tempfile.mkdtemp(prefix="causalkv-vo-offline-"))
    try:
        return _run(args, settings, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _generate(folder: Path, work: Path, setting: str, num_frames: int, lines: _Lines) -> dict:
    """One ``Omni`` instance for ``setting``, one request, shut down: the run's record."""
    import numpy as np
    import PIL.Image
    import tiny_pipeline
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    model_config = {"lingbot_action_root": str(work / "actions")}
    if setting != "stock":
        model_config["causalkv_kv_cache"] = {"kv_cache_quant": setting}
    lines.lines.clear()
    start = time.perf_counter()
    omni = Omni(model=str(folder), model_class_name=tiny_pipeline.ARCH, dtype="float32",
                enforce_eager=True, stage_init_timeout=600, model_config=model_config)
    ready = time.perf_counter()
    image = PIL.Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8"))
    params = OmniDiffusionSamplingParams(height=64, width=64, num_frames=num_frames, seed=SEED,
                                         num_inference_steps=4, extra_args={"action_path": "walk"})
    try:
        outs = omni.generate([{"prompt": "a fox trots through fresh snow",
                               "multi_modal_data": {"image": image}}], [params], use_tqdm=False)
    finally:
        omni.shutdown()
        _undecorate()
    done = time.perf_counter()
    summary = [line for line in lines.lines if line.startswith("causalkv kv-cache summary:")]
    installed = [line for line in lines.lines if line.startswith("causalkv: LingBotWorldCausalDMDPipeline")]
    video = _video(outs[0])
    return {
        "setting": setting, "outputs": len(outs), "video_shape": list(video.shape), "video": video,
        "installed": installed, "summary": summary,
        "fields": dict(re.findall(r"(\w+)=(\S+)", summary[0])) if len(summary) == 1 else {},
        "init_s": round(ready - start, 1), "generate_s": round(done - ready, 1),
    }


def _undecorate() -> None:
    """Takes back the ``(DiffusionWorker pid=...)`` prefix vLLM's ``decorate_logs`` put on this
    process's stdout and stderr (the worker runs in process), so the table prints as is."""
    for stream in (sys.stdout, sys.stderr):
        if "_original_write" in vars(stream):
            del stream.write, stream._original_write


def _say(text: str) -> None:
    print(textwrap.fill(text, 100, break_on_hyphens=False))


def _cache_class(run: dict) -> str:
    if run["setting"] == "stock":
        return "vLLM-Omni LingBotAttentionCache"
    return f"causalkv {run['fields'].get('cache', '?')}"


def _rows(runs: list[dict]) -> list[tuple[str, ...]]:
    from causalkv.runtime.host.compare_step import bytes_ratio

    ref = next((r["video"] for r in runs if r["setting"] == "off"), None)
    rows = [("setting", "KV cache class", "KV peak", "vLLM-Omni dense peak", "peak vs dense",
             "KV resident", "vLLM-Omni dense", "resident vs dense", "video PSNR vs off: drift (*)")]
    for run in runs:
        f = run["fields"]
        p = None if ref is None else psnr(run["video"], ref)
        drift = "-" if p is None else "identical" if p == float("inf") else f"{p:.1f} dB"
        if not f:  # stock: vLLM-Omni's cache logs no summary; its bytes are the dense columns
            rows.append((run["setting"], _cache_class(run), "-", "-", "", "-", "-", "", drift))
            continue
        peak, dense_peak = int(f["peak_bytes"]), int(f["dense_peak_bytes"])
        resident, dense = int(f["resident_bytes"]), int(f["dense_bytes"])
        rows.append((run["setting"], _cache_class(run), f"{peak:,}", f"{dense_peak:,}",
                     bytes_ratio(dense_peak, peak), f"{resident:,}", f"{dense:,}",
                     bytes_ratio(dense, resident), drift))
    return rows


def _run(args: argparse.Namespace, settings: list[str], work: Path) -> int:
    from causalkv.runtime.tools.checkpoints import build_checkpoint

    num_frames = (args.blocks * _BLOCK - 1) * _TEMPORAL + 1
    _actions(work / "actions", num_frames)  # vLLM-Omni wants a pose per video frame at least
    folder = build_checkpoint("lingbot-world", args.dir or work / "lingbot", host="vllm-omni")
    lines = _Lines()
    logging.getLogger("causalkv.vllm_omni.pipeline").addHandler(lines)

    import tiny_pipeline

    tiny_pipeline.register()
    runs = []
    for setting in settings:
        run = _generate(folder, work, setting, num_frames, lines)
        print(f"Omni(model={str(folder)!r}, model_class_name={tiny_pipeline.ARCH!r}) {setting}: "
              f"engine up in {run['init_s']} s, request {run['generate_s']} s, video "
              f"{run['video_shape']}", flush=True)
        print(*run["installed"], *run["summary"], sep="\n", flush=True)
        runs.append(run)
    rows = _rows(runs)
    print()
    _say(f"causalkv inside vLLM-Omni 0.30.0, through its offline entry point Omni(model=DIR)."
          f"generate: tiny LingBot-World checkpoint with RANDOM weights (2 layers x 2 heads x 64, "
          f"float32; {args.blocks} blocks of 3 latent frames = {num_frames} video frames of 64x64, "
          f"16 tokens per latent frame, sink 3 / window 9 frames; seed {SEED}); KV bytes are all "
          "layers' self-attention K/V")
    print(_table(rows))
    _say("KV peak: the most the request's stores held at once plus the largest visible K/V one "
          "attention call built; dense: vLLM-Omni's dense cache for the same request (its "
          "[B, max_tokens, H, D] K and V per layer, allocated whole); dense peak: that plus the "
          "same visible K/V. At this size the sink, one older chunk and the current one fill the "
          "window and the current and keep-recent chunks stay unpacked, so little is packed; at "
          "LingBot-World's geometry see `causalkv memory lingbot --host vllm-omni`.")
    _say("(*) the weights are random: the PSNR says how far each setting's video drifts from "
          "off's on the same request and seed, not how good a video is.")
    if args.json:
        ref = {r["setting"]: r["video"] for r in runs}
        Path(args.json).write_text(json.dumps({
            "blocks": args.blocks, "num_frames": num_frames, "rows": rows,
            "runs": [{k: v for k, v in r.items() if k != "video"} for r in runs],
            # None where identical (JSON has no inf); only with an off run
            "psnr_vs_off": {s: (None if (p := psnr(v, ref["off"])) == float("inf") else p)
                            for s, v in ref.items()} if "off" in ref else {},
            "equal_to_stock": {s: bool((v == ref["stock"]).all()) for s, v in ref.items()}
            if "stock" in ref else {},
        }) + "\n")
    ok = all(r["outputs"] == 1 and len(r["installed"]) == 1
             and len(r["summary"]) == (0 if r["setting"] == "stock" else 1) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
