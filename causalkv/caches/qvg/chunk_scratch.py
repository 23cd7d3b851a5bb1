"""`ChunkScratch`: the chunk being generated, held once for all the layers of a stage.

A causal video model rewrites the K/V of the chunk it is generating on every denoising pass,
and each self-attention layer consumes the view of its write inside the same call; only the
context-update pass (the clean latents at ``context_noise``) writes K/V that later chunks
read. So the chunk being generated does not have to live in every layer: the layers of a
stage run one after another, and one buffer of one chunk serves them all.

A `ChunkScratch` is that buffer, shared by every cache of a stage (its CFG branches too),
plus the stage's word on which pass is the context update:

- ``buffer(shape, dtype, device)``: K and V ``[B, n, H, D]`` views of the shared storage
  (grown when a larger chunk comes, never shrunk until `release`);
- ``with scratch.context_pass(pin=...)``: the writes made inside are context: each cache
  moves the chunk straight to its tier (packed at once with ``keep_recent_chunks=0``) and
  drops what the next chunk's advance would drop. ``pin=True`` announces that the stage
  pins this chunk as the shot sink right after the pass (``pin_current_chunk``), so the
  tier it gets is the one a pinned chunk gets;
- ``ledger``: the `causalkv.caches.ledger.ByteLedger` of the whole cache set: every cache
  reports its resident bytes after each write and every one-call buffer it fills, the scratch
  its own buffer, so ``ledger.peak_nbytes`` is the most the stage's caches held at once over
  the request, all layers, the scratch and the largest one-call buffer included.

Sharing is an opt-in the caller declares, because only the caller knows that it ends every
chunk with a context pass and reads each view inside the call that wrote it:
``ChunkScratch(shared=True)``, `share`, or the first `context_pass` declares it. Until then
the caches given the scratch keep the chunk being generated in their own storage (the dense
cache's answers at the dense cache's memory for that chunk) and only use its ledger. Once
declared, a chunk that ends without its context pass is still answered right while its K/V
are intact in the scratch (the cache takes its own copy at the next advance); if another
layer has overwritten them, the next advance, or a read, is refused with
`causalkv.caches.spec.CacheProtocolError` naming the chunk and the fix, the cache unchanged.

A cache given no scratch keeps the chunk being generated in its own storage (the contract of
`causalkv.caches.spec.CausalKVCache` without any stage cooperation).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from causalkv.caches.ledger import ByteLedger
from causalkv.caches.spec import CacheProtocolError
from causalkv.errors import UsageError

__all__ = ["ChunkScratch"]


class ChunkScratch:
    """One chunk of K/V shared by the caches of a stage, the context-pass flag, the ledger.

    Args:
        shared: declare at once that the caller ends every chunk with a context pass (see
            `share`); False waits for `share` or the first `context_pass`.

    Attributes:
        shared: the chunk being generated lives here (declared by the caller); False: every
            cache keeps its own and the scratch is only the ledger.
        committing: True inside `context_pass`.
        passes: context passes opened so far (a cache tells two passes apart by it).
        pin: the announcement of the current `context_pass` (False outside one).
        writer: the cache that wrote the buffer last (a reader that is not it would read
            another layer's K/V: `check_reader` refuses that).
        ledger: the cache set's `ByteLedger` (the caches and this buffer report to it).
    """

    def __init__(self, *, shared: bool = False) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.shared = bool(shared)
        self.passes = 0
        self.committing = False
        self.pin = False
        self.writer: object | None = None
        self.ledger = ByteLedger()

    # ---- the buffer ------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the shared K and V storage now."""
        if self._k is None or self._v is None:
            return 0
        return self._k.nbytes + self._v.nbytes

    def buffer(
        self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
        writer: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V views ``shape = [B, n, H, D]`` of the shared storage, now ``writer``'s.

        The storage grows to the largest ``B * n * H * D`` asked for (dtype and device are
        the first caller's; another is a `UsageError`: one stage, one cache dtype).
        """
        numel = 1
        for s in shape:
            numel *= int(s)
        k = self._k
        if k is not None and (k.dtype != dtype or k.device != device):
            raise UsageError(
                f"ChunkScratch holds {k.dtype} on {k.device}; a cache of {dtype} on {device} "
                "cannot share it (give each cache dtype and device its own scratch)"
            )
        if k is None or k.numel() < numel:
            self._k = self._v = None  # free the old storage before the new one is allocated
            self._k = torch.empty(numel, dtype=dtype, device=device)
            self._v = torch.empty(numel, dtype=dtype, device=device)
            self.ledger.hold(self, self.nbytes)
        assert self._k is not None and self._v is not None
        kb, vb = self._k[:numel].view(shape), self._v[:numel].view(shape)
        kb.zero_()
        vb.zero_()
        self.writer = writer
        return kb, vb

    def claim(self, writer: object) -> None:
        """``writer`` writes the buffer now (the views it holds are its chunk's K/V)."""
        self.writer = writer

    def intact(self, reader: object) -> bool:
        """True while ``reader`` wrote the buffer last (its chunk's K/V are still here)."""
        return self.writer is reader

    def check_reader(self, reader: object, what: str) -> None:
        """`CacheProtocolError` unless ``reader`` wrote the buffer last."""
        if self.writer is not reader:
            raise CacheProtocolError(
                f"{what}: the chunk being generated lives in the stage's shared scratch, which "
                "another layer has written since; read a cache's view inside the call that "
                "wrote it, or end the chunk with a context pass (ChunkScratch.context_pass)"
            )

    # ---- the declaration -------------------------------------------------------------------
    def share(self) -> None:
        """Declare that the caller ends every chunk with a context pass (`context_pass`) and
        reads each view inside the call that wrote it: from the next chunk on, the caches
        keep the chunk being generated here, once for all of them."""
        self.shared = True

    def release(self) -> None:
        """Free the storage (a new request allocates it again on its first write)."""
        self._k = self._v = None
        self.writer = None
        self.ledger.hold(self, 0)

    # ---- the context pass ------------------------------------------------------------------
    @contextmanager
    def context_pass(self, *, pin: bool = False) -> Iterator[ChunkScratch]:
        """Writes inside are the chunk's context update (see the module docstring); the first
        pass declares the sharing (`share`)."""
        if self.committing:
            raise UsageError("ChunkScratch.context_pass is already open (passes do not nest)")
        self.shared = True
        self.passes += 1
        self.committing, self.pin = True, bool(pin)
        try:
            yield self
        finally:
            self.committing, self.pin = False, False
