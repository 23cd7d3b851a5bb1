"""Cache capabilities: the named features a cache supports, and the built-in feature names.

Torch-free, so plugin registrations (`causalkv.hooks.CacheFactory`) and the resolver use it
without loading torch. This module is their one import path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "GROWTH",
    "HEAD_SLICE",
    "INT_INDICES",
    "PINNED_SINK",
    "PROBE_COMMIT",
    "QUANT_QVG",
    "RECENT_WINDOW",
    "CacheCapabilities",
]

PINNED_SINK = "pinned_sink"
HEAD_SLICE = "head_slice"
RECENT_WINDOW = "recent_window"
GROWTH = "growth"
INT_INDICES = "int_indices"
QUANT_QVG = "quant:qvg"
#: the cache kind stores less when told which writes are probes and which commit
#: (``cache.use_marker(marker)``, `causalkv.caches.passes`): the stage marks its passes
#: when every cache it built has this
PROBE_COMMIT = "probe_commit"


@dataclass(frozen=True)
class CacheCapabilities:
    """The named features a cache implementation supports.

    Features are plain strings so that third-party caches can declare new ones; the
    built-in names are the module constants (``PINNED_SINK``, ``HEAD_SLICE``,
    ``RECENT_WINDOW``, ``GROWTH``, ``INT_INDICES``, ``QUANT_QVG``).
    """

    features: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, *features: str) -> CacheCapabilities:
        return cls(frozenset(features))

    def __contains__(self, feature: object) -> bool:
        return feature in self.features

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.features))

    def missing(self, requirements: Iterable[str]) -> frozenset[str]:
        """The requirements this cache does not cover (empty when it qualifies)."""
        return frozenset(requirements) - self.features

    def covers(self, requirements: Iterable[str]) -> bool:
        return not self.missing(requirements)

    def __str__(self) -> str:
        return ", ".join(sorted(self.features)) or "(none)"
