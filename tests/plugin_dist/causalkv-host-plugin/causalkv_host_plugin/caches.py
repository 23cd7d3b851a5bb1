"""A cache kind of causalkv's contract, ``ToyPackedCache(spec, options)``: causalkv's packed cache
under another name (imports torch, not a host)."""

from causalkv.caches.qvg.packed import QVGPackedCausalKVCache


class ToyPackedCache(QVGPackedCausalKVCache):
    """causalkv's packed cache under another name: every method and capability inherited."""
