"""Triton implementation of the PRQ codec's kernels (CUDA tensors; CPU under TRITON_INTERPRET=1).

A `causalkv.caches.codecs.prq.format.PRQKernels`, with the same functions and layouts as
`causalkv.caches.codecs.prq.torch_impl`:

- `kmeans_assign`: per (batch-head, token tile) a running argmin of ``||c||^2 - 2 x.c`` over
  centroid tiles (``tl.dot`` in IEEE fp32).
- `kmeans_update`: per (batch-head, centroid tile) the one-hot matmul ``onehot^T @ x`` over
  token tiles: a fixed summation order, so it is deterministic (no atomics).
- `quantize_pack`: per (token tile, channel block) round to the grid and OR the
  ``8 // bits`` fields of each byte together.
- `dequantize_into`: one fused kernel per (batch-head, token tile), whole rows: unpack
  each code byte once with shifts, decode the e4m3 scale bytes x ``2**scale_exp`` in
  registers, sum the assigned centroids of every stage, store into any-strided ``out``
  (16-byte vector stores when ``out`` is contiguous along D).

triton is optional: this module imports it when it can and says so in `AVAILABLE`
(`causalkv.caches.codecs.prq.quantizer` selects this backend only then). Without triton the
kernels below stay plain, never-launched functions. triton decides at import time whether its
kernels run interpreted, so set ``TRITON_INTERPRET=1`` before this module (or the codec)
is first imported to run them on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from causalkv.caches.codecs.base import CodecError
from causalkv.caches.codecs.prq.format import POISON_SCALE_EXP, PackedSegment
from causalkv.env import flag

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - ImportError, or a broken install: the backend is off
    triton = tl = None

__all__ = [
    "AVAILABLE",
    "dequantize_into",
    "interpreting",
    "kmeans_assign",
    "kmeans_update",
    "quantize_pack",
]

#: whether triton imports here (the codec selects this backend only when it does)
AVAILABLE: bool = triton is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for triton's interpreter (the kernels on CPU tensors):
    a `causalkv.env.flag`, default off (a value it does not take reads as off; triton reads it
    too)."""
    return flag("TRITON_INTERPRET", default=False, strict=False)


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``; without triton, ``fn`` as it is (never launched: `AVAILABLE` is False)."""
    return triton.jit(fn) if AVAILABLE else fn


def level_mode(grid: str, asymmetric: bool) -> int:
    """The kernels' ``MODE`` (how codes map to levels, `format`): 0 reference ``v``, 1 ``mse4``
    ``2v + 1``, 2 asymmetric ``v - z``."""
    return 2 if asymmetric else int(grid == "mse4")


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


# ---------------------------------------------------------------------------------------------
# k-means
# ---------------------------------------------------------------------------------------------
@_jit
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


@_jit
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
@_jit
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
    r, scale = r.contiguous(), scale.to(torch.float32).contiguous()
    z = zeros.contiguous() if zeros is not None else scale  # unused placeholder when symmetric
    codes = torch.empty(N, D * bits // 8, dtype=torch.uint8, device=r.device)
    BLOCK_T = 32
    _quant_pack_kernel[(triton.cdiv(N, BLOCK_T), D // block)](
        r, scale, z, codes, N, D=D, BS=block, BITS=bits, MODE=level_mode(grid, zeros is not None),
        BLOCK_T=BLOCK_T, BLOCK_B=_pow2(block * bits // 8, lo=1),
    )
    return codes


# ---------------------------------------------------------------------------------------------
# fused dequantize
# ---------------------------------------------------------------------------------------------
@_jit
def _e4m3_scale(u, e):
    """Decoded e4m3 byte ``u`` (int32 [T]) times ``2**e`` (int32 scalar), as float32.

    Exactly `format.scale_table`: the byte is ``M * 2**(max(E, 1) - 10)`` with the integer
    ``M = m + 8 * (E > 0)`` (``E`` the 4 exponent bits, ``m`` the 3 mantissa bits), so the
    product with ``2**e`` is the float64 ``M * 2**k`` (exact) rounded once to float32.
    ``0x80`` (all-zero input block) and the NaN bytes ``0x7F`` / ``0xFF`` decode to 0.
    """
    E = (u >> 3) & 15
    m = u & 7
    M = tl.where(E > 0, m + 8, m)
    k = tl.minimum(tl.maximum(tl.maximum(E, 1) - 10 + e, -1022), 1023)
    p2 = ((k + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    mag = M.to(tl.float64) * p2
    val = tl.where(u >= 128, -mag, mag).to(tl.float32)
    return tl.where((u == 128) | ((u & 127) == 127), 0.0, val)


@_jit
def _dequant_kernel(
    codes_ptr, sb_ptr, z_ptr, ids_ptr, cent_ptr, exp_ptr, out_ptr, S, H,
    c_sb, c_sh, s_sb, s_sh, z_sb, z_sh, i_sst, i_sb, i_sh, ce_sst, ce_sb, ce_sh, e_sb, e_sh,
    o_sb, o_sh, o_ss, o_sd,
    D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
    OUT_CONTIG: tl.constexpr, POISON: tl.constexpr,
):
    """One program = ``BLOCK_T`` tokens of one (batch, head), every channel of their rows.

    Grid ``(cdiv(S, BLOCK_T), B * H)``. Every tensor is read through its ``(b, h)`` strides
    (`segment_operands`: rows contiguous), so head and token slices of a segment are read in
    place. Per token tile: per scale block (static loop): the block's code bytes loaded once
    (contiguous) and unpacked with shifts, its scale bytes decoded in registers (no table),
    the assigned centroid rows (contiguous), and one store of ``BS`` contiguous channels per
    token.
    """
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = D // BS
    DB: tl.constexpr = D // PER  # code bytes per token
    BSB: tl.constexpr = BS // PER  # code bytes per block
    BLOCK_C: tl.constexpr = BLOCK_B * PER
    MASK: tl.constexpr = (1 << BITS) - 1
    bh = tl.program_id(1)
    s0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    lt = tl.arange(0, BLOCK_T)  # token within the tile
    s_ok = s0 + lt < S
    codes_base = codes_ptr + b * c_sb + h * c_sh + s0 * DB
    sb_base = sb_ptr + b * s_sb + h * s_sh + s0 * NB
    ids_base = ids_ptr + b * i_sb + h * i_sh + s0
    cent_base = cent_ptr + b * ce_sb + h * ce_sh
    e = tl.load(exp_ptr + b * e_sb + h * e_sh).to(tl.int32)
    out_base = out_ptr + (b * o_sb + h * o_sh + s0 * o_ss)
    out_rows = lt.to(tl.int64)[:, None] * o_ss
    offs_b = tl.arange(0, BLOCK_B)
    offs_c = tl.arange(0, BLOCK_C)  # channel within a block: byte offs_c // PER, field % PER
    shifts = tl.arange(0, PER) * BITS
    if BSB == BLOCK_B:
        mb = s_ok[:, None]
        mc = s_ok[:, None]
    else:
        mb = s_ok[:, None] & (offs_b < BSB)[None, :]
        mc = s_ok[:, None] & (offs_c < BS)[None, :]
    if STAGES == 1:  # the cluster ids once for every block
        cid0 = tl.load(ids_base + lt, mask=s_ok, other=0).to(tl.int32)
    for blk in tl.static_range(NB):
        sb = tl.load(sb_base + lt * NB + blk, mask=s_ok, other=0).to(tl.int32)
        scale = _e4m3_scale(sb, e)  # decoded e4m3 x 2**scale_exp[bh]; 0x80 -> 0
        scale = tl.where(e == POISON, float("nan"), scale)  # a poisoned head: NaN out
        keep = (sb != 128).to(tl.float32)  # all-zero input block: drop the centroids too
        byte = tl.load(
            codes_base + lt[:, None] * DB + (blk * BSB + offs_b)[None, :], mask=mb, other=0,
        ).to(tl.int32)
        fields = (byte[:, :, None] >> shifts[None, None, :]) & MASK  # [T, BLOCK_B, PER]
        field = tl.reshape(fields, [BLOCK_T, BLOCK_C])  # channel = byte * PER + field
        v = field - ((field >> (BITS - 1)) << BITS)  # sign-extend
        if MODE == 1:
            lv = (2 * v + 1).to(tl.float32)
        elif MODE == 2:
            z_base = z_ptr + b * z_sb + h * z_sh + s0 * NB
            z = tl.load(z_base + lt * NB + blk, mask=s_ok, other=0).to(tl.int32)
            lv = (v - z[:, None]).to(tl.float32)
        else:
            lv = v.to(tl.float32)
        ch = blk * BS + offs_c
        if STAGES == 1:
            c = tl.load(cent_base + cid0[:, None] * D + ch[None, :], mask=mc, other=0.0)
            acc = c.to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for st in tl.static_range(STAGES):
                cid = tl.load(ids_base + st * i_sst + lt, mask=s_ok, other=0).to(tl.int32)
                c = tl.load(
                    cent_base + st * ce_sst + cid[:, None] * D + ch[None, :], mask=mc, other=0.0
                )
                acc += c.to(tl.float32)
        val = acc * keep[:, None] + lv * scale[:, None]
        if OUT_CONTIG:
            optr = out_base + out_rows + ch[None, :]
        else:
            optr = out_base + out_rows + ch[None, :].to(tl.int64) * o_sd
        tl.store(optr, val, mask=mc)


def dequantize_into(packed: PackedSegment, out: torch.Tensor) -> None:
    """Write the reconstruction of ``packed`` into ``out [B, H, S, D]`` (any strides, float dtype).

    One kernel launch and no other device work for single-stage segments, whole or a head /
    token slice (`PackedSegment.select_heads` / ``select_tokens``): the tensors are passed as
    they are and read through their strides (`segment_operands`), the scale exponents are
    applied inside the kernel. Several stages stack their ids / centroids first.
    """
    B, H, S, D = packed.shape
    if B * H > 65535:  # the grid's second axis
        raise CodecError(
            f"dequantize (triton): B*H = {B * H} exceeds 65535; dequantize the heads in slices "
            "(packed.select_heads) or use backend='torch'"
        )
    tensors, strides, _ = segment_operands(packed)
    block_t = max(16, min(128, 8192 // _pow2(D)))  # tokens per program: ~8K channels
    block_b = _pow2(packed.block_size * packed.bits // 8, lo=1)  # padded code bytes per block
    mode = level_mode(packed.grid, packed.asymmetric)
    _dequant_kernel[(-(-S // block_t), B * H)](
        *tensors, out, S, H, *strides, *out.stride(),
        D=D, BS=packed.block_size, BITS=packed.bits, MODE=mode, STAGES=packed.stages,
        BLOCK_T=block_t, BLOCK_B=block_b, OUT_CONTIG=out.stride(3) == 1, POISON=POISON_SCALE_EXP,
        num_warps=4,
    )


def segment_operands(seg: PackedSegment) -> tuple[list[torch.Tensor], list[int], int]:
    """(tensors, strides, extra bytes) of one segment for a kernel that reads it in place
    (`_dequant_kernel`, `causalkv.caches.codecs.prq.attention`).

    Tensors: codes, scale bytes, zero points (the scale bytes again when symmetric: never
    read), ids, centroids, exponents; strides: ``(b, h)`` of the first three, ``(stage, b, h)``
    of ids and centroids, ``(b, h)`` of the exponents. Several stages stack their ids and
    centroids into one tensor each (a copy of ``stages * (s + K*D*2)`` bytes per head, counted
    in the extra bytes); so does a layout whose rows are not contiguous (never produced by the
    codec or by head/token slicing).
    """
    extra = 0

    def rows(t: torch.Tensor) -> torch.Tensor:
        """``t`` with each token's row contiguous (and so the rows of a head): as it is, or copied."""
        nonlocal extra
        if t.stride(-1) == 1 and (t.shape[-2] <= 1 or t.stride(-2) == t.shape[-1]):
            return t
        extra += t.nbytes
        return t.contiguous()

    codes = rows(seg.codes)
    sc = rows(seg.scales.view(torch.uint8))
    z = rows(seg.zeros) if seg.zeros is not None else sc
    if seg.stages == 1:  # in place, with a stage axis of one
        ids, cent = seg.ids[0][None], rows(seg.centroids[0])[None]
        if ids.stride(-1) != 1:
            extra += ids.nbytes
            ids = ids.contiguous()
    else:
        ids = torch.stack(seg.ids)  # [stages, B, H, s]
        cent = torch.stack(seg.centroids)  # [stages, B, H, K, D]
        extra += ids.nbytes + cent.nbytes
    tensors = [codes, sc, z, ids, cent, seg.scale_exp]
    strides = [st for t, n in zip(tensors, (2, 2, 2, 3, 3, 2)) for st in t.stride()[:n]]
    return tensors, strides, extra
