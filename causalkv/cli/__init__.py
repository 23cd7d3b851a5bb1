"""The ``causalkv`` command line: one module per subcommand in this package.

Subcommands: ``generate`` (`causalkv.cli.generate`), ``plugins`` and ``resolve``
(`causalkv.cli.plugins`), ``demo`` (`causalkv.cli.demo`). Every error causalkv raises on
purpose (`causalkv.errors.CausalKVError`) ends the command with one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from causalkv import __version__
from causalkv.cli import demo, generate, plugins

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="causalkv",
        description=(
            "Causal KV caches for chunk-by-chunk video diffusion: generate video on a tiny "
            "embedded model or a local diffusers-format Wan checkpoint, inspect plugins and "
            "cache resolution, or walk through the cache."
        ),
    )
    parser.add_argument("--version", action="version", version=f"causalkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (generate, plugins, demo):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
