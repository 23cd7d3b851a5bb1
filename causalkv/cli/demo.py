"""``causalkv demo``: walk a LongLive-2.0-like stream through the dense rolling KV cache (no model)."""

from __future__ import annotations

import argparse
import sys

from causalkv.caches.demo import DemoConfig, format_report, run_demo

__all__ = ["register"]


def _cuts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--cuts takes comma-separated chunk indices such as 3,6; got {text!r}"
        ) from e


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def _main(args: argparse.Namespace) -> int:
    if args.cuts is None:  # the default cuts that fall inside the requested chunks
        args.cuts = tuple(c for c in DemoConfig().cuts if c < args.chunks)
    bad = [c for c in args.cuts if not 0 < c < args.chunks]
    if bad or len(set(args.cuts)) != len(args.cuts):
        what = (f"{', '.join(map(str, bad))} is not a chunk index in 1..{args.chunks - 1} (chunk 0 "
                f"starts the stream, --chunks {args.chunks} ends it)") if bad else "a chunk is listed twice"
        print(f"causalkv demo: error: --cuts {','.join(map(str, args.cuts))}: {what}; see causalkv "
              "demo --help", file=sys.stderr)
        return 2
    config = DemoConfig(chunks=args.chunks, tokens_per_frame=args.tokens_per_frame, cuts=args.cuts)
    print(format_report(config, run_demo(config)))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    defaults = DemoConfig()
    parser = subparsers.add_parser(
        "demo",
        help="walk a LongLive-2.0-like stream through the dense KV cache (fast, no model)",
        description="Walk a LongLive-2.0-like stream through the dense rolling KV cache: per "
        "chunk, what attention saw, pins, resident bytes and a frame map. No model, no weights.",
    )
    parser.add_argument("--chunks", type=_positive, default=defaults.chunks,
                        help=f"chunks to generate (default {defaults.chunks})")
    parser.add_argument("--tokens-per-frame", type=_positive, default=defaults.tokens_per_frame,
                        help=f"tokens per latent frame (default {defaults.tokens_per_frame}; "
                        "880 in LongLive 2.0)")
    parser.add_argument("--cuts", type=_cuts, default=None,
                        help="comma-separated scene-cut chunk indices (default "
                        + ",".join(map(str, defaults.cuts)) + ", those below --chunks); each in "
                        "1..chunks-1")
    parser.set_defaults(func=_main)
