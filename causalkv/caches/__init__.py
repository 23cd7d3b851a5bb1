"""Causal KV caches: one contract (docs/caches.md), a dense rolling cache and a QVG packed cache.

    from causalkv.caches import DenseCausalKVCache, CausalCacheSpec, QVGPackedCausalKVCache, attend

The names are exported lazily (PEP 562, `causalkv.lazy.lazy_names`): importing a torch-free
submodule such as `causalkv.caches.qvg.options` runs this package without importing torch; the
first use of a name below imports its module. The feature names and `CacheCapabilities` live in
`causalkv.capabilities` (torch-free), their one import path.
"""

from __future__ import annotations

from causalkv.lazy import lazy_names

#: exported name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("AttendError", "AttendStats", "attend"), "causalkv.caches.attention"),
    "CrossAttentionKVCache": "causalkv.caches.cross",
    "DenseCausalKVCache": "causalkv.caches.dense",
    **dict.fromkeys(("CommitPass", "PassMarker"), "causalkv.caches.passes"),
    "QVGPackedCausalKVCache": "causalkv.caches.qvg.packed",
    **dict.fromkeys(
        ("CacheWriteError", "CausalAttentionKVView", "CausalKVCache", "CausalCacheSpec"),
        "causalkv.caches.spec",
    ),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
