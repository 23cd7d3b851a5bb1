"""`CrossAttentionKVCache`: the per-layer text K/V, computed once per prompt."""

from __future__ import annotations

import torch

from causalkv.caches.spec import CacheWriteError
from causalkv.errors import UsageError


class CrossAttentionKVCache:
    """Holds cross-attention ``k``/``v`` ``[B, L, H, D]`` (detached) until reset."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def is_initialized(self) -> bool:
        return self.k is not None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape != v.shape:
            raise CacheWriteError(f"cross-attention k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
        self.k, self.v = k.detach(), v.detach()

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            raise UsageError("cross-attention cache is empty: store() the prompt's K/V first")
        return self.k, self.v

    def reset(self) -> None:
        self.k = self.v = None

    def resident_nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes  # type: ignore[union-attr]
