"""``causalkv sglang-checkpoint {longlive2,wan-causal,lingbot} DIR`` and ``causalkv
vllm-omni-checkpoint DIR``: a tiny folder in a host's own format.

Builds (or finds complete) the checkpoint with `causalkv.runtime.tools.checkpoints`; for
sglang, prints as its last line the ``sglang generate`` command that runs it. Needs no sglang,
vLLM or vLLM-Omni. A folder that holds anything else is refused with what it holds (a
complete checkpoint of another name is replaced only with ``--force``); every fault is one
line (exit 2 for the folder, 1 for a write that failed, 130/143 for a signal), the folder left
as it was.
"""

from __future__ import annotations

import argparse

from causalkv.cli.faults import Progress, Stdout, run_guarded
from causalkv.runtime.tools.checkpoints import (
    CHECKPOINTS,
    HOSTS,
    build_checkpoint,
    generate_command,
    is_complete_checkpoint,
)

__all__ = ["register"]

#: per host: the subcommand's help and description
_HELP = {
    "sglang": (
        "build a tiny checkpoint in sglang's own format and print the sglang command",
        "Build a tiny checkpoint (seeded random weights, nothing downloaded) in the layout and "
        "key names sglang's own pipeline loads, and print the `sglang generate` line that runs it.",
    ),
    "vllm-omni": (
        "build a tiny LingBot-World checkpoint in vLLM-Omni's own folder format",
        "Build a tiny LingBot-World checkpoint (seeded random weights, nothing downloaded) in the "
        "folder layout, config keys and safetensors names vLLM-Omni 0.30.0's LingBot-World loader "
        "reads.",
    ),
}


def _main(args: argparse.Namespace) -> int:
    spec = CHECKPOINTS[args.pipeline]

    def body() -> int:
        cached = is_complete_checkpoint(args.dir, spec.name)
        folder = build_checkpoint(spec.name, args.dir, host=spec.host, force=bool(args.force))
        out = Stdout()  # a reader that goes away (`| head`) ends the printing: the folder is built
        out(f"{'found complete' if cached else 'built'} tiny {spec.name} checkpoint in {folder} "
            f"({HOSTS[spec.host]} layout: {spec.pipeline_class}, {spec.dit_class}; RANDOM weights)")
        if spec.known_failure:
            out(f"note: {spec.known_failure}")
        if spec.request:
            import torch

            if not torch.cuda.is_available():  # sglang's CPU platform needs more (the docs say what)
                out("no CUDA here: on a CPU, sglang needs the environment and stand-ins of "
                    "docs/sglang.md, 'Running on a CPU'")
            out(generate_command(spec.name, folder))
        out.flush()
        return 0

    return run_guarded(f"causalkv {spec.host}-checkpoint", body, debug=bool(args.debug),
                       progress=Progress(f"{args.dir!r} is left as it was"))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sglang-checkpoint`` and ``vllm-omni-checkpoint`` subcommands."""
    for host, (help_, description) in _HELP.items():
        parser = subparsers.add_parser(
            f"{host}-checkpoint", help=help_,
            description=f"{description} A complete folder of the same checkpoint is kept as it "
            "is; one of another is refused (--force replaces it); any other non-empty DIR is refused.",
        )
        names = [name for name, spec in CHECKPOINTS.items() if spec.host == host]
        if len(names) > 1:
            parser.add_argument("pipeline", choices=names, help=f"which {HOSTS[host]} pipeline the checkpoint is for")
        else:
            parser.set_defaults(pipeline=names[0])
        parser.add_argument("dir", help="folder to build (created; reused when already complete)")
        parser.add_argument("--force", action="store_true",
                            help="replace a complete checkpoint of another pipeline in DIR (atomically)")
        parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
        parser.set_defaults(func=_main)
