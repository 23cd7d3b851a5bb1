"""QVG (Quant-VideoGen) KV-cache quantization: the settings and the segment store.

The codec that packs QVG's cold chunks, PRQ (``quantize``/``dequantize``, `PackedSegment`,
the byte formula, `PRQCodec`), is the codec layer's: `causalkv.caches.codecs.prq`, beside
FP8 and NVFP4. See docs/qvg.md.

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

from causalkv.lazy import lazy_names

#: exported name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("QVGCodecOptions", "QVGKVQuantArgs", "QVGPackingOptions", "quant_choices",
         "recent_tiers"),
        "causalkv.caches.qvg.options",
    ),
    **dict.fromkeys(
        ("RECENT_CHUNKS", "RECENT_NON_SINK", "RecentChunksPolicy", "ChunkInfo", "PackingDecision", "PackingPolicy",
         "RecentNonSinkPolicy"),
        "causalkv.caches.qvg.policy",
    ),
    "KVWrite": "causalkv.caches.qvg.segments",
    "SegmentStore": "causalkv.caches.qvg.store",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
