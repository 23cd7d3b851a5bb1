"""Soak: a long LongLive-2.0-like int2 stream on the QVG packed cache stays flat.

    .venv/bin/python benchmarks/soak.py                  # 10,000 chunks, table
    .venv/bin/python benchmarks/soak.py --chunks 2000 --json
    .venv/bin/python benchmarks/soak.py --quick          # 400 chunks of 128 tokens (smoke run)

Stream (defaults): LongLive 2.0's real chunk geometry, 880 tokens per frame x 8 frames =
7,040 tokens per chunk, an 8-frame global sink plus an 8-frame pinned shot sink, a 32-frame
window, with reduced heads (1 x 128). A scene cut pins the current chunk as the shot sink every
``--pin-every`` (4) chunks. K/V are `benchmarks/cache.py`'s structured chunks (a pool of 16
distinct chunks written in turn, so generating data costs nothing in the loop).

Every ``--sample-every`` (500) chunks it samples the cache's resident bytes, the mean time per
chunk over the last interval and the process RSS (after returning free heap to the OS). Once the window is full, resident bytes and
RSS must stay within ``--tolerance`` (5%) of their first sample; time per chunk is reported as
min / median / max of the samples (it moves with the machine's load). Exit status 1 when
resident bytes or RSS drift beyond the tolerance.

Torch runs on one CPU thread by default (``--threads``): on a loaded 2-core machine the
codec's small per-chunk ops ran about 5x slower with two threads than with one.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache import StreamKV  # noqa: E402

from causalkv.caches import CausalCacheSpec  # noqa: E402
from causalkv.caches.qvg.options import QVGKVQuantArgs  # noqa: E402
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache  # noqa: E402


@dataclass(frozen=True)
class SoakConfig:
    """Stream geometry and settings (defaults: LongLive 2.0's chunk, reduced heads)."""

    chunks: int = 10_000
    sample_every: int = 500
    tokens_per_frame: int = 880
    frames_per_chunk: int = 8
    sink_frames: int = 8
    global_sink_frames: int = 8
    window_frames: int = 32
    heads: int = 1
    head_dim: int = 128
    pin_every: int = 4
    bits: int = 2
    pool: int = 16  # distinct K/V chunks written in turn

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk

    @property
    def fill_chunks(self) -> int:
        """Chunks after which the window is full and every later advance looks the same."""
        return -(-self.window_frames // self.frames_per_chunk) + self.pin_every + 2

    def spec(self) -> CausalCacheSpec:
        tpf = self.tokens_per_frame
        return CausalCacheSpec(
            batch_size=1, num_heads=self.heads, head_dim=self.head_dim,
            cache_size=self.window_frames * tpf, sink_tokens=self.sink_frames * tpf,
            global_sink_tokens=self.global_sink_frames * tpf,
            attention_window_size=self.window_frames * tpf, dtype=torch.bfloat16,
        )


#: ``--quick``: the same stream (frames, sinks, window, cuts) at 16 tokens per frame, 400 chunks
QUICK = SoakConfig(chunks=400, sample_every=50, tokens_per_frame=16)


@dataclass(frozen=True)
class Sample:
    chunk: int  # chunks written so far
    resident_bytes: int
    ms_per_chunk: float  # mean over the chunks since the previous sample
    rss_bytes: int
    live_tensors: int | None = None  # torch.Tensor objects alive (only when counted)


@dataclass
class SoakResult:
    config: SoakConfig
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    quantize_calls: int = 0
    packing: dict[str, object] = field(default_factory=dict)

    def after_fill(self) -> list[Sample]:
        return [s for s in self.samples if s.chunk > self.config.fill_chunks]

    def drift(self, name: str) -> float:
        """Largest relative distance of ``name`` from its first sample after the window filled."""
        xs = [getattr(s, name) for s in self.after_fill()]
        if not xs:
            return 0.0
        return max(abs(x - xs[0]) for x in xs) / xs[0]

    def summary(self, tolerance: float) -> dict[str, object]:
        ms = [s.ms_per_chunk for s in self.after_fill()]
        return {
            "resident_drift": self.drift("resident_bytes"),
            "rss_drift": self.drift("rss_bytes"),
            "ms_per_chunk_min": min(ms) if ms else None,
            "ms_per_chunk_median": statistics.median(ms) if ms else None,
            "ms_per_chunk_max": max(ms) if ms else None,
            "ok": self.drift("resident_bytes") <= tolerance and self.drift("rss_bytes") <= tolerance,
        }


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def rss_bytes() -> int:
    """The process's resident set now (Linux ``/proc``; elsewhere its peak, ``ru_maxrss``).

    Free heap is handed back to the OS first (``gc.collect()`` and glibc's ``malloc_trim``):
    otherwise RSS moves by +-10% with whatever the allocator happens to keep cached (measured:
    311-348 MiB over 3,000 chunks), while memory still referenced, a leak, cannot be trimmed.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def live_tensors() -> int:
    """``torch.Tensor`` objects alive now (after a full collection)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() touches deprecated torch module attributes
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def run_soak(
    cfg: SoakConfig,
    *,
    count_tensors: bool = False,
    on_sample: Callable[[Sample], None] | None = None,
) -> SoakResult:
    """Write ``cfg.chunks`` chunks (pin every ``cfg.pin_every``), sampling every ``cfg.sample_every``."""
    torch.set_grad_enabled(False)
    cache = QVGPackedCausalKVCache(cfg.spec(), QVGKVQuantArgs(codec=f"int{cfg.bits}"))
    data = StreamKV(cfg.heads, cfg.head_dim)
    n = cfg.tokens_per_chunk
    pool = [(data.chunk(i, n, 0), data.chunk(i, n, 1)) for i in range(cfg.pool)]
    result = SoakResult(cfg)
    start = last = time.perf_counter()
    for i in range(cfg.chunks):
        k, v = pool[i % cfg.pool]
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
        if cfg.pin_every and i % cfg.pin_every == 0 and i > 0:
            cache.pin_current_chunk(n)
        if (i + 1) % cfg.sample_every == 0:
            now = time.perf_counter()
            sample = Sample(
                chunk=i + 1,
                resident_bytes=cache.resident_nbytes(),
                ms_per_chunk=1e3 * (now - last) / cfg.sample_every,
                rss_bytes=rss_bytes(),
                live_tensors=live_tensors() if count_tensors else None,
            )
            result.samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
            last = time.perf_counter()  # the sampling itself is not charged to the chunks
    result.seconds = time.perf_counter() - start
    result.quantize_calls = cache.quantize_calls
    result.packing = cache.packing_report().to_dict()
    return result


def _row(s: Sample) -> str:
    return (f"{s.chunk:>7d}  {s.resident_bytes:>14,d}  {s.ms_per_chunk:>9.1f}  "
            f"{s.rss_bytes / 2**20:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    q = QUICK
    p.add_argument("--chunks", type=int, default=None,
                   help=f"chunks to write (default {d.chunks}, --quick {q.chunks})")
    p.add_argument("--sample-every", type=int, default=None,
                   help=f"chunks between samples (default {d.sample_every}, --quick {q.sample_every})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"heads (default {d.heads})")
    p.add_argument("--tokens-per-frame", type=int, default=None,
                   help=f"tokens per frame (default {d.tokens_per_frame}, --quick {q.tokens_per_frame})")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run of seconds: {q.chunks} chunks of {q.tokens_per_chunk} tokens, "
                   f"a sample every {q.sample_every}")
    p.add_argument("--bits", type=int, choices=(2, 4), default=d.bits, help="QVG bits (default 2)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="allowed drift of resident bytes and RSS after the window filled (default 0.05)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1; 0 keeps torch's own choice)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    base = QUICK if args.quick else d
    for name in ("chunks", "sample_every", "tokens_per_frame"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(base, name))
    for name in ("chunks", "sample_every", "heads", "tokens_per_frame"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    cfg = SoakConfig(chunks=args.chunks, sample_every=args.sample_every, heads=args.heads,
                     tokens_per_frame=args.tokens_per_frame, bits=args.bits)
    if not args.json:
        print(f"soak: {cfg.chunks} chunks x {cfg.tokens_per_chunk} tokens, {cfg.heads} x "
              f"{cfg.head_dim} heads, int{cfg.bits}, pin every {cfg.pin_every}; window full "
              f"after chunk {cfg.fill_chunks}")
        print(f"{'chunk':>7s}  {'resident B':>14s}  {'ms/chunk':>9s}  {'RSS MiB':>9s}", flush=True)
    result = run_soak(cfg, on_sample=None if args.json else lambda s: print(_row(s), flush=True))
    summary = result.summary(args.tolerance)
    if args.json:
        json.dump({"config": asdict(cfg), "samples": [asdict(s) for s in result.samples],
                   "seconds": result.seconds, "quantize_calls": result.quantize_calls,
                   "packing": result.packing, "tolerance": args.tolerance, **summary},
                  sys.stdout, indent=2)
        print()
    else:
        ms = ("n/a" if summary["ms_per_chunk_min"] is None else
              f"{summary['ms_per_chunk_min']:.1f} / {summary['ms_per_chunk_median']:.1f} / "
              f"{summary['ms_per_chunk_max']:.1f}")
        print(f"{result.seconds:.0f} s; after the window filled: resident bytes drift "
              f"{summary['resident_drift']:.2%}, RSS drift {summary['rss_drift']:.2%} "
              f"(tolerance {args.tolerance:.0%}); ms/chunk min/median/max {ms}; "
              f"packing {result.packing}")
        print("OK" if summary["ok"] else "DRIFT beyond tolerance")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
