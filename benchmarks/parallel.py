"""Sequence parallel (Ulysses, torch.distributed): 1 vs 2 processes, side by side in one run.

A random-weight Wan transformer at a geometry where attention dominates (many tokens per
frame, few layers: by default 2 layers, 4 heads x 64, 32x32 latents = 256 tokens per frame,
3 frames = 768 tokens per chunk, a 12-frame window) runs ``--chunks`` chunks, each one
denoising call that advances every layer's dense causal cache (`CausalWanTransformer` with the
causal processors, the same call the stages make). Each row is a torchrun job of
``--nproc-per-node`` ranks, one thread per rank (torchrun's default OMP_NUM_THREADS=1), all
ranks seeded alike so the weights and inputs agree. Per row:

- time per chunk once the window is full (median of those chunks, the slowest rank, after a
  barrier each chunk);
- KV bytes one rank's caches hold at the end (each rank caches H/N heads);
- bytes one rank sends per chunk through the all-to-alls (counted, and the formula of
  `causalkv.runtime.processes.distributed.exchange_nbytes` next to it);
- the largest |difference| of the 2-rank output from the 1-rank output (same seed).

Run: ``.venv/bin/python benchmarks/parallel.py [--device cpu|cuda] [--chunks 8] [--json]``
(``--quick``: 2 chunks per row, a smoke run). On CUDA the 2-rank row needs 2 GPUs; with one GPU
only the 1-rank row runs and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GEOMETRY = {
    "num_layers": 2,
    "num_heads": 4,
    "head_dim": 64,
    "latent_hw": 32,  # 32x32 latents, patch 2x2 -> 256 tokens per frame
    "frames_per_chunk": 3,
    "window_frames": 12,
    "text_tokens": 16,
}


def build(device: torch.device, dtype: torch.dtype) -> Any:
    """The random-weight causal Wan transformer of `GEOMETRY` (seed 0 on every rank)."""
    from diffusers import WanTransformer3DModel

    from causalkv.runtime.model_io.causal_wan import CausalWanTransformer

    g = GEOMETRY
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=g["num_heads"], attention_head_dim=g["head_dim"],
        in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=256,
        num_layers=g["num_layers"], cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024,
    )
    return CausalWanTransformer(model.to(device=device, dtype=dtype))


def worker(args: argparse.Namespace) -> None:
    """One rank of a row: run the chunks, write this rank's figures (rank 0: the output too)."""
    import torch.distributed as dist

    from causalkv.caches import CausalCacheSpec, DenseCausalKVCache
    from causalkv.caches.cross import CrossAttentionKVCache
    from causalkv.runtime.processes.distributed import (
        EXCHANGE,
        exchange_nbytes,
        init_parallel,
        shutdown,
    )

    ctx = init_parallel(args.device)
    dtype = getattr(torch, args.dtype)
    net = build(ctx.device, dtype)
    net.enable_sequence_parallel(ctx)
    g = GEOMETRY
    hw = g["latent_hw"]
    tpf = net.tokens_per_frame(hw, hw)
    tpc = tpf * g["frames_per_chunk"]
    spec = CausalCacheSpec(batch_size=1, num_heads=net.num_heads, head_dim=net.head_dim,
                       cache_size=g["window_frames"] * tpf, dtype=dtype, device=ctx.device,
                       head_offset=net.head_offset)
    caches = [DenseCausalKVCache(spec) for _ in range(net.num_layers)]
    cross = [CrossAttentionKVCache() for _ in range(net.num_layers)]
    gen = torch.Generator().manual_seed(1)
    text = torch.randn(1, g["text_tokens"], 32, generator=gen)
    fpc = g["frames_per_chunk"]
    seconds, sent, outs = [], [], []
    for i in range(args.chunks):
        x = torch.randn(1, 4, fpc, hw, hw, generator=gen)
        EXCHANGE.reset()
        if ctx.world_size > 1:
            dist.barrier()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        out = net(x, 500.0, text, kv_caches=caches, cross_caches=cross,
                  token_start=i * tpc, rope_frame_start=i * fpc)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds.append(time.perf_counter() - t0)
        sent.append(EXCHANGE.bytes_sent)
        outs.append(out.cpu())
    record = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "seconds_per_chunk": seconds,
        "kv_bytes": sum(c.resident_nbytes() for c in caches),
        "all_to_all_bytes_per_chunk": sent,
        "all_to_all_bytes_formula": exchange_nbytes(
            tpc, int(net.model.config.num_attention_heads), net.head_dim,
            torch.tensor([], dtype=dtype).element_size(), ctx.world_size,
            layers=net.num_layers, calls=1),
        "tokens_per_chunk": tpc,
    }
    Path(args.out, f"rank{ctx.rank}.json").write_text(json.dumps(record))
    if ctx.is_main:
        torch.save(torch.cat(outs, dim=2), Path(args.out, "output.pt"))
    shutdown()


def run_row(nproc: int, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun job of ``nproc`` ranks; its summary row."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               __file__, "--worker", "--out", out, "--device", args.device, "--dtype", args.dtype,
               "--chunks", str(args.chunks)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{nproc}-rank job failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]
        output = torch.load(Path(out, "output.pt"))
    full = GEOMETRY["window_frames"] // GEOMETRY["frames_per_chunk"]  # chunks filling the window
    steady = slice(min(full, args.chunks - 1), None)  # chunks that attend over a full window
    slowest = [max(r["seconds_per_chunk"][i] for r in ranks) for i in range(args.chunks)]
    return {
        "processes": nproc,
        "tokens_per_chunk": ranks[0]["tokens_per_chunk"],
        "seconds_per_chunk": statistics.median(slowest[steady]),
        "kv_bytes_per_rank": ranks[0]["kv_bytes"],
        "kv_bytes_all_ranks": sum(r["kv_bytes"] for r in ranks),
        "all_to_all_bytes_per_chunk": ranks[0]["all_to_all_bytes_per_chunk"][-1],
        "all_to_all_bytes_formula": ranks[0]["all_to_all_bytes_formula"],
        "_output": output,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunks", type=int, default=None, help="chunks per row (default 8, --quick 2)")
    p.add_argument("--quick", action="store_true",
                   help="2 chunks per row (a smoke run: both rows, the same geometry)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunks is None:
        args.chunks = 2 if args.quick else 8
    if args.worker:
        worker(args)
        return 0
    rows = [run_row(1, args)]
    note = None
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        note = f"the 2-process row needs 2 GPUs; this machine has {torch.cuda.device_count()}"
    else:
        rows.append(run_row(2, args))
        rows[1]["max_abs_diff_vs_1"] = float((rows[1]["_output"] - rows[0]["_output"]).abs().max())
        rows[1]["max_abs_vs_1"] = float(rows[0]["_output"].abs().max())
        rows[1]["speedup_vs_1"] = rows[0]["seconds_per_chunk"] / rows[1]["seconds_per_chunk"]
        rows[1]["kv_bytes_per_rank_vs_1"] = rows[1]["kv_bytes_per_rank"] / rows[0]["kv_bytes_per_rank"]
    for r in rows:
        del r["_output"]
    result = {"device": args.device, "dtype": args.dtype, "geometry": GEOMETRY, "rows": rows, "note": note}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    g = GEOMETRY
    print(f"{args.device} {args.dtype}: {g['num_layers']} layers, {g['num_heads']} heads x {g['head_dim']}, "
          f"{rows[0]['tokens_per_chunk']} tokens/chunk, window {g['window_frames']} frames, "
          f"{args.chunks} chunks, one thread per process")
    print(f"{'procs':>5} {'s/chunk':>9} {'speedup':>8} {'KV B/rank':>11} {'KV/rank vs 1':>12} "
          f"{'a2a B/chunk/rank':>17} {'(formula)':>11} {'max|diff| vs 1':>15}")
    for r in rows:
        print(f"{r['processes']:>5} {r['seconds_per_chunk']:>9.4f} {r.get('speedup_vs_1', 1.0):>7.2f}x "
              f"{r['kv_bytes_per_rank']:>11,} {r.get('kv_bytes_per_rank_vs_1', 1.0):>12.2f} "
              f"{r['all_to_all_bytes_per_chunk']:>17,} {r['all_to_all_bytes_formula']:>11,} "
              f"{r.get('max_abs_diff_vs_1', 0.0):>15.2e}")
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
