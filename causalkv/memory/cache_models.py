"""The caches the planner counts, each as its cursor model, packing policy, centroid rule and
the way its calls read their window (`CacheModel`). The planner takes one of them; which host
runs which is the caller's table (``causalkv memory --host``: `causalkv.cli.memory`).
"""

from __future__ import annotations

from causalkv.caches.codecs.prq.centroids import MIN_TOKENS_PER_CENTROID
from causalkv.caches.qvg.policy import RECENT_CHUNKS, RECENT_NON_SINK
from causalkv.caches.rolling_slots import RollingSlots
from causalkv.caches.stream import StreamState
from causalkv.memory.records import CacheModel

__all__ = ["ROLLING_SLOT_CACHE", "STREAM_CACHE"]

#: `QVGPackedCausalKVCache` as built by default: positions by `StreamState`, keep-recent over
#: all completed chunks, 32+ tokens per centroid, lazy views read one packed segment at a time
STREAM_CACHE = CacheModel(StreamState, RECENT_CHUNKS, MIN_TOKENS_PER_CENTROID, "streamed",
                          lazy_views=True)

#: a QVG cache that reproduces a rolling slot buffer's views (`RollingSlots`): keep-recent
#: over non-sink chunks, the centroids as given, every call's window gathered after its write
ROLLING_SLOT_CACHE = CacheModel(RollingSlots, RECENT_NON_SINK, None, "gathered",
                                lazy_views=False)
