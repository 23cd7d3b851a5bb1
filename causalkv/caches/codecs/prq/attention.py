"""Flash attention that reads PRQ-packed K/V directly: `packed_attention` (Triton).

``packed_attention(query, k, v)`` is softmax attention of ``query [B, n, H, D]`` over one
packed K/V segment (two codec `PackedSegment` of ``[B, H, s, D]``), returning the output and
its log-sum-exp, so that `causalkv.caches.attend` can merge segments. The decoded K/V never
exist in global memory: each program decodes its K and V tiles in registers from what the
codec stores (format.py's module docstring has the byte layout):

- cluster ids ``[B, H, s]`` uint8 per stage -> rows of the bf16 centroids ``[B, H, K, D]``
  (small: at most 256 x D per head, so they stay in L1/L2);
- packed codes ``[B, H, s, D * bits / 8]`` -> signed levels by shifts (reference ``v``,
  ``mse4`` ``2v + 1``, asymmetric ``v - z`` with the int8 zero points);
- float8-e4m3 block scales ``[B, H, s, D / block]`` times ``2**scale_exp[b, h]``, decoded by
  the very function the codec's Triton dequantize kernel uses (`triton_impl._e4m3_scale`);
  the ``0x80`` byte (all-zero input block) zeroes the block, centroid included.

Tiling (FlashAttention-2's forward): one program per ``BLOCK_M`` queries of one (batch,
head); it loops over ``BLOCK_N``-token tiles of the segment, decodes the tile's K, takes
``Q K^T`` on the tensor cores (K rounded to the query dtype, as decode-to-bf16-then-attend
would), keeps the running row maximum and sum (online softmax, base-2 exponentials with the
softmax scale folded in), decodes the tile's V and accumulates ``P V`` in float32. Rows and
tokens past the ends are masked, so any ``n`` and ``s`` work. Every tensor is read through
its strides, so head slices (`PackedSegment.select_heads`) and token slices
(`PackedSegment.select_tokens`) of a stored segment are attended without a copy.

``merge_into=(acc, lse)`` fuses the log-sum-exp merge of segment-by-segment attention into
the kernel's epilogue: the program reads the running fp32 output and log-sum-exp of its rows,
combines them with its own and writes them back, so a packed segment costs no temporary at
all (`attend`'s fused path).

The kernel is correct under ``TRITON_INTERPRET=1`` on CPU tensors (tests/test_packed_attention.py
checks it against a float64 oracle); its speed is a GPU matter (benchmarks/gpu_attention.py).

This module imports triton at import time (like `triton_impl`); `causalkv.caches.attend`
imports it only when the fused path runs, so the CPU path never needs triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from causalkv.caches.codecs.prq.format import PackedSegment
from causalkv.caches.codecs.prq.triton_impl import _e4m3_scale, level_mode, segment_operands
from causalkv.caches.codecs.prq.triton_impl import interpreting as _triton_interpret
from causalkv.errors import CausalKVError, is_number

__all__ = [
    "PackedAttentionError",
    "packed_attention",
    "supports",
    "workspace_nbytes",
]

_LOG2E = 1.4426950408889634
_DOT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # `_operand`'s codes
_MAX_HEAD_DIM = 256
_MAX_GRID_Y = 65535


class PackedAttentionError(CausalKVError, ValueError):
    """`packed_attention` was given inputs it cannot attend (shapes, dtypes, devices, layout)."""


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def _expand(x, BLOCK_N: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    """Per-block values ``[BLOCK_N, NB]`` -> per-channel ``[BLOCK_N, NB * BS]``."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, NB, BS)), (BLOCK_N, NB * BS))


@triton.jit
def _operand(x, DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` as a ``tl.dot`` operand: ``DOT`` 0 float32, 1 float16, 2 bfloat16,
    rounded to nearest even.

    Under the interpreter (triton 3.9) a bfloat16 ``tl.dot`` multiplies the raw 16-bit
    patterns and a float32 -> bfloat16 cast truncates, so there the value is rounded to
    bfloat16 by integer arithmetic and kept in float32: a float32 product of two
    bfloat16-valued operands is exact, so the dot computes what the GPU's bf16 x bf16 ->
    fp32 tensor-core dot computes (up to the summation order).
    """
    if DOT == 2 and INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    elif DOT == 2:
        return x.to(tl.bfloat16)
    elif DOT == 1:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def _decode_tile(
    codes_ptr, sc_ptr, z_ptr, ids_ptr, cent_ptr, e, ids_sst, cent_sst, offs_s, s_ok,
    D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr,
    STAGES: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Decoded rows ``[BLOCK_N, D]`` float32 of tokens ``offs_s`` of one (batch, head).

    The pointers are already offset to the (batch, head); rows are contiguous (``D*BITS/8``
    code bytes, ``D/BS`` scale bytes and zero points per token), the centroid rows ``D``
    wide. Tokens outside ``s_ok`` decode to 0. Same arithmetic as the codec's dequantize
    kernel: ``sum of centroids * keep + level * scale``.
    """
    PER: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PER  # code bytes per token
    NB: tl.constexpr = D // BS  # scale blocks per token
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_b = tl.arange(0, DB)
    byte = tl.load(
        codes_ptr + offs_s[:, None] * DB + offs_b[None, :], mask=s_ok[:, None], other=0
    ).to(tl.int32)
    shifts = tl.arange(0, PER) * BITS
    fields = (byte[:, :, None] >> shifts[None, None, :]) & MASK  # [BLOCK_N, DB, PER]
    field = tl.reshape(fields, (BLOCK_N, D))  # channel = byte * PER + field index
    lvl = field - ((field >> (BITS - 1)) << BITS)  # sign-extend the two's-complement code
    offs_nb = tl.arange(0, NB)
    sb = tl.load(
        sc_ptr + offs_s[:, None] * NB + offs_nb[None, :], mask=s_ok[:, None], other=128
    ).to(tl.int32)
    scale = _expand(_e4m3_scale(sb, e), BLOCK_N, NB, BS)  # e4m3 x 2**scale_exp; 0x80 -> 0
    keep = _expand((sb != 128).to(tl.float32), BLOCK_N, NB, BS)
    if MODE == 1:
        lv = (2 * lvl + 1).to(tl.float32)
    elif MODE == 2:
        z = tl.load(
            z_ptr + offs_s[:, None] * NB + offs_nb[None, :], mask=s_ok[:, None], other=0
        ).to(tl.int32)
        lv = (lvl - _expand(z, BLOCK_N, NB, BS)).to(tl.float32)
    else:
        lv = lvl.to(tl.float32)
    offs_d = tl.arange(0, D)
    cent = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for st in tl.static_range(STAGES):
        cid = tl.load(ids_ptr + st * ids_sst + offs_s, mask=s_ok, other=0).to(tl.int32)
        c = tl.load(cent_ptr + st * cent_sst + cid[:, None] * D + offs_d[None, :])
        cent += c.to(tl.float32)
    return cent * keep + lv * scale


@triton.jit
def _packed_attention_kernel(
    q_ptr, o_ptr, lse_ptr,
    kc_ptr, ksc_ptr, kz_ptr, kid_ptr, kcent_ptr, kexp_ptr,
    vc_ptr, vsc_ptr, vz_ptr, vid_ptr, vcent_ptr, vexp_ptr,
    n, S, H, qk_scale,
    q_sb, q_sn, q_sh, o_sb, o_sn, o_sh, l_sb, l_sh, l_sn,
    kc_sb, kc_sh, ksc_sb, ksc_sh, kz_sb, kz_sh, kid_sst, kid_sb, kid_sh,
    kcent_sst, kcent_sb, kcent_sh, kexp_sb, kexp_sh,
    vc_sb, vc_sh, vsc_sb, vsc_sh, vz_sb, vz_sh, vid_sst, vid_sb, vid_sh,
    vcent_sst, vcent_sb, vcent_sh, vexp_sb, vexp_sh,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_BS: tl.constexpr, K_BITS: tl.constexpr, K_MODE: tl.constexpr, K_STAGES: tl.constexpr,
    V_BS: tl.constexpr, V_BITS: tl.constexpr, V_MODE: tl.constexpr, V_STAGES: tl.constexpr,
    MERGE: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid ``(cdiv(n, BLOCK_M), B * H)``: ``BLOCK_M`` queries of one (batch, head)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n
    offs_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * q_sb + h * q_sh + offs_m[:, None].to(tl.int64) * q_sn + offs_d[None, :],
        mask=m_ok[:, None], other=0.0,
    )
    if DOT == 2 and INTERPRET:
        q = q.to(tl.float32)  # exact; see `_operand`
    # this (batch, head)'s packed tensors
    kc = kc_ptr + b * kc_sb + h * kc_sh
    ksc = ksc_ptr + b * ksc_sb + h * ksc_sh
    kz = kz_ptr + b * kz_sb + h * kz_sh
    kid = kid_ptr + b * kid_sb + h * kid_sh
    kcent = kcent_ptr + b * kcent_sb + h * kcent_sh
    ke = tl.load(kexp_ptr + b * kexp_sb + h * kexp_sh).to(tl.int32)
    vc = vc_ptr + b * vc_sb + h * vc_sh
    vsc = vsc_ptr + b * vsc_sb + h * vsc_sh
    vz = vz_ptr + b * vz_sb + h * vz_sh
    vid = vid_ptr + b * vid_sb + h * vid_sh
    vcent = vcent_ptr + b * vcent_sb + h * vcent_sh
    ve = tl.load(vexp_ptr + b * vexp_sb + h * vexp_sh).to(tl.int32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_N):
        offs_s = s0 + tl.arange(0, BLOCK_N)
        s_ok = offs_s < S
        k = _decode_tile(kc, ksc, kz, kid, kcent, ke, kid_sst, kcent_sst, offs_s, s_ok,
                         D, K_BS, K_BITS, K_MODE, K_STAGES, BLOCK_N)
        k = _operand(k, DOT, INTERPRET)
        if DOT == 0:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(s_ok[None, :], qk * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _decode_tile(vc, vsc, vz, vid, vcent, ve, vid_sst, vcent_sst, offs_s, s_ok,
                         D, V_BS, V_BITS, V_MODE, V_STAGES, BLOCK_N)
        v = _operand(v, DOT, INTERPRET)
        p = _operand(p, DOT, INTERPRET)
        if DOT == 0:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log-sum-exp
    rows = offs_m.to(tl.int64)
    o_ptrs = o_ptr + b * o_sb + h * o_sh + rows[:, None] * o_sn + offs_d[None, :]
    l_ptrs = lse_ptr + b * l_sb + h * l_sh + rows * l_sn
    if MERGE:  # online-softmax merge into the running (acc, lse) of these rows, in place
        old = tl.load(o_ptrs, mask=m_ok[:, None], other=0.0)
        run = tl.load(l_ptrs, mask=m_ok, other=float("-inf"))
        mx = tl.maximum(run, lse)
        w_old = tl.exp(run - mx)
        w_new = tl.exp(lse - mx)
        total = w_old + w_new
        new = (old * (w_old / total)[:, None]) + out * (w_new / total)[:, None]
        tl.store(o_ptrs, new, mask=m_ok[:, None])
        tl.store(l_ptrs, mx + tl.log(total), mask=m_ok)
    else:
        tl.store(o_ptrs, _operand(out, DOT, INTERPRET).to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None])
        tl.store(l_ptrs, lse, mask=m_ok)


# ---------------------------------------------------------------------------------------------
# The host side
# ---------------------------------------------------------------------------------------------
def workspace_nbytes(k: PackedSegment, v: PackedSegment) -> int:
    """Bytes `packed_attention` allocates for ``k``/``v`` besides its outputs: 0 for what the
    codec produces with one stage (and its head/token slices); the stacked ids and centroids
    with several stages."""
    return segment_operands(k)[2] + segment_operands(v)[2]


def supports(query: torch.Tensor, k: PackedSegment, v: PackedSegment) -> str | None:
    """None when `packed_attention` can attend ``query`` over ``k``/``v``, else why not."""
    if query.dim() != 4:
        return f"query must be [B, n, H, D], got shape {tuple(query.shape)}"
    B, n, H, D = (int(x) for x in query.shape)
    if query.dtype not in _DOT:
        return f"query dtype must be one of bfloat16/float16/float32, got {query.dtype}"
    for name, seg in (("k", k), ("v", v)):
        if not isinstance(seg, PackedSegment):
            return f"{name} must be a codec PackedSegment, got {type(seg).__name__}"
        sb, sh, _, sd = seg.shape
        if (sb, sh, sd) != (B, H, D):
            return (f"{name} is [B, H, s, D] = {tuple(seg.shape)}, the query [B, n, H, D] = "
                    f"{tuple(query.shape)}: B, H and D must agree")
        if seg.device != query.device:
            return f"{name} is on {seg.device}, the query on {query.device}"
    if k.shape[2] != v.shape[2]:
        return f"k has {k.shape[2]} tokens, v {v.shape[2]}"
    if D & (D - 1) or not 16 <= D <= _MAX_HEAD_DIM:
        return f"head_dim must be a power of two in [16, {_MAX_HEAD_DIM}], got {D}"
    if B * H > _MAX_GRID_Y:
        return f"B*H = {B * H} exceeds {_MAX_GRID_Y}; attend the heads in slices"
    return None


def _tiles(D: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head_dim ``D``.

    On a GPU: 128 queries x 64 tokens with 8 warps (FlashAttention-2's forward tile for
    D = 128 on Ampere/Hopper; 4 warps at D <= 64), two pipeline stages. Under the
    interpreter: the same tile, which keeps the number of (Python-executed) programs low.
    """
    if device.type == "cuda":
        return 128, 64, 8 if D > 64 else 4, 2
    return 128, 64, 4, 1


def packed_attention(
    query: torch.Tensor,
    k: PackedSegment,
    v: PackedSegment,
    *,
    scale: float | None = None,
    merge_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` over one packed K/V segment, and its log-sum-exp.

    Args:
        query: ``[B, n, H, D]`` bfloat16, float16 or float32, any strides (contiguous along D
            or it is copied), on CUDA (or the CPU under ``TRITON_INTERPRET=1``).
        k, v: codec `PackedSegment` of ``[B, H, s, D]`` on the query's device: any bits,
            block size, grid, symmetric or asymmetric, any number of stages, head/token
            slices of a stored segment (their strides are read as they are). K and V may
            use different settings.
        scale: softmax scale (default ``1 / sqrt(D)``).
        merge_into: ``(acc [B, n, H, D] float32, lse [B, H, n] float32)``, any strides: the
            running output and log-sum-exp of earlier segments (``-inf`` rows for none). The
            kernel merges this segment into them in place (the online-softmax recurrence)
            and returns them; nothing else is allocated.
        tiles: ``(BLOCK_M, BLOCK_N)`` override, powers of two >= 16 (tests, tuning).

    Returns:
        ``(out [B, n, H, D] in query.dtype, lse [B, H, n] float32)``: ``out`` the softmax
        attention over the segment's decoded K/V (decoded in float32, rounded to the query
        dtype for the two products, accumulated in float32), ``lse`` the natural log-sum-exp
        of the scaled scores per query. With ``merge_into``: that pair, updated.

    Raises:
        PackedAttentionError: shapes, dtypes or devices that do not fit (the message names
            the value and what to pass instead), or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    why = supports(query, k, v)
    if why is not None:
        raise PackedAttentionError(f"packed_attention: {why}")
    B, n, H, D = (int(x) for x in query.shape)
    S = int(k.shape[2])
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if not is_number(scale) or scale <= 0:
        raise PackedAttentionError(f"packed_attention: scale must be a finite float > 0, got {scale!r}")
    dev = query.device
    if dev.type != "cuda" and not _triton_interpret():
        raise PackedAttentionError(
            f"packed_attention: tensors on {dev.type} need a CUDA device, or set "
            "TRITON_INTERPRET=1 before triton is imported to run the kernel on the CPU"
        )
    if query.stride(-1) != 1:
        query = query.contiguous()
    if merge_into is not None:  # the kernel reads and rewrites them in place
        out, lse = merge_into
        if (tuple(out.shape) != (B, n, H, D) or tuple(lse.shape) != (B, H, n)
                or out.dtype != torch.float32 or lse.dtype != torch.float32
                or out.device != dev or lse.device != dev or out.stride(-1) != 1):
            raise PackedAttentionError(
                f"packed_attention: merge_into must be (acc [{B}, {n}, {H}, {D}] float32 "
                f"contiguous along D, lse [{B}, {H}, {n}] float32) on {dev}, got "
                f"({tuple(out.shape)} {out.dtype} strides {out.stride()}, "
                f"{tuple(lse.shape)} {lse.dtype})"
            )
    else:
        out = torch.empty((B, n, H, D), dtype=query.dtype, device=dev)
        lse = torch.empty((B, H, n), dtype=torch.float32, device=dev)
    if n == 0:
        return out, lse
    block_m, block_n, warps, stages = _tiles(D, dev)
    if tiles is not None:
        block_m, block_n = (int(t) for t in tiles)
        if any(t < 16 or t & (t - 1) for t in (block_m, block_n)):
            raise PackedAttentionError(
                f"packed_attention: tiles must be powers of two >= 16, got {tiles!r}"
            )
    kt, ks, _ = segment_operands(k)
    vt, vs, _ = segment_operands(v)
    _packed_attention_kernel[(triton.cdiv(n, block_m), B * H)](
        query, out, lse, *kt, *vt,
        n, S, H, float(scale) * _LOG2E,
        *query.stride()[:3], *out.stride()[:3], *lse.stride(),
        *ks, *vs,
        D=D, BLOCK_M=block_m, BLOCK_N=block_n,
        K_BS=k.block_size, K_BITS=k.bits, K_STAGES=k.stages,
        K_MODE=level_mode(k.grid, k.asymmetric), V_MODE=level_mode(v.grid, v.asymmetric),
        V_BS=v.block_size, V_BITS=v.bits, V_STAGES=v.stages,
        MERGE=merge_into is not None, DOT=_DOT[query.dtype], INTERPRET=_triton_interpret(),
        num_warps=warps, num_stages=stages,
    )
    return out, lse
