"""PRQ behind the codec interface: `PRQCodec` (the ``int4`` and ``int2`` codec settings).

A thin adapter over the PRQ quantizer (`causalkv.caches.codecs.prq.quantizer`
``quantize``/``dequantize``, `causalkv.caches.codecs.prq.format` ``PackedSegment`` and its byte
formula): the numbers are the quantizer's, bit for bit. PRQ shares k-means codebooks between segments (``codebooks``) and has
an attention kernel straight over its records (`causalkv.caches.codecs.prq.attention`).
"""

from __future__ import annotations

from typing import Any

import torch

from causalkv.caches.codecs.base import KVCodec
from causalkv.caches.codecs.prq import quantizer
from causalkv.caches.codecs.prq.centroids import MIN_TOKENS_PER_CENTROID, centroids_for
from causalkv.caches.codecs.prq.format import (
    CodecSettings,
    PackedSegment,
    block_fills_bytes,
    packed_nbytes_formula,
)
from causalkv.env import text as env_text

__all__ = ["PRQCodec"]


class PRQCodec(KVCodec):
    """Product residual quantization (docs/qvg.md): k-means centroids per (batch, head),
    ``bits``-bit residual codes with fp8 block scales.

    Args:
        settings: the PRQ settings (residual bits, centroids, block size, ...).
    """

    shares_codebooks = True
    reads = frozenset({"centroids", "block_size", "stages", "kmeans_iters", "asymmetric", "grid"})

    def __init__(self, settings: CodecSettings) -> None:
        self.settings = settings
        self.name = f"int{settings.bits}"

    @classmethod
    def from_settings(cls, settings: Any, *, bits: int, **_: Any) -> PRQCodec:
        """PRQ at ``bits`` with the cache record's centroids, block size, stages, k-means
        iterations, zero points and grid."""
        return cls(CodecSettings(bits, **{f: getattr(settings, f) for f in cls.reads}))

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

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """PRQ's bound per element, from its definition (`quantizer`), for any settings.

        Per (batch, head), stage by stage: a k-means centroid is a mean of the stage's input
        tokens (or one of them), so per channel it lies within their range, then is rounded to
        bf16 (``2**-9`` of the largest magnitude). Stage 1 leaves a residual
        ``|r_td| <= max(x_td - lo_d, hi_d - x_td) + 2**-9 * M_d`` (``lo``, ``hi``, ``M``: the
        channel's minimum, maximum and largest ``|x|`` over the tokens); a later stage, whose
        centroids lie within the previous residual's range, adds at most that range's largest
        magnitude (times ``1 + 2**-9``). The final residual is coded per block of
        ``block_size`` channels with the block's largest ``|r|``, ``a``, bounding the error:

        - reference grid, or zero points: ``|e| <= s / 2`` with the scale ``s`` rounded *up*
          to e4m3 (``s <= (1 + 2**-3) * a / q``, ``q = 2**(bits-1) - 1``; with zero points the
          scale is ``range / (2**bits - 1)`` and no code clips), so ``(1 + 2**-3) / (2 q) * a``;
        - ``mse4``: nearest of the odd levels, the least-squares scale is at most ``a`` and
          rounded to the nearest e4m3 (``2**-4``), an element beyond the outer level is off by
          at most ``a``: ``(1 + 2**-4) * a``.

        Plus ``2**-14`` of the head's largest ``a`` (an e4m3 subnormal scale rounded) and
        ``2**-20 * (|x| + a)`` (float32 arithmetic).
        """
        st = self.settings
        xd = x.detach().double()
        lo, hi = xd.amin(dim=2, keepdim=True), xd.amax(dim=2, keepdim=True)  # [B, H, 1, D]
        big = xd.abs().amax(dim=2, keepdim=True)
        r = torch.maximum(xd - lo, hi - xd) + 2.0**-9 * big  # stage 1's residual, [B, H, S, D]
        for _ in range(1, st.stages):
            r = r + (1 + 2.0**-9) * r.amax(dim=2, keepdim=True)
        a = r.unflatten(-1, (-1, st.block_size)).amax(dim=-1, keepdim=True)  # [B, H, S, nb, 1]
        if st.grid == "mse4" and not st.asymmetric:
            f = 1 + 2.0**-4
        else:
            f = (1 + 2.0**-3) / (2 * (2 ** (st.bits - 1) - 1))
        head = a.amax(dim=(2, 3, 4), keepdim=True)
        bound = f * a + 2.0**-14 * head + 2.0**-20 * a
        return (bound + 2.0**-20 * xd.abs().unflatten(-1, (-1, st.block_size))).flatten(-2)

    def request_lines(self, span_tokens: int, whole_sink_tokens: int = 0) -> list[str]:
        """The run header's line: the centroids a packed span of ``span_tokens`` gets (and a
        sink of ``whole_sink_tokens`` packed whole), by the centroid rule
        (`causalkv.caches.codecs.prq.centroids`)."""
        c = self.settings.centroids
        whole_sink = (f"; the whole sink ({whole_sink_tokens:,} tokens) "
                      f"{centroids_for(whole_sink_tokens, c)}" if whole_sink_tokens else "")
        return [
            f"centroids: {centroids_for(span_tokens, c)} per packed span of {span_tokens:,} "
            f"tokens{whole_sink} (at most {c}; a span of S tokens gets min({c}, 2**floor(log2(S / "
            f"{MIN_TOKENS_PER_CENTROID}))), so centroids cost at most half a bit per element; "
            "metrics kv_packing.centroids counts the chunks by centroids used)"
        ]

    def device_problem(self, device: torch.device) -> str | None:
        """Why PRQ's backend (``CAUSALKV_QVG_BACKEND``) cannot run on ``device``: a name that
        does not exist, or a backend that does not run there."""
        try:
            quantizer.resolve_backend(None, device)
        except ValueError as exc:
            env = quantizer.BACKEND_ENV
            return (f"{env}={env_text(env)!r}: {exc}; set {env} to auto (or unset it) to let "
                    "causalkv pick the backend that runs here")
        return None

    def layout_problem(self, head_dim: int) -> str | None:
        """PRQ's block-size rules: a block's codes fill whole bytes (`block_fills_bytes`) and
        ``block_size`` divides ``head_dim``; the message names the flag and the fix."""
        s = self.settings
        if not block_fills_bytes(s.block_size, s.bits):
            return (f"kv-cache-quant-block-size {s.block_size} x {s.bits} bits is not a whole "
                    f"number of bytes; use a block size divisible by {8 // s.bits}")
        if head_dim % s.block_size:
            divisors = [d for d in range(8 // s.bits, head_dim + 1)
                        if head_dim % d == 0 and block_fills_bytes(d, s.bits)]
            return (
                f"kv-cache-quant-block-size {s.block_size} does not divide head_dim={head_dim}; "
                f"choose one of {divisors}"
            )
        return None
