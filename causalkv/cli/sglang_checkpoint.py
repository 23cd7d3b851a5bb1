"""``causalkv sglang-checkpoint {longlive2,wan-causal,lingbot} DIR``: a tiny sglang-native folder.

Builds (or finds complete) the checkpoint with `causalkv.runtime.tools.sglang_checkpoints` and prints,
as its last line, the ``sglang generate`` command that runs it. Needs no sglang. A folder that
holds anything else is refused with what it holds (a complete checkpoint of another pipeline
is replaced only with ``--force``); every fault is one line (exit 2 for the folder, 1 for a
write that failed, 130/143 for a signal), the folder left as it was.
"""

from __future__ import annotations

import argparse

from causalkv.cli.faults import Stdout, Steps, run_guarded
from causalkv.runtime.tools.sglang_checkpoints import (
    CHECKPOINTS,
    build_sglang_checkpoint,
    generate_command,
    is_complete_checkpoint,
)

__all__ = ["register"]


def _main(args: argparse.Namespace) -> int:
    spec = CHECKPOINTS[args.pipeline]

    def body() -> int:
        cached = is_complete_checkpoint(args.dir, spec.name)
        folder = build_sglang_checkpoint(spec.name, args.dir, force=bool(args.force))
        out = Stdout()  # a reader that goes away (`| head`) ends the printing: the folder is built
        out(f"{'found complete' if cached else 'built'} tiny {spec.name} checkpoint in {folder} "
            f"({spec.pipeline_class}, {spec.dit_class}; RANDOM weights)")
        if spec.known_failure:
            out(f"note: {spec.known_failure}")
        out(generate_command(spec.name, folder))
        out.flush()
        return 0

    return run_guarded("causalkv sglang-checkpoint", body, debug=bool(args.debug),
                       progress=Steps(f"{args.dir!r} is left as it was"))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sglang-checkpoint`` subcommand."""
    parser = subparsers.add_parser(
        "sglang-checkpoint",
        help="build a tiny checkpoint in sglang's own format and print the sglang command",
        description="Build a tiny checkpoint (seeded random weights, nothing downloaded) in the "
        "layout and key names sglang's own pipeline loads, and print the `sglang generate` line "
        "that runs it. A complete folder of the same pipeline is kept as it is; one of another "
        "pipeline is refused (--force replaces it); any other non-empty DIR is refused.",
    )
    parser.add_argument("pipeline", choices=list(CHECKPOINTS),
                        help="which sglang pipeline the checkpoint is for")
    parser.add_argument("dir", help="folder to build (created; reused when already complete)")
    parser.add_argument("--force", action="store_true",
                        help="replace a complete checkpoint of another pipeline in DIR (atomically)")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    parser.set_defaults(func=_main)
