"""`CacheSet`: one branch's caches.

A stage allocates one set per CFG branch, once, on first use (after
``causalkv_configure_stage`` had its say): a causal KV cache per self-attention layer, built
by the chosen cache factory with the request's settings record, and a cross-attention cache
per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.caches.spec import CausalKVCache

__all__ = ["CacheSet"]


@dataclass
class CacheSet:
    """One branch's caches: a causal KV cache and a cross-attention cache per layer.

    ``prompt`` is the text whose cross-attention K/V the cross caches hold (None: empty).
    """

    kv: list[CausalKVCache]
    cross: list[CrossAttentionKVCache]
    prompt: str | None = None

    def reset(self) -> None:
        for cache in self.kv:
            cache.reset_indices()
        self.reset_cross()

    def reset_cross(self) -> None:
        for cache in self.cross:
            cache.reset()
        self.prompt = None

