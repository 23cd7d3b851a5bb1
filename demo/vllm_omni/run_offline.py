"""vLLM-Omni's offline entry point on a CPU: ``Omni(model=DIR).generate(...)`` on the tiny
LingBot-World checkpoint (``causalkv vllm-omni-checkpoint``), causalkv's store inside.

What runs is vLLM-Omni 0.30.0's own path: ``Omni`` -> its engine and orchestrator -> the
single diffusion stage (inline client, uniproc executor, ``DiffusionWorker``, model runner) ->
``DiffusersPipelineLoader`` (builds the pipeline, loads the folder's weights) -> LingBot's
pre-process, request-mode DMD blocks (four probes and a commit each), VAE decode and
post-process. Two stand-ins: the CPU ones of ``cpu_stand_ins/`` (on ``PYTHONPATH``: vLLM-Omni
has no CPU platform) and ``tiny_pipeline.TinyLingBotWorldPipeline``, registered with vLLM-Omni's
``register_diffusion_model`` and named by ``model_class_name``: causalkv's pipeline with the
DiT built at the checkpoint's geometry, which vLLM-Omni's ``from_config`` refuses (it takes
LingBot-World v2's 40 x 40 x 128 only). Weights are RANDOM: the video is noise.

Prints the request's ``causalkv kv-cache summary`` line (logged by causalkv's pipeline in the
worker) and the video's shape; ``--json FILE`` writes them for the test.

    PYTHONPATH=demo/vllm_omni/cpu_stand_ins .venv-vllm-omni/bin/python demo/vllm_omni/run_offline.py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

#: latent frames per block (LingBot) and the VAE's temporal factor: num_frames for N blocks
_BLOCK, _TEMPORAL = 3, 4


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


def _video_shape(out) -> list[int]:
    """The generated video's shape, wherever the output keeps it."""
    import numpy as np

    for value in (getattr(out, "multimodal_output", None) or {}).values():
        if hasattr(value, "shape"):
            return list(value.shape)
        if isinstance(value, list) and value and hasattr(value[0], "shape"):
            return [len(value), *np.asarray(value[0]).shape]
    if getattr(out, "images", None):
        return [len(out.images), *np.asarray(out.images[0]).shape]
    raise RuntimeError(f"no video in the output: {out!r}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quant", default="int2", choices=("off", "int4", "int2"),
                        help="model_config.causalkv_kv_cache.kv_cache_quant (default int2)")
    parser.add_argument("--blocks", type=int, default=4, help="causal blocks of 3 latent frames")
    parser.add_argument("--dir", help="checkpoint folder, kept (default: a temporary one, removed)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="causalkv-vo-offline-"))
    try:
        return _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    import numpy as np
    import PIL.Image

    from causalkv.cli.vllm_omni_checkpoint import build

    num_frames = (args.blocks * _BLOCK - 1) * _TEMPORAL + 1
    _actions(work / "actions", num_frames)  # vLLM-Omni wants a pose per video frame at least
    folder, _ = build(args.dir or work / "lingbot")
    lines = _Lines()
    logging.getLogger("causalkv.vllm_omni.pipeline").addHandler(lines)

    import tiny_pipeline
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    tiny_pipeline.register()
    start = time.perf_counter()
    omni = Omni(model=str(folder), model_class_name=tiny_pipeline.ARCH, dtype="float32",
                enforce_eager=True, stage_init_timeout=600,
                model_config={"causalkv_kv_cache": {"kv_cache_quant": args.quant},
                              "lingbot_action_root": str(work / "actions")})
    ready = time.perf_counter()
    image = PIL.Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8"))
    params = OmniDiffusionSamplingParams(height=64, width=64, num_frames=num_frames,
                                         num_inference_steps=4, extra_args={"action_path": "walk"})
    try:
        outs = omni.generate([{"prompt": "a fox trots through fresh snow",
                               "multi_modal_data": {"image": image}}], [params], use_tqdm=False)
    finally:
        omni.shutdown()
    done = time.perf_counter()
    summary = [line for line in lines.lines if line.startswith("causalkv kv-cache summary:")]
    installed = [line for line in lines.lines if "self-attention cache" in line]
    result = {
        "pipeline": tiny_pipeline.ARCH, "quant": args.quant, "blocks": args.blocks,
        "num_frames": num_frames, "video_shape": _video_shape(outs[0]), "outputs": len(outs),
        "installed": installed, "summary": summary,
        "init_s": round(ready - start, 1), "generate_s": round(done - ready, 1),
    }
    print(f"vLLM-Omni's offline entry point on a CPU: Omni(model={str(folder)!r}, "
          f"model_class_name={tiny_pipeline.ARCH!r}), {args.blocks} blocks, RANDOM weights")
    print(*installed, sep="\n")
    print(*summary, sep="\n")
    print(f"video {result['video_shape']} ({num_frames} frames of 64x64); engine up in "
          f"{result['init_s']} s, request {result['generate_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")
    return 0 if len(summary) == 1 and len(installed) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
