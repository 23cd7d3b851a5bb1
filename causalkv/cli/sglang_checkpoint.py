"""``causalkv sglang-checkpoint {longlive2,wan-causal,lingbot} DIR``: a tiny sglang-native folder.

Builds (or finds complete) the checkpoint with `causalkv.runtime.sglang_checkpoints` and prints,
as its last line, the ``sglang generate`` command that runs it. Needs no sglang.
"""

from __future__ import annotations

import argparse

from causalkv.runtime.sglang_checkpoints import (
    CHECKPOINTS,
    build_sglang_checkpoint,
    generate_command,
    is_complete_checkpoint,
)

__all__ = ["register"]


def _main(args: argparse.Namespace) -> int:
    spec = CHECKPOINTS[args.pipeline]
    cached = is_complete_checkpoint(args.dir, spec.name)
    folder = build_sglang_checkpoint(spec.name, args.dir)
    print(f"{'found complete' if cached else 'built'} tiny {spec.name} checkpoint in {folder} "
          f"({spec.pipeline_class}, {spec.dit_class}; RANDOM weights)")
    if spec.known_failure:
        print(f"note: {spec.known_failure}")
    print(generate_command(spec.name, folder))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sglang-checkpoint`` subcommand."""
    parser = subparsers.add_parser(
        "sglang-checkpoint",
        help="build a tiny checkpoint in sglang's own format and print the sglang command",
        description="Build a tiny checkpoint (seeded random weights, nothing downloaded) in the "
        "layout and key names sglang's own pipeline loads, and print the `sglang generate` line "
        "that runs it. A complete folder is kept as it is; an unrelated non-empty DIR is refused.",
    )
    parser.add_argument("pipeline", choices=list(CHECKPOINTS),
                        help="which sglang pipeline the checkpoint is for")
    parser.add_argument("dir", help="folder to build (created; reused when already complete)")
    parser.set_defaults(func=_main)
