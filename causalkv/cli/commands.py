"""The ``causalkv`` parser and its dispatch (`causalkv.cli.main` is the light entry point
that imports this module): the subcommands' parsers, then one command run.

Before a command runs, the documented switches (`ENV_SWITCHES`: the plugin manager's and the
sglang bridge's) are checked (`causalkv.env.check_switches`): a value they do not take is one
line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from causalkv import __version__, sglang
from causalkv.cli import checkpoints, demo, generate, memory, plugins
from causalkv.cli.faults import OneLineErrorParser, reserve_standard_fds
from causalkv.env import check_switches
from causalkv.errors import CausalKVError, print_stderr
from causalkv.plugin import manager

__all__ = ["ENV_SWITCHES", "build_parser", "main"]

#: the switches every command refuses up front when set to a value they do not take
#: (``CAUSALKV_TRACE_PLUGINS=2`` would be read as off, ``CAUSALKV_SGLANG_BRIDGE=maybe`` as on)
ENV_SWITCHES = (*manager.SWITCHES, *sglang.SWITCHES)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(  # subcommand parsers inherit the one-line usage errors
        prog="causalkv",
        description=(
            "Causal KV caches for chunk-by-chunk video diffusion: generate video on a tiny "
            "embedded model or a local diffusers-format Wan checkpoint, inspect plugins and "
            "cache resolution, or walk through the cache."
        ),
    )
    parser.add_argument("--version", action="version", version=f"causalkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    found = generate.collect_plugins()  # once: the flags of `generate` and `resolve`, and the run
    generate.register(sub, plugins=found)
    plugins.register(sub, plugins=found)
    for module in (demo, checkpoints, memory):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    reserve_standard_fds()  # `>&-`: no file the run opens may land on descriptor 1 or 2
    try:
        check_switches(ENV_SWITCHES)
    except CausalKVError as exc:
        print_stderr(f"causalkv: error: {exc}")
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # re-executed under torchrun
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)

