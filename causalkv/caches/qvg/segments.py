"""The segment store's records: the storage of a run of positions, writes, plans, reports.

`Segment` is a run ``[start, end)`` of global positions of one chunk (or of a packed span of
chunks) whose ``storage`` is `DenseKV` (``[B, len, H, D]`` in the store's dtype) or `PackedKV`
(one codec record for K and one for V, `causalkv.caches.codecs.base.PackedRecord`). `Codebook` is the k-means centroids that
consecutive cold chunks share; `KVWrite` is what a host writes, `StorePlan` the store after a
write as values, `PackingReport` what the store decided per chunk. All are values: the store
(`causalkv.caches.qvg.store.SegmentStore`) builds new ones instead of mutating them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from causalkv.caches.codecs.base import KVCodec, PackedRecord
from causalkv.caches.qvg.tiering import BookState, TierSegment
from causalkv.caches.spec import KVSegment, on_device
from causalkv.errors import InvalidTypeError

__all__ = [
    "BorrowedKV",
    "Codebook",
    "DecodedKV",
    "DenseKV",
    "KVWrite",
    "PackedKV",
    "PackingReport",
    "Segment",
    "StorePlan",
    "copy_write",
    "dense_storage",
    "held_nbytes",
]


# ---------------------------------------------------------------------------------------------
# Typed storage
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DenseKV:
    """Dense K and V ``[B, len, h, D]`` in the store's dtype, of the heads from ``h0`` on (the
    store's own hold every head: ``h0 = 0``; a probe's K/V hold the heads it wrote)."""

    k: torch.Tensor
    v: torch.Tensor
    h0: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy(self, lo: int = 0, hi: int | None = None) -> DenseKV:
        """Tokens ``[lo, hi)`` (default: all) as a copy the store owns (so the rest can be
        freed; borrowed K/V get their own), decoded rows still marked `DecodedKV`."""
        kind = DecodedKV if isinstance(self, DecodedKV) else DenseKV
        return kind(self.k[:, lo:hi].clone(), self.v[:, lo:hi].clone())

    def select_tokens(self, lo: int, hi: int) -> DenseKV:
        """Tokens ``[lo, hi)`` as views, of the same kind."""
        return replace(self, k=self.k[:, lo:hi], v=self.v[:, lo:hi])

    def heads(self, lo: int, hi: int, h0: int, h1: int) -> KVSegment:
        """Views of tokens ``[lo, hi)``, heads ``[h0, h1)``: ``[B, hi - lo, h1 - h0, D]``."""
        a, b = h0 - self.h0, h1 - self.h0
        return self.k[:, lo:hi, a:b], self.v[:, lo:hi, a:b]

    def read_into(
        self, lo: int, hi: int, h0: int, h1: int, k: torch.Tensor, v: torch.Tensor,
        device: torch.device,
    ) -> None:
        """Tokens ``[lo, hi)``, heads ``[h0, h1)`` copied into ``k``/``v`` ``[B, hi - lo, h1 - h0, D]``."""
        kk, vv = self.heads(lo, hi, h0, h1)
        k.copy_(kk)
        v.copy_(vv)


@dataclass(frozen=True, eq=False)
class DecodedKV(DenseKV):
    """Dense K/V ``[B, len, H, D]`` decoded from a packed record and then written in part: the
    rows not rewritten carry the codec's error once, so the store never packs them again (a
    second packing would add a second error past the codec's bound); they stay dense."""


@dataclass(frozen=True, eq=False)
class BorrowedKV(DenseKV):
    """Views of K/V the store does not own ``[B, len, h, D]`` (a write's tensors, or a probe's
    own heads from ``h0``): a plan packs straight from them, and `SegmentStore.commit` gives
    what stays dense its own copy; never held as is."""


@dataclass(frozen=True, eq=False)
class PackedKV:
    """K and V packed by ``codec``, each a `PackedRecord` of logical shape ``[B, H, len, D]``.

    ``recent``: packed at the recency tier (``recent_tier``) while the policy keeps the chunk
    for recency; re-packed with the cache's codec once it no longer does.
    """

    k: PackedRecord
    v: PackedRecord
    codec: KVCodec
    recent: bool = False

    @property
    def nbytes(self) -> int:
        """Stored bytes of both (a shared codebook counted in each; see `resident_nbytes`)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def num_centroids(self) -> int:
        """k-means centroids per (batch, head) per stage (0 for a codec without a codebook)."""
        return int(getattr(self.k, "num_centroids", 0))

    def shared_tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors other segments may reference too (PRQ's shared codebooks)."""
        return self.k.shared_tensors() + self.v.shared_tensors()

    def select_heads(self, h0: int, h1: int) -> PackedKV:
        """Heads ``[h0, h1)`` as views (no copy)."""
        if h0 == 0 and h1 == self.k.shape[1]:
            return self
        return replace(self, k=self.k.select_heads(h0, h1), v=self.v.select_heads(h0, h1))

    def select_tokens(self, a: int, b: int) -> PackedKV:
        """Tokens ``[a, b)`` as views (no copy)."""
        return replace(self, k=self.k.select_tokens(a, b), v=self.v.select_tokens(a, b))

    def read_into(
        self, lo: int, hi: int, h0: int, h1: int, k: torch.Tensor, v: torch.Tensor,
        device: torch.device,
    ) -> None:
        """Tokens ``[lo, hi)``, heads ``[h0, h1)`` decoded straight into ``k``/``v``
        ``[B, hi - lo, h1 - h0, D]`` on ``device`` (only that part is decoded)."""
        packed = self.onloaded(device).select_heads(h0, h1).select_tokens(lo, hi)
        self.codec.decode_into(packed.k, k.permute(0, 2, 1, 3))
        self.codec.decode_into(packed.v, v.permute(0, 2, 1, 3))

    def decoded(self, device: torch.device, dtype: torch.dtype) -> DenseKV:
        """All of it decoded to dense ``[B, len, H, D]`` ``dtype`` K/V on ``device``."""
        B, H, S, D = self.k.shape
        k = torch.empty((B, S, H, D), dtype=dtype, device=device)
        v = torch.empty((B, S, H, D), dtype=dtype, device=device)
        self.read_into(0, S, 0, H, k, v, device)
        return DenseKV(k, v)

    def offloaded(self) -> PackedKV:
        """The same K/V in CPU memory (pinned when it was on a GPU)."""
        k, v = self.k.to("cpu"), self.v.to("cpu")
        if self.device.type == "cuda":
            k, v = k.pin_memory(), v.pin_memory()
        return replace(self, k=k, v=v)

    def onloaded(self, device: torch.device) -> PackedKV:
        """The same K/V on ``device`` (itself when already there)."""
        if on_device(self.device, device):
            return self
        return replace(
            self, k=self.k.to(device, non_blocking=True), v=self.v.to(device, non_blocking=True)
        )


@dataclass(frozen=True, eq=False)
class Segment(TierSegment):
    """A run ``[start, end)`` of global positions and its K/V ``storage``.

    ``first_chunk``/``last_chunk`` are the indices of the chunks it came from (a packed span
    covers several).
    """

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    storage: DenseKV | PackedKV

    @property
    def packed(self) -> bool:
        return isinstance(self.storage, PackedKV)

    @property
    def recent(self) -> bool:
        """Packed at the recency tier (re-packed with the cache's codec once no longer kept)."""
        return isinstance(self.storage, PackedKV) and self.storage.recent

    @property
    def rewritten(self) -> bool:
        """Decoded from packed for a write into part of it (`DecodedKV`): never packed again."""
        return isinstance(self.storage, DecodedKV)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def dense_slice(self, a: int, b: int) -> Segment:
        """A dense segment of positions ``[a, b)`` (a copy, so the rest can be freed)."""
        return replace(self, start=a, end=b, storage=dense_storage(self).copy(a - self.start, b - self.start))


def held_nbytes(segments: Iterable[Segment]) -> int:
    """Exact bytes ``segments`` hold: dense segments' K/V plus packed segments' stored bytes, a
    tensor several packed segments reference (PRQ's shared codebook, ``codebook_chunks > 1``)
    counted once. The one ledger of held segments (`SegmentStore.resident_nbytes`, the paged
    cache's session report)."""
    segments = list(segments)
    shared = [c for seg in segments if seg.packed for c in seg.storage.shared_tensors()]
    once = {(c.device, c.data_ptr()): c.nbytes for c in shared}
    return sum(seg.nbytes for seg in segments) - sum(c.nbytes for c in shared) + sum(once.values())


@dataclass(frozen=True, eq=False)
class Codebook(BookState):
    """The k-means centroids that consecutive cold chunks share (``codebook_chunks > 1``): the
    tier policy's `BookState` (chunks packed with it so far, its centroids) and its tensors.

    Attributes:
        k, v: per stage ``[B, H, K, D]`` bf16, the very tensors the packed segments reference.
    """

    k: tuple[torch.Tensor, ...] = ()
    v: tuple[torch.Tensor, ...] = ()

    def used_by(self, seg: Segment) -> bool:
        if not isinstance(seg.storage, PackedKV):
            return False
        shared = seg.storage.k.shared_tensors()
        return bool(shared) and shared[0] is self.k[0]


@dataclass(frozen=True)
class PackingReport:
    """What a store decided for every chunk written so far (the current one excluded).

    Counts are cumulative since the store was built (across resets). A chunk still held
    counts with its present storage (a ``"recent"`` chunk may be packed later); a chunk that
    rolled out counts with the storage it had last.

    Attributes:
        chunks_packed: chunks stored packed.
        chunks_dense: chunks kept dense, by reason (keys from ``DENSE_REASONS``: ``"recent"``,
            ``"sink_keep"``, ``"sink"``, ``"waiting for span"``, ``"not smaller than dense"``,
            ``"quant off"``, ``"policy"``); only reasons that occurred appear.
        centroids: k-means centroids per (batch, head) per stage -> chunks packed with that
            many (a chunk assigned to a shared codebook counts with the codebook's size).
        quantize_calls: codec calls (one per packed segment, K and V together).
    """

    chunks_packed: int = 0
    chunks_dense: Mapping[str, int] = field(default_factory=dict)
    centroids: Mapping[int, int] = field(default_factory=dict)
    quantize_calls: int = 0

    @property
    def chunks_kept_dense(self) -> int:
        return sum(self.chunks_dense.values())

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready dict (centroid counts keyed by the string of K)."""
        return {
            "chunks_packed": self.chunks_packed,
            "chunks_dense": dict(sorted(self.chunks_dense.items())),
            "chunks_kept_dense": self.chunks_kept_dense,
            "centroids": {str(k): n for k, n in sorted(self.centroids.items())},
            "quantize_calls": self.quantize_calls,
        }

    @classmethod
    def merge(cls, reports: Iterable[PackingReport]) -> PackingReport:
        """The sum of several caches' reports (e.g. every layer of a run)."""
        reports = list(reports)
        dense: Counter[str] = sum((Counter(r.chunks_dense) for r in reports), Counter())
        books: Counter[int] = sum((Counter(r.centroids) for r in reports), Counter())
        return cls(sum(r.chunks_packed for r in reports), dict(sorted(dense.items())),
                   dict(sorted(books.items())), sum(r.quantize_calls for r in reports))


@dataclass(frozen=True, eq=False)
class KVWrite:
    """A write of global positions ``[start, end)``, heads ``[h0, h1)`` (``heads``).

    ``key``/``value`` ``[B, end - start, h1 - h0, D]``, or None: a write of no K/V, which
    copies nothing (the store's own plans that only keep or pack, `SegmentStore.plan_commit`
    and ``reset``, carry one of no positions).
    """

    start: int
    end: int
    heads: tuple[int, int]
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    def borrowed(self, a: int, b: int) -> BorrowedKV:
        """Views of its K/V of positions ``[a, b)``."""
        return BorrowedKV(self.key[:, a - self.start : b - self.start],
                          self.value[:, a - self.start : b - self.start])


@dataclass(frozen=True)
class StorePlan:
    """The store after one write, as a value (`SegmentStore.plan`; a step makes a new one with
    `dataclasses.replace`); `SegmentStore.commit` applies it."""

    segments: list[Segment]
    codebook: Codebook | None
    current: int | None
    chunk_tokens: int
    next_chunk: int
    write: KVWrite
    packs: list[Segment] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)  # chunk -> why it stays dense
    #: what the call's view reads (`SegmentStore.plan_commit`: the chunk as written, and the
    #: positions the commit drops); None: ``segments``
    view_segments: list[Segment] | None = None



def dense_storage(seg: Segment) -> DenseKV:
    """``seg``'s `DenseKV` (a packed segment is refused: only dense ones are sliced or packed)."""
    if not isinstance(seg.storage, DenseKV):
        raise InvalidTypeError(f"segment [{seg.start}, {seg.end}) is packed; only dense segments are sliced or packed")
    return seg.storage


def copy_write(segs: Iterable[Segment], w: KVWrite) -> None:
    """``w`` into the dense segments of ``segs`` it overlaps (in place; a packed one is skipped:
    the store packs it from a patched copy)."""
    if w.key is None or w.value is None:
        return
    h0, h1 = w.heads
    for seg in segs:
        if seg.end <= w.start or seg.start >= w.end or seg.packed:
            continue
        store = dense_storage(seg)
        lo, hi = max(w.start, seg.start), min(w.end, seg.end)
        store.k[:, lo - seg.start : hi - seg.start, h0:h1].copy_(w.key[:, lo - w.start : hi - w.start])
        store.v[:, lo - seg.start : hi - seg.start, h0:h1].copy_(w.value[:, lo - w.start : hi - w.start])
