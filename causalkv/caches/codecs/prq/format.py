"""The PRQ packed format: `PackedSegment`, its constants, its byte formula and its scale table.

The leaf of the PRQ codec: the driver (`causalkv.caches.codecs.prq.quantizer`) and both
backends (`torch_impl`, `triton_impl`) import it, and it imports neither. `PRQKernels` is the protocol
the two backends implement.

Byte layout (all tensors contiguous when produced by `quantize`):

- ``codes [B, H, S, D * bits // 8]`` uint8: byte ``i`` of a token holds channels
  ``i*P .. i*P+P-1`` (``P = 8 // bits``), channel ``i*P + j`` in bits ``[j*bits, (j+1)*bits)``,
  each field a two's-complement signed code ``v`` in ``[-2^(bits-1), 2^(bits-1) - 1]``.
- Levels: grid ``"reference"`` symmetric: ``v * s`` with ``v`` in ``-q..q``, ``q = 2^(bits-1) - 1``
  (three levels at 2 bits, as in the reference package); grid ``"mse4"``: ``(2v + 1) * s``, all
  ``2^bits`` levels, odd multiples of a half-step ``s`` chosen by least squares; asymmetric:
  ``(v - z) * s`` with the int8 zero point ``z``.
- ``scales [B, H, S, D // block_size]`` float8_e4m3fn, decoded as ``fp8 * 2**scale_exp[b, h]``:
  ``scale_exp [B, H]`` int16 holds one exponent per (batch, head), chosen so the head's largest
  block scale lands in ``(224, 448]``, the top of e4m3's range. Every block scale within
  ``2^-17`` of its head's largest keeps 4 significant bits; smaller ones flush toward the e4m3
  subnormals (absolute error below ``2^-18`` of the head's largest scale). Symmetric and
  asymmetric scales are rounded *up* to the next e4m3 value, so codes never clip and the
  per-element error stays within half a (stored) step.
- A block whose *input* is all zeros stores the scale byte ``0x80`` (e4m3 ``-0.0``, never
  produced otherwise) and decodes to exact zeros regardless of its token's centroid.
- A head whose scale exponent is `POISON_SCALE_EXP` (non-finite input packed off the CPU,
  where refusing it would cost a host sync) decodes to non-finite values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from causalkv.caches.codecs.base import CodecError, RecordViews

__all__ = [
    "FP8_MAX",
    "MIN_SCALE_EXP",
    "POISON_SCALE_EXP",
    "ZERO_BLOCK_SCALE_BYTE",
    "CodecSettings",
    "PRQKernels",
    "PackedSegment",
    "bits_per_element",
    "block_fills_bytes",
    "encode_scales",
    "packed_nbytes_formula",
    "pow2",
    "scale_exponents",
    "scale_table",
]

ZERO_BLOCK_SCALE_BYTE = 0x80  # e4m3 -0.0: "this input block is all zeros"
FP8_MAX = 448.0
MIN_SCALE_EXP = -100  # 2**-e stays a finite float32 power of two
POISON_SCALE_EXP = 32767  # int16 max: 2**e is inf, so every decoded value is inf or NaN


@dataclass(frozen=True)
class CodecSettings:
    """The settings the codec reads, fixed for one codec (`PRQCodec` holds one); `quantize`
    and the byte formulas take any object with these attributes
    (`causalkv.caches.qvg.options.QVGKVQuantArgs` has them): residual ``bits`` (None: off, 2
    or 4), ``centroids`` per (batch, head) per stage, ``block_size`` channels per scale,
    k-means ``stages`` and ``kmeans_iters``, ``asymmetric`` zero points, and the level
    ``grid`` (``"reference"`` or ``"mse4"``)."""

    bits: int | None
    centroids: int = 128
    block_size: int = 64
    stages: int = 1
    kmeans_iters: int = 2
    asymmetric: bool = False
    grid: str = "reference"


# ---------------------------------------------------------------------------------------------
# The packed form
# ---------------------------------------------------------------------------------------------
#: the tensor fields of `PackedSegment` that hold a row per token (`select_tokens` slices them),
#: then those per head (the centroids and the scale exponents)
_PER_TOKEN = ("ids", "codes", "scales", "zeros")
_TENSORS = (*_PER_TOKEN, "centroids", "scale_exp")


def _apply(fn, value):
    """``fn`` on a field of tensors: a tensor, a list of them (one per stage) or None."""
    if value is None:
        return None
    return [fn(t) for t in value] if isinstance(value, list) else fn(value)


@dataclass
class PackedSegment(RecordViews):
    """One PRQ-packed segment of K or V, logical shape ``[B, H, S, D]``.

    Attributes:
        centroids: per stage ``[B, H, K, D]`` bf16, ``K = min(args.centroids, S)``.
        ids: per stage ``[B, H, S]`` uint8 cluster ids.
        codes: ``[B, H, S, D * bits // 8]`` uint8 packed residual codes (see module doc).
        scales: ``[B, H, S, D // block_size]`` float8_e4m3fn block scales (``x 2**scale_exp``).
        scale_exp: ``[B, H]`` int16, the power-of-two exponent of every decoded scale of a head.
        zeros: ``[B, H, S, D // block_size]`` int8 zero points when asymmetric, else None.
        shape: ``(B, H, S, D)``.
        dtype: dtype of the tensor that was quantized.
        bits: residual bits (2 or 4).
        block_size: channels per scale block.
        grid: ``"reference"`` or ``"mse4"`` (how codes map to levels).
    """

    centroids: list[torch.Tensor]
    ids: list[torch.Tensor]
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    scale_exp: torch.Tensor
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    bits: int
    block_size: int
    grid: str = "reference"

    @property
    def nbytes(self) -> int:
        """Exactly the stored bytes: the sum of every tensor's ``nbytes``."""
        values = [getattr(self, f) for f in _TENSORS]
        return int(sum(t.nbytes for v in values if v is not None
                       for t in (v if isinstance(v, list) else [v])))

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

    def shared_tensors(self) -> tuple[torch.Tensor, ...]:
        """The centroids: segments packed with a shared codebook reference the same tensors."""
        return tuple(self.centroids)

    def _map(self, fn, kind: str | None = None, **changes: Any) -> PackedSegment:
        """A copy with ``fn`` applied to each tensor (only the per-token ones for ``kind``
        ``"tokens"``: the centroids and the per-head scale exponents are shared with ``self``,
        so `nbytes` of a token slice counts them whole) and ``changes`` made.
        `dequantize` reads a slice through its strides: decoding part of a segment costs that
        part only."""
        fields = _PER_TOKEN if kind == "tokens" else _TENSORS
        return replace(self, **{f: _apply(fn, getattr(self, f)) for f in fields}, **changes)

    @staticmethod
    def cat_heads(parts: list[PackedSegment]) -> PackedSegment:
        """``parts`` (the same tokens and settings, their heads in order) joined along the
        heads into new tensors (one part: itself)."""
        if len(parts) == 1:
            return parts[0]

        def cat(field: str) -> Any:
            values = [getattr(p, field) for p in parts]
            if values[0] is None:
                return None
            if isinstance(values[0], list):
                return [torch.cat(stage, dim=1) for stage in zip(*values)]
            return torch.cat(values, dim=1)

        B, _, S, D = parts[0].shape
        heads = sum(p.shape[1] for p in parts)
        return replace(parts[0], **{f: cat(f) for f in _TENSORS}, shape=(B, heads, S, D))


# ---------------------------------------------------------------------------------------------
# Byte accounting (docs/design.md, "Memory math")
# ---------------------------------------------------------------------------------------------
def block_fills_bytes(block_size: int, bits: int) -> bool:
    """Whether a scale block of ``block_size`` channels fills whole bytes of ``bits``-bit codes
    (the Triton kernels read a block's codes as bytes of its own): PRQ's block-size rule beside
    ``head_dim % block_size == 0``, read by the codec's layout rule
    (`causalkv.caches.codecs.prq.codec.PRQCodec.layout_problem`) and `quantize`'s checks."""
    return block_size * bits % 8 == 0


def packed_nbytes_formula(shape: tuple[int, int, int, int], args: CodecSettings) -> int:
    """Stored bytes of a segment ``shape = (B, H, S, D)`` packed with ``args``.

    ``B*H*S*D*bits/8`` (codes) + ``B*H*S*D/block`` (fp8 scales) [+ the same for int8 zeros]
    + ``stages*B*H*S`` (uint8 ids) + ``2*stages*B*H*K*D`` (bf16 centroids) + ``2*B*H`` (int16
    scale exponents), ``K = min(centroids, S)``.
    """
    B, H, S, D = (int(v) for v in shape)
    if args.bits is None:
        raise CodecError("packed_nbytes_formula: quantization is off (args.bits is None)")
    K = min(args.centroids, S)
    n = B * H * S
    blocks = n * (D // args.block_size)
    return (
        n * D * args.bits // 8
        + blocks * (2 if args.asymmetric else 1)
        + args.stages * n
        + 2 * args.stages * B * H * K * D
        + 2 * B * H
    )


def bits_per_element(S: int, D: int, args: CodecSettings) -> float:
    """Stored bits per element of one head's ``[S, D]`` segment (16 when ``args.bits`` is None):
    ``bits + 8/block [+ 8/block] + 8*stages/D + 16*stages*K/S + 16/(S*D)``,
    ``K = min(centroids, S)``, the last term the per-head int16 scale exponent."""
    if args.bits is None:
        return 16.0
    return 8.0 * packed_nbytes_formula((1, 1, S, D), args) / (S * D)


# ---------------------------------------------------------------------------------------------
# Scale encoding and decoding
# ---------------------------------------------------------------------------------------------
def scale_exponents(max_scale: torch.Tensor) -> torch.Tensor:
    """Per element of ``max_scale [...]`` (any float dtype) the smallest ``e`` with
    ``max_scale * 2**-e <= 448`` (0 for an all-zero segment), int32, no sync.

    ``max_scale / 448 = m * 2**e`` with ``m`` in ``[0.5, 1)`` (one less when ``m = 0.5``); at
    least `MIN_SCALE_EXP`: ``2**-e`` must stay a finite float32 power of two (below ``2**-100``
    a segment is numerically zero)."""
    m, e = torch.frexp(max_scale.to(torch.float64) / FP8_MAX)
    e = (e - (m == 0.5).to(e.dtype)).clamp_min(MIN_SCALE_EXP)
    return torch.where(max_scale > 0, e, 0).to(torch.int32)


def pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly ``2.0**e`` as ``dtype`` (float32 or float64) for int ``e`` in its normal range,
    built from the exponent bits (no host value, no rounding)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def encode_scales(
    scale: torch.Tensor, exp: torch.Tensor, *, round_up: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scales ``[...]`` -> (e4m3 bytes uint8, decoded fp32 scales = fp8 * 2**exp).

    ``exp``: an int tensor broadcastable to ``scale`` (e.g. one per head).
    ``round_up`` picks the next e4m3 value at or above the scale (never below), so a
    symmetric/asymmetric grid still covers the block's range after rounding.
    """
    up = pow2(exp, torch.float32)
    scaled = (scale * pow2(-exp, torch.float32)).clamp_(0.0, FP8_MAX)
    enc = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    if round_up:  # one step up where the e4m3 value fell below the scale
        enc.add_(enc.view(torch.float8_e4m3fn).float() < scaled)
    return enc, enc.view(torch.float8_e4m3fn).float().mul_(up)


@functools.lru_cache(maxsize=4)
def _fp8_table64() -> torch.Tensor:
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    table = torch.nan_to_num(table.double(), nan=0.0)  # 0x7F / 0xFF are never stored
    table[ZERO_BLOCK_SCALE_BYTE] = 0.0
    return table


def scale_table(scale_exp: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Decoded value of every e4m3 byte times ``2**scale_exp`` (``0x80`` -> 0), float32:
    ``[B*H, 256]`` for the ``[B, H]`` exponents (`PackedSegment.scale_exp`), row ``b*H + h``
    for head ``(b, h)``. Computed in float64, so an exponent outside float32's range still
    gives every representable product exactly.
    """
    base = _fp8_table64().to(device)
    e = scale_exp.reshape(-1, 1).to(device=device, dtype=torch.float64)
    return (base * torch.exp2(e)).float()


# ---------------------------------------------------------------------------------------------
# What a backend implements
# ---------------------------------------------------------------------------------------------
class PRQKernels(Protocol):
    """The kernels a codec backend provides (`torch_impl` and `triton_impl` are modules that
    implement it). Layouts: ``x [G, S, D]`` float32 token vectors of ``G`` (batch, head)
    pairs, ``c [G, K, D]`` float32 centroids, residual ``r [N, D]`` float32 (``N = G * S``),
    block scales ``[N, D // block]``. The driver (`causalkv.caches.codecs.prq.quantizer`) does the
    rest: normalization, k-means draws, block statistics, scale encoding."""

    def kmeans_assign(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Nearest centroid ``[G, S]`` int64 of each token (ties: the lowest index)."""

    def kmeans_update(self, x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Lloyd update ``[G, K, D]``: each cluster's mean, an empty cluster keeps ``c``."""

    def quantize_pack(
        self, r: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, *,
        bits: int, block: int, grid: str,
    ) -> torch.Tensor:
        """Residual ``r`` quantized with decoded block scales (and zero points), packed:
        ``[N, D * bits // 8]`` uint8 (the codes of the module docstring)."""

    def dequantize_into(self, packed: PackedSegment, out: torch.Tensor) -> None:
        """The reconstruction of ``packed`` written into ``out [B, H, S, D]`` (any strides,
        float dtype, on ``packed.device``)."""
