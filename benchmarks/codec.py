"""PRQ codec benchmark: error vs bits against simpler quantizers, and CPU throughput.

    .venv/bin/python benchmarks/codec.py            # table
    .venv/bin/python benchmarks/codec.py --json     # the same figures as JSON
    .venv/bin/python benchmarks/codec.py --quick    # smaller shapes (smoke run)

Data (``[B, H, S, D]`` bf16, S = frames x tokens per frame):

- ``structured``: a stand-in for a video model's K/V. Per head, 48 prototype token vectors
  N(0, 1); every frame is a ``h x w`` token grid whose 4x4 patches each draw a prototype
  (Zipf-like weights: a few dominant "textures"), plus N(0, 0.25^2) noise per token. The
  prototypes drift slowly over frames (``+ 0.04 * frame * direction``). Keys get 4 outlier
  channels per head scaled x8 (the channel outliers KIVI quantizes keys per channel for);
  values get a log-normal per-token gain (sigma 0.3).
- ``gaussian``: iid N(0, 1), the worst case for k-means.

Methods (relative error ``||x^ - x|| / ||x||``, SNR ``= -20 log10(rel)`` dB, bits/element):

- ``rtn-sym`` / ``rtn-asym``: round to nearest per (token, block of channels): symmetric
  absmax (``2^(b-1)-1`` levels each side) or min/max with ``2^b`` levels; fp16 scale (+ fp16 min).
- ``kivi``: KIVI-style asymmetric ``2^b`` levels: keys per channel over groups of 32 tokens,
  values per token over groups of 32 channels; fp16 scale + min (its fp16 recent window is
  not modelled: every token is quantized).
- ``prq-ref``: this codec at the reference defaults (centroids 128, block 64, 1 stage, 2 iters,
  symmetric reference grid).
- ``prq-*``: variants; ``best`` marks the lowest-error variant within 0.6 bits/element of
  ``prq-ref``.

Throughput: quantize and dequantize of ``[1, 12, S, 128]`` (bf16 GB/s of the segment), and a
plain ``clone`` of a tensor of the output's size in the same run (median of interleaved runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from causalkv.caches.qvg import (  # noqa: E402
    QVGKVQuantArgs,
    bits_per_element,
    dequantize,
    quantize,
)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def structured_kv(
    B: int = 1, H: int = 4, frames: int = 3, hw: tuple[int, int] = (30, 52), D: int = 128,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic K, V ``[B, H, frames*h*w, D]`` bf16 (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    h, w = hw
    P = 48
    protos = torch.randn(B, H, P, D, generator=g)
    drift = torch.randn(B, H, P, D, generator=g)
    weights = 1.0 / torch.arange(1, P + 1, dtype=torch.float32) ** 1.1
    ph, pw = math.ceil(h / 4), math.ceil(w / 4)
    frames_out = []
    for f in range(frames):
        patch = torch.multinomial(weights, B * H * ph * pw, replacement=True, generator=g)
        patch = patch.view(B, H, ph, pw)
        grid = patch.repeat_interleave(4, 2).repeat_interleave(4, 3)[:, :, :h, :w]
        ids = grid.reshape(B, H, h * w)
        pf = protos + 0.04 * f * drift
        tok = torch.gather(pf, 2, ids.unsqueeze(-1).expand(-1, -1, -1, D))
        frames_out.append(tok + 0.25 * torch.randn(B, H, h * w, D, generator=g))
    base = torch.cat(frames_out, dim=2)
    k = base.clone()
    outlier = torch.stack([torch.randperm(D, generator=g)[:4] for _ in range(H)])  # [H, 4]
    for hh in range(H):
        k[:, hh, :, outlier[hh]] *= 8.0
    v = torch.flip(base, dims=[-1]) * torch.exp(0.3 * torch.randn(B, H, base.shape[2], 1, generator=g))
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# baselines (float64, simulated; storage counted as fp16 scale/min per group)
# ---------------------------------------------------------------------------------------------
def _asym_groups(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Min/max uniform quantization with 2^bits levels over the last dim (groups)."""
    mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    mn16, mx16 = mn.half().double(), mx.half().double()
    step = ((mx16 - mn16) / (2**bits - 1)).clamp_min(1e-12)
    return torch.round((x - mn16) / step).clamp(0, 2**bits - 1) * step + mn16


def rtn(x: torch.Tensor, bits: int, block: int, symmetric: bool) -> tuple[torch.Tensor, float]:
    xb = x.double().unflatten(-1, (-1, block))
    if symmetric:
        q = 2 ** (bits - 1) - 1
        step = (xb.abs().amax(-1, keepdim=True) / q).half().double().clamp_min(1e-12)
        y = torch.round(xb / step).clamp(-q, q) * step
        return y.flatten(-2), bits + 16 / block
    return _asym_groups(xb, bits).flatten(-2), bits + 32 / block


def kivi(x: torch.Tensor, bits: int, is_key: bool, group: int = 32) -> tuple[torch.Tensor, float]:
    x64 = x.double()
    if is_key:  # per channel, groups of `group` tokens
        B, H, S, D = x64.shape
        pad = (-S) % group
        xp = torch.cat([x64, x64[:, :, -1:].expand(B, H, pad, D)], 2) if pad else x64
        g = xp.unflatten(2, (-1, group)).transpose(-1, -2)  # [B, H, S/g, D, g]
        y = _asym_groups(g, bits).transpose(-1, -2).flatten(2, 3)[:, :, :S]
    else:  # per token, groups of `group` channels
        y = _asym_groups(x64.unflatten(-1, (-1, group)), bits).flatten(-2)
    return y, bits + 32 / group


def _rel(y: torch.Tensor, x: torch.Tensor) -> float:
    x64 = x.double()
    return float((y.double() - x64).norm() / x64.norm())


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------
def prq_variants(bits: int) -> dict[str, QVGKVQuantArgs]:
    b = dict(bits=bits)
    return {
        "prq-ref": QVGKVQuantArgs(**b),
        "prq-mse4": QVGKVQuantArgs(**b, grid="mse4"),
        "prq-asym": QVGKVQuantArgs(**b, asymmetric=True),
        "prq-b32": QVGKVQuantArgs(**b, block_size=32),
        "prq-b32-mse4": QVGKVQuantArgs(**b, block_size=32, grid="mse4"),
        "prq-b16-mse4": QVGKVQuantArgs(**b, block_size=16, grid="mse4"),
        "prq-2stage": QVGKVQuantArgs(**b, stages=2),
        "prq-iters4-mse4": QVGKVQuantArgs(**b, kmeans_iters=4, grid="mse4"),
    }


def quality(datasets: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[dict]:
    rows = []
    for data, (k, v) in datasets.items():
        S, D = k.shape[2], k.shape[3]
        for bits in (2, 4):
            for tensor, x in (("K", k), ("V", v)):
                cases: list[tuple[str, torch.Tensor, float]] = []
                for sym in (True, False):
                    y, bpe = rtn(x, bits, 64, sym)
                    cases.append(("rtn-sym" if sym else "rtn-asym", y, bpe))
                y, bpe = kivi(x, bits, tensor == "K")
                cases.append(("kivi", y, bpe))
                for name, args in prq_variants(bits).items():
                    y = dequantize(quantize(x, args), dtype=torch.float32)
                    cases.append((name, y, bits_per_element(S, D, args)))
                ref_bpe = next(bpe for n, _, bpe in cases if n == "prq-ref")
                part = []
                for name, y, bpe in cases:
                    e = _rel(y, x)
                    part.append(dict(data=data, tensor=tensor, bits=bits, method=name,
                                     bits_per_element=round(bpe, 4), rel_err=round(e, 5),
                                     snr_db=round(-20 * math.log10(max(e, 1e-12)), 2)))
                prq = [r for r in part if r["method"].startswith("prq-")
                       and r["bits_per_element"] <= ref_bpe + 0.6]
                min(prq, key=lambda r: r["rel_err"])["best"] = True
                rows += part
    return rows


def _median_time(fns: dict, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm up
    for _ in range(reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def throughput(S: int, reps: int) -> dict:
    k, _ = structured_kv(H=12, frames=max(1, S // 1560))
    x = k[:, :, :S].contiguous()
    nbytes = x.numel() * 2
    out = {"shape": list(x.shape), "threads": torch.get_num_threads()}
    for bits in (2, 4):
        args = QVGKVQuantArgs(bits=bits)
        tq = _median_time({"q": lambda a=args: quantize(x, a)}, max(1, reps // 3))["q"]
        p = quantize(x, args)
        t = _median_time({"clone": lambda: x.clone(), "deq": lambda pp=p: dequantize(pp)}, reps)
        # Without allocation (how the cache materializes a window): dequantize into an
        # existing buffer vs a plain copy into an existing buffer, interleaved.
        buf, dst = torch.zeros_like(x), torch.zeros_like(x)
        t_into = _median_time({
            "deq_into": lambda pp=p, o=buf: dequantize(pp, out=o),
            "copy_into": lambda o=dst: o.copy_(x),
        }, reps)
        out[f"int{bits}"] = dict(
            quantize_gbps=round(nbytes / tq / 1e9, 4),
            dequantize_gbps=round(nbytes / t["deq"] / 1e9, 3),
            dequantize_into_gbps=round(nbytes / t_into["deq_into"] / 1e9, 3),
            clone_gbps=round(nbytes / t["clone"] / 1e9, 3),
            dequantize_over_clone=round(t["clone"] / t["deq"], 3),
            copy_into_gbps=round(nbytes / t_into["copy_into"] / 1e9, 3),
            dequantize_into_over_copy=round(t_into["copy_into"] / t_into["deq_into"], 3),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--reps", type=int, default=7, help="timing repetitions (median)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    frames, H, S_tp = (1, 2, 1560) if a.quick else (3, 4, 14040)
    k, v = structured_kv(H=H, frames=frames)
    g = torch.Generator().manual_seed(1)
    gk = torch.randn(k.shape, generator=g).to(torch.bfloat16)
    gv = torch.randn(k.shape, generator=g).to(torch.bfloat16)
    rows = quality({"structured": (k, v), "gaussian": (gk, gv)})
    tp = throughput(S_tp, 3 if a.quick else a.reps)
    if a.json:
        print(json.dumps({"quality": rows, "throughput": tp}, indent=1))
        return 0
    print(f"quality: [B, H, S, D] = {list(k.shape)}  (rel = ||x^-x||/||x||)")
    print(f"{'data':<11}{'T':<3}{'b':<3}{'method':<17}{'bits/el':>8}{'rel err':>10}{'SNR dB':>8}")
    for r in rows:
        mark = "  <- best" if r.get("best") else ""
        print(f"{r['data']:<11}{r['tensor']:<3}{r['bits']:<3}{r['method']:<17}"
              f"{r['bits_per_element']:>8.3f}{r['rel_err']:>10.4f}{r['snr_db']:>8.2f}{mark}")
    print(f"\nthroughput on this CPU: {tp['shape']} bf16, {tp['threads']} threads")
    for bits in (2, 4):
        t = tp[f"int{bits}"]
        print(f"int{bits}: quantize {t['quantize_gbps']} GB/s | dequantize {t['dequantize_gbps']} "
              f"GB/s (into a buffer {t['dequantize_into_gbps']}) | clone {t['clone_gbps']} GB/s | "
              f"dequantize/clone = {t['dequantize_over_clone']} | into a buffer vs copy_ "
              f"{t['dequantize_into_over_copy']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
