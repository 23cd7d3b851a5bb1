"""What the chunk loop hands back: `ChunkStats` per chunk, `ForwardRecord` per transformer
call, `DenoisingResult` per request. Typed records, read by attribute (the run report, the
command line, the ``causalkv_chunk_done`` hook).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkStats", "ForwardRecord", "DenoisingResult"]


@dataclass(frozen=True)
class ChunkStats(Mapping[str, Any]):
    """One chunk of the loop, measured after its context pass (``causalkv_chunk_done``'s
    ``stats``). Read the attributes; it is also a read-only mapping of the same names
    (``stats["seconds"]``, ``stats.get("seconds")``), as the dict of earlier releases was.

    Attributes:
        chunk: the chunk's index (0-based).
        frames: ``(first, end)`` latent frames of the chunk (end exclusive).
        token_start: the chunk's first global token position in the caches.
        rope_frame_start: the RoPE frame of its first frame (may be fractional).
        prompt: the chunk's prompt.
        seconds: wall time of the chunk (its denoising steps and the context pass).
        kv_resident_bytes: bytes all self-attention caches hold after it (every layer, K and
            V, every CFG branch).
        visible_tokens: tokens a read of the first layer's cache shows after the chunk (sink,
            pinned range, window; the recent window when one applies). After a commit (a
            stage that marks its context pass) that is what the next chunk reads beside
            itself: the commit already dropped what the next advance drops.
    """

    chunk: int
    frames: tuple[int, int]
    token_start: int
    rope_frame_start: float
    prompt: str
    seconds: float
    kv_resident_bytes: int
    visible_tokens: int

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


@dataclass(frozen=True)
class ForwardRecord:
    """One transformer call of the loop (for tracing and the oracle tests).

    ``latents``/``prediction``: ``[B, C, F, h, w]`` float32; ``step`` is the denoising step
    index, or ``-1`` for the context pass; ``token_start``/``rope_frame_start`` as passed.
    """

    chunk_index: int
    step: int
    timestep: float
    latents: torch.Tensor
    prediction: torch.Tensor
    token_start: int
    rope_frame_start: float


@dataclass
class DenoisingResult:
    """Clean latents ``[B, C, F, h, w]`` (float32) and one `ChunkStats` per chunk."""

    latents: torch.Tensor
    chunk_stats: list[ChunkStats] = field(default_factory=list)
