"""``causalkv generate``: streaming chunk-by-chunk video generation on a preset or a folder."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from causalkv import quant_config as qvg_args
from causalkv.config import DTYPES, ServerArgs
from causalkv.errors import CausalKVError

__all__ = ["add_generate_args", "compare_table", "options_from_args", "register", "run_generate"]


def _preset_names() -> str:
    from causalkv.plugin import collect, get_plugin_manager

    try:
        return ", ".join(collect(get_plugin_manager()).presets())
    except CausalKVError:  # a plugin conflict: `generate` reports it when it runs
        return "see causalkv plugins"


def add_generate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``generate`` flags (model, prompts, frames, stream overrides, QVG, output)."""
    from causalkv.runtime.generate import DEFAULT_PROMPT

    parser.add_argument(
        "--model", default="tiny-wan",
        help=f"preset ({_preset_names()}) or a diffusers-format Wan folder "
        "(default: tiny-wan; preset weights are random)",
    )
    parser.add_argument(
        "--prompt", action="append", dest="prompts", metavar="TEXT",
        help="prompt of one shot; repeat for several shots (frames split evenly, shots after "
        f"the first are scene cuts). Default: {DEFAULT_PROMPT!r}",
    )
    parser.add_argument("--negative-prompt", default=None, help="negative CFG prompt (model default)")
    parser.add_argument("--frames", type=int, default=None,
                        help="latent frames, a multiple of the model's frames per chunk "
                        "(default: the model's default_frames)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the noise (default: 0)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                        help="transformer and KV-cache dtype (default: bfloat16)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=DTYPES,
                        help="KV-cache dtype when it differs from --dtype (e.g. --dtype float32 "
                        "--kv-cache-dtype bfloat16 on CPUs without bf16 instructions)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--sink-frames", type=int, default=None, help="override the sink (frames)")
    parser.add_argument("--window-frames", type=int, default=None,
                        help="override the attention window (frames, sink included)")
    parser.add_argument("--recent-window-frames", type=int, default=None,
                        help="recent-window sampling: frames before the chunk a chunk sees")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="classifier-free guidance scale (LongLive 2.0; model default)")
    parser.add_argument("--stage", default=None, help="force a stage by registration name")
    parser.add_argument("--cache", default=None, help="force a cache factory by name (dense, qvg, ...)")
    qvg_args.add_cli_args(parser)
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="video file (.mp4 via imageio-ffmpeg, .gif; default: "
                        "out/<model>.mp4)")
    parser.add_argument("--no-video", action="store_true", help="skip decoding and writing the video")
    parser.add_argument("--metrics", default=None, metavar="FILE", help="write the metrics JSON here")
    parser.add_argument("--compare-bf16", action="store_true",
                        help="also run with kv-cache-quant off (same seed) and report latent_psnr_db")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def register(subparsers: Any) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="generate a video chunk by chunk (causal KV cache chosen by the plugin system)",
        description=(
            "Generate a video chunk by chunk with a causal Wan transformer. The stage and the "
            "KV cache are resolved from the model and the flags before any weights load."
        ),
    )
    add_generate_args(p)
    p.set_defaults(func=run_generate)


def options_from_args(args: argparse.Namespace) -> Any:
    """`GenerateOptions` from parsed ``generate`` arguments (validates the QVG flags)."""
    from causalkv.runtime.generate import DEFAULT_PROMPT, GenerateOptions

    server_args = ServerArgs(
        kv_cache_quant_config=qvg_args.from_namespace(args),
        sink_frames=args.sink_frames,
        window_frames=args.window_frames,
        recent_window_frames=args.recent_window_frames,
        cache=args.cache,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    output = None
    if not args.no_video:
        output = args.output or str(Path("out") / f"{Path(str(args.model)).name}.mp4")
    return GenerateOptions(
        model=args.model,
        prompts=args.prompts if args.prompts is not None else [DEFAULT_PROMPT],
        frames=args.frames,
        server_args=server_args,
        guidance_scale=args.guidance_scale,
        negative_prompt=args.negative_prompt,
        stage=args.stage,
        compare_bf16=args.compare_bf16,
        output=output,
        quiet=args.quiet,
    )


def compare_table(metrics: dict[str, Any]) -> str:
    """The end-of-run summary of a ``--compare-bf16`` run: KV bytes, latent PSNR and seconds
    per chunk of the quantized run next to the unquantized reference (same seed).

    Reads ``kv_resident_bytes_max``, ``reference_kv_resident_bytes_max``,
    ``latent_psnr_db``, ``seconds_per_chunk_mean`` and ``reference_seconds_per_chunk_mean``.
    """
    quant = str(metrics.get("kv_cache_quant", "quantized")).split("(", 1)[-1].split(",")[0]
    ref_name = f"off ({metrics.get('kv_cache_dtype', metrics.get('dtype', 'bfloat16'))})"
    ref_b, q_b = metrics["reference_kv_resident_bytes_max"], metrics["kv_resident_bytes_max"]
    ref_s, q_s = metrics["reference_seconds_per_chunk_mean"], metrics["seconds_per_chunk_mean"]
    psnr = metrics["latent_psnr_db"]
    rows = [
        ("", ref_name, quant, "ratio"),
        ("KV bytes (max resident)", f"{ref_b:,}", f"{q_b:,}", f"{ref_b / max(1, q_b):.2f}x smaller"),
        ("latent PSNR vs off", "-", "identical" if psnr is None else f"{psnr:.1f} dB", ""),
        ("seconds per chunk", f"{ref_s:.2f}", f"{q_s:.2f}", f"{q_s / ref_s:.2f}x time"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    )


def run_generate(args: argparse.Namespace) -> int:
    """Entry of ``causalkv generate``: 0 on success, 2 on bad input (message on stderr)."""
    from causalkv.runtime.generate import generate

    try:
        options = options_from_args(args)
        metrics, _run = generate(options, log=print)
    except CausalKVError as exc:
        print(f"causalkv generate: error: {exc}", file=sys.stderr)
        return 2
    s = metrics["seconds_per_chunk"]
    print(
        f"done: {metrics['chunks']} chunks, {sum(s) / len(s):.3f} s/chunk, KV resident max "
        f"{metrics['kv_resident_bytes_max']:,} B, final {metrics['kv_resident_bytes_final']:,} B"
    )
    if args.metrics:
        path = Path(args.metrics)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=2, allow_nan=False) + "\n")
        print(f"metrics: {path}")
    if "reference_kv_resident_bytes_max" in metrics:
        print(compare_table(metrics))
    return 0
