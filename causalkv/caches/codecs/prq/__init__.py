"""PRQ, the ``int4`` and ``int2`` codec: k-means centroids + 2/4-bit residual codes.

`quantize` packs a K or V segment ``[B, H, S, D]`` into a `PackedSegment` (k-means
centroids + uint8 ids + 2/4-bit residual codes with fp8 block scales); `dequantize`
reconstructs it, optionally straight into a slice of a larger buffer (`quantizer`: the driver
and the backend choice, `resolve_backend` and its env var `BACKEND_ENV`). `PRQCodec`
(`codec`) is PRQ behind the `causalkv.caches.codecs.base.KVCodec` interface, registered as
the ``int4`` and ``int2`` codec settings. See docs/qvg.md.

The modules: `format` (the packed record, its byte layout and formula: the leaf), `centroids`
(the centroid rule: how many centroids a packed span gets),
`torch_impl` and `triton_impl` (the two backends' kernels), `workspace` (reused CPU
temporaries) and `attention`.

`causalkv.caches.codecs.prq.attention.packed_attention` attends queries over a packed
segment without decoding it to memory (a Triton kernel; that module needs triton, so it is
not exported here). See docs/attention.md.

The names are exported lazily (PEP 562, `causalkv.lazy.lazy_names`): importing this package
imports no torch until a name is read.
"""

from __future__ import annotations

from causalkv.lazy import lazy_names

#: exported name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("MIN_TOKENS_PER_CENTROID", "centroids_for"), "causalkv.caches.codecs.prq.centroids"),
    **dict.fromkeys(
        ("BACKEND_ENV", "dequantize", "quantize", "resolve_backend"),
        "causalkv.caches.codecs.prq.quantizer",
    ),
    **dict.fromkeys(
        ("CodecSettings", "PackedSegment", "bits_per_element", "packed_nbytes_formula"),
        "causalkv.caches.codecs.prq.format",
    ),
    "PRQCodec": "causalkv.caches.codecs.prq.codec",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
