"""PRQ codec: `quantize` a K or V segment ``[B, H, S, D]`` into a `PackedSegment`, `dequantize` it.

PRQ (the Quant-VideoGen scheme), per (batch, head):

1. ``stages`` rounds of seeded k-means over the S token vectors (D dims); each round stores
   its centroids ``[B, H, K, D]`` in bf16 and one uint8 cluster id per token, and subtracts
   the assigned (bf16-rounded) centroid from the running residual.
2. The final residual is quantized per token in blocks of ``block_size`` channels to
   ``bits`` bits with one float8-e4m3 scale per block (plus an int8 zero point per block
   when ``asymmetric``), and the codes are packed ``8 // bits`` per byte.

Dequantize = sum of the assigned centroids + level x scale, in one pass per stage.

Byte layout (all tensors contiguous when produced by `quantize`):

- ``codes [B, H, S, D * bits // 8]`` uint8: byte ``i`` of a token holds channels
  ``i*P .. i*P+P-1`` (``P = 8 // bits``), channel ``i*P + j`` in bits ``[j*bits, (j+1)*bits)``,
  each field a two's-complement signed code ``v`` in ``[-2^(bits-1), 2^(bits-1) - 1]``.
- Levels: grid ``"reference"`` symmetric: ``v * s`` with ``v`` in ``-q..q``, ``q = 2^(bits-1) - 1``
  (three levels at 2 bits, as in the reference package); grid ``"mse4"``: ``(2v + 1) * s``, all
  ``2^bits`` levels, odd multiples of a half-step ``s`` chosen by least squares; asymmetric:
  ``(v - z) * s`` with the int8 zero point ``z``.
- ``scales [B, H, S, D // block_size]`` float8_e4m3fn, decoded as ``fp8 * 2**scale_exp``:
  ``scale_exp`` is one integer per segment (Python metadata, no tensor bytes) chosen so the
  largest block scale lands in ``(224, 448]``, the top of e4m3's range. Every block scale within
  ``2^-17`` of the largest keeps 4 significant bits; smaller ones flush toward the e4m3
  subnormals (absolute error below ``2^-18`` of the segment's largest scale). Symmetric and
  asymmetric scales are rounded *up* to the next e4m3 value, so codes never clip and the
  per-element error stays within half a (stored) step.
- A block whose *input* is all zeros stores the scale byte ``0x80`` (e4m3 ``-0.0``, never
  produced otherwise) and decodes to exact zeros regardless of its token's centroid.

`quantize` makes two host syncs per call (the non-finite check and ``scale_exp``); it runs
once per cold chunk. `dequantize` makes none.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch

from causalkv.caches.qvg.args import QVGKVQuantArgs

__all__ = [
    "BACKEND_ENV",
    "PackedSegment",
    "bits_per_element",
    "dequantize",
    "packed_nbytes_formula",
    "quantize",
    "resolve_backend",
]

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
# Byte accounting (ARCHITECTURE.md "QVG")
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
    impl = _impl(resolve_backend(backend, x.device))
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
    impl = _impl(resolve_backend(backend, packed.device))
    impl.dequantize_into(packed, out)
    return out
