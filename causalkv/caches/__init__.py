"""Causal KV caches: one contract (docs/caches.md), a dense rolling cache and a QVG packed cache.

    from causalkv.caches import DenseCausalKVCache, KVCacheSpec, QVGPackedCausalKVCache, attend
"""

from causalkv.caches.attention import AttendError, AttendStats, attend
from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.caches.dense import DenseCausalKVCache
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.spec import (
    GROWTH,
    HEAD_SLICE,
    INT_INDICES,
    PINNED_SINK,
    QUANT_QVG,
    RECENT_WINDOW,
    CacheCapabilities,
    CacheWriteError,
    CausalAttentionKVView,
    CausalKVCache,
    KVCacheSpec,
)

__all__ = [
    "GROWTH",
    "HEAD_SLICE",
    "INT_INDICES",
    "PINNED_SINK",
    "QUANT_QVG",
    "RECENT_WINDOW",
    "AttendError",
    "AttendStats",
    "CacheCapabilities",
    "CacheWriteError",
    "CausalAttentionKVView",
    "CausalKVCache",
    "CrossAttentionKVCache",
    "DenseCausalKVCache",
    "KVCacheSpec",
    "QVGPackedCausalKVCache",
    "attend",
]
