"""``causalkv generate``: streaming chunk-by-chunk video generation on a preset or a folder.

The command line is the host's flags (model, prompts, frames, seed, dtype, device, stream
overrides, sharding, cache choice, outputs) plus, in one ``--help`` group per record, the
flags every registered stage family and cache declares (`causalkv.options`: LongLive 2.0's
shot flags, LingBot-World's ``--motion``, the QVG cache's ``--kv-cache-quant*``), read from
the plugin registry (`add_extension_args`); this module names no family and no cache.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from causalkv.cli.faults import Progress, Stdout, run_guarded
from causalkv.config import DTYPES, ServerArgs
from causalkv.errors import CausalKVError, ConfigError, check_int
from causalkv.memory.records import format_bytes
from causalkv.options import Options
from causalkv.runtime.files.video import video_formats
from causalkv.runtime.host.pipeline_records import DEFAULT_PROMPT, GenerateOptions, PluginSet
from causalkv.runtime.processes.launch import env_world, launched_by_torchrun, register_rank

# The parser (``--help``) imports no torch: the modules that run a generation (torch,
# diffusers, transformers) are imported by the functions that run it.

__all__ = [
    "add_extension_args",
    "add_generate_args",
    "collect_plugins",
    "extension_records",
    "options_from_args",
    "register",
    "run_generate",
]

#: the namespace attribute `add_extension_args` sets: the records whose flags it added
_RECORDS = "_causalkv_option_records"
#: the namespace attribute `register` sets: the plugins the parser was built from (the run's)
_PLUGINS = "_causalkv_plugins"


def host_flags() -> frozenset[str]:
    """The flags of ``causalkv generate`` and ``resolve`` themselves: a plugin record that
    declares one is set aside when the plugins are collected (`causalkv.plugin.collect`)."""
    return frozenset(add_generate_args(argparse.ArgumentParser(), plugins=None)._option_string_actions) | {"--json"}


def collect_plugins() -> PluginSet | None:
    """The process-wide plugin manager's plugins, collected once for the parser and the run
    (a plugin that fails or clashes, with a host flag too, is set aside with one line); None
    when they cannot be collected (which `generate` reports when it runs)."""
    try:
        return PluginSet.collect(reserved_flags=host_flags())
    except CausalKVError:
        return None


def add_extension_args(parser: argparse.ArgumentParser, plugins: PluginSet | None) -> argparse.ArgumentParser:
    """Add the flags of every option record the stages and caches of ``plugins`` declare, one
    group per record titled with the record and its owners (the registry holds no clashing
    flag: a plugin declaring one is set aside), and one group per plugin set aside, while
    loading or while collecting, so ``--help`` drops none silently."""
    owned: dict[type[Options], list[str]] = {}  # record -> its owners ("stage longlive2", "cache qvg")
    if plugins is not None:
        declared = [(f"stage {e.name}", e.registration.options) for e in plugins.registry.stages]
        declared += [(f"cache {e.name}", e.factory.options) for e in plugins.registry.caches]
        for owner, record in declared:
            if record is not None:
                owned.setdefault(record, []).append(owner)
    for record, owners in owned.items():
        record.add_arguments(parser, title=f"{record.title} ({', '.join(owners)})")
    for failure in plugins.failures if plugins is not None else ():  # a group each: argparse refills a description
        parser.add_argument_group("plugin set aside (its stages, caches and flags are not here)",
                                  description=str(failure))
    parser.set_defaults(**{_RECORDS: tuple(owned)})
    return parser


def extension_records(args: argparse.Namespace) -> list[Options]:
    """The option records the parsed flags give (validated; `ConfigError` naming the flag),
    one per record with at least one flag typed."""
    records = getattr(args, _RECORDS, ())
    return [record(**given) for record in records if (given := record.given_in(args))]


def add_generate_args(parser: argparse.ArgumentParser, *, plugins: Any = ...) -> argparse.ArgumentParser:
    """The ``generate`` flags: the host's, then the extensions' (`add_extension_args`, from
    ``plugins``, a `PluginSet` or None; default: the process-wide plugin manager's)."""
    plugins = collect_plugins() if plugins is ... else plugins
    presets = ", ".join(plugins.registry.presets()) if plugins is not None else "see causalkv plugins"
    formats = ", ".join(f"{suffix} ({what})" for suffix, what in video_formats().items())
    parser.add_argument(
        "--model", default="tiny-wan",
        help=f"preset ({presets}) or a diffusers-format Wan folder "
        "(default: tiny-wan; preset weights are random)",
    )
    parser.add_argument(
        "--prompt", action="append", dest="prompts", metavar="TEXT",
        help="prompt of one shot; repeat for several shots (frames split evenly, shots after "
        f"the first are scene cuts). Default: {DEFAULT_PROMPT!r}",
    )
    parser.add_argument(
        "--shot-prompt", action="append", dest="shot_prompts", metavar="TEXT",
        help="prompt of one shot (repeatable; same as --prompt, do not mix the two)",
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
    parser.add_argument("--output", default=None, metavar="FILE",
                        help=f"video file; the installed encoders write {formats or 'no format'} "
                        "(default: out/<model>.mp4). Written atomically; if it cannot be written "
                        "after all, the latents are kept in NAME.latents.safetensors beside it")
    parser.add_argument("--no-video", action="store_true", help="skip decoding and writing the video")
    parser.add_argument("--metrics", default=None, metavar="FILE",
                        help="write the metrics JSON here (atomically)")
    parser.add_argument("--save-latents", default=None, metavar="FILE.safetensors",
                        help="also save the generated latents [B, C, F, h, w] (float32, key 'latents')")
    parser.add_argument("--force", action="store_true",
                        help="replace an --output, --metrics or --save-latents file that holds "
                        "something else (another kind of file, not a previous run's), atomically")
    parser.add_argument("--strict-plugins", action="store_true",
                        help="any plugin fault stops the run (exit 2): a plugin set aside while "
                        "loading (import error, a registration hook that raises, a clashing flag "
                        "or name) and a causalkv_chunk_done implementation that raises, instead "
                        "of one line and going on without it")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (exit codes: docs/usage.md)")
    parser.add_argument("--compare-bf16", action="store_true",
                        help="also run with kv-cache-quant off and bf16 caches (same seed), report "
                        "latent_psnr_db, then time both settings warm (the table at the end)")
    parser.add_argument("--compare-dtype", default=None, choices=DTYPES,
                        help="the KV-cache dtype of --compare-bf16's reference run (default: "
                        "bfloat16, whatever --dtype and --kv-cache-dtype say)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="sequence parallel on N local processes (torchrun; gloo on CPU, "
                        "nccl on CUDA): each rank caches heads/N. Under torchrun the ranks come "
                        "from torchrun and N, if given, must match its --nproc-per-node")
    return add_extension_args(parser, plugins)


def register(subparsers: Any, *, plugins: PluginSet | None) -> None:
    """Add the ``generate`` subcommand, its flags from ``plugins`` (None: the host's flags
    only; the run reports why they could not be collected); the run uses the same ``plugins``."""
    p = subparsers.add_parser(
        "generate",
        help="generate a video chunk by chunk (causal KV cache chosen by the plugin system)",
        description=(
            "Generate a video chunk by chunk with a causal Wan transformer. The stage and the "
            "KV cache are resolved from the model and the flags before any weights load."
        ),
    )
    add_generate_args(p, plugins=plugins)
    p.set_defaults(func=run_generate, **{_PLUGINS: plugins})


def options_from_args(args: argparse.Namespace) -> Any:
    """`GenerateOptions` from parsed ``generate`` arguments (validates every option record)."""
    if args.prompts is not None and args.shot_prompts is not None:
        raise ConfigError("pass the shots with --prompt or with --shot-prompt, not both")
    server_args = ServerArgs(
        options=extension_records(args),
        heads_sharded=_world_size(args),
        # the host flags whose dest is the ServerArgs field of the same name
        **{name: getattr(args, name) for name in ("sink_frames", "window_frames", "recent_window_frames",
                                                  "cache", "seed", "dtype", "device", "kv_cache_dtype")},
    )
    if args.compare_dtype is not None and not args.compare_bf16:
        raise ConfigError(f"--compare-dtype {args.compare_dtype} names the reference of --compare-bf16; "
                          "add --compare-bf16 or drop --compare-dtype")
    if args.no_video and args.output is not None:
        raise ConfigError(f"--output {args.output!r} and --no-video contradict each other; drop one of them")
    default_output = str(Path("out") / f"{Path(str(args.model)).name}.mp4")
    return GenerateOptions(
        prompts=args.shot_prompts or args.prompts or [DEFAULT_PROMPT],  # `append`: never empty
        server_args=server_args,
        compare_dtype=args.compare_dtype or "bfloat16",
        output=None if args.no_video else args.output or default_output,
        # the flags whose dest is the GenerateOptions field of the same name
        **{name: getattr(args, name) for name in ("model", "frames", "guidance_scale", "negative_prompt", "stage",
                                                  "compare_bf16", "quiet", "metrics", "save_latents",
                                                  "strict_plugins", "force")},
    )


def _world_size(args: argparse.Namespace) -> int:
    """Ranks of the request: torchrun's ``WORLD_SIZE`` in a worker, else ``--nproc-per-node``."""
    nproc = args.nproc_per_node
    if nproc is not None:
        check_int("--nproc-per-node", nproc, minimum=1)
    if not launched_by_torchrun():
        return 1 if nproc is None else nproc
    _rank, world, _local, local_world = env_world()
    if nproc is not None and nproc != local_world:
        raise ConfigError(
            f"--nproc-per-node {nproc} does not match torchrun's {local_world} processes on this "
            "node; drop --nproc-per-node under torchrun or pass the same value"
        )
    return world


def run_generate(args: argparse.Namespace) -> int:
    """Entry of ``causalkv generate``: the exit status (`causalkv.cli.faults`: 0 done, 1
    unexpected, 2 bad request / model folder / plugin, 130 interrupted), one line on stderr.

    With ``--nproc-per-node N > 1`` outside torchrun the request is planned here (every bad
    input is refused before any process starts) and the command re-executes itself under
    ``python -m torch.distributed.run --standalone --nproc-per-node N``; its exit status is
    torchrun's (non-zero as soon as one rank fails). In a torchrun worker the rank joins the
    process group and rank 0 alone prints, writes the video and the metrics.
    """
    from causalkv.runtime.host.compare_step import compare_table
    from causalkv.runtime.host.generate import generate
    from causalkv.runtime.processes.distributed import init_parallel, shutdown

    out, progress = Stdout(), Progress()
    plugins = getattr(args, _PLUGINS, None)

    def body() -> int:
        register_rank()  # a rank of `_launch`'s job: report to it, die with torchrun
        options = options_from_args(args)
        if options.server_args.heads_sharded > 1 and not launched_by_torchrun():
            return _launch(args, options, out, plugins)
        main_rank = not launched_by_torchrun() or init_parallel(options.server_args.device).is_main
        try:  # logging on rank 0; then leave the process group if one was joined
            metrics, run = generate(
                options, plugins=plugins, log=out, on_plan=progress.on_plan, on_loaded=progress.on_loaded,
                on_chunk_done=progress.on_chunk_done, on_written=progress.on_written,
            )
        finally:
            shutdown()
        if not main_rank:
            return 0
        out(done_line(run, metrics))
        if options.metrics is not None:
            out(f"metrics: {options.metrics}")
        if "reference_kv_resident_bytes_max" in metrics:
            out(compare_table(metrics))
        out.flush()
        return 0

    return run_guarded("causalkv generate", body, debug=args.debug, progress=progress)


def done_line(run: Any, metrics: dict[str, Any]) -> str:
    """The ``done:`` line: chunks, seconds per chunk of the first run in this process (cold:
    its first chunks pay for warming up) and, after ``--compare-bf16``, the warm figure the
    table shows; KV bytes in binary units."""
    seconds = f"{run.seconds_per_chunk_mean:.3f} s/chunk cold (the first run in this process)"
    warm = metrics.get("seconds_per_chunk_best")
    if warm is not None:
        seconds += f", {warm:.3f} s/chunk warm (least of {metrics['timing_repeats']} runs, the table's)"
    return (
        f"done: {len(run.chunk_stats)} chunks, {seconds}; KV resident max "
        f"{format_bytes(run.kv_resident_bytes_max)}, final {format_bytes(run.kv_resident_bytes_final)}"
    )


def _launch(args: argparse.Namespace, options: Any, out: Any, plugins: PluginSet | None) -> int:
    """Plan on this process (errors before any rank starts), then run the same command
    under torchrun on ``--nproc-per-node`` local ranks, supervised
    (`causalkv.runtime.processes.launch`): the job's exit status, its one line printed here."""
    from causalkv.runtime.host.plan_step import plan_generation
    from causalkv.runtime.processes.launch import run_supervised

    plan = plan_generation(options, plugins=plugins)
    out(f"sequence parallel: {options.server_args.heads_sharded} processes (torchrun)")
    return run_supervised(  # args.argv: the command line `causalkv.cli.commands.main` parsed
        options.server_args.heads_sharded, args.argv, debug=args.debug,
        quiet=bool(options.quiet), seen=getattr(plan.plugin_set().pm, "reported", ()),
    )
