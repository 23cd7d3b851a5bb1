"""PRQ behind the codec interface: `PRQCodec` (the ``int4`` and ``int2`` codec settings).

A thin adapter over the PRQ quantizer (`causalkv.caches.codecs.prq.quantizer`
``quantize``/``dequantize``, `causalkv.caches.codecs.prq.format` ``PackedSegment`` and its byte
formula): the numbers are the quantizer's, bit for bit. PRQ shares k-means codebooks between segments (``codebooks``) and has
an attention kernel straight over its records (`causalkv.caches.codecs.prq.attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from causalkv.caches.codecs.base import KVCodec
from causalkv.caches.codecs.prq import quantizer
from causalkv.caches.codecs.prq.format import PackedSegment, bits_per_element, packed_nbytes_formula

__all__ = ["PRQCodec", "PRQSettings"]


@dataclass(frozen=True)
class PRQSettings:
    """What `quantizer.quantize` reads (the `CodecSettings` protocol), fixed for one codec."""

    bits: int
    centroids: int = 128
    block_size: int = 64
    stages: int = 1
    kmeans_iters: int = 2
    asymmetric: bool = False
    grid: str = "reference"


class PRQCodec(KVCodec):
    """Product residual quantization (docs/qvg.md): k-means centroids per (batch, head),
    ``bits``-bit residual codes with fp8 block scales.

    Args:
        settings: the PRQ settings (residual bits, centroids, block size, ...).
        name: the codec setting it was made from.
    """

    shares_codebooks = True
    reads = frozenset({"centroids", "block_size", "stages", "kmeans_iters", "asymmetric", "grid"})

    def __init__(self, settings: PRQSettings, name: str = "") -> None:
        self.settings = settings
        self.name = name or f"int{settings.bits}"

    @classmethod
    def from_settings(cls, settings: Any, *, bits: int, **_: Any) -> PRQCodec:
        """PRQ at ``bits`` with the cache record's centroids, block size, stages, k-means
        iterations, zero points and grid."""
        return cls(PRQSettings(
            bits=bits, centroids=settings.centroids, block_size=settings.block_size,
            stages=settings.stages, kmeans_iters=settings.kmeans_iters,
            asymmetric=settings.asymmetric, grid=settings.grid,
        ), name=f"int{bits}")

    def encode(
        self, x: torch.Tensor, *, seed: int = 1234, head_offset: int = 0,
        codebooks: list[torch.Tensor] | None = None,
    ) -> PackedSegment:
        return quantizer.quantize(x, self.settings, seed=seed, head_offset=head_offset,
                              codebooks=codebooks)

    def decode_into(self, record: PackedSegment, out: torch.Tensor) -> None:  # type: ignore[override]
        quantizer.dequantize(record, out=out)

    def nbytes(self, shape: tuple[int, int, int, int]) -> int:
        return packed_nbytes_formula(shape, self.settings)

    def shared_nbytes(self, shape: tuple[int, int, int, int]) -> int:
        """The bf16 centroids ``[B, H, K, D]`` per stage, ``K = min(centroids, S)``."""
        B, H, S, D = (int(v) for v in shape)
        return 2 * self.settings.stages * B * H * min(self.settings.centroids, S) * D

    def bits_per_element(self, S: int, D: int) -> float:
        return bits_per_element(S, D, self.settings)

    def layout_problem(self, head_dim: int) -> str | None:
        s = self.settings
        if head_dim % s.block_size:
            divisors = [d for d in range(8 // s.bits, head_dim + 1)
                        if head_dim % d == 0 and (d * s.bits) % 8 == 0]
            return (
                f"kv-cache-quant-block-size {s.block_size} does not divide head_dim={head_dim}; "
                f"choose one of {divisors}"
            )
        return None
