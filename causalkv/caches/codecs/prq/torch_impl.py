"""PyTorch implementation of the PRQ codec's kernels (any device; the CPU reference).

This module is a `causalkv.caches.codecs.prq.format.PRQKernels`: `kmeans_assign`,
`kmeans_update`, `quantize_pack` and `dequantize_into` have Triton twins in
`causalkv.caches.codecs.prq.triton_impl` with the same signatures;
`causalkv.caches.codecs.prq.quantizer` picks one. Layouts: ``x [BH, S, D]`` fp32 token vectors
per (batch, head), ``c [BH, K, D]`` fp32 centroids, residual ``r [N, D]`` fp32 with
``N = BH * S``, block scales ``[N, D // block]``.
"""

from __future__ import annotations

import functools

import torch

from causalkv.caches.codecs.prq.format import ZERO_BLOCK_SCALE_BYTE, PackedSegment, scale_table
from causalkv.caches.codecs.prq.workspace import temporary as _temporary

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

    Squared distance up to the per-token constant: ``||c||^2 - 2 x.c`` (one GEMM per token
    tile); ties go to the lowest centroid index. On the CPU the distances are laid out
    ``[K, tokens]`` so the minimum and the first index reaching it are reductions over the
    outer dimension (vectorized along the tokens), in reused workspace buffers
    (`causalkv.caches.codecs.prq.workspace`).
    """
    BH, S, _ = x.shape
    K = c.shape[1]
    cn = (c * c).sum(-1)  # [BH, K]
    out = torch.empty(BH, S, dtype=torch.int64, device=x.device)
    if x.device.type != "cpu":
        cn3 = cn.unsqueeze(1)
        for a, b in _bh_chunks(BH, S * K):
            dist = torch.baddbmm(cn3[a:b], x[a:b], c[a:b].transpose(1, 2), alpha=-2.0)
            out[a:b] = dist.argmin(dim=2)
        return out
    rev = (K - torch.arange(K, dtype=torch.int16)).view(1, K, 1)  # first index of the min
    cn3 = cn.unsqueeze(2)  # [BH, K, 1]
    step = max(1, _ASSIGN_TILE // (K * BH))
    for s0 in range(0, S, step):
        s1 = min(s0 + step, S)
        n = BH * K * (s1 - s0)
        dist = torch.baddbmm(cn3, c, x[:, s0:s1].transpose(1, 2), alpha=-2.0,
                             out=_temporary("assign.dist", n, torch.float32, x.device).view(BH, K, -1))
        eq = torch.eq(dist, dist.amin(1, keepdim=True),
                      out=_temporary("assign.eq", n, torch.bool, x.device).view(dist.shape))
        w = torch.mul(eq, rev, out=_temporary("assign.w", n, torch.int16, x.device).view(dist.shape))
        torch.sub(K, w.amax(1), out=out[:, s0:s1])
    return out


_ASSIGN_TILE = 1 << 21  # distances per assignment tile (8 MB of float32)


def kmeans_update(x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Lloyd update: the mean of each cluster's tokens ``[BH, K, D]``; empty clusters keep ``c``.

    One-hot matmul ``onehot [K, S] @ x [S, D]`` per (batch, head): a GEMM (fast on every
    device) with a fixed summation order, so it is deterministic (no atomics).
    """
    BH, S, D = x.shape
    K = c.shape[1]
    sums = torch.empty(BH, K, D, dtype=torch.float32, device=x.device)
    counts = torch.empty(BH, K, 1, dtype=torch.float32, device=x.device)
    ks = torch.arange(K, device=x.device, dtype=ids.dtype).view(1, K, 1)
    for a, b in _bh_chunks(BH, S * K):
        n = b - a
        hot = torch.eq(ids[a:b].unsqueeze(1), ks,
                       out=_temporary("update.eq", n * K * S, torch.bool, x.device).view(n, K, S))
        onehot = _temporary("update.onehot", n * K * S, torch.float32, x.device).view(n, K, S)
        onehot.copy_(hot)
        torch.bmm(onehot, x[a:b], out=sums[a:b])
        torch.sum(onehot, dim=-1, keepdim=True, out=counts[a:b])
    return torch.where(counts > 0, sums / counts.clamp_min(1.0), c)


def pack_fields(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes ``v [..., D]`` (int8, in ``[-2^(bits-1), 2^(bits-1))``) -> ``[..., D*bits//8]`` uint8.

    The ``P = 8 // bits`` codes of one output byte are ``P`` consecutive bytes: read them as
    one little-endian word (int32 for 2 bits, int16 for 4), mask each byte to its field and
    fold the fields together with shifts by ``(8 - bits) * 2**k`` (2 bits: fields 0,1 -> bits
    0..3 and 2,3 -> 16..19, then 2,3 -> bits 4..7), so byte ``j``'s field lands in bits
    ``[j*bits, ...)``.
    """
    per = 8 // bits
    v = v.to(torch.int8).contiguous()
    shape = (*v.shape[:-1], v.shape[-1] // per)
    n, dev, word = v.numel() // per, v.device, _PACK_WORD[bits]
    mask = int.from_bytes(bytes([(1 << bits) - 1]) * per, "little")
    w = torch.bitwise_and(v.view(-1).view(word), mask, out=_temporary("pack.w", n, word, dev))
    t = _temporary("pack.t", n, word, dev)
    for k in range(per.bit_length() - 1):
        w |= torch.bitwise_right_shift(w, (8 - bits) << k, out=t)
    return w.to(torch.uint8).view(shape)


_PACK_WORD = {2: torch.int32, 4: torch.int16}


def unpack_levels(codes: torch.Tensor, bits: int, *, odd: bool = False) -> torch.Tensor:
    """Packed bytes ``[..., n]`` -> int8 ``[..., n * 8 // bits]`` signed codes ``v`` (or ``2v+1``).

    Sign extension by shifts: move field ``j`` to the top of the byte, reinterpret as int8,
    shift right arithmetically (by one less for ``odd``, then set the low bit).
    """
    per = 8 // bits
    out = torch.empty(*codes.shape, per, dtype=torch.int8, device=codes.device)
    down = 8 - bits - (1 if odd else 0)
    for j in range(per):
        top = codes << (8 - bits * (j + 1))  # field j at the top of the byte
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
    s = scale.view(N, nb, 1).to(torch.float32)
    # s == 0 -> divide by inf: q = 0 (r is finite), so v = 0 with no extra select pass.
    q = _temporary("pack.q", N * D, torch.float32, r.device).view(N, nb, block)
    torch.div(r.view(N, nb, block), torch.where(s > 0, s, torch.inf), out=q)
    if zeros is not None:
        z = zeros.view(N, nb, 1).to(torch.float32).masked_fill_(s == 0, 0.0)
        q.add_(0.5).floor_().add_(z).clamp_(-half, half - 1)
    elif grid == "mse4":
        q.mul_(0.5).floor_().clamp_(-half, half - 1)
    else:
        q.add_(0.5).floor_().clamp_(-(half - 1), half - 1)
    v = _temporary("pack.v", N * D, torch.int8, r.device).view(N, D)
    return pack_fields(v.copy_(q.view(N, D)), bits)


_TILE_ELEMS = 1 << 21  # outputs per dequantize tile: few ops per call, temporaries of a few MB
_LUT_WORD = {2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def _tiles(B: int, H: int, S: int, D: int) -> list[tuple[int, int, int, int, int]]:
    """``(b, h0, h1, s0, s1)`` tiles of about ``_TILE_ELEMS`` outputs each; every tile is one
    contiguous run of the ``B*H*S`` packed rows (one head's token range, or whole heads)."""
    rows = max(1, _TILE_ELEMS // D)
    if S >= rows:  # (h0, h1, s0, s1): the same for every batch index
        n = -(-S // rows)
        step = -(-S // n)
        spans = [(h, h + 1, s, min(s + step, S)) for h in range(H) for s in range(0, S, step)]
    else:
        hh = rows // S
        spans = [(h, min(h + hh, H), 0, S) for h in range(0, H, hh)]
    return [(b, *span) for b in range(B) for span in spans]


def dequantize_into(packed: PackedSegment, out: torch.Tensor) -> None:
    """Write the reconstruction of ``packed`` into ``out [B, H, S, D]`` (any strides, float dtype).

    Tiled over tokens so every temporary stays small (and, on the CPU, is reused across
    calls). Per tile: the decoded block scales (a ``[256]`` table lookup of the e4m3 bytes),
    one row gather per stage from a ``[(B*H*K*nb) + 1, block]`` centroid table (the extra zero
    row serves all-zero input blocks), one gather from a level table that maps each code byte
    (or byte pair) to all its levels at once, then one ``addcmul`` of levels and scales onto
    the centroids, written straight into ``out``'s tile (a view of any strides).

    ``packed`` may be a view (`PackedSegment.select_heads` / ``select_tokens``): its ids,
    codes, scales and zeros are read tile by tile through their strides, never copied whole.
    """
    B, H, S, D = packed.shape
    bs, bits = packed.block_size, packed.bits
    BH, nb = B * H, D // bs
    K = packed.num_centroids
    dev = out.device
    # bf16 work only for one stage (then the single rounding is the final one); several
    # stages sum their centroids in float32 like the Triton kernel.
    native = out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and packed.stages == 1)
    work = out.dtype if native else torch.float32

    s_table = scale_table(packed.scale_exp, dev).to(work).view(-1)  # [BH * 256]
    s_off = torch.arange(BH, device=dev, dtype=torch.int32).view(BH, 1, 1) * 256
    sb = packed.scales.view(torch.uint8)  # [B, H, S, nb], read per tile through its strides
    zero_row = BH * K * nb
    rowoff = torch.arange(BH, device=dev, dtype=torch.int32).view(BH, 1, 1) * (K * nb)
    rowoff = rowoff + torch.arange(nb, device=dev, dtype=torch.int32)

    def centroid_table(cent: torch.Tensor) -> torch.Tensor:
        """``[zero_row + 1, bs]``: the centroids' blocks (any strides, one copy), then zeros."""
        table = torch.empty(zero_row + 1, bs, dtype=work, device=dev)
        table[:zero_row].view(cent.shape).copy_(cent)
        table[zero_row].zero_()
        return table

    stages = [(centroid_table(cent), ids) for cent, ids in zip(packed.centroids, packed.ids)]
    zeros = packed.zeros  # [B, H, S, nb] or None

    # Levels: one table lookup per code byte, or per byte pair when a pair's levels fit in
    # 16 bytes and every block holds whole pairs.
    per = 8 // bits
    bpb = bs // per  # code bytes per block
    pair = bpb % 2 == 0 and 2 * per * work.itemsize <= 16
    lut = _lut(bits, packed.grid == "mse4", work, pair, dev)
    codes = packed.codes.view(torch.uint16) if pair else packed.codes  # [B, H, S, width]
    width = codes.shape[3]  # table lookups per token

    tiles = _tiles(B, H, S, D)
    rows = max((h1 - h0) * (s1 - s0) for _, h0, h1, s0, s1 in tiles)
    # The 1-D index_select loop is serial; with intra-op threads a gather over a stride-0
    # [rows, table] expansion of the table splits the lookups across them.
    threaded = torch.get_num_threads() > 1
    idx_dtype = torch.int64 if threaded else torch.int32
    lut_rows = lut.expand(rows, lut.numel())
    for b, h0, h1, s0, s1 in tiles:
        hh, ss = h1 - h0, s1 - s0
        t = hh * ss
        sb_t = sb[b, h0:h1, s0:s1]  # [hh, ss, nb]
        zero_t = _temporary("zero", t * nb, torch.bool, dev).view(t, nb)
        torch.eq(sb_t, ZERO_BLOCK_SCALE_BYTE, out=zero_t.view(hh, ss, nb))
        sbi = _temporary("sbi", t * nb, torch.int32, dev).view(t, nb)
        bh0 = b * H + h0
        torch.add(sb_t, s_off[bh0 : bh0 + hh], out=sbi.view(hh, ss, nb))
        s_t = torch.index_select(s_table, 0, sbi.view(-1), out=_temporary("s", t * nb, work, dev))

        acc = _temporary("acc", t * nb * bs, work, dev).view(t * nb, bs)
        for st, (table, ids) in enumerate(stages):
            cidx = _temporary("cidx", t * nb, torch.int32, dev)
            torch.add(rowoff[bh0 : bh0 + hh], ids[b, h0:h1, s0:s1].unsqueeze(-1), alpha=nb,
                      out=cidx.view(hh, ss, nb))
            cidx.view(t, nb).masked_fill_(zero_t, zero_row)
            if st == 0:
                torch.index_select(table, 0, cidx, out=acc)
            else:
                acc += torch.index_select(
                    table, 0, cidx, out=_temporary("c", t * nb * bs, work, dev).view(t * nb, bs)
                )
        acc = acc.view(t, nb, bs)

        code_idx = _temporary("code_idx", t * width, idx_dtype, dev).view(t, width)
        code_idx.view(hh, ss, width).copy_(codes[b, h0:h1, s0:s1])
        lv = _temporary("levels", t * width, lut.dtype, dev)
        if threaded:
            torch.gather(lut_rows[:t], 1, code_idx, out=lv.view(t, width))
        else:
            torch.index_select(lut, 0, code_idx.view(-1), out=lv)
        lv = lv.view(work).view(t, nb, bs)
        if zeros is not None:  # v - z: integers below 2^8 in magnitude, exact in bf16
            z = _temporary("z", t * nb, work, dev).view(t, nb, 1)
            z.view(hh, ss, nb).copy_(zeros[b, h0:h1, s0:s1])
            lv = lv.sub_(z)

        shape4 = (hh, ss, nb, bs)
        dst = out[b, h0:h1, s0:s1].unflatten(-1, (nb, bs))
        if out.dtype == work:  # write straight into out (its rows, or the strided tile view)
            torch.addcmul(acc.view(shape4), lv.view(shape4), s_t.view(hh, ss, nb, 1), out=dst)
        else:  # e.g. float16 out: compute in float32, cast once
            acc.addcmul_(lv, s_t.view(t, nb, 1))
            dst.copy_(acc.view(shape4))


@functools.cache
def _lut(bits: int, odd: bool, dtype: torch.dtype, pair: bool, device: torch.device) -> torch.Tensor:
    """``[256]`` (or ``[65536]`` for little-endian byte pairs): every code byte's levels in
    ``dtype``, bit-packed into one word (int16/int32/int64/complex128) per entry."""
    n = 65536 if pair else 256
    byte = torch.arange(n, dtype=torch.int32)
    byte = byte.to(torch.int16).view(torch.uint8) if pair else byte.to(torch.uint8)
    levels = unpack_levels(byte.view(n, -1), bits, odd=odd).to(dtype).contiguous()
    word = _LUT_WORD[levels.shape[1] * levels.element_size()]
    return levels.view(word).view(n).to(device)
