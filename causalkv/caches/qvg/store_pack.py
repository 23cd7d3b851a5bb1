"""The segment store's packing: a `Packer` executes the tier policy's decision on tensors.

`causalkv.caches.qvg.tiering.TierPolicy` decides, without tensors, which cold segments are
packed by which codec in which spans and which stay dense and why; the `Packer` a
`causalkv.caches.qvg.store.SegmentStore` owns carries that decision out on a `StorePlan`: one
encode per packed span (from the segments' K/V as the plan holds them, its write applied), the
shared codebook threaded through, a recency-tier segment re-packed at the cache's codec
decoded first, and the one check only tensors can answer (a span holding NaN or inf stays dense).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from causalkv.caches.qvg.policy import PackingDecision
from causalkv.caches.qvg.segments import Codebook, PackedKV, Segment, StorePlan, dense_storage
from causalkv.caches.qvg.tiering import Kept, Packed, TierPolicy, codec_for

__all__ = ["Packer"]


@dataclass(frozen=True)
class Packer:
    """Packs a store's cold segments as its tier policy decides (see the module docstring).

    Attributes:
        tiering: the store's `TierPolicy` (what is packed by which codec, in which spans).
        device, dtype: where the store's dense K/V live, and their dtype.
        seed: k-means seed (packing is reproducible).
        head_offset: global index of the first head (the codec keys each head's draws by it).
        offload: keep packed segments in CPU memory (pinned when on a GPU).
    """

    tiering: TierPolicy
    device: torch.device
    dtype: torch.dtype
    seed: int
    head_offset: int
    offload: bool

    def pack_cold(self, plan: StorePlan, decision: PackingDecision, current: int) -> StorePlan:
        """``plan`` with the cold segments of ``plan.segments`` packed as the tier policy decides
        under ``decision`` (a new plan; ``current``: the chunk being generated, or the one
        after a committed chunk)."""
        @functools.cache  # a recency-tier segment re-packed is decoded once
        def as_dense(seg: Segment) -> Segment:
            if not isinstance(seg.storage, PackedKV):
                return seg
            return replace(seg, storage=seg.storage.decoded(self.device, self.dtype))

        tiering = self.tiering.decide(
            plan.segments, decision, current, plan.codebook,
            finite=lambda pieces: self._finite([as_dense(p) for p in pieces]),
        )
        segments, packs, reasons, codebook = [], list(plan.packs), dict(plan.reasons), plan.codebook
        for step in tiering.steps:
            if isinstance(step, Kept):
                segments.append(step.seg)
                reasons.update(tiering.reasons(step))
                continue
            packed, codebook = self.encode(step, [as_dense(p) for p in step.pieces], codebook)
            segments.append(packed)
            packs.append(packed)
        return replace(plan, segments=segments, packs=packs, reasons=reasons, codebook=codebook)

    def encode(
        self, step: Packed[Segment], pieces: list[Segment], codebook: Codebook | None,
    ) -> tuple[Segment, Codebook | None]:
        """One packed segment of ``pieces`` (dense, adjacent) as ``step`` says, and the
        codebook after it (``codebook`` before)."""
        stores = [dense_storage(p) for p in pieces]
        k = torch.cat([s.k for s in stores], dim=1) if len(stores) > 1 else stores[0].k
        v = torch.cat([s.v for s in stores], dim=1) if len(stores) > 1 else stores[0].v
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
        seg = Segment(
            start=pieces[0].start, end=pieces[-1].end,
            first_chunk=pieces[0].first_chunk, last_chunk=pieces[-1].last_chunk,
            storage=storage,
        )
        return seg, codebook

    def _finite(self, pieces: Sequence[Segment]) -> bool:
        """False when ``pieces`` (dense) hold NaN or inf, checked where the codec would refuse
        them (the CPU, where the check costs no device sync); the chunk then stays dense, as
        the dense cache keeps it. On other devices the codec stores a non-finite head
        poisoned (it decodes to non-finite values) without a host sync."""
        if self.device.type != "cpu":
            return True
        return all(bool(torch.isfinite(st.k).all()) and bool(torch.isfinite(st.v).all())
                   for st in map(dense_storage, pieces))
