"""``causalkv memory MODEL``: the KV bytes of a request's caches per QVG setting, and a budget.

A front end of the planner `causalkv.memory` (pure arithmetic: no weights, no tensors).
Prints one row per setting (``--json``: a list of objects), and with ``--budget`` whether each
fits and the longest window (or video) that does. Every bad input ends the command with one
line on stderr naming the value and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from causalkv.caches.qvg.options import QVGKVQuantArgs, quant_choices
from causalkv.config import DTYPES
from causalkv.errors import CausalKVError, print_stderr
from causalkv.memory.geometry import BUILTIN_MODELS
from causalkv.memory.records import (
    ATTENTION,
    SETTINGS,
    MemoryRequest,
    attention_of,
    format_bytes,
    format_columns,
    parse_bytes,
)
from causalkv.runtime.model_io.geometry import resolve_model

if TYPE_CHECKING:
    from causalkv.memory.plan import MemoryPlan

__all__ = ["HOST_CACHES", "chosen_settings", "format_plan", "register"]

#: the one place a ``--host`` name maps to the cache the planner counts (a name in
#: `causalkv.memory.cache_models`: its cursor model, packing policy and centroid rule):
#: sglang's stages get the bridge's cache (sglang's slot arithmetic, keep-recent over non-sink
#: chunks, the centroids as given), causalkv generate its own ``QVGPackedCausalKVCache``
#: (``--host vllm-omni`` plans vLLM-Omni's sessions apart, `causalkv.vllm_omni.admission`)
HOST_CACHES = {"sglang": "ROLLING_SLOT_CACHE", "causalkv": "STREAM_CACHE"}


_COLUMNS = """\
columns (--json gives the same fields, in bytes, per setting):
  setting        the QVG setting (the rows below, the benchmark's names)
  kv_bytes       the most the stage's caches hold after any chunk's context pass, all
                 layers and CFG sets (the denoising passes are probes: they store
                 nothing; the context pass commits the chunk to its tier)
  peak_bytes     the most held at once over the request: while a chunk is generated,
                 the caches (the larger of the context before it and after it) plus
                 one layer's visible window gathered as one dense
                 buffer (the whole window once the cache is full); at most kv_bytes +
                 that window (--attention gathered: sglang's attention reads the
                 view that way, the default with --host sglang), or one packed
                 segment decoded at a time (--attention streamed: causalkv generate's
                 attention, the default with --host causalkv; its metric kv_peak_bytes)
  dense_bytes    what sglang's dense cache allocates for the same request: layers x sets
                 x 2 (K, V) x window tokens x heads x head_dim x 2 bytes (bf16)
  kv/dense, peak/dense   the ratios (the table only; --json: kv_ratio, peak_ratio)
  fits           (--budget) peak_bytes <= the budget
  max_window_frames      (--budget) the longest window, in latent frames (a multiple of
                 the chunk), whose full steady state fits the budget: the request is
                 lengthened to fill the window when it is shorter
  max_video_frames       (--budget, models whose cache holds the whole video, e.g.
                 self-forcing) the longest video, in latent frames, with the window = the
                 video, that fits
                 (">= N", --json at_search_limit: the search stops there and it still fits)

--json also gives transient_bytes (the window term above) and chunk_bytes (one layer's
chunk, dense).

settings (every one: 128 centroids, block 64, 1 stage, symmetric, sink packed unless
--kv-cache-quant-sink 0; a chunk is packed only where that stores fewer bytes; every codec
setting registered, a loaded plugin's too, has its -default and -recent0 rows):
"""

_MODELS = """

Out of scope: sequence-parallel and head-sliced caches (each rank holds its heads' share),
the cross-attention (text) cache, weights and activations.

built-in models:
""" + "\n".join(
    f"  {k:13s}  {g.describe()}, {g.height}x{g.width}, {g.frames_per_chunk}-frame chunks, sink "
    f"{g.sink_frames}, window {g.window_frames} frames, {g.default_frames} frames by default"
    for k, g in BUILTIN_MODELS.items()
)


def chosen_settings(names: Sequence[str] | None, codecs: Sequence[str] | None) -> list[str] | None:
    """The rows ``--setting`` (``names``) and ``--kv-cache-quant`` (``codecs``) pick: the named
    ones, then each codec setting's rows in table order; None (every row) when neither is given.

    Raises:
        ConfigError: a codec setting no codec registered (the codec options' own check: the
            message lists the registered ones).
    """
    if codecs is None:
        return None if names is None else list(names)
    wanted = {QVGKVQuantArgs.from_codec_name(c).codec for c in codecs}
    return list(dict.fromkeys([*(names or ()), *(n for n, s in SETTINGS.items() if s.codec in wanted)]))


def format_plan(plan: MemoryPlan, host: str) -> str:
    """The human-readable table of ``plan``, planned for ``--host host``."""
    g, lay, req = plan.geometry, plan.layout, plan.request
    slots = lay.cache_tokens // lay.chunk_tokens
    lines = [
        f"{g.describe()}, host {host}: {lay.height}x{lay.width} = "
        f"{lay.tokens_per_frame:,} tokens per latent frame; {lay.video_frames} frames = "
        f"{lay.latent_frames} latent frames = {lay.num_chunks} chunks of {lay.frames_per_chunk} "
        f"frames ({lay.chunk_tokens:,} tokens)",
        f"sink {g.sink_frames} frames, window {lay.window_frames} frames ({lay.cache_tokens:,} "
        f"tokens, {slots} chunk slots); {lay.sets} cache set{'s' if lay.sets > 1 else ''} (CFG "
        f"{'on' if lay.sets > 1 else 'off'}), batch {req.batch_size}, {req.dtype}"
        + (f"; a shot sink pinned at chunk{'s' if len(lay.pins) > 1 else ''} "
           f"{', '.join(map(str, sorted(lay.pins)))}" if lay.pins else "")
        + ("" if req.sink else "; --kv-cache-quant-sink 0"),
    ]
    if plan.rows:
        if attention_of(plan.cache, req.attention) == "gathered":
            buffer = f"one layer's window gathered: {format_bytes(plan.rows[0].transient_bytes)}"
        else:
            buffer = "attention streamed, the largest one-call buffer: " + ", ".join(
                f"{format_bytes(r.transient_bytes)} ({r.setting})" for r in plan.rows)
        lines.append(f"denoising passes are probes (nothing stored); {buffer}")
    budget = plan.budget
    longest = "max_video_frames" if g.window_is_video else "max_window_frames"
    head = ["setting", "kv_bytes", "peak_bytes", "dense_bytes", "kv/dense", "peak/dense"]
    if budget is not None:
        head += ["fits", longest]
    rows = [head]
    for r in plan.rows:
        row = [r.setting, format_bytes(r.kv_bytes), format_bytes(r.peak_bytes),
               format_bytes(r.dense_bytes), f"{r.kv_ratio:.3f}", f"{r.peak_ratio:.3f}"]
        if budget is not None:
            best = getattr(r, longest)
            shown = "none fits" if best is None else f">= {best}" if r.at_search_limit else f"{best}"
            row += ["yes" if r.fits else "no", shown]
        rows.append(row)
    lines += format_columns(rows)
    lines += [f"left out: {name}: {why}" for name, why in plan.left_out]
    if any(r.setting == "off" for r in plan.rows):
        lines.append(
            "note: off is the QVG cache with quantization off (probes store nothing, the "
            "commit keeps what the next chunk reads, bf16); "
            "a run with --kv-cache-quant off keeps sglang's (or causalkv's) dense cache: "
            "dense_bytes"
        )
    if budget is not None:
        what = ("video that fits with the window = the video" if g.window_is_video
                else "window whose full steady state fits")
        lines.append(
            f"budget {format_bytes(budget)} ({budget:,} bytes): fits = peak_bytes <= budget; "
            f"{longest} = the longest {what}, in latent frames (multiples of "
            f"{lay.frames_per_chunk})"
        )
    return "\n".join(lines)


def _vllm_omni(args: argparse.Namespace, budget: int | None) -> str:
    """``--host vllm-omni``: the realtime sessions vLLM-Omni's AR-diffusion engine admits for
    LingBot-World, its own pool against causalkv's pages per setting (one formula with the
    engine's admission, `causalkv.vllm_omni.admission`)."""
    # lazy: only this host's rows need the module
    from causalkv.vllm_omni.admission import ROWS, format_admission, lingbot_engine, plan_admission

    if resolve_model(args.model).name != BUILTIN_MODELS["lingbot"].name:
        raise CausalKVError(f"--host vllm-omni plans LingBot-World only, got {args.model!r}; pass lingbot")
    for flag, given in (("--setting", args.setting), ("--kv-cache-quant", args.kv_cache_quant)):
        if given:  # refused, never ignored
            raise CausalKVError(f"{flag} picks rows of --host sglang or causalkv; --host vllm-omni "
                                f"plans its own rows (stock, {', '.join(ROWS)}): drop {flag}")
    eng = lingbot_engine(args.height, args.width)
    plans = plan_admission(budget, eng=eng)
    if args.json:
        return json.dumps([p.as_json() for p in plans], indent=2)
    return format_admission(eng, plans, budget)


def _plan(args: argparse.Namespace, budget: int | None) -> str:
    """``--host sglang`` or ``causalkv``: the rows of the cache `HOST_CACHES` names."""
    # lazy: the planner and the cache models import the caches' position arithmetic (and torch)
    from causalkv.memory import cache_models
    from causalkv.memory.plan import plan_memory

    same = ("height", "width", "frames", "latent_frames", "seconds", "fps", "cfg", "shots",
            "batch_size", "window_frames", "attention")  # the flags named as the request's fields
    req = MemoryRequest(dtype=args.kv_dtype, sink=args.kv_cache_quant_sink == 1,
                        **{name: getattr(args, name) for name in same})
    plan = plan_memory(resolve_model(args.model), req, getattr(cache_models, HOST_CACHES[args.host]),
                       budget=budget, settings=chosen_settings(args.setting, args.kv_cache_quant))
    if args.json:  # the JSON stays the rows; what was left out goes to stderr
        for name, why in plan.left_out:
            print_stderr(f"causalkv memory: left out: {name}: {why}")
        return json.dumps(plan.as_json(), indent=2)
    return format_plan(plan, args.host)


def _main(args: argparse.Namespace) -> int:
    try:
        budget = None if args.budget is None else parse_bytes(args.budget)
        text = (_vllm_omni if args.host == "vllm-omni" else _plan)(args, budget)
    except CausalKVError as exc:
        print_stderr(f"causalkv memory: error: {exc}; see causalkv memory --help")
        return 2
    print(text, flush=True)  # a reader that went away (`| head`): `causalkv.cli.main` ends quietly
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``memory`` subcommand: its rows (``--setting``, ``--help``) are every codec
    setting registered when it is called (`causalkv.cli.commands.build_parser` loads the
    plugins first)."""
    parser = subparsers.add_parser(
        "memory",
        help="KV-cache bytes of a request per QVG setting, against sglang's dense cache",
        description="Plan the KV-cache memory of one request: per QVG setting the bytes the "
        "caches of a stage hold (all layers, CFG sets), their peak with the largest one-call buffer, and what sglang's dense "
        "cache allocates for the same request. Exact arithmetic on the model's geometry (the "
        "codec's stored-bytes formula, the hosts' own position bookkeeping and packing "
        "policies): no weights, no tensors.",
        # the columns, every row `SETTINGS` has now (a plugin's codec settings too), the models
        epilog=_COLUMNS + "\n".join(f"  {name:18s}{s.help}" for name, s in SETTINGS.items()) + _MODELS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", help=f"a built-in model ({', '.join(BUILTIN_MODELS)}), a causalkv preset "
        "(causalkv generate's --model names, e.g. tiny-longlive2-1k) or a local diffusers / "
        "sglang model folder (read from transformer/config.json, vae/config.json, "
        "model_index.json and causalkv.json)",
    )
    parser.add_argument("--height", type=int, default=None, help="video height in pixels (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="video width in pixels (default: the model's)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--frames", type=int, default=None,
                        help="video frames, as sglang's --num-frames (1 + 4k; default: the model's)")
    length.add_argument("--latent-frames", type=int, default=None,
                        help="latent frames, as causalkv generate's --frames (a multiple of the chunk)")
    length.add_argument("--seconds", type=float, default=None,
                        help="video length in seconds at --fps (rounded up to whole chunks)")
    parser.add_argument("--fps", type=int, default=None, help="frames per second for --seconds (default: the model's)")
    cfg = parser.add_mutually_exclusive_group()
    cfg.add_argument("--cfg", dest="cfg", action="store_true", default=False,
                     help="classifier-free guidance on: a second cache set (the negative branch)")
    cfg.add_argument("--no-cfg", dest="cfg", action="store_false", help="CFG off (the default)")
    parser.add_argument("--shots", type=int, default=1,
                        help="shots (LongLive 2.0: each shot after the first pins its cut chunk "
                        "as the shot sink; chunks split evenly); default 1")
    parser.add_argument("--window-frames", type=int, default=None,
                        help="the window (= the cache) in latent frames (default: the model's)")
    parser.add_argument("--host", choices=(*HOST_CACHES, "vllm-omni"), default="sglang",
                        help="whose cache: sglang (the bridge: sglang's packing rule and slot "
                        "arithmetic, the centroids as given; the default), causalkv (causalkv "
                        "generate's QVGPackedCausalKVCache: causalkv's rule, 32+ tokens per centroid) "
                        "or vllm-omni (lingbot only: realtime sessions on vLLM-Omni's paged "
                        "AR-diffusion engine, its own pool against causalkv's pages off/int4/int2, "
                        "bytes per session and, with --budget (the engine's free memory x "
                        "gpu_memory_fraction), the sessions it admits; docs/vllm_omni.md)")
    parser.add_argument("--attention", choices=ATTENTION, default=None,
                        help="how a call reads its window, for peak_bytes: gathered (one dense "
                        "buffer: sglang's attention; the default with --host sglang) or streamed "
                        "(one packed segment decoded at a time: causalkv generate's; the default "
                        "with --host causalkv)")
    parser.add_argument("--kv-cache-quant-sink", type=int, choices=(0, 1), default=1, metavar="{0,1}",
                        help="1: pack the sink chunks (the default); 0: keep them bf16 (at int4 "
                        "in int2-recent-int4)")
    parser.add_argument("--batch-size", type=int, default=1, help="batch size of the caches (default 1)")
    parser.add_argument("--kv-dtype", choices=DTYPES, default="bfloat16",
                        help="KV dtype (default bfloat16)")
    parser.add_argument("--setting", action="append", choices=list(SETTINGS), default=None,
                        help="only this setting (repeat for several; default: all)")
    parser.add_argument("--kv-cache-quant", action="append", default=None, metavar="CODEC",
                        help="only the rows of this codec setting (repeat for several; with "
                        f"--setting, those too): one of {', '.join(quant_choices())} (off: the off row)")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="memory for the KV caches, e.g. 80GiB (GiB = 2^30 B, GB = 10^9 B): "
                        "adds fits and the longest window (or video) that fits")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list of objects: setting, kv_bytes, dense_bytes, "
                        "peak_bytes (+ fits and the longest window/video with --budget)")
    parser.set_defaults(func=_main)
