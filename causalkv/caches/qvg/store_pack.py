"""The segment store's packing: a `Packer` executes the tier policy's steps on tensors.

`causalkv.caches.qvg.tiering.TierPolicy` decides, without tensors, which cold segments are
packed by which codec in which spans and which stay dense and why (`TierPolicy.settle`, the
one tier loop); the `Packer` a `causalkv.caches.qvg.store.SegmentStore` owns (and the paged
engine cache, layer by layer) carries each packed step out: one encode per span (from the
segments' K/V as the host holds them), the shared codebook threaded through, a recency-tier
segment re-packed at the cache's codec decoded first (`Packer.dense`), and the one check only
tensors can answer (`Packer.finite`: a span holding NaN or inf stays dense).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from causalkv.caches.qvg.segments import Codebook, PackedKV, Segment, dense_storage
from causalkv.caches.qvg.tiering import Packed, codec_for
from causalkv.caches.spec import concat_segments

__all__ = ["Packer"]


@dataclass(frozen=True)
class Packer:
    """Packs a store's cold segments as its tier policy decides (see the module docstring).

    Attributes:
        device, dtype: where the store's dense K/V live, and their dtype.
        seed: k-means seed (packing is reproducible).
        head_offset: global index of the first head (the codec keys each head's draws by it).
        offload: keep packed segments in CPU memory (pinned when on a GPU).
    """

    device: torch.device
    dtype: torch.dtype
    seed: int
    head_offset: int
    offload: bool

    def dense(self, seg: Segment) -> Segment:
        """``seg`` with dense K/V (a packed one decoded: a recency-tier segment re-packed)."""
        if not isinstance(seg.storage, PackedKV):
            return seg
        return replace(seg, storage=seg.storage.decoded(self.device, self.dtype))

    def encode(
        self, step: Packed[Segment], pieces: list[Segment], codebook: Codebook | None,
    ) -> tuple[Segment, Codebook | None]:
        """One packed segment of ``pieces`` (dense, adjacent) as ``step`` says, and the
        codebook after it (``codebook`` before)."""
        k, v = concat_segments([(s.k, s.v) for s in map(dense_storage, pieces)])
        c = codec_for(step.quant)
        book = codebook if step.joins_book else None
        pk = c.encode(k.permute(0, 2, 1, 3), seed=self.seed, head_offset=self.head_offset,
                      codebooks=list(book.k) if book else None)
        pv = c.encode(v.permute(0, 2, 1, 3), seed=self.seed, head_offset=self.head_offset,
                      codebooks=list(book.v) if book else None)
        after = step.book_after
        if not step.tier:  # the codebook after it (the tier policy's count), its tensors
            codebook = None if after is None else Codebook(
                after.chunks, after.centroids, pk.shared_tensors(), pv.shared_tensors())
        storage = PackedKV(pk, pv, c, recent=step.recent)
        if self.offload:
            storage = storage.offloaded()
        first, last = pieces[0], pieces[-1]
        return Segment(first.start, last.end, first.first_chunk, last.last_chunk, storage), codebook

    def finite(self, pieces: Sequence[Segment]) -> bool:
        """False when ``pieces`` (dense) hold NaN or inf, checked where the codec would refuse
        them (the CPU, where the check costs no device sync); the chunk then stays dense, as
        the dense cache keeps it. On other devices the codec stores a non-finite head
        poisoned (it decodes to non-finite values) without a host sync."""
        if self.device.type != "cpu":
            return True
        return all(bool(torch.isfinite(st.k).all()) and bool(torch.isfinite(st.v).all())
                   for st in map(dense_storage, pieces))
