"""QVG (Quant-VideoGen) KV-cache quantization: settings, the PRQ codec, the segment store.

`quantize` packs a K or V segment ``[B, H, S, D]`` into a `PackedSegment` (k-means
centroids + uint8 ids + 2/4-bit residual codes with fp8 block scales); `dequantize`
reconstructs it, optionally straight into a slice of a larger buffer. See docs/qvg.md.

`causalkv.caches.qvg.attention.packed_attention` attends queries over a packed segment
without decoding it to memory (a Triton kernel; that module needs triton, so it is not
exported here). See docs/attention.md.

`SegmentStore` (`causalkv.caches.qvg.store`) holds one layer's K/V by global position with
cold chunks packed under a packing policy object (`causalkv.caches.qvg.policy`: `RECENT_CHUNKS`,
`RECENT_NON_SINK`); causalkv's `QVGPackedCausalKVCache` and every host adapter's cache use it.
Which cold chunks it packs by which codec in which spans is its tier policy
(`causalkv.caches.qvg.tiering`), the decision the memory planner counts bytes from.

The settings (`causalkv.caches.qvg.options`: `QVGCodecOptions`, `QVGPackingOptions`,
`QVGKVQuantArgs`) are torch-free; the names are exported lazily (PEP 562,
`causalkv.lazy.lazy_names`), so importing the settings loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from causalkv.lazy import lazy_names

if TYPE_CHECKING:
    from causalkv.caches.qvg.chunk_scratch import ChunkScratch
    from causalkv.caches.qvg.codec import BACKEND_ENV, dequantize, quantize, resolve_backend
    from causalkv.caches.qvg.format import PackedSegment, bits_per_element, packed_nbytes_formula
    from causalkv.caches.qvg.options import (
        QVGCodecOptions,
        QVGKVQuantArgs,
        QVGPackingOptions,
        add_cli_args,
        from_namespace,
        quant_choices,
        recent_tiers,
    )
    from causalkv.caches.qvg.policy import (
        RECENT_CHUNKS,
        RECENT_NON_SINK,
        ChunkInfo,
        PackingDecision,
        PackingPolicy,
        RecentChunksPolicy,
        RecentNonSinkPolicy,
    )
    from causalkv.caches.qvg.store import KVWrite, SegmentStore

#: exported name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("QVGCodecOptions", "QVGKVQuantArgs", "QVGPackingOptions", "add_cli_args",
         "from_namespace", "quant_choices", "recent_tiers"),
        "causalkv.caches.qvg.options",
    ),
    **dict.fromkeys(
        ("BACKEND_ENV", "dequantize", "quantize", "resolve_backend"), "causalkv.caches.qvg.codec"
    ),
    **dict.fromkeys(
        ("PackedSegment", "bits_per_element", "packed_nbytes_formula"), "causalkv.caches.qvg.format"
    ),
    **dict.fromkeys(
        ("RECENT_CHUNKS", "RECENT_NON_SINK", "RecentChunksPolicy", "ChunkInfo", "PackingDecision", "PackingPolicy",
         "RecentNonSinkPolicy"),
        "causalkv.caches.qvg.policy",
    ),
    **dict.fromkeys(("KVWrite", "SegmentStore"), "causalkv.caches.qvg.store"),
    "ChunkScratch": "causalkv.caches.qvg.chunk_scratch",
}

__all__ = [
    "BACKEND_ENV",
    "RECENT_CHUNKS",
    "RECENT_NON_SINK",
    "RecentChunksPolicy",
    "ChunkInfo",
    "ChunkScratch",
    "KVWrite",
    "PackedSegment",
    "PackingDecision",
    "PackingPolicy",
    "QVGCodecOptions",
    "QVGKVQuantArgs",
    "QVGPackingOptions",
    "RecentNonSinkPolicy",
    "SegmentStore",
    "add_cli_args",
    "bits_per_element",
    "dequantize",
    "from_namespace",
    "packed_nbytes_formula",
    "quant_choices",
    "quantize",
    "recent_tiers",
    "resolve_backend",
]

__getattr__ = lazy_names(__name__, _EXPORTS)
