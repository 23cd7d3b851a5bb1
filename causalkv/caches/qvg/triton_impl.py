"""Triton implementation of the PRQ codec's kernels (CUDA tensors; CPU under TRITON_INTERPRET=1).

Same functions and layouts as `causalkv.caches.qvg.torch_impl`:

- `kmeans_assign`: per (batch-head, token tile) a running argmin of ``||c||^2 - 2 x.c`` over
  centroid tiles (``tl.dot`` in IEEE fp32).
- `kmeans_update`: per (batch-head, centroid tile) the one-hot matmul ``onehot^T @ x`` over
  token tiles: a fixed summation order, so it is deterministic (no atomics).
- `quantize_pack`: per (token tile, channel block) round to the grid and OR the
  ``8 // bits`` fields of each byte together.
- `dequantize_into`: one fused kernel per (token tile, channel block): unpack, scale
  (via a 256-entry decoded e4m3 table), sum the assigned centroids of every stage, store
  into any-strided ``out``.

This module imports triton at import time; `causalkv.caches.qvg.codec` imports it only when
the Triton backend is selected, so the CPU path never needs triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from causalkv.caches.qvg.codec import PackedSegment

__all__ = ["dequantize_into", "kmeans_assign", "kmeans_update", "quantize_pack"]

_MODE_REFERENCE, _MODE_MSE, _MODE_ASYM = 0, 1, 2


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


# ---------------------------------------------------------------------------------------------
# k-means
# ---------------------------------------------------------------------------------------------
@triton.jit
def _assign_kernel(
    x_ptr, c_ptr, cn_ptr, ids_ptr, S, K, D,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < S
    d_ok = offs_d < D
    x = tl.load(
        x_ptr + bh * S * D + offs_s[:, None] * D + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    best = tl.full([BLOCK_S], float("inf"), tl.float32)
    best_i = tl.zeros([BLOCK_S], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        c = tl.load(
            c_ptr + bh * K * D + offs_k[:, None] * D + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :], other=0.0,
        )
        cn = tl.load(cn_ptr + bh * K + offs_k, mask=k_ok, other=float("inf"))
        dot = tl.dot(x, tl.trans(c), input_precision="ieee")
        dist = cn[None, :] - 2.0 * dot
        m, i = tl.min(dist, axis=1, return_indices=True)
        better = m < best
        best = tl.where(better, m, best)
        best_i = tl.where(better, i + k0, best_i)
    tl.store(ids_ptr + bh * S + offs_s, best_i, mask=s_ok)


def kmeans_assign(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Nearest centroid ``[BH, S]`` int64 of each token of ``x [BH, S, D]`` among ``c [BH, K, D]``."""
    BH, S, D = x.shape
    K = c.shape[1]
    x, c = x.contiguous(), c.contiguous()
    cn = (c * c).sum(-1).contiguous()
    ids = torch.empty(BH, S, dtype=torch.int32, device=x.device)
    BLOCK_S, BLOCK_K = 64, min(64, _pow2(K))
    _assign_kernel[(BH, triton.cdiv(S, BLOCK_S))](
        x, c, cn, ids, S, K, D, BLOCK_S=BLOCK_S, BLOCK_K=BLOCK_K, BLOCK_D=_pow2(D)
    )
    return ids.to(torch.int64)


@triton.jit
def _update_kernel(
    x_ptr, ids_ptr, c_ptr, out_ptr, S, K, D,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    k_ok = offs_k < K
    d_ok = offs_d < D
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    cnt = tl.zeros([BLOCK_K], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = offs_s < S
        ids = tl.load(ids_ptr + bh * S + offs_s, mask=s_ok, other=-1)
        onehot = (ids[None, :] == offs_k[:, None]).to(tl.float32)  # [BLOCK_K, BLOCK_S]
        x = tl.load(
            x_ptr + bh * S * D + offs_s[:, None] * D + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :], other=0.0,
        )
        acc += tl.dot(onehot, x, input_precision="ieee")
        cnt += tl.sum(onehot, axis=1)
    ptrs = bh * K * D + offs_k[:, None] * D + offs_d[None, :]
    m = k_ok[:, None] & d_ok[None, :]
    old = tl.load(c_ptr + ptrs, mask=m, other=0.0)
    mean = tl.math.div_rn(acc, tl.maximum(cnt, 1.0)[:, None])
    tl.store(out_ptr + ptrs, tl.where(cnt[:, None] > 0, mean, old), mask=m)


def kmeans_update(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Lloyd update ``[BH, K, D]``: cluster means, empty clusters keep ``c``; deterministic."""
    BH, S, D = x.shape
    K = c.shape[1]
    x, c = x.contiguous(), c.contiguous()
    ids32 = ids.to(torch.int32).contiguous()
    out = torch.empty_like(c)
    BLOCK_K = min(64, _pow2(K))
    _update_kernel[(BH, triton.cdiv(K, BLOCK_K))](
        x, ids32, c, out, S, K, D, BLOCK_S=64, BLOCK_K=BLOCK_K, BLOCK_D=_pow2(D)
    )
    return out


# ---------------------------------------------------------------------------------------------
# residual quantize + pack
# ---------------------------------------------------------------------------------------------
@triton.jit
def _quant_pack_kernel(
    r_ptr, s_ptr, z_ptr, codes_ptr, N,
    D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    NBYTE: tl.constexpr = BS // PER
    NB: tl.constexpr = D // BS
    HALF: tl.constexpr = 1 << (BITS - 1)
    blk = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    s = tl.load(s_ptr + t * NB + blk, mask=t_ok, other=0.0)
    safe = tl.where(s > 0, s, 1.0)
    if MODE == 2:
        z = tl.load(z_ptr + t * NB + blk, mask=t_ok, other=0).to(tl.float32)
    offs_b = tl.arange(0, BLOCK_B)
    m2 = t_ok[:, None] & (offs_b < NBYTE)[None, :]
    packed = tl.zeros([BLOCK_T, BLOCK_B], dtype=tl.int32)
    for j in tl.static_range(PER):
        ch = blk * BS + offs_b * PER + j
        r = tl.load(r_ptr + t[:, None] * D + ch[None, :], mask=m2, other=0.0)
        q = tl.math.div_rn(r, safe[:, None])
        if MODE == 1:
            v = tl.floor(q * 0.5)
            v = tl.minimum(tl.maximum(v, -HALF), HALF - 1)
        elif MODE == 2:
            v = tl.floor(q + 0.5) + z[:, None]
            v = tl.minimum(tl.maximum(v, -HALF), HALF - 1)
        else:
            v = tl.floor(q + 0.5)
            v = tl.minimum(tl.maximum(v, -(HALF - 1)), HALF - 1)
        v = tl.where(s[:, None] > 0, v, 0.0)
        field = v.to(tl.int32) & ((1 << BITS) - 1)
        packed = packed | (field << (BITS * j))
    tl.store(
        codes_ptr + t[:, None] * (D // PER) + blk * NBYTE + offs_b[None, :],
        packed.to(tl.uint8), mask=m2,
    )


def quantize_pack(
    r: torch.Tensor,
    scale: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    block: int,
    grid: str,
) -> torch.Tensor:
    """Quantize residual ``r [N, D]`` with decoded scales ``[N, nb]``; ``[N, D*bits//8]`` uint8."""
    N, D = r.shape
    mode = _MODE_ASYM if zeros is not None else (_MODE_MSE if grid == "mse4" else _MODE_REFERENCE)
    r, scale = r.contiguous(), scale.to(torch.float32).contiguous()
    z = zeros.contiguous() if zeros is not None else scale  # unused placeholder when symmetric
    codes = torch.empty(N, D * bits // 8, dtype=torch.uint8, device=r.device)
    BLOCK_T = 32
    _quant_pack_kernel[(triton.cdiv(N, BLOCK_T), D // block)](
        r, scale, z, codes, N, D=D, BS=block, BITS=bits, MODE=mode, BLOCK_T=BLOCK_T,
        BLOCK_B=_pow2(block * bits // 8, lo=1),
    )
    return codes


# ---------------------------------------------------------------------------------------------
# fused dequantize
# ---------------------------------------------------------------------------------------------
@triton.jit
def _dequant_kernel(
    codes_ptr, sb_ptr, z_ptr, ids_ptr, cent_ptr, table_ptr, out_ptr,
    N, S, H, K, BHKD,
    o_sb, o_sh, o_ss, o_sd,
    D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = D // BS
    blk = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    bh = t // S
    s_idx = t % S
    b = bh // H
    h = bh % H
    offs_c = tl.arange(0, BLOCK_C)
    ch = blk * BS + offs_c
    m2 = t_ok[:, None] & (offs_c < BS)[None, :]

    sb = tl.load(sb_ptr + t * NB + blk, mask=t_ok, other=0).to(tl.int32)
    scale = tl.load(table_ptr + bh * 256 + sb)  # decoded e4m3 x 2**scale_exp[bh]; 0x80 -> 0
    keep = (sb != 128).to(tl.float32)  # all-zero input block: drop the centroids too

    byte = tl.load(codes_ptr + t[:, None] * (D // PER) + (ch // PER)[None, :], mask=m2, other=0)
    field = (byte.to(tl.int32) >> ((ch % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    v = field - ((field >> (BITS - 1)) << BITS)  # sign-extend
    if MODE == 1:
        lv = (2 * v + 1).to(tl.float32)
    elif MODE == 2:
        z = tl.load(z_ptr + t * NB + blk, mask=t_ok, other=0).to(tl.int32)
        lv = (v - z[:, None]).to(tl.float32)
    else:
        lv = v.to(tl.float32)

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for st in tl.static_range(STAGES):
        cid = tl.load(ids_ptr + st * N + t, mask=t_ok, other=0).to(tl.int64)
        row = (bh.to(tl.int64) * K + cid) * D
        c = tl.load(cent_ptr + st * BHKD + row[:, None] + ch[None, :], mask=m2, other=0.0)
        acc += c.to(tl.float32)
    val = acc * keep[:, None] + lv * scale[:, None]
    o = b.to(tl.int64) * o_sb + h.to(tl.int64) * o_sh + s_idx.to(tl.int64) * o_ss
    tl.store(out_ptr + o[:, None] + ch[None, :].to(tl.int64) * o_sd, val, mask=m2)


def dequantize_into(packed: PackedSegment, out: torch.Tensor) -> None:
    """Write the reconstruction of ``packed`` into ``out [B, H, S, D]`` (any strides, float dtype)."""
    from causalkv.caches.qvg.codec import scale_table

    B, H, S, D = packed.shape
    N, nb = B * H * S, D // packed.block_size
    K = packed.num_centroids
    dev = out.device
    codes = packed.codes.reshape(N, -1).contiguous()
    sb = packed.scales.reshape(N, nb).view(torch.uint8).contiguous()
    ids = torch.stack([i.reshape(N) for i in packed.ids]).contiguous()  # [stages, N]
    cents = torch.stack([c.reshape(B * H * K * D) for c in packed.centroids]).contiguous()
    table = scale_table(packed.scale_exp, dev).contiguous()  # [B*H, 256]
    if packed.zeros is not None:
        mode, z = _MODE_ASYM, packed.zeros.reshape(N, nb).contiguous()
    else:
        mode, z = (_MODE_MSE if packed.grid == "mse4" else _MODE_REFERENCE), sb
    BLOCK_T = 32
    _dequant_kernel[(triton.cdiv(N, BLOCK_T), nb)](
        codes, sb, z, ids, cents, table, out,
        N, S, H, K, B * H * K * D,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        D=D, BS=packed.block_size, BITS=packed.bits, MODE=mode,
        STAGES=packed.stages, BLOCK_T=BLOCK_T, BLOCK_C=_pow2(packed.block_size, lo=1),
    )
