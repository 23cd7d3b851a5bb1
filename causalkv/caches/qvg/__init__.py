"""QVG (Quant-VideoGen) KV-cache quantization: settings and the PRQ codec.

`quantize` packs a K or V segment ``[B, H, S, D]`` into a `PackedSegment` (k-means
centroids + uint8 ids + 2/4-bit residual codes with fp8 block scales); `dequantize`
reconstructs it, optionally straight into a slice of a larger buffer. See docs/qvg.md.

`causalkv.caches.qvg.attention.packed_attention` attends queries over a packed segment
without decoding it to memory (a Triton kernel; that module needs triton, so it is not
imported here). See docs/attention.md.
"""

from causalkv.caches.qvg.args import QUANT_CHOICES, QVGKVQuantArgs, add_cli_args, from_namespace
from causalkv.caches.qvg.codec import (
    BACKEND_ENV,
    PackedSegment,
    bits_per_element,
    dequantize,
    packed_nbytes_formula,
    quantize,
    resolve_backend,
)

__all__ = [
    "BACKEND_ENV",
    "QUANT_CHOICES",
    "PackedSegment",
    "QVGKVQuantArgs",
    "add_cli_args",
    "bits_per_element",
    "dequantize",
    "from_namespace",
    "packed_nbytes_formula",
    "quantize",
    "resolve_backend",
]
