"""PRQ codec on a GPU: Triton vs PyTorch backend agreement, Triton dequantize vs HBM bandwidth.

    .venv/bin/python benchmarks/gpu_codec.py --json gpu_codec.json      # on a CUDA machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_codec.py --device cpu --smoke   # CPU smoke

Needs only torch, triton and causalkv (no benchmark extras); finishes in well under two
minutes on one GPU. Two parts:

1. ``checks``: on small CUDA tensors, for int2/int4 (reference grid, mse4, asymmetric, two
   stages): (a) the same packed segment dequantized by both backends (float32 out: relative
   difference at most ``2^-20``; bf16 out: at most one bf16 ulp); (b) ``quantize`` on both
   backends from the same seed: the same k-means ids and codes up to float summation near-ties
   (at least 95% equal, the CPU tests' bound) and reconstruction errors within 2% of each
   other; (c) the Triton backend packs a head slice with ``head_offset`` exactly like the same
   heads of the whole tensor (bit for bit).
2. ``throughput``: Triton ``dequantize(packed, out=buf)`` into an existing bf16 buffer at
   ``[1, 12, 14040, 128]`` and ``[1, 40, 4680, 128]``, int2 and int4 (reference defaults), vs
   ``buf.copy_(x)`` of the same bf16 tensor, timed with CUDA events (median). GB/s of bf16
   output and of packed input, and the kernel's memory traffic (packed read + bf16 write)
   as a fraction of the nominal HBM bandwidth (``--hbm-tbps``, default 4.8 for an H200).

JSON (``--json PATH``), schema ``causalkv.gpu-codec-bench/1``::

    {"schema", "device", "torch", "triton", "hbm_tbps_nominal",
     "checks": [{"name", "args", "shape", "dequant_f32_max_rel", "dequant_bf16_max_ulp",
                 "ids_equal_frac", "codes_equal_frac", "rel_err_torch", "rel_err_triton",
                 "head_offset_bitwise", "ok"}],
     "throughput": [{"shape", "bits", "packed_bytes", "bf16_bytes", "dequant_ms", "copy_ms",
                     "dequant_out_gbps", "dequant_packed_gbps", "dequant_traffic_gbps",
                     "dequant_hbm_frac", "copy_gbps", "copy_traffic_gbps", "copy_hbm_frac",
                     "dequant_over_copy"}],
     "ok": bool}

The exit status is 1 when a check fails. Without a CUDA device (``--device cuda``, the
default) it says so in one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from causalkv.caches.codecs.prq import dequantize, quantize  # noqa: E402
from causalkv.caches.qvg import QVGKVQuantArgs  # noqa: E402

SCHEMA = "causalkv.gpu-codec-bench/1"
CHECK_ARGS = {
    "int2": QVGKVQuantArgs(codec="int2"),
    "int4": QVGKVQuantArgs(codec="int4"),
    "int2-mse4": QVGKVQuantArgs(codec="int2", grid="mse4"),
    "int4-asym": QVGKVQuantArgs(codec="int4", asymmetric=True),
    "int2-2stage": QVGKVQuantArgs(codec="int2", stages=2, centroids=64),
}
BENCH_SHAPES = [(1, 12, 14040, 128), (1, 40, 4680, 128)]
BF16_ULP = 2.0**-7


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = tuple(int(v) for v in text.lower().split("x"))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape must be BxHxSxD, got {text!r}")
    return parts  # type: ignore[return-value]


def kv_like(shape: tuple[int, int, int, int], device: torch.device, seed: int = 0) -> torch.Tensor:
    """Clustered bf16 tokens (64 prototypes per head + noise), heads of different scales."""
    B, H, S, D = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    protos = torch.randn(B, H, 64, D, generator=g)
    which = torch.randint(0, 64, (B, H, S), generator=g)
    gain = 2.0 ** torch.randint(-4, 5, (1, H, 1, 1), generator=g).float()
    x = torch.gather(protos, 2, which.unsqueeze(-1).expand(-1, -1, -1, D))
    x = (x + 0.3 * torch.randn(B, H, S, D, generator=g)) * gain
    return x.to(device=device, dtype=torch.bfloat16)


def _rel(y: torch.Tensor, x: torch.Tensor) -> float:
    x64 = x.double()
    return float((y.double() - x64).norm() / x64.norm())


def check(name: str, args: QVGKVQuantArgs, shape, device: torch.device) -> dict:
    x = kv_like(shape, device, seed=len(name))
    pt = quantize(x, args, seed=7, backend="torch")
    pa = quantize(x, args, seed=7, backend="triton")
    # (a) one packed segment, both dequantizers
    want32 = dequantize(pt, dtype=torch.float32, backend="torch").double()
    got32 = dequantize(pt, dtype=torch.float32, backend="triton").double()
    scale = want32.abs().clamp_min(torch.finfo(torch.float32).tiny)
    f32_rel = float(((got32 - want32).abs() / scale).max())
    got16 = dequantize(pt, dtype=torch.bfloat16, backend="triton").double()
    ulp = float(((got16 - want32).abs() / (scale * BF16_ULP)).max())
    # (b) both quantizers from the same seed
    ids_eq = float(sum((a == b).float().mean() for a, b in zip(pa.ids, pt.ids)) / len(pa.ids))
    codes_eq = float((pa.codes == pt.codes).float().mean())
    e_t = _rel(dequantize(pt, dtype=torch.float32, backend="torch"), x)
    e_a = _rel(dequantize(pa, dtype=torch.float32, backend="triton"), x)
    # (c) head slices under the Triton backend
    H = shape[1]
    a, b = H // 3, H // 3 + max(1, H // 3)
    part = quantize(x[:, a:b], args, seed=7, backend="triton", head_offset=a)
    sub = pa.select_heads(a, b)
    same = (
        torch.equal(part.codes, sub.codes) and torch.equal(part.scale_exp, sub.scale_exp)
        and torch.equal(part.scales.view(torch.uint8), sub.scales.view(torch.uint8))
        and all(torch.equal(p, s) for p, s in zip(part.ids, sub.ids))
        and all(torch.equal(p, s) for p, s in zip(part.centroids, sub.centroids))
        and (part.zeros is None or torch.equal(part.zeros, sub.zeros))
    )
    ok = (f32_rel <= 2.0**-20 and ulp <= 1.0 + 1e-6 and ids_eq >= 0.95 and codes_eq >= 0.95
          and abs(e_a - e_t) <= 0.02 * e_t and same)
    return dict(name=name, args=args.describe(), shape=list(shape),
                dequant_f32_max_rel=f32_rel, dequant_bf16_max_ulp=ulp,
                ids_equal_frac=round(ids_eq, 5), codes_equal_frac=round(codes_eq, 5),
                rel_err_torch=round(e_t, 5), rel_err_triton=round(e_a, 5),
                head_offset_bitwise=same, ok=ok)


def _time(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall clock elsewhere)."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def throughput(shape, bits: int, device: torch.device, reps: int, hbm_tbps: float) -> dict:
    x = kv_like(shape, device, seed=bits)
    p = quantize(x, QVGKVQuantArgs(codec=f"int{bits}"), backend="triton")
    buf, dst = torch.empty_like(x), torch.empty_like(x)
    t_deq = _time(lambda: dequantize(p, out=buf, backend="triton"), device, reps)
    t_cp = _time(lambda: dst.copy_(x), device, reps)
    out_b, in_b = x.numel() * 2, p.nbytes
    hbm = hbm_tbps * 1e12
    return dict(
        shape=list(shape), bits=bits, packed_bytes=in_b, bf16_bytes=out_b,
        dequant_ms=round(t_deq * 1e3, 4), copy_ms=round(t_cp * 1e3, 4),
        dequant_out_gbps=round(out_b / t_deq / 1e9, 2),
        dequant_packed_gbps=round(in_b / t_deq / 1e9, 2),
        dequant_traffic_gbps=round((in_b + out_b) / t_deq / 1e9, 2),
        dequant_hbm_frac=round((in_b + out_b) / t_deq / hbm, 4),
        copy_gbps=round(out_b / t_cp / 1e9, 2),
        copy_traffic_gbps=round(2 * out_b / t_cp / 1e9, 2),
        copy_hbm_frac=round(2 * out_b / t_cp / hbm, 4),
        dequant_over_copy=round(t_cp / t_deq, 4),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu with TRITON_INTERPRET=1")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (median)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="nominal HBM bandwidth, TB/s")
    ap.add_argument("--check-shape", type=_shape, default=(1, 6, 2048, 128),
                    help="BxHxSxD of the backend checks (default 1x6x2048x128)")
    ap.add_argument("--bench-shape", type=_shape, action="append",
                    help="BxHxSxD to time (repeatable; default the two reference shapes)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, 1 repetition (CPU smoke test under TRITON_INTERPRET=1)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_codec: no CUDA device here; run it on a GPU machine (or --device cpu with "
              "TRITON_INTERPRET=1 --smoke)", file=sys.stderr)
        return 2
    import triton

    check_shape, shapes, reps = a.check_shape, a.bench_shape or BENCH_SHAPES, a.reps
    check_args = CHECK_ARGS
    if a.smoke:
        check_shape, shapes, reps = (1, 3, 96, 32), a.bench_shape or [(1, 2, 64, 64)], 1
        check_args = {n: QVGKVQuantArgs(**{**args.to_dict(), "centroids": 8, "block_size": 16})
                      for n, args in CHECK_ARGS.items()}
    t0 = time.perf_counter()
    checks = [check(n, args, check_shape, device) for n, args in check_args.items()]
    tp = [throughput(s, bits, device, reps, a.hbm_tbps) for s in shapes for bits in (2, 4)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    res = dict(schema=SCHEMA, device=name, torch=torch.__version__, triton=triton.__version__,
               hbm_tbps_nominal=a.hbm_tbps, checks=checks, throughput=tp,
               ok=all(c["ok"] for c in checks), seconds=round(time.perf_counter() - t0, 1))
    print(f"device: {name}   ({res['seconds']} s)")
    print(f"{'check':<13}{'f32 rel':>10}{'bf16 ulp':>9}{'ids=':>8}{'codes=':>8}"
          f"{'err torch':>10}{'err triton':>11}{'head_off':>9}{'ok':>6}")
    for c in checks:
        print(f"{c['name']:<13}{c['dequant_f32_max_rel']:>10.2e}{c['dequant_bf16_max_ulp']:>9.3f}"
              f"{c['ids_equal_frac']:>8.4f}{c['codes_equal_frac']:>8.4f}{c['rel_err_torch']:>10.4f}"
              f"{c['rel_err_triton']:>11.4f}{c['head_offset_bitwise']!s:>9}{c['ok']!s:>6}")
    print(f"\n{'shape':<20}{'bits':>5}{'deq ms':>9}{'out GB/s':>10}{'packed GB/s':>12}"
          f"{'HBM frac':>9}{'copy GB/s':>10}{'copy HBM':>9}{'deq/copy':>9}")
    for t in tp:
        print(f"{'x'.join(map(str, t['shape'])):<20}{t['bits']:>5}{t['dequant_ms']:>9.3f}"
              f"{t['dequant_out_gbps']:>10.1f}{t['dequant_packed_gbps']:>12.1f}"
              f"{t['dequant_hbm_frac']:>9.3f}{t['copy_gbps']:>10.1f}{t['copy_hbm_frac']:>9.3f}"
              f"{t['dequant_over_copy']:>9.3f}")
    print("(HBM frac: (packed read + bf16 write) / time / nominal; copy: read + write)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
