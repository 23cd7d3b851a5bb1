"""The ``causalkv`` command line. Each subcommand lives beside the code it drives.

Subcommands: ``generate`` (runtime), ``plugins`` and ``resolve`` (plugin system),
``demo`` (the cache walkthrough).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from causalkv import __version__

#: modules exposing ``register(subparsers)``; each sets ``func(args) -> int`` on its parser
SUBCOMMAND_MODULES = ("causalkv.runtime.cli", "causalkv.plugin.cli", "causalkv.caches.demo")


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
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
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
