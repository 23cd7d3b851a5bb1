"""``causalkv demo``: walk a LongLive-2.0-like stream through the dense rolling KV cache (no model).

Its sizes are bounded before anything is built: ``--chunks`` by what the report prints (one
frame-map line per chunk, one character per frame of the stream: `MAX_CHUNKS`), and
``--tokens-per-frame`` by this machine's memory (the preallocated cache, its attention view
and one chunk's K/V). A refusal, an interrupt and a terminate are one line each (exit 2, 130,
143).
"""

from __future__ import annotations

import argparse

from causalkv.caches.demo import DemoConfig, format_report, run_demo
from causalkv.cli.faults import Progress, Stdout, run_guarded
from causalkv.errors import ConfigError
from causalkv.memory.records import format_bytes
from causalkv.runtime.host.request_checks import host_memory_bytes

__all__ = ["MAX_CHUNKS", "check_demo_sizes", "demo_memory_floor", "register"]

#: the most chunks the report prints: its frame map is one line per chunk of one character
#: per frame of the whole stream (chunks x 8 characters), so 128 chunks are 128 lines of 1,024
MAX_CHUNKS = 128


def _cuts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--cuts takes comma-separated chunk indices such as 3,6; got {text!r}"
        ) from e


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def demo_memory_floor(config: DemoConfig) -> int:
    """Bytes the walkthrough needs at least: the preallocated K and V buffers, a view of the
    window (K and V), and one chunk's K/V tensor."""
    spec = config.spec()
    return 2 * spec.dense_nbytes() + spec.dense_nbytes(config.chunk_tokens) // 2


def check_demo_sizes(config: DemoConfig, memory: int | None) -> None:
    """Refuse (`ConfigError`) cuts that are not chunk indices (or repeat one), more chunks than
    `MAX_CHUNKS` and a cache beyond ``memory``."""
    chunks, cuts = config.chunks, config.cuts
    bad = ", ".join(str(c) for c in cuts if not 0 < c < chunks)
    if bad or len(set(cuts)) != len(cuts):
        what = (f"{bad} is not a chunk index in 1..{chunks - 1} (chunk 0 starts the stream, "
                f"--chunks {chunks} ends it)") if bad else "a chunk is listed twice"
        raise ConfigError(f"--cuts {','.join(map(str, cuts))}: {what}; see causalkv demo --help")
    if config.chunks > MAX_CHUNKS:
        raise ConfigError(
            f"--chunks {config.chunks}: the walkthrough prints one line per chunk of one character "
            f"per frame ({config.chunks * config.frames_per_chunk:,} here); pass --chunks "
            f"{MAX_CHUNKS} or fewer"
        )
    need = demo_memory_floor(config)
    if memory is not None and need > memory:
        per_token = max(1, need // (config.window_frames * config.tokens_per_frame))
        fit = max(1, memory // (per_token * config.window_frames))
        raise ConfigError(
            f"--tokens-per-frame {config.tokens_per_frame:,}: the cache and its view need at least "
            f"{need:,} bytes, more than the {memory:,} bytes of memory here; pass "
            f"--tokens-per-frame {fit:,} or fewer"
        )


def _main(args: argparse.Namespace) -> int:
    if args.cuts is None:  # the default cuts that fall inside the requested chunks
        args.cuts = tuple(c for c in DemoConfig().cuts if c < args.chunks)
    config = DemoConfig(chunks=args.chunks, tokens_per_frame=args.tokens_per_frame, cuts=args.cuts)

    def body() -> int:
        check_demo_sizes(config, host_memory_bytes())
        out = Stdout()  # a reader that goes away (`| head`) ends the printing, not the command
        out(format_report(config, run_demo(config), format_bytes))
        out.flush()
        return 0

    return run_guarded("causalkv demo", body, progress=Progress("the report was not printed"))


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
                        help=f"chunks to generate (default {defaults.chunks}, at most {MAX_CHUNKS})")
    parser.add_argument("--tokens-per-frame", type=_positive, default=defaults.tokens_per_frame,
                        help=f"tokens per latent frame (default {defaults.tokens_per_frame}; "
                        "880 in LongLive 2.0; bounded by this machine's memory)")
    parser.add_argument("--cuts", type=_cuts, default=None,
                        help="comma-separated scene-cut chunk indices (default "
                        + ",".join(map(str, defaults.cuts)) + ", those below --chunks); each in "
                        "1..chunks-1")
    parser.set_defaults(func=_main)
