"""KV codec benchmark: PRQ, FP8 and NVFP4 side by side (bytes, peak/dense at real geometry,
K/V and attention error, CPU throughput), and error vs bits against simpler quantizers and
real peers.

    .venv/bin/python benchmarks/codec.py                  # tables
    .venv/bin/python benchmarks/codec.py --json out.json  # also write the figures as JSON
    .venv/bin/python benchmarks/codec.py --json -         # JSON on stdout instead of tables
    .venv/bin/python benchmarks/codec.py --quick          # small shapes (smoke run, seconds)
    .venv/bin/python benchmarks/codec.py --only compare   # the codec comparison (+ throughput)

Peers (the ``bench`` extra: ``pip install -e '.[bench]'``; a missing one is reported, not
fatal): ``hqq`` (HQQ's ``Quantizer``, 2/4 bits, group 64 along the channels, its half-quadratic
zero/scale optimization), ``torchao`` (``choose_qparams_affine`` / ``quantize_affine`` /
``dequantize_affine``: asymmetric uint 2/4 bits, group 64, bf16 scale and zero point) and
``optimum-quanto`` (``quantize_weight`` with qint2/qint4, group 64, ``MaxOptimizer``). Every
peer's bits per element are counted as if it stored a 16-bit scale and zero per group
(``bits + 32/64``: 2.5 and 4.5, the count most favourable to it; ``bits_per_element``) and
as it actually stores them (``bits_stored``: the bytes of the tensors it returns; HQQ keeps
fp32 scale/zero on the CPU, torchao's primitives one uint8 per code, quanto packs the codes).

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
- ``prq-*``: variants (``kN`` N centroids, ``bN`` block N, ``mse4`` the all-levels grid).

- ``fp8``, ``nvfp4``: the codec settings of those names (`causalkv.caches.codecs`), bits as
  stored (FP8: e4m3 + an fp32 scale per token and head; NVFP4: e2m1 + an e4m3 scale per 16 +
  an fp32 scale per segment).

Comparison (``compare`` in the JSON): per codec setting and model geometry (LongLive 2.0,
LingBot-World, Self-Forcing, from the memory planner's `BUILTIN_MODELS`): bits per element
of one packed chunk (``S`` = the model's chunk tokens, ``D`` = its head_dim; the codec's byte
formula), ``peak_ratio`` / ``resident_ratio`` against sglang's dense cache for the model's
default request with keep-recent 0 and 1 (the planner, `causalkv memory`, whose figures equal
the real caches'), and, on one structured chunk ``[1, 2, S, D]`` of each geometry, the K and
V relative error and the relative error of the attention output of 256 queries over the
decoded K/V (against float64 attention over the exact K/V).

Targets (``targets`` in the JSON): for every peer row on the structured data (K and V, 2 and
4 bits), the lowest-error PRQ row with at most the peer's counted bits per element and a
lower error.

JSON (``--json``), schema ``causalkv.codec-bench/2`` (keys are stable; a part skipped with
``--only`` leaves its keys empty)::

    {"schema", "config": {"shape", "group", "quick", "torch", "threads"},
     "peers": {"hqq" | "torchao" | "quanto": {"package", "available", "version", "reason"}},
     "quality": [{"data": "structured" | "gaussian", "tensor": "K" | "V", "bits": 2 | 4,
                  "method", "family": "baseline" | "peer" | "prq",
                  "bits_per_element" (as counted), "bits_stored", "rel_err", "snr_db"}],
     "targets": [{"data", "tensor", "bits", "peer", "peer_bits_per_element", "peer_rel_err",
                  "prq_method", "prq_bits_per_element", "prq_rel_err", "met"}],
     "throughput": null | {"shape", "threads", "load_avg_1min",
                           "<codec>": {"encode_gbps", "decode_into_gbps", "copy_into_gbps",
                                       "decode_into_over_copy"}},
     "compare": [{"model", "codec", "S", "D", "bits_per_element", "peak_ratio_recent0",
                  "resident_ratio_recent0", "peak_ratio_default", "resident_ratio_default",
                  "k_rel_err", "v_rel_err", "attn_rel_err"}]}

Throughput: encode and decode-into-a-buffer of ``[1, 12, S, 128]`` bf16 per codec setting
(GB/s of the bf16 segment), next to ``copy_`` into a buffer of the same size, interleaved
(median of the repetitions). To compare with an older tree, run this script with
``PYTHONPATH=<that checkout>`` (as ``benchmarks/flag_path.py`` does).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from causalkv.caches.codecs import make_codec  # noqa: E402
from causalkv.caches.codecs.prq import bits_per_element, dequantize, quantize  # noqa: E402
from causalkv.caches.qvg import QVGKVQuantArgs  # noqa: E402
from causalkv.memory import (  # noqa: E402
    BUILTIN_MODELS,
    ROLLING_SLOT_CACHE,
    MemoryRequest,
    plan_setting,
    stream_layout,
)
from causalkv.memory.records import Setting  # noqa: E402

#: the codec settings compared side by side
CODECS = ("int4", "int2", "fp8", "nvfp4")
#: the geometries of the comparison (the memory planner's built-in models)
MODELS = ("longlive2", "lingbot", "self-forcing")


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
# peers (the `bench` extra)
# ---------------------------------------------------------------------------------------------
GROUP = 64
SCHEMA = "causalkv.codec-bench/2"


def _nbytes_deep(t) -> int:
    """Bytes of a tensor, or of every inner tensor of a tensor subclass (packed codes)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes_deep(getattr(t, n)) for n in names)
    return int(t.numel() * t.element_size())


def _peer_hqq(x2: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    from hqq.core.quantize import Quantizer

    w_q, meta = Quantizer.quantize(x2, nbits=bits, group_size=GROUP, axis=1, device="cpu",
                                   compute_dtype=torch.float32)
    y = Quantizer.dequantize(w_q, meta)
    return y, _nbytes_deep(w_q) + _nbytes_deep(meta["scale"]) + _nbytes_deep(meta["zero"])


def _peer_torchao(x2: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    from torchao.quantization.quant_primitives import (
        MappingType,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

    blk, qmax = (1, GROUP), 2**bits - 1
    scale, zero = choose_qparams_affine(
        x2, MappingType.ASYMMETRIC, blk, torch.uint8, quant_min=0, quant_max=qmax,
        scale_dtype=torch.bfloat16, zero_point_dtype=torch.bfloat16)
    q = quantize_affine(x2, blk, scale, zero, torch.uint8, 0, qmax)
    y = dequantize_affine(q, blk, scale, zero, torch.uint8, 0, qmax, output_dtype=torch.float32)
    return y, _nbytes_deep(q) + _nbytes_deep(scale) + _nbytes_deep(zero)


def _peer_quanto(x2: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    from optimum.quanto import MaxOptimizer, qint2, qint4
    from optimum.quanto.tensor.weights import quantize_weight

    qtype = {2: qint2, 4: qint4}[bits]
    scale, shift = MaxOptimizer()(x2, qtype, axis=0, group_size=GROUP)
    q = quantize_weight(x2, qtype=qtype, axis=0, scale=scale, shift=shift, group_size=GROUP,
                        optimized=False)
    return q.dequantize(), _nbytes_deep(q)


PEERS: dict[str, tuple[str, Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]]] = {
    "hqq": ("hqq", _peer_hqq),
    "torchao": ("torchao", _peer_torchao),
    "quanto": ("optimum-quanto", _peer_quanto),
}


def probe_peers() -> dict[str, dict]:
    """Which peers run here: ``{name: {available, package, version, reason}}``."""
    out = {}
    x = torch.randn(4, 2 * GROUP).to(torch.bfloat16)
    for name, (package, fn) in PEERS.items():
        info: dict = {"package": package, "available": False, "version": None, "reason": None}
        try:
            info["version"] = importlib.metadata.version(package)
            fn(x, 2)
            info["available"] = True
        except Exception as e:  # not installed, or broken against this torch/transformers
            info["reason"] = f"{type(e).__name__}: {e}"[:300]
        out[name] = info
    return out


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------
def prq_variants(bits: int) -> dict[str, QVGKVQuantArgs]:
    b = dict(codec=f"int{bits}")  # PRQ at ``bits``: the codec setting of that name
    return {
        "prq-ref": QVGKVQuantArgs(**b),
        "prq-mse4": QVGKVQuantArgs(**b, grid="mse4"),
        "prq-asym": QVGKVQuantArgs(**b, asymmetric=True),
        "prq-b32-mse4": QVGKVQuantArgs(**b, block_size=32, grid="mse4"),
        "prq-2stage": QVGKVQuantArgs(**b, stages=2),
        "prq-k64": QVGKVQuantArgs(**b, centroids=64),
        "prq-k64-mse4": QVGKVQuantArgs(**b, centroids=64, grid="mse4"),
        "prq-b128-k96-mse4": QVGKVQuantArgs(**b, block_size=128, centroids=96, grid="mse4"),
        "prq-b128-k64-mse4": QVGKVQuantArgs(**b, block_size=128, centroids=64, grid="mse4"),
        "prq-b128-k32-mse4": QVGKVQuantArgs(**b, block_size=128, centroids=32, grid="mse4"),
    }


def _row(data: str, tensor: str, bits: int, method: str, family: str, y: torch.Tensor,
         x: torch.Tensor, bpe: float, stored: float) -> dict:
    e = _rel(y.reshape(x.shape), x)
    return dict(data=data, tensor=tensor, bits=bits, method=method, family=family,
                bits_per_element=round(bpe, 4), bits_stored=round(stored, 4),
                rel_err=round(e, 5), snr_db=round(-20 * math.log10(max(e, 1e-12)), 2))


def quality(datasets: dict[str, tuple[torch.Tensor, torch.Tensor]], peers: dict[str, dict],
            methods: Collection[str] | None = None) -> list[dict]:
    """The quality rows; ``methods`` (names such as ``rtn-asym``, ``kivi``, ``prq-mse4``,
    ``fp8``) keeps only those (tests/test_doc_commands.py recomputes the docs' rows)."""
    rows = []

    def want(method: str) -> bool:
        return methods is None or method in methods

    for data, (k, v) in datasets.items():
        S, D = k.shape[2], k.shape[3]
        for bits in (2, 4):
            for tensor, x in (("K", k), ("V", v)):
                for sym in (True, False):
                    if not want("rtn-sym" if sym else "rtn-asym"):
                        continue
                    y, bpe = rtn(x, bits, GROUP, sym)
                    rows.append(_row(data, tensor, bits, "rtn-sym" if sym else "rtn-asym",
                                     "baseline", y, x, bpe, bpe))
                if want("kivi"):
                    y, bpe = kivi(x, bits, tensor == "K")
                    rows.append(_row(data, tensor, bits, "kivi", "baseline", y, x, bpe, bpe))
                x2 = x.reshape(-1, D)
                for name, info in peers.items():
                    if not info["available"] or not want(name):
                        continue
                    y, nbytes = PEERS[name][1](x2, bits)
                    rows.append(_row(data, tensor, bits, name, "peer", y, x,
                                     bits + 32 / GROUP, 8 * nbytes / x.numel()))
                for name, args in prq_variants(bits).items():
                    if not want(name):
                        continue
                    p = quantize(x, args)
                    y = dequantize(p, dtype=torch.float32)
                    rows.append(_row(data, tensor, bits, name, "prq", y, x,
                                     bits_per_element(S, D, args), 8 * p.nbytes / x.numel()))
            if bits == 4:  # the 4-bit-class and 8-bit formats: one row each, in the bits-4 group
                for tensor, x in (("K", k), ("V", v)):
                    for name in (n for n in ("fp8", "nvfp4") if want(n)):
                        c = make_codec(name, QVGKVQuantArgs(codec=name))
                        rec = c.encode(x)
                        y = c.decode(rec, torch.float32)
                        bpe = 8 * c.nbytes(tuple(x.shape)) / x.numel()
                        rows.append(_row(data, tensor, bits, name, name, y, x, bpe,
                                         8 * rec.nbytes / x.numel()))
    return rows


def targets(rows: list[dict], data: str = "structured") -> list[dict]:
    """For every peer row on ``data``: the lowest-error PRQ row with at most the peer's
    counted bits per element and a lower error (``met``), else the nearest miss."""
    out = []
    for peer in (r for r in rows if r["family"] == "peer" and r["data"] == data):
        same = [r for r in rows if r["family"] == "prq" and r["data"] == data
                and r["tensor"] == peer["tensor"] and r["bits"] == peer["bits"]
                and r["bits_per_element"] <= peer["bits_per_element"]]
        best = min(same, key=lambda r: r["rel_err"], default=None)
        out.append(dict(
            data=data, tensor=peer["tensor"], bits=peer["bits"], peer=peer["method"],
            peer_bits_per_element=peer["bits_per_element"], peer_rel_err=peer["rel_err"],
            prq_method=None if best is None else best["method"],
            prq_bits_per_element=None if best is None else best["bits_per_element"],
            prq_rel_err=None if best is None else best["rel_err"],
            met=best is not None and best["rel_err"] < peer["rel_err"],
        ))
    return out


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


def throughput(S: int, reps: int, codecs: tuple[str, ...] = CODECS) -> dict:
    """Per codec setting: encode and decode-into-a-buffer, and ``copy_``, interleaved in one
    run, on ``[1, 12, S, 128]`` bf16."""
    k, _ = structured_kv(H=12, frames=max(1, -(-S // 1560)))
    x = k[:, :, :S].contiguous()
    nbytes = x.numel() * 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out: dict = {"shape": list(x.shape), "threads": torch.get_num_threads(),
                 "load_avg_1min": None if load is None else round(load, 2)}
    for name in codecs:
        c = make_codec(name, QVGKVQuantArgs(codec=name))
        te = _median_time({"encode": lambda c=c: c.encode(x)}, max(1, reps // 3))
        rec = c.encode(x)
        buf, dst = torch.zeros_like(x), torch.zeros_like(x)
        t = _median_time({
            "decode": lambda c=c, r=rec, o=buf: c.decode_into(r, o),
            "copy": lambda o=dst: o.copy_(x),
        }, reps)
        out[name] = dict(
            encode_gbps=round(nbytes / te["encode"] / 1e9, 4),
            decode_into_gbps=round(nbytes / t["decode"] / 1e9, 3),
            copy_into_gbps=round(nbytes / t["copy"] / 1e9, 3),
            decode_into_over_copy=round(t["copy"] / t["decode"], 3),
        )
    return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``q [1, H, n, D]`` over ``k``/``v`` ``[1, H, S, D]``, float64."""
    q, k, v = q.double(), k.double(), v.double()
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return w @ v


def compare(quick: bool, codecs: tuple[str, ...] = CODECS) -> list[dict]:
    """The side-by-side table (module docstring, "Comparison")."""
    rows = []
    for model in MODELS:
        geom = BUILTIN_MODELS[model]
        lay = stream_layout(geom, MemoryRequest())
        S, D = lay.chunk_tokens, geom.head_dim
        S_data = min(S, QUICK_TOKENS) if quick else S
        hw = (30, 52)
        k, v = structured_kv(H=2, frames=-(-(S_data + 256) // (hw[0] * hw[1])), hw=hw, D=D,
                             seed=MODELS.index(model))
        q = k[:, :, S_data:S_data + 256]  # queries: the next tokens' keys
        k, v = k[:, :, :S_data].contiguous(), v[:, :, :S_data].contiguous()
        exact = _attention(q, k, v)
        for name in codecs:
            args = QVGKVQuantArgs(codec=name)
            c = make_codec(name, args)
            yk = c.decode(c.encode(k), torch.float32)
            yv = c.decode(c.encode(v), torch.float32)
            approx = _attention(q, yk, yv)
            row = dict(model=model, codec=name, S=S, D=D,
                       bits_per_element=round(c.bits_per_element(S, D), 4),
                       k_rel_err=round(_rel(yk, k), 5), v_rel_err=round(_rel(yv, v), 5),
                       attn_rel_err=round(_rel(approx, exact), 5))
            for label, keep in (("recent0", 0), ("default", 1)):
                plan = plan_setting(geom, lay, Setting(f"{name}-{label}", name, keep),
                                    cache=ROLLING_SLOT_CACHE)
                row[f"peak_ratio_{label}"] = round(plan.peak_ratio, 4)
                row[f"resident_ratio_{label}"] = round(plan.kv_ratio, 4)
            rows.append(row)
    return rows


#: ``--quick`` (a smoke run, seconds: every method, peer and codec setting, small tensors): the
#: quality data is one frame of 16 x 32 tokens, the throughput and comparison chunks 512 tokens
QUICK_HW, QUICK_TOKENS = (16, 32), 512


def quality_data(quick: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The quality table's K/V: ``structured`` and ``gaussian`` (see the module doc)."""
    frames, H, hw = (1, 2, QUICK_HW) if quick else (3, 4, (30, 52))
    k, v = structured_kv(H=H, frames=frames, hw=hw)
    g = torch.Generator().manual_seed(1)
    gk = torch.randn(k.shape, generator=g).to(torch.bfloat16)
    gv = torch.randn(k.shape, generator=g).to(torch.bfloat16)
    return {"structured": (k, v), "gaussian": (gk, gv)}


def run(quick: bool, reps: int, parts: str = "all") -> dict:
    S_tp = QUICK_TOKENS if quick else 14040
    data = quality_data(quick)
    k = data["structured"][0]
    res: dict = {
        "schema": SCHEMA,
        "config": {"shape": list(k.shape), "group": GROUP, "quick": quick,
                   "torch": torch.__version__, "threads": torch.get_num_threads()},
        "peers": {}, "quality": [], "targets": [], "throughput": None, "compare": [],
    }
    if parts in ("all", "quality"):
        res["peers"] = probe_peers()
        res["quality"] = quality(data, res["peers"])
        res["targets"] = targets(res["quality"])
    if parts in ("all", "throughput", "compare"):  # the comparison shows the throughput too
        res["throughput"] = throughput(S_tp, 3 if quick else reps)
    if parts in ("all", "compare"):
        res["compare"] = compare(quick)
    return res


def print_tables(res: dict) -> None:
    if res["quality"]:
        print_quality(res)
    if res["throughput"]:
        print_throughput(res["throughput"])
    if res["compare"]:
        print_compare(res["compare"], res["throughput"])


def print_quality(res: dict) -> None:
    print(f"quality: [B, H, S, D] = {res['config']['shape']}  (rel = ||x^-x||/||x||; bits/el "
          "as counted, peers with a 16-bit scale + zero per group of 64; stored = actual)")
    for name, info in res["peers"].items():
        if not info["available"]:
            print(f"  peer {name} ({info['package']}) not run: {info['reason']}")
    rows = res["quality"]
    key = lambda r: (r["data"], r["bits"], r["method"])  # noqa: E731
    pairs: dict = {}
    for r in rows:
        pairs.setdefault(key(r), {})[r["tensor"]] = r
    print(f"{'data':<11}{'b':<3}{'method':<19}{'bits/el':>8}{'stored':>8}"
          f"{'K rel':>9}{'V rel':>9}")
    for (data, bits, method), kv in pairs.items():
        r = kv["K"]
        print(f"{data:<11}{bits:<3}{method:<19}{r['bits_per_element']:>8.3f}{r['bits_stored']:>8.3f}"
              f"{kv['K']['rel_err']:>9.4f}{kv['V']['rel_err']:>9.4f}")
    print("\ntargets (structured): PRQ at <= the peer's counted bits with a lower error")
    for t in res["targets"]:
        mark = "met" if t["met"] else "MISSED"
        print(f"  {t['tensor']} int{t['bits']} {t['peer']:<8} {t['peer_bits_per_element']:.3f} b "
              f"{t['peer_rel_err']:.4f} vs {t['prq_method']} {t['prq_bits_per_element']} b "
              f"{t['prq_rel_err']}: {mark}")


def print_throughput(tp: dict) -> None:
    print(f"\nthroughput on this CPU: {tp['shape']} bf16, {tp['threads']} threads, "
          f"load average {tp['load_avg_1min']}")
    for name in CODECS:
        t = tp[name]
        print(f"{name}: encode {t['encode_gbps']} GB/s | decode into a buffer "
              f"{t['decode_into_gbps']} GB/s | copy_ {t['copy_into_gbps']} GB/s | "
              f"into/copy_ = {t['decode_into_over_copy']}")


def print_compare(rows: list[dict], tp: dict | None) -> None:
    """The comparison as a markdown table (docs/benchmarks.md)."""
    print("\n| model | codec | bits/el | peak/dense (recent 0) | peak/dense (recent 1) "
          "| K rel err | V rel err | attn rel err | encode GB/s | decode GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = (tp or {}).get(r["codec"]) if r["model"] == MODELS[0] else None
        speed = f"{t['encode_gbps']} | {t['decode_into_gbps']}" if t else " | "
        print(f"| {r['model']} (S={r['S']:,}, D={r['D']}) | {r['codec']} | "
              f"{r['bits_per_element']:.3f} | {r['peak_ratio_recent0']:.3f} | "
              f"{r['peak_ratio_default']:.3f} | {r['k_rel_err']:.4f} | {r['v_rel_err']:.4f} | "
              f"{r['attn_rel_err']:.4f} | {speed} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", nargs="?", const="-", default=None,
                    help="write the figures as JSON to PATH ('-' or no PATH: stdout, no tables)")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--reps", type=int, default=7, help="timing repetitions (median)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); 1 avoids thread barriers "
                         "stalling on a CPU shared with other jobs")
    ap.add_argument("--only", choices=("quality", "throughput", "compare"), default=None,
                    help="run one part only (the other part's JSON keys stay empty)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    res = run(a.quick, a.reps, a.only or "all")
    if a.json == "-":
        print(json.dumps(res, indent=1))
        return 0
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print_tables(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
