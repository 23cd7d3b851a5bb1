"""PyTorch implementation of the PRQ codec's kernels (any device; the CPU reference).

Every function here has a Triton twin in `causalkv.caches.qvg.triton_impl` with the same
signature; `causalkv.caches.qvg.codec` picks one. Layouts: ``x [BH, S, D]`` fp32 token
vectors per (batch, head), ``c [BH, K, D]`` fp32 centroids, residual ``r [N, D]`` fp32 with
``N = BH * S``, block scales ``[N, D // block]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from causalkv.caches.qvg.codec import PackedSegment

__all__ = [
    "dequantize_into",
    "kmeans_assign",
    "kmeans_update",
    "pack_fields",
    "quantize_pack",
    "unpack_levels",
]

_CHUNK_ELEMS = 1 << 24  # bound on the [chunk, S, K] distance / one-hot temporaries


def _bh_chunks(BH: int, per_bh: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMS // max(per_bh, 1))
    return [(i, min(i + step, BH)) for i in range(0, BH, step)]


def kmeans_assign(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Nearest centroid ``[BH, S]`` int64 of each token of ``x [BH, S, D]`` among ``c [BH, K, D]``.

    Squared distance up to the per-token constant: ``||c||^2 - 2 x.c`` (one batched matmul);
    ties go to the lowest centroid index.
    """
    BH, S, _ = x.shape
    K = c.shape[1]
    cn = (c * c).sum(-1).unsqueeze(1)  # [BH, 1, K]
    out = torch.empty(BH, S, dtype=torch.int64, device=x.device)
    for a, b in _bh_chunks(BH, S * K):
        dist = torch.baddbmm(cn[a:b], x[a:b], c[a:b].transpose(1, 2), alpha=-2.0)
        out[a:b] = dist.argmin(dim=2)
    return out


def kmeans_update(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Lloyd update: the mean of each cluster's tokens ``[BH, K, D]``; empty clusters keep ``c``.

    Deterministic on every device: ``index_add_`` on the CPU (rows added in token order), a
    one-hot matmul ``onehot [K, S] @ x [S, D]`` elsewhere (CUDA ``index_add_`` uses atomics).
    """
    BH, S, D = x.shape
    K = c.shape[1]
    if x.device.type == "cpu":  # sequential row adds on the CPU: cheap and deterministic
        flat = (ids + torch.arange(BH, device=x.device).unsqueeze(1) * K).reshape(-1)
        sums = torch.zeros(BH * K, D, dtype=torch.float32, device=x.device)
        sums.index_add_(0, flat, x.reshape(BH * S, D))
        counts = torch.bincount(flat, minlength=BH * K).to(torch.float32)
        sums, counts = sums.view(BH, K, D), counts.view(BH, K, 1)
    else:
        sums = torch.empty(BH, K, D, dtype=torch.float32, device=x.device)
        counts = torch.empty(BH, K, 1, dtype=torch.float32, device=x.device)
        ks = torch.arange(K, device=x.device, dtype=ids.dtype).view(1, K, 1)
        for a, b in _bh_chunks(BH, S * K):
            onehot = (ids[a:b].unsqueeze(1) == ks).to(torch.float32)  # [n, K, S]
            torch.bmm(onehot, x[a:b], out=sums[a:b])
            torch.sum(onehot, dim=-1, keepdim=True, out=counts[a:b])
    return torch.where(counts > 0, sums / counts.clamp_min(1.0), c)


def pack_fields(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes ``v [..., D]`` (int8, in ``[-2^(bits-1), 2^(bits-1))``) -> ``[..., D*bits//8]`` uint8."""
    per = 8 // bits
    f = (v.to(torch.int8).view(torch.uint8) & ((1 << bits) - 1)).unflatten(-1, (-1, per))
    out = f[..., 0].clone()
    for j in range(1, per):
        out |= f[..., j] << (bits * j)
    return out


def unpack_levels(
    codes: torch.Tensor, bits: int, *, odd: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed bytes ``[..., n]`` -> int8 ``[..., n * 8 // bits]`` signed codes ``v`` (or ``2v+1``).

    Sign extension by shifts: move field ``j`` to the top of the byte, reinterpret as int8,
    shift right arithmetically (by one less for ``odd``, then set the low bit).
    """
    per = 8 // bits
    if out is None:
        out = torch.empty(*codes.shape, per, dtype=torch.int8, device=codes.device)
    else:
        out = out.view(*codes.shape, per)
    down = 8 - bits - (1 if odd else 0)
    for j in range(per):
        up = 8 - bits * (j + 1)
        top = (codes << up) if up else codes
        torch.bitwise_right_shift(top.view(torch.int8), down, out=out[..., j])
    if odd:
        out |= 1
    return out.flatten(-2)


def quantize_pack(
    r: torch.Tensor,
    scale: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    block: int,
    grid: str,
) -> torch.Tensor:
    """Quantize residual ``r [N, D]`` with decoded block scales ``scale [N, nb]`` and pack.

    Codes: reference ``v = clamp(floor(r/s + 1/2), -q, q)``; ``"mse4"``
    ``v = clamp(floor(r/(2s)), -2^(b-1), 2^(b-1)-1)`` (nearest odd level); asymmetric (``zeros``
    given) ``v = clamp(floor(r/s + 1/2) + z, -2^(b-1), 2^(b-1)-1)``. Blocks with ``s == 0`` get
    ``v = 0``. Returns ``[N, D * bits // 8]`` uint8.
    """
    N, D = r.shape
    nb = D // block
    half = 2 ** (bits - 1)
    s = scale.view(N, nb, 1)
    q = r.view(N, nb, block) / torch.where(s > 0, s, 1.0)
    if zeros is not None:
        v = (torch.floor(q + 0.5) + zeros.view(N, nb, 1).to(torch.float32)).clamp_(-half, half - 1)
    elif grid == "mse4":
        v = torch.floor(q * 0.5).clamp_(-half, half - 1)
    else:
        v = torch.floor(q + 0.5).clamp_(-(half - 1), half - 1)
    v = torch.where(s > 0, v, 0.0).to(torch.int8).view(N, D)
    return pack_fields(v, bits)


def dequantize_into(packed: PackedSegment, out: torch.Tensor) -> None:
    """Write the reconstruction of ``packed`` into ``out [B, H, S, D]`` (any strides, float dtype).

    Per stage one row gather from a ``[(B*H*K*nb) + 1, block]`` centroid table (the extra zero
    row serves all-zero input blocks), then one ``addcmul`` of the unpacked int8 levels with the
    decoded scales, written straight into ``out``.
    """
    from causalkv.caches.qvg.codec import ZERO_BLOCK_SCALE_BYTE, scale_table

    B, H, S, D = packed.shape
    bs, bits = packed.block_size, packed.bits
    BH, N, nb = B * H, B * H * S, D // bs
    K = packed.num_centroids
    dev = out.device
    # bf16 work only for one stage (then the single rounding is the final one); several
    # stages sum their centroids in float32 like the Triton kernel.
    native = out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and packed.stages == 1)
    work = out.dtype if native else torch.float32

    sb = packed.scales.reshape(N, nb).view(torch.uint8)
    s = scale_table(packed.scale_exp, dev).to(work).index_select(0, sb.reshape(-1).to(torch.int32))
    s = s.view(N, nb, 1)
    zero_rows = BH * K * nb
    row = (torch.arange(BH, device=dev) * (K * nb)).view(BH, 1, 1) + torch.arange(nb, device=dev)
    sentinel = (sb == ZERO_BLOCK_SCALE_BYTE).view(BH, S, nb)

    direct = out.dtype == work and out.is_contiguous()
    acc = out.view(N, nb, bs) if direct else torch.empty(N, nb, bs, dtype=work, device=dev)
    for st, (cent, ids) in enumerate(zip(packed.centroids, packed.ids)):
        table = torch.cat(
            [cent.reshape(BH * K * nb, bs).to(work), torch.zeros(1, bs, dtype=work, device=dev)]
        )
        idx = row + ids.reshape(BH, S, 1).to(torch.int64) * nb
        idx = torch.where(sentinel, zero_rows, idx).view(-1)
        if st == 0:
            torch.index_select(table, 0, idx, out=acc.view(N * nb, bs))
        else:
            acc += table.index_select(0, idx).view(N, nb, bs)

    codes = packed.codes.reshape(N, D * bits // 8)
    if work == torch.bfloat16:  # one table gather: byte -> its 8 // bits levels in bf16
        if bits == 4 and codes.shape[1] % 2 == 0:  # two bytes -> four levels (one int64)
            lut = _level_lut16(packed.grid == "mse4", dev)
            idx = codes.view(torch.int16).reshape(-1).to(torch.int32) & 0xFFFF
        else:
            lut = _level_lut(bits, packed.grid == "mse4", dev)
            idx = codes.reshape(-1).to(torch.int32)
        levels = lut.index_select(0, idx).view(torch.bfloat16)
    else:
        levels = unpack_levels(codes, bits, odd=packed.grid == "mse4")
    levels = levels.view(N, nb, bs)
    if packed.zeros is not None:  # v - z: integers below 2^8 in magnitude, exact in bf16
        z = packed.zeros.reshape(N, nb, 1)
        levels = levels.to(work) - z.to(work)
    if direct:
        acc.addcmul_(levels, s)
    elif out.dtype == work:  # strided view: write straight into it
        shape5 = (B, H, S, nb, bs)
        torch.addcmul(
            acc.view(shape5), levels.view(shape5), s.view(B, H, S, nb, 1),
            out=out.unflatten(-1, (nb, bs)),
        )
    else:  # e.g. float16 out: compute in float32, cast once
        acc.addcmul_(levels, s)
        out.copy_(acc.view(B, H, S, D))


_LUTS: dict[tuple[int, bool, str], torch.Tensor] = {}


def _level_lut(bits: int, odd: bool, device: torch.device) -> torch.Tensor:
    """``[256]`` int64 (2 bits) / int32 (4 bits): the bf16 levels of every code byte, bit-packed."""
    key = (bits, odd, str(device))
    if key not in _LUTS:
        per = 8 // bits
        byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        levels = unpack_levels(byte, bits, odd=odd).view(256, per).to(torch.bfloat16)
        lut = levels.contiguous().view(torch.int64 if per == 4 else torch.int32).view(256)
        _LUTS[key] = lut.to(device)
    return _LUTS[key]


def _level_lut16(odd: bool, device: torch.device) -> torch.Tensor:
    """``[65536]`` int64: the four bf16 4-bit levels of every little-endian byte pair."""
    key = (16, odd, str(device))
    if key not in _LUTS:
        pair = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8)
        levels = unpack_levels(pair.view(65536, 2), 4, odd=odd).to(torch.bfloat16)
        _LUTS[key] = levels.contiguous().view(torch.int64).view(65536).to(device)
    return _LUTS[key]
