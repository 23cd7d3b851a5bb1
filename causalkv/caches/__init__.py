"""Causal KV caches: one contract (docs/caches.md), a dense rolling cache and a QVG packed cache."""

from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.caches.dense import DenseCausalKVCache
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
    "CacheCapabilities",
    "CacheWriteError",
    "CausalAttentionKVView",
    "CausalKVCache",
    "CrossAttentionKVCache",
    "DenseCausalKVCache",
    "KVCacheSpec",
]
