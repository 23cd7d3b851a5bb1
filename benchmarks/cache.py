"""Packed vs dense causal KV cache, side by side in one run.

For LingBot-World-like and LongLive-2.0-like streams (real tokens per frame and frames per
chunk, reduced head count) this drives a `DenseCausalKVCache` and a `QVGPackedCausalKVCache`
with the same chunks and reports, per QVG setting:

- resident bytes of the dense cache / the packed cache once the window is full (ratio);
- bf16 size / stored size of the packed segments alone (ratio);
- relative error ||packed view - dense view|| / ||dense view|| of the visible K and V;
- time per advance, packed / dense (ratio, measured in the same loop);
- peak temporary bytes of attention over the window for a chunk of queries: the materialized
  window's K+V vs segment streaming (`AttendStats`: one dequantized segment plus one query
  block's partial output), each as a multiple of one chunk's dense K+V.

Then a LongLive-2.0-like stream with scene cuts runs ``--long-chunks`` chunks at int2 and
shows resident bytes staying flat once the window is full.

Data: `stream_kv` below. Each head has a few cluster centres (token vectors cluster, as
video tokens of similar content do), a slow drift of those centres over chunks (frames
change gradually), token noise, and a handful of outlier channels with 8x the scale (the
channel outliers known from LLM and video K caches). Keys and values use independent draws.

``--centroid-sweep`` instead measures the centroid rule of the packed cache
(`causalkv.caches.codecs.prq.centroids.centroids_for`): for chunks of a few dozen to 7,040 tokens of
`benchmarks/codec.py`'s structured K/V (2 heads x 128), the relative error and bits per
element of int2 and int4 with the rule's centroid count, half and twice it, and the
reference's fixed 128 (capped at the token count, as the codec does).

Run: ``.venv/bin/python benchmarks/cache.py [--chunks 60] [--long-chunks 1000] [--centroid-sweep] [--json]``;
``--quick`` runs every stream and setting at 16 tokens per frame, each just past a full window,
and a 24-chunk long run (a smoke run of seconds, what the test runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache
from causalkv.caches.attention import AttendStats, attend, attend_dense
from causalkv.caches.codecs.prq import bits_per_element, dequantize, quantize
from causalkv.caches.codecs.prq.centroids import centroids_for
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache


@dataclass(frozen=True)
class StreamConfig:
    name: str
    tokens_per_frame: int
    frames_per_chunk: int
    sink_frames: int
    global_sink_frames: int
    window_frames: int
    heads: int = 2
    head_dim: int = 128
    scene_cut_every: int = 0  # pin a shot sink every N chunks (LongLive 2.0)

    @property
    def chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk

    def spec(self) -> CausalCacheSpec:
        tpf = self.tokens_per_frame
        return CausalCacheSpec(
            batch_size=1, num_heads=self.heads, head_dim=self.head_dim,
            cache_size=self.window_frames * tpf, sink_tokens=self.sink_frames * tpf,
            global_sink_tokens=self.global_sink_frames * tpf, dtype=torch.bfloat16,
        )


CONFIGS = [
    StreamConfig("lingbot-world", 1560, 3, 3, 3, 45),
    StreamConfig("longlive2", 880, 8, 8, 8, 32, scene_cut_every=4),
]
#: ``--quick``: the same streams (frames, sinks, windows, cuts) at this many tokens per frame
QUICK_TOKENS_PER_FRAME = 16


def settings() -> list[tuple[str, QVGKVQuantArgs]]:
    return [
        ("int2 reference", QVGKVQuantArgs(codec="int2")),
        ("int4 reference", QVGKVQuantArgs(codec="int4")),
        # beyond the reference: amortize the bf16 centroids over more tokens
        ("int2 span=5", QVGKVQuantArgs(codec="int2", span_chunks=5)),
        ("int2 cb=4 c64 mse4", QVGKVQuantArgs(codec="int2", codebook_chunks=4, centroids=64, grid="mse4")),
        ("int2 cb=3 c96 mse4", QVGKVQuantArgs(codec="int2", codebook_chunks=3, centroids=96, grid="mse4")),
    ]


@dataclass
class StreamKV:
    """Deterministic structured K/V chunks ``[1, n, H, D]`` (see module docstring)."""

    heads: int
    head_dim: int
    seed: int = 0
    clusters: int = 24
    outliers: int = 4
    centres: dict = field(default_factory=dict)

    def chunk(self, index: int, n: int, which: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + which)
        centres = torch.randn(self.heads, self.clusters, self.head_dim, generator=g)
        drift = torch.randn(self.heads, self.clusters, self.head_dim, generator=g) * 0.02
        scale = torch.ones(self.head_dim)
        scale[torch.randperm(self.head_dim, generator=g)[: self.outliers]] = 8.0
        g.manual_seed(self.seed * 104729 + index * 2 + which)
        assign = torch.randint(0, self.clusters, (self.heads, n), generator=g)
        c = centres + drift * index
        x = torch.gather(c, 1, assign[..., None].expand(-1, -1, self.head_dim))
        x = x + 0.3 * torch.randn(self.heads, n, self.head_dim, generator=g)
        return (x * scale).permute(1, 0, 2)[None].to(torch.bfloat16)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_stream(cfg: StreamConfig, q: QVGKVQuantArgs, chunks: int) -> dict:
    spec = cfg.spec()
    dense, packed = DenseCausalKVCache(spec), QVGPackedCausalKVCache(spec, q)
    data = StreamKV(cfg.heads, cfg.head_dim)
    t_dense = t_packed = 0.0
    n = cfg.chunk
    for i in range(chunks):
        k, v = data.chunk(i, n, 0), data.chunk(i, n, 1)
        for cache in (dense, packed):
            t0 = time.perf_counter()
            view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
            dt = time.perf_counter() - t0
            if cache is dense:
                t_dense += dt
                ref = view
            else:
                t_packed += dt
                out = view
            if cfg.scene_cut_every and i % cfg.scene_cut_every == 0 and i > 0:
                cache.pin_current_chunk(n)
    packed_bf16 = sum(2 * (s.end - s.start) * cfg.heads * cfg.head_dim * 2 for s in packed.packed_segments())
    dense_held = sum(s.nbytes for s in packed.segments if not s.packed)
    packed_stored = packed.resident_nbytes() - dense_held  # shared codebooks counted once
    one_chunk = 2 * n * cfg.heads * cfg.head_dim * 2
    query = data.chunk(chunks, n, 2)  # a whole chunk of queries, as in generation
    stats = AttendStats()
    streamed = attend(query, out, stats=stats)  # streams segment by segment
    streaming_peak = stats.peak_transient_nbytes
    k_err, v_err = rel_err(out.k, ref.k), rel_err(out.v, ref.v)  # materializes the window
    materialized_peak = out.k.nbytes + out.v.nbytes
    attn_err = rel_err(streamed, attend_dense(query, out.k, out.v))
    assert out.position_ranges == ref.position_ranges
    return {
        "config": cfg.name,
        "setting": q.describe(),
        "chunks": chunks,
        "resident_dense_bytes": dense.resident_nbytes(),
        "resident_packed_bytes": packed.resident_nbytes(),
        "window_ratio": dense.resident_nbytes() / packed.resident_nbytes(),
        "packed_segment_ratio": packed_bf16 / packed_stored if packed_stored else None,
        "k_rel_err": k_err,
        "v_rel_err": v_err,
        "advance_time_ratio": t_packed / t_dense,
        "advance_ms_dense": 1e3 * t_dense / chunks,
        "advance_ms_packed": 1e3 * t_packed / chunks,
        "materialized_peak_segments": materialized_peak / one_chunk,
        "streaming_peak_segments": streaming_peak / one_chunk,
        "quantize_calls": packed.quantize_calls,
        "packing": packed.packing_report().to_dict(),
        "streaming_vs_materialized_attention_rel_err": attn_err,
    }


def run_long(chunks: int, tokens_per_frame: int) -> dict:
    cfg = StreamConfig("longlive2-long", tokens_per_frame, 8, 8, 8, 32, heads=2, scene_cut_every=4)
    spec = cfg.spec()
    cache = QVGPackedCausalKVCache(spec, QVGKVQuantArgs(codec="int2"))
    data = StreamKV(cfg.heads, cfg.head_dim)
    n = cfg.chunk
    sizes = []
    k, v = data.chunk(0, n, 0), data.chunk(0, n, 1)
    t0 = time.perf_counter()
    for i in range(chunks):
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
        if i % cfg.scene_cut_every == 0 and i > 0:
            cache.pin_current_chunk(n)
        sizes.append(cache.resident_nbytes())
    full = cfg.window_frames // cfg.frames_per_chunk + 2
    tail = sizes[full:]
    return {
        "config": cfg.name,
        "chunks": chunks,
        "tokens_per_chunk": n,
        "resident_bytes_first_full": tail[0] if tail else None,
        "resident_bytes_min_after_full": min(tail) if tail else None,
        "resident_bytes_max_after_full": max(tail) if tail else None,
        "resident_bytes_final": sizes[-1],
        "flat": bool(tail) and max(tail) == min(tail),
        "seconds": time.perf_counter() - t0,
        "quantize_calls": cache.quantize_calls,
        "packing": cache.packing_report().to_dict(),
    }


SWEEP_TOKENS = ((3, (4, 4)), (3, (8, 8)), (3, (10, 16)), (8, (10, 11)), (3, (30, 52)), (8, (22, 40)))
"""(frames, (h, w)) of the swept chunks: 48, 192, 480, 880, 4,680 and 7,040 tokens."""


def centroid_sweep() -> list[dict]:
    """Error and bits per element around the centroid rule (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from codec import structured_kv  # the codec benchmark's data

    rows = []
    for frames, hw in SWEEP_TOKENS:
        k, v = structured_kv(H=2, frames=frames, hw=hw, D=128, seed=1)
        S, D = k.shape[2], k.shape[3]
        rule = centroids_for(S, 128)
        for bits in (2, 4):
            for label, K in (("rule/2", rule // 2), ("rule", rule), ("rule*2", rule * 2),
                             ("fixed 128", min(128, S))):
                if K < 1 or K > S:
                    continue
                q = QVGKVQuantArgs(codec=f"int{bits}", centroids=K)
                err = [rel_err(dequantize(quantize(x, q)), x) for x in (k, v)]
                rows.append({"tokens": S, "bits": bits, "which": label, "centroids": K,
                             "bits_per_element": bits_per_element(S, D, q),
                             "k_rel_err": err[0], "v_rel_err": err[1]})
    return rows


def _ratio(x: float | None) -> str:
    return "  none" if x is None else f"{x:5.2f}x"  # none: no segment was packed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=None,
                   help="chunks per stream (default 60; --quick: the window's chunks + 3)")
    p.add_argument("--long-chunks", type=int, default=None,
                   help="chunks of the long LongLive-2.0-like int2 run (default 1000, --quick 24; 0 skips)")
    p.add_argument("--long-tokens-per-frame", type=int, default=None,
                   help="tokens per frame of the long run (default 110 = 880/8, to keep it short; --quick 16)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run of seconds: every stream and setting at 16 tokens per frame, "
                   "each stream just past a full window, a 24-chunk long run")
    p.add_argument("--config", choices=[c.name for c in CONFIGS], action="append",
                   help="run only these stream configs")
    p.add_argument("--centroid-sweep", action="store_true",
                   help="only measure error vs bits around the centroid rule")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.centroid_sweep:
        sweep = centroid_sweep()
        if args.json:
            json.dump({"centroid_sweep": sweep}, sys.stdout, indent=2)
            print()
        for r in [] if args.json else sweep:
            print(f"{r['tokens']:5d} tokens int{r['bits']} {r['which']:9s} K={r['centroids']:3d}  "
                  f"{r['bits_per_element']:5.2f} bits/elem  err K {r['k_rel_err']:.3f} "
                  f"V {r['v_rel_err']:.3f}")
        return 0
    rows = []
    for cfg in CONFIGS:
        if args.config and cfg.name not in args.config:
            continue
        chunks = args.chunks
        if args.quick:
            cfg = replace(cfg, tokens_per_frame=QUICK_TOKENS_PER_FRAME)
            chunks = chunks or cfg.window_frames // cfg.frames_per_chunk + 3
        for label, q in settings():
            row = run_stream(cfg, q, chunks or 60)
            row["label"] = label
            rows.append(row)
            if not args.json:
                print(
                    f"{cfg.name:14s} {label:18s} window {row['window_ratio']:5.2f}x  "
                    f"packed {_ratio(row['packed_segment_ratio'])}  "
                    f"err K {row['k_rel_err']:.4f} V {row['v_rel_err']:.4f}  "
                    f"advance {row['advance_time_ratio']:5.2f}x dense "
                    f"({row['advance_ms_packed']:.1f} vs {row['advance_ms_dense']:.1f} ms)  "
                    f"peak tmp: materialized {row['materialized_peak_segments']:.2f} / "
                    f"streaming {row['streaming_peak_segments']:.2f} segments",
                    flush=True,
                )
    long_chunks = (24 if args.quick else 1000) if args.long_chunks is None else args.long_chunks
    long_tpf = args.long_tokens_per_frame or (QUICK_TOKENS_PER_FRAME if args.quick else 110)
    long = run_long(long_chunks, long_tpf) if long_chunks else None
    if args.json:
        json.dump({"streams": rows, "long": long}, sys.stdout, indent=2)
        print()
    elif long:
        print(
            f"{long['config']}: {long['chunks']} chunks x {long['tokens_per_chunk']} tokens int2 in "
            f"{long['seconds']:.1f} s; resident bytes after the window filled: "
            f"min {long['resident_bytes_min_after_full']} max {long['resident_bytes_max_after_full']} "
            f"({'flat' if long['flat'] else 'NOT flat'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
