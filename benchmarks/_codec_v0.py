"""The PRQ codec's CPU path as of commit 3d118d4 (before the per-head exponent and the
faster quantize), frozen for `benchmarks/codec.py` to time old vs new in the same run.

Benchmark-only: not imported by the package. Generated from ``git show
3d118d4:causalkv/caches/qvg/codec.py`` and ``torch_impl.py`` (torch backend only).
"""
# ruff: noqa
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, replace

import torch

from causalkv.caches.qvg.options import QVGKVQuantArgs

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


_TILE_ELEMS = 1 << 21  # outputs per dequantize tile: few ops per call, temporaries of a few MB
_WORKSPACE = threading.local()  # per-thread reusable CPU temporaries, see `_scratch`
_LUT_WORD = {2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def _tiles(B: int, H: int, S: int, D: int) -> list[tuple[int, int, int, int, int]]:
    """``(b, h0, h1, s0, s1)`` tiles of about ``_TILE_ELEMS`` outputs each; every tile is one
    contiguous run of the ``B*H*S`` packed rows (one head's token range, or whole heads)."""
    rows = max(1, _TILE_ELEMS // D)
    tiles = []
    for b in range(B):
        if S >= rows:
            n = -(-S // rows)
            step = -(-S // n)
            tiles += [(b, h, h + 1, s, min(s + step, S)) for h in range(H) for s in range(0, S, step)]
        else:
            hh = rows // S
            tiles += [(b, h, min(h + hh, H), 0, S) for h in range(0, H, hh)]
    return tiles


def _scratch(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D ``[n]`` temporary. On the CPU it is kept per thread and reused across calls:
    a fresh multi-MB allocation costs a page fault per 4 KiB, more than the work done in it
    (tile-sized, so at most a few MB per buffer)."""
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    bufs = _WORKSPACE.__dict__.setdefault("bufs", {})
    buf = bufs.get((name, dtype))
    if buf is None or buf.numel() < n:
        buf = bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
    return buf[:n]


def dequantize_into(packed: PackedSegment, out: torch.Tensor) -> None:
    """Write the reconstruction of ``packed`` into ``out [B, H, S, D]`` (any strides, float dtype).

    Tiled over tokens so every temporary stays small (and, on the CPU, is reused across
    calls). Per tile: the decoded block scales (a ``[256]`` table lookup of the e4m3 bytes),
    one row gather per stage from a ``[(B*H*K*nb) + 1, block]`` centroid table (the extra zero
    row serves all-zero input blocks), one gather from a level table that maps each code byte
    (or byte pair) to all its levels at once, then one ``addcmul`` of levels and scales onto
    the centroids, written straight into ``out`` (its rows when contiguous, else the strided
    tile view).
    """
    B, H, S, D = packed.shape
    bs, bits = packed.block_size, packed.bits
    BH, N, nb = B * H, B * H * S, D // bs
    K = packed.num_centroids
    dev = out.device
    # bf16 work only for one stage (then the single rounding is the final one); several
    # stages sum their centroids in float32 like the Triton kernel.
    native = out.dtype == torch.float32 or (out.dtype == torch.bfloat16 and packed.stages == 1)
    work = out.dtype if native else torch.float32
    flat = out.view(N, nb, bs) if out.dtype == work and out.is_contiguous() else None

    s_table = scale_table(packed.scale_exp, dev).to(work)
    sb = packed.scales.reshape(N, nb).view(torch.uint8)
    zero_row = BH * K * nb
    rowoff = torch.arange(BH, device=dev, dtype=torch.int32).view(BH, 1, 1) * (K * nb)
    rowoff = rowoff + torch.arange(nb, device=dev, dtype=torch.int32)
    stages = [
        (
            torch.cat(
                [cent.reshape(zero_row, bs).to(work), torch.zeros(1, bs, dtype=work, device=dev)]
            ),
            ids.reshape(BH, S, 1),
        )
        for cent, ids in zip(packed.centroids, packed.ids)
    ]
    zeros = None if packed.zeros is None else packed.zeros.reshape(N, nb, 1)

    # Levels: one table lookup per code byte, or per byte pair when a pair's levels fit in
    # 16 bytes and every block holds whole pairs.
    per = 8 // bits
    bpb = bs // per  # code bytes per block
    itemsize = torch.empty((), dtype=work).element_size()
    pair = bpb % 2 == 0 and 2 * per * itemsize <= 16
    lut = _lut(bits, packed.grid == "mse4", work, pair, dev)
    codes = packed.codes.reshape(N, nb * bpb)
    if pair:
        codes = codes.view(torch.uint16)
    width = codes.shape[1]  # table lookups per token

    tiles = _tiles(B, H, S, D)
    rows = max((h1 - h0) * (s1 - s0) for _, h0, h1, s0, s1 in tiles)
    # The 1-D index_select loop is serial; with intra-op threads a gather over a stride-0
    # [rows, table] expansion of the table splits the lookups across them.
    threaded = torch.get_num_threads() > 1
    idx_dtype = torch.int64 if threaded else torch.int32
    lut_rows = lut.expand(rows, lut.numel())
    for b, h0, h1, s0, s1 in tiles:
        hh, ss = h1 - h0, s1 - s0
        n0 = (b * H + h0) * S + s0
        t = hh * ss
        n1 = n0 + t
        sb_t = sb[n0:n1]
        zero_t = _scratch("zero", t * nb, torch.bool, dev).view(t, nb)
        torch.eq(sb_t, ZERO_BLOCK_SCALE_BYTE, out=zero_t)
        sbi = _scratch("sbi", t * nb, torch.int32, dev).view(t, nb)
        sbi.copy_(sb_t)
        s_t = torch.index_select(s_table, 0, sbi.view(-1), out=_scratch("s", t * nb, work, dev))
        s_t = s_t.view(t, nb, 1)

        acc = _scratch("acc", t * nb * bs, work, dev).view(t * nb, bs)
        for st, (table, ids) in enumerate(stages):
            cidx = _scratch("cidx", t * nb, torch.int32, dev)
            bh0 = b * H + h0
            torch.add(rowoff[bh0 : bh0 + hh], ids[bh0 : bh0 + hh, s0:s1], alpha=nb,
                      out=cidx.view(hh, ss, nb))
            cidx.view(t, nb).masked_fill_(zero_t, zero_row)
            if st == 0:
                torch.index_select(table, 0, cidx, out=acc)
            else:
                acc += torch.index_select(
                    table, 0, cidx, out=_scratch("c", t * nb * bs, work, dev).view(t * nb, bs)
                )
        acc = acc.view(t, nb, bs)

        code_idx = _scratch("code_idx", t * width, idx_dtype, dev).view(t, width)
        code_idx.copy_(codes[n0:n1])
        lv = _scratch("levels", t * width, lut.dtype, dev)
        if threaded:
            torch.gather(lut_rows[:t], 1, code_idx, out=lv.view(t, width))
        else:
            torch.index_select(lut, 0, code_idx.view(-1), out=lv)
        lv = lv.view(work).view(t, nb, bs)
        if zeros is not None:  # v - z: integers below 2^8 in magnitude, exact in bf16
            z = _scratch("z", t * nb, work, dev).view(t, nb, 1)
            lv = lv.sub_(z.copy_(zeros[n0:n1]))

        if flat is not None:  # contiguous out of the work dtype: write its rows
            torch.addcmul(acc, lv, s_t, out=flat[n0:n1])
            continue
        shape4 = (hh, ss, nb, bs)
        dst = out[b, h0:h1, s0:s1].unflatten(-1, (nb, bs))
        if out.dtype == work:  # strided view: write straight into it
            torch.addcmul(acc.view(shape4), lv.view(shape4), s_t.view(hh, ss, nb, 1), out=dst)
        else:  # e.g. float16 out: compute in float32, cast once
            acc.addcmul_(lv, s_t)
            dst.copy_(acc.view(shape4))


_LUTS: dict[tuple, torch.Tensor] = {}


def _lut(bits: int, odd: bool, dtype: torch.dtype, pair: bool, device: torch.device) -> torch.Tensor:
    """``[256]`` (or ``[65536]`` for little-endian byte pairs): every code byte's levels in
    ``dtype``, bit-packed into one word (int16/int32/int64/complex128) per entry."""
    key = (bits, odd, dtype, pair, str(device))
    if key not in _LUTS:
        n = 65536 if pair else 256
        byte = torch.arange(n, dtype=torch.int32)
        byte = byte.to(torch.int16).view(torch.uint8) if pair else byte.to(torch.uint8)
        levels = unpack_levels(byte.view(n, -1), bits, odd=odd).to(dtype).contiguous()
        word = _LUT_WORD[levels.shape[1] * levels.element_size()]
        _LUTS[key] = levels.view(word).view(n).to(device)
    return _LUTS[key]


def _level_lut(bits: int, odd: bool, device: torch.device) -> torch.Tensor:
    """``[256]`` int64 (2 bits) / int32 (4 bits): the bf16 levels of every code byte, bit-packed."""
    return _lut(bits, odd, torch.bfloat16, False, device)


BACKEND_ENV = "CAUSALKV_QVG_BACKEND"
_BACKENDS = ("auto", "torch", "triton")
ZERO_BLOCK_SCALE_BYTE = 0x80  # e4m3 -0.0: "this input block is all zeros"
FP8_MAX = 448.0
_MAX_ZERO_RANGE = 120.0  # asymmetric: |zero point| stays <= 120 + 2^(bits-1) (fits int8)
_MSE_ITERS = 4
_MIN_SCALE_EXP = -100


# ---------------------------------------------------------------------------------------------
# The packed form
# ---------------------------------------------------------------------------------------------
@dataclass
class PackedSegment:
    """One PRQ-packed segment of K or V, logical shape ``[B, H, S, D]``.

    Attributes:
        centroids: per stage ``[B, H, K, D]`` bf16, ``K = min(args.centroids, S)``.
        ids: per stage ``[B, H, S]`` uint8 cluster ids.
        codes: ``[B, H, S, D * bits // 8]`` uint8 packed residual codes (see module doc).
        scales: ``[B, H, S, D // block_size]`` float8_e4m3fn block scales (``x 2**scale_exp``).
        zeros: ``[B, H, S, D // block_size]`` int8 zero points when asymmetric, else None.
        shape: ``(B, H, S, D)``.
        dtype: dtype of the tensor that was quantized.
        bits: residual bits (2 or 4).
        block_size: channels per scale block.
        grid: ``"reference"`` or ``"mse4"`` (how codes map to levels).
        scale_exp: power-of-two exponent applied to every decoded scale.
    """

    centroids: list[torch.Tensor]
    ids: list[torch.Tensor]
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    bits: int
    block_size: int
    grid: str = "reference"
    scale_exp: int = 0

    @property
    def nbytes(self) -> int:
        """Exactly the stored bytes: the sum of every tensor's ``nbytes``."""
        total = self.codes.nbytes + self.scales.nbytes
        total += sum(c.nbytes for c in self.centroids) + sum(i.nbytes for i in self.ids)
        if self.zeros is not None:
            total += self.zeros.nbytes
        return int(total)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def stages(self) -> int:
        return len(self.centroids)

    @property
    def num_centroids(self) -> int:
        """K, the centroids per (batch, head) per stage actually stored."""
        return int(self.centroids[0].shape[2])

    @property
    def asymmetric(self) -> bool:
        return self.zeros is not None

    def _map(self, fn) -> PackedSegment:
        return replace(
            self,
            centroids=[fn(c) for c in self.centroids],
            ids=[fn(i) for i in self.ids],
            codes=fn(self.codes),
            scales=fn(self.scales),
            zeros=None if self.zeros is None else fn(self.zeros),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedSegment:
        """The same segment on ``device`` (for offload / onload)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedSegment:
        """The same segment in pinned host memory (CPU tensors only; needs a CUDA build)."""
        return self._map(lambda t: t.pin_memory())

    def select_heads(self, h0: int, h1: int) -> PackedSegment:
        """Heads ``[h0, h1)`` as views (no copy); shape becomes ``[B, h1 - h0, S, D]``."""
        B, H, S, D = self.shape
        if not 0 <= h0 < h1 <= H:
            raise ValueError(f"select_heads: need 0 <= h0 < h1 <= {H}, got h0={h0}, h1={h1}")
        out = self._map(lambda t: t[:, h0:h1])
        out.shape = (B, h1 - h0, S, D)
        return out


# ---------------------------------------------------------------------------------------------
# Byte accounting (docs/design.md, "Memory math")
# ---------------------------------------------------------------------------------------------
def packed_nbytes_formula(shape: tuple[int, int, int, int], args: QVGKVQuantArgs) -> int:
    """Stored bytes of a segment ``shape = (B, H, S, D)`` packed with ``args``.

    ``B*H*S*D*bits/8`` (codes) + ``B*H*S*D/block`` (fp8 scales) [+ the same for int8 zeros]
    + ``stages*B*H*S`` (uint8 ids) + ``2*stages*B*H*K*D`` (bf16 centroids), ``K = min(centroids, S)``.
    """
    B, H, S, D = (int(v) for v in shape)
    if not args.enabled:
        raise ValueError("packed_nbytes_formula: quantization is off (args.bits is None)")
    K = min(args.centroids, S)
    n = B * H * S
    blocks = n * (D // args.block_size)
    return (
        n * D * args.bits // 8
        + blocks * (2 if args.asymmetric else 1)
        + args.stages * n
        + 2 * args.stages * B * H * K * D
    )


def bits_per_element(S: int, D: int, args: QVGKVQuantArgs) -> float:
    """``bits + 8/block [+ 8/block] + 8*stages/D + 16*stages*K/S`` with ``K = min(centroids, S)``."""
    if not args.enabled:
        return 16.0
    K = min(args.centroids, S)
    zeros = 8.0 / args.block_size if args.asymmetric else 0.0
    return (
        args.bits + 8.0 / args.block_size + zeros + 8.0 * args.stages / D
        + 16.0 * args.stages * K / S
    )


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``.

    ``backend`` (argument) wins, then the ``CAUSALKV_QVG_BACKEND`` env var, then auto:
    Triton for CUDA tensors when ``triton`` imports, PyTorch everywhere else.
    """
    name = (backend or os.environ.get(BACKEND_ENV) or "auto").lower()
    if name not in _BACKENDS:
        raise ValueError(f"QVG codec backend must be one of {list(_BACKENDS)}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if name == "triton":
        if not _triton_importable():
            raise ValueError(
                "QVG codec backend 'triton' requested but triton does not import; "
                "install causalkv[triton] or use backend='torch'"
            )
        if device.type != "cuda" and not _triton_interpret():
            raise ValueError(
                f"QVG codec backend 'triton' needs CUDA tensors (got {device.type}); "
                "set TRITON_INTERPRET=1 to run the kernels on the CPU, or use backend='torch'"
            )
    return name


def _impl(name: str):
    if name == "triton":
        from causalkv.caches.qvg import triton_impl

        return triton_impl
    from causalkv.caches.qvg import torch_impl

    return torch_impl


# ---------------------------------------------------------------------------------------------
# Scale encoding (shared by both backends)
# ---------------------------------------------------------------------------------------------
def scale_exponent(max_scale: float) -> int:
    """Smallest ``e`` with ``max_scale * 2**-e <= 448`` (0 for an all-zero segment)."""
    if not max_scale > 0.0:
        return 0
    m, e = math.frexp(max_scale / FP8_MAX)  # max_scale / 448 = m * 2^e, m in [0.5, 1)
    e = e - 1 if m == 0.5 else e
    # 2**-e must stay a finite fp32 power of two: below 2^-100 a segment is numerically zero.
    return max(e, _MIN_SCALE_EXP)


def encode_scales(
    scale: torch.Tensor, exp: int, *, round_up: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scales ``[...]`` -> (e4m3 bytes uint8, decoded fp32 scales = fp8 * 2**exp).

    ``round_up`` picks the next e4m3 value at or above the scale (never below), so a
    symmetric/asymmetric grid still covers the block's range after rounding.
    """
    scaled = (scale * math.ldexp(1.0, -exp)).clamp(0.0, FP8_MAX)
    enc = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    if round_up:
        low = enc.view(torch.float8_e4m3fn).float() < scaled
        enc = torch.where(low, enc + 1, enc)
    return enc, enc.view(torch.float8_e4m3fn).float() * math.ldexp(1.0, exp)


@functools.lru_cache(maxsize=64)
def _scale_table_cpu(exp: int) -> torch.Tensor:
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    table = torch.nan_to_num(table, nan=0.0)  # 0x7F / 0xFF are never stored
    table[ZERO_BLOCK_SCALE_BYTE] = 0.0
    return table * math.ldexp(1.0, exp)


def scale_table(exp: int, device: torch.device) -> torch.Tensor:
    """``[256]`` fp32: decoded value of every e4m3 byte times ``2**exp`` (``0x80`` -> 0)."""
    return _scale_table_cpu(exp).to(device)


# ---------------------------------------------------------------------------------------------
# Block statistics (shared; plain torch on any device)
# ---------------------------------------------------------------------------------------------
def _block_scales(
    r: torch.Tensor, bits: int, block: int, grid: str, asymmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw fp32 block scales ``[N, nb]`` for residual ``r [N, D]`` (and block minima if asym)."""
    N, D = r.shape
    r3 = r.view(N, D // block, block)
    if asymmetric:
        mn, mx = r3.amin(-1), r3.amax(-1)
        amax = torch.maximum(mn.abs(), mx.abs())
        s = torch.maximum((mx - mn) / float(2**bits - 1), amax / _MAX_ZERO_RANGE)
        return s, mn
    amax = r3.abs().amax(-1)
    if grid == "reference":
        return amax / float(2 ** (bits - 1) - 1), None
    # "mse4": levels (2v+1)*s over all 2^bits codes; alternate nearest-level assignment and
    # the least-squares scale (each step lowers the block's squared error), starting from the
    # grid whose outer level is the block's absmax.
    half = 2 ** (bits - 1)
    s = amax / float(2**bits - 1)
    for _ in range(_MSE_ITERS):
        safe = torch.where(s > 0, s, 1.0).unsqueeze(-1)
        lv = torch.floor(r3 / safe * 0.5).clamp_(-half, half - 1).mul_(2.0).add_(1.0)
        s = (r3 * lv).sum(-1) / (lv * lv).sum(-1)
    return s, None


# ---------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------
def _check_args(args: QVGKVQuantArgs, D: int) -> None:
    args.validate()
    if not args.enabled:
        raise ValueError(
            "quantize: args.bits is None (quantization off); pass QVGKVQuantArgs(bits=2 or 4)"
        )
    if D % args.block_size:
        raise ValueError(
            f"quantize: head_dim {D} is not divisible by block_size {args.block_size}; "
            f"choose a block size that divides {D}"
        )
    if (args.block_size * args.bits) % 8:
        raise ValueError(
            f"quantize: block_size {args.block_size} x {args.bits} bits is not a whole number "
            f"of bytes; use a block size divisible by {8 // args.bits}"
        )


def quantize(
    x: torch.Tensor,
    args: QVGKVQuantArgs,
    *,
    seed: int = 1234,
    backend: str | None = None,
    codebooks: list[torch.Tensor] | None = None,
) -> PackedSegment:
    """PRQ-pack ``x [B, H, S, D]`` (any float dtype, any strides) with ``args``.

    Deterministic: the same input, args, seed and backend give identical bytes; the global
    RNG is untouched (the k-means initialization draws from its own seeded generator).

    ``codebooks`` (one ``[B, H, K, D]`` bf16 tensor per stage, e.g. ``other.centroids`` of
    an earlier segment) skips k-means: tokens are assigned to those centroids and the
    returned segment references the very same tensors, so segments sharing a codebook
    store it once (the cache counts shared tensors once).

    Raises:
        ValueError: quantization off, bad shape, ``D % block_size != 0``, more than 256
            centroids, or NaN/inf in ``x`` (the message says how many).
    """
    if x.dim() != 4:
        raise ValueError(f"quantize: expected x of shape [B, H, S, D], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"quantize: expected a floating-point tensor, got {x.dtype}")
    B, H, S, D = (int(v) for v in x.shape)
    _check_args(args, D)
    if codebooks is not None:
        if len(codebooks) != args.stages or any(
            c.dim() != 4 or tuple(c.shape[:2]) != (B, H) or c.shape[3] != D
            or c.dtype != torch.bfloat16 for c in codebooks
        ):
            raise ValueError(
                f"quantize: codebooks must be {args.stages} bf16 tensor(s) of shape "
                f"[{B}, {H}, K, {D}], got {[(tuple(c.shape), c.dtype) for c in codebooks]}"
            )
    if B * H * S == 0:
        raise ValueError(f"quantize: empty segment {tuple(x.shape)}; nothing to pack")
    amax = float(x.abs().amax())  # NaN/inf propagate: one sync covers both checks
    if not math.isfinite(amax):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"quantize: input has {bad} non-finite value(s) (NaN or inf) out of {x.numel()}; "
            "PRQ needs finite K/V"
        )
    impl = _TorchImpl
    bits, block, grid = args.bits, args.block_size, args.grid
    assert bits is not None
    BH, N, nb = B * H, B * H * S, D // block
    K = min(args.centroids, S)

    # Normalize by a power of two (exact) so |x| <= 1: k-means distances cannot overflow
    # fp32 for any bf16-range input, and the codec is exactly equivariant to 2^k scaling.
    norm_exp = math.frexp(amax)[1] if amax > 0 else 0
    xf = (x.reshape(BH, S, D).to(torch.float32) * math.ldexp(1.0, -norm_exp)).contiguous()
    zero_block = (xf.view(N, nb, block) == 0).all(-1)  # [N, nb]
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    resid = xf
    centroids, ids = [], []
    for stage in range(args.stages):
        if codebooks is not None:
            shared = codebooks[stage]
            Ks = int(shared.shape[2])
            c32 = shared.reshape(BH, Ks, D).float() * math.ldexp(1.0, -norm_exp)
            a = impl.kmeans_assign(resid, c32)
            resid = resid - torch.gather(c32, 1, a.unsqueeze(-1).expand(BH, S, D))
            centroids.append(shared)
            ids.append(a.to(torch.uint8).view(B, H, S))
            continue
        # K distinct tokens per (batch, head), drawn from the private generator on the CPU so
        # every device starts from the same centroids.
        pick = torch.rand(BH, S, generator=gen).argsort(dim=1)[:, :K].to(x.device)
        c = torch.gather(resid, 1, pick.unsqueeze(-1).expand(BH, K, D))
        for _ in range(args.kmeans_iters):
            a = impl.kmeans_assign(resid, c)
            c = impl.kmeans_update(resid, a, c)
        c_bf = c.to(torch.bfloat16)
        c32 = c_bf.float()
        a = impl.kmeans_assign(resid, c32)
        resid = resid - torch.gather(c32, 1, a.unsqueeze(-1).expand(BH, S, D))
        centroids.append((c_bf * math.ldexp(1.0, norm_exp)).view(B, H, K, D))
        ids.append(a.to(torch.uint8).view(B, H, S))

    r = resid.view(N, D)
    raw, mn = _block_scales(r, bits, block, grid, args.asymmetric)
    exp = scale_exponent(float(raw.max()))
    enc, dec = encode_scales(raw, exp, round_up=grid != "mse4" or args.asymmetric)
    enc = torch.where(zero_block, ZERO_BLOCK_SCALE_BYTE, enc)
    dec = torch.where(zero_block, 0.0, dec)
    zeros = None
    if args.asymmetric:
        assert mn is not None
        safe = torch.where(dec > 0, dec, 1.0)
        z = torch.floor(-mn / safe + 0.5) - 2 ** (bits - 1)
        zeros = torch.where(dec > 0, z, 0.0).to(torch.int8)
    codes = impl.quantize_pack(r, dec, zeros, bits=bits, block=block, grid=grid)
    return PackedSegment(
        centroids=centroids,
        ids=ids,
        codes=codes.view(B, H, S, D * bits // 8),
        scales=enc.view(torch.float8_e4m3fn).view(B, H, S, nb),
        zeros=None if zeros is None else zeros.view(B, H, S, nb),
        shape=(B, H, S, D),
        dtype=x.dtype,
        bits=bits,
        block_size=block,
        grid="reference" if args.asymmetric else grid,
        scale_exp=exp + norm_exp,
    )


def dequantize(
    packed: PackedSegment,
    *,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Reconstruct ``[B, H, S, D]`` from ``packed``.

    With ``out`` (any strides, e.g. ``big.permute(0, 2, 1, 3)[:, :, a:b]`` of a ``[B, S, H, D]``
    buffer, on ``packed.device``) the result is written into it in ``out.dtype`` and ``out``
    is returned; otherwise a new contiguous tensor of ``dtype`` is returned.
    """
    shape = tuple(packed.shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    else:
        if tuple(out.shape) != shape:
            raise ValueError(
                f"dequantize: out has shape {tuple(out.shape)}, the segment is {shape}"
            )
        if out.device != packed.device:
            raise ValueError(
                f"dequantize: out is on {out.device}, the segment on {packed.device}; "
                "move the segment with packed.to(device) first"
            )
        if not out.is_floating_point():
            raise ValueError(f"dequantize: out must be a float tensor, got {out.dtype}")
    if out.numel() == 0:
        return out
    dequantize_into(packed, out)
    return out


class _TorchImpl:
    kmeans_assign = staticmethod(kmeans_assign)
    kmeans_update = staticmethod(kmeans_update)
    quantize_pack = staticmethod(quantize_pack)
