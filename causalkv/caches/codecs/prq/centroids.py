"""PRQ's centroid rule: how many k-means centroids a packed span of ``S`` tokens gets.

``min(centroids, 2**floor(log2(S // m)))`` (at least 1), ``m = MIN_TOKENS_PER_CENTROID`` by
default: the bf16 centroids then cost at most ``16 * K / S = 0.5`` bits per element, as the
reference's 128 do on its 4,680-token chunks (docs/packed_cache.md has the measurements behind
the rule). The store applies it per span (`causalkv.caches.qvg.tiering.TierPolicy`), the PRQ
codec names it in a run's header (`causalkv.caches.codecs.prq.codec.PRQCodec.request_lines`).
No torch here: the memory planner counts with it.
"""

from __future__ import annotations

__all__ = ["MIN_TOKENS_PER_CENTROID", "centroids_for"]

MIN_TOKENS_PER_CENTROID = 32
"""Default of the centroid rule: at least this many tokens per k-means centroid."""


def centroids_for(
    tokens: int, centroids: int, min_tokens_per_centroid: int = MIN_TOKENS_PER_CENTROID
) -> int:
    """K-means centroids for a span of ``tokens``: ``min(centroids, 2**floor(log2(tokens // m)))``.

    ``m = min_tokens_per_centroid``; at least 1. With ``m = 32`` the bf16 centroids cost at
    most ``16 * K / tokens = 0.5`` bits per element; a 4,680-token chunk keeps the reference's
    128 (146 tokens/32 rounds down to 128), 880 tokens get 16 and 48 tokens 1.
    """
    cap = max(1, tokens // min_tokens_per_centroid)
    return min(centroids, 1 << (cap.bit_length() - 1))
