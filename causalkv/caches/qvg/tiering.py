"""The tier policy: which cold chunks of a segment store are packed, by which codec, in which spans.

One tier loop, three hosts. `TierPolicy.settle` walks a host's segments (ascending position)
once per advance and, from the `PackingPolicy`'s `PackingDecision` (which chunks stay dense,
which sink chunks pack as one span), the settings and the codec's ``nbytes`` formula, decides
for every segment what becomes of it:

- kept: the segment stays as it is (dense, packed at the cache's codec, or packed at the
  recency tier) with the reason of each of its chunks
  (`causalkv.caches.qvg.policy.DENSE_REASONS`). A segment packed at the recency tier that the
  policy no longer keeps is re-packed at the cache's codec with its span, and only then
  decoded: while its span waits, or when the cache's codec would not store fewer bytes, it
  stays at its tier (decoding it to bf16 would only hold more bytes of the same values).
- `Packed`: adjacent segments packed as one span with the given settings, at the cache's
  codec (``span_chunks`` chunks at a time, or a policy group whole; sharing a codebook over
  ``codebook_chunks`` chunks when the codec shares them), or at the recency tier
  (``recent_tier``: a chunk the policy keeps for recency, or as a bf16 sink, packed with the
  tier's codec, its own codebook). A span is packed only when its packed bytes (the codec's
  ``nbytes``, decided before any encode) are smaller than its dense bytes; a segment packed at
  the cache's codec is never packed again, nor is one decoded for a write into part of it
  (``REWRITTEN``: its rows carry the codec's error already).

Each host carries out a `Packed` step with its own ``pack``: the segment store and the paged
engine cache encode it on tensors (`causalkv.caches.qvg.store_pack.Packer`, one encode per
step), the memory planner (`causalkv.memory.plan`) counts its bytes without tensors. The only
input the decision cannot know without tensors is whether a span's K/V are finite: the tensor
hosts pass ``finite`` (a span that is not stays dense, ``NON_FINITE``), the planner passes
nothing (every span is).

No torch here: the planner imports it without loading a model's worth of anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from causalkv.caches import intervals as iv
from causalkv.caches.codecs import make_codec
from causalkv.caches.codecs.prq.centroids import centroids_for
from causalkv.caches.intervals import Intervals
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import (
    NON_FINITE,
    NOT_SMALLER,
    POLICY,
    RECENT,
    REWRITTEN,
    SINK,
    WAITING,
    ChunkInfo,
    PackingPolicy,
)

if TYPE_CHECKING:
    from causalkv.caches.codecs.base import KVCodec

__all__ = [
    "BookState",
    "Packed",
    "TierPolicy",
    "TierSegment",
    "chunk_infos",
    "codec_for",
    "keep_held",
    "tier_policy",
]


class TierSegment:
    """What the policy reads of a segment: the base of the store's `Segment`, the paged engine
    cache's group and the planner's model of one (each a dataclass with these fields, or
    properties).

    Attributes:
        start, end: its positions ``[start, end)``.
        first_chunk, last_chunk: the chunks it holds (a packed span covers several).
        packed: stored packed.
        recent: packed at the recency tier (re-packed at the cache's codec once no longer kept).
        rewritten: decoded from packed for a write into part of it: its rows carry a codec
            error already, so it stays dense (``REWRITTEN``) and is never packed twice.
    """

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    packed: bool
    recent: bool
    rewritten: bool

    @property
    def chunks(self) -> range:
        return range(self.first_chunk, self.last_chunk + 1)

    @property
    def run(self) -> Intervals:
        return ((self.start, self.end),)


S = TypeVar("S", bound=TierSegment)


@dataclass(frozen=True)
class BookState:
    """The codebook the next span at the cache's codec may join: chunks packed with it so far
    and its centroids (per batch, head and stage)."""

    chunks: int
    centroids: int


B = TypeVar("B", bound="BookState | None")


class Packed(NamedTuple, Generic[S]):
    """``pieces`` (adjacent; a recency-tier one among them is decoded first) packed as one
    segment with ``quant`` (its ``codec`` and centroids).

    Attributes:
        tier: the recency tier's pack of one kept chunk (its own codebook; the current one
            is left as it is).
        recent: stored as recency-tier (re-packed at the cache's codec once no longer kept):
            a tier pack whose codec is not the cache's.
        joins_book: encoded with the current codebook (`BookState`) instead of its own.
        book_after: the codebook after it (None when the codec shares none); unchanged by a
            recency-tier pack.
    """

    pieces: tuple[S, ...]
    quant: QVGKVQuantArgs
    tier: bool = False
    recent: bool = False
    joins_book: bool = False
    book_after: BookState | None = None

    @property
    def tokens(self) -> int:
        return self.pieces[-1].end - self.pieces[0].start


@functools.lru_cache(maxsize=64)
def codec_for(q: QVGKVQuantArgs) -> KVCodec:
    """The codec of settings ``q`` (``q.codec`` configured by ``q``; settings are frozen)."""
    return make_codec(q.codec, q)


@functools.lru_cache(maxsize=64)
def tier_policy(
    quant: QVGKVQuantArgs, min_tokens_per_centroid: int | None, batch_size: int,
    num_heads: int, head_dim: int, item_bytes: int,
) -> TierPolicy:
    """The `TierPolicy` of these settings and geometry, checked once and shared by every layer's
    store (settings are frozen and the policy holds no state).

    Raises:
        ConfigError: the codec (or the recency tier's) cannot pack K/V of ``head_dim``
            channels (`QVGKVQuantArgs.layout_problem`).
    """
    quant.check_layout(head_dim)
    return TierPolicy(quant, min_tokens_per_centroid, batch_size, num_heads, head_dim, item_bytes)


@dataclass(frozen=True)
class TierPolicy:
    """The one tier policy of a store (see the module docstring).

    Attributes:
        quant: the cache's QVG settings (``codec``, ``recent_tier``, ``span_chunks``,
            ``codebook_chunks``, centroids).
        min_tokens_per_centroid: PRQ's centroid rule's ``m`` (`centroids_for`); None packs with
            ``quant.centroids`` as given.
        batch_size, num_heads, head_dim: the K/V's ``[B, ., H, D]``.
        item_bytes: bytes of one dense element (the store's dtype).
    """

    quant: QVGKVQuantArgs
    min_tokens_per_centroid: int | None
    batch_size: int
    num_heads: int
    head_dim: int
    item_bytes: int

    def span_quant(self, tokens: int) -> QVGKVQuantArgs:
        """The settings a span of ``tokens`` is packed with (the centroid rule applied, if set)."""
        if self.min_tokens_per_centroid is None:
            return self.quant
        k = centroids_for(tokens, self.quant.centroids, self.min_tokens_per_centroid)
        return self.quant if k == self.quant.centroids else replace(self.quant, centroids=k)

    def tier_quant(self, tokens: int) -> QVGKVQuantArgs:
        """The settings a recency-tier chunk of ``tokens`` is packed with (the tier's codec)."""
        q = self.span_quant(tokens)
        tier = self.quant.recent_tier
        return q if q.codec == tier else replace(q, codec=tier)

    def packed_nbytes(self, q: QVGKVQuantArgs, tokens: int) -> int:
        """K and V of a span of ``tokens`` packed with ``q`` (the codec's formula, each codebook
        counted)."""
        return 2 * codec_for(q).nbytes((self.batch_size, self.num_heads, tokens, self.head_dim))

    def pays(self, tokens: int, chunks: int, book: BookState | None,
             q: QVGKVQuantArgs | None = None) -> bool:
        """True when packing a span of ``tokens`` (``chunks`` chunks) stores fewer bytes than
        keeping it dense. Counted without sharing: a span that would join ``book`` is charged
        its centroids too. ``q``: the settings (default: the span's at the cache's codec)."""
        q = self.span_quant(tokens) if q is None else q
        if book is not None and book.chunks + chunks <= q.codebook_chunks:
            q = replace(q, centroids=book.centroids)  # it would assign to ``book``
        dense = 2 * self.batch_size * tokens * self.num_heads * self.head_dim * self.item_bytes
        return self.packed_nbytes(q, tokens) < dense

    def settle(
        self,
        policy: PackingPolicy,
        segs: Sequence[S],
        current: int,
        book: B,
        pack: Callable[[Packed[S], B], tuple[S, B]],
        *,
        sink_end: int,
        pinned: Intervals,
        sink_open: bool,
        chunk_tokens: int,
        finite: Callable[[Sequence[S]], bool] | None = None,
    ) -> tuple[list[S], B, dict[int, str]]:
        """``segs`` (ascending) with their cold chunks packed: the one tier loop of every host
        (the store, the paged engine cache, the memory planner).

        ``policy`` decides which chunks stay dense (`chunk_infos` of ``segs``, ``sink_end``
        and ``pinned``; ``sink_open``: whether the sink is still being written), then each
        segment is kept as it is or packed (see the module docstring): ``pack(step, book)``
        carries out a `Packed` step and returns the host's packed segment and its codebook
        after it (``book``: the host's codebook, read as a `BookState`, that the next span at
        the cache's codec may join). ``current``: the chunk being generated, or the one after
        a committed chunk; ``finite``: whether a span's K/V are finite, None when every span is.

        Returns:
            The segments after, the codebook after them, and why each chunk of a segment kept
            as it is is not packed now (`causalkv.caches.qvg.policy.DENSE_REASONS`; recorded
            for a packed one too).
        """
        decision = policy.decide(self.quant, chunk_infos(segs, current, sink_end, pinned), current,
                                 sink_open=sink_open, chunk_tokens=chunk_tokens)
        keep = set(decision.dense) | {current}
        tiered = self.quant.recent_tier != "bf16"
        out: list[S] = []
        reasons: dict[int, str] = {}
        pending: list[S] = []  # adjacent packable segments of one group
        pending_group: frozenset[int] | None = None

        def kept(seg: S, reason: str | None = None) -> None:
            out.append(seg)
            reasons.update({c: reason or decision.dense.get(c, POLICY) for c in seg.chunks})

        def packed(step: Packed[S]) -> None:
            nonlocal book
            seg, book = pack(step, book)
            out.append(seg)

        def flush_dense(reason: str) -> None:
            for p in pending:
                kept(p, reason)
            pending.clear()

        for seg in segs:
            chunks, tokens = set(seg.chunks), seg.end - seg.start
            rewritten = seg.rewritten and current not in chunks  # a codec error already: dense
            # kept as it is: packed at the cache's codec (never again), rewritten, or kept by
            # the policy (a recency-tier one that left it is re-packed with its span below)
            if (seg.packed and not seg.recent) or rewritten or chunks & keep:
                flush_dense(WAITING)
                if rewritten:
                    kept(seg, REWRITTEN)
                elif not (tiered and not seg.packed and current not in chunks
                          and {decision.dense.get(c, POLICY) for c in chunks} <= {RECENT, SINK}
                          and self.pays(tokens, len(chunks), None, self.tier_quant(tokens))):
                    kept(seg)
                elif finite is not None and not finite([seg]):
                    kept(seg, NON_FINITE)
                else:  # kept for recency or as a bf16 sink: packed at the recency tier
                    packed(Packed((seg,), self.tier_quant(tokens), tier=True, book_after=book,
                                  recent=self.quant.codec != self.quant.recent_tier))
                continue
            group = next((g for g in decision.groups if chunks & g), None)
            if pending and (group != pending_group or pending[-1].end != seg.start):
                flush_dense(WAITING)
            pending.append(seg)
            pending_group = group
            have = set().union(*(p.chunks for p in pending))
            if have >= group if group is not None else len(have) >= self.quant.span_chunks:
                span_tokens = pending[-1].end - pending[0].start
                span_chunks = pending[-1].last_chunk - pending[0].first_chunk + 1
                if not self.pays(span_tokens, span_chunks, book):
                    flush_dense(NOT_SMALLER)
                    continue
                if finite is not None and not finite(pending):
                    flush_dense(NON_FINITE)
                    continue
                packed(self._span(tuple(pending), span_tokens, span_chunks, book))
                pending.clear()
        flush_dense(WAITING)
        return out, book, reasons

    def _span(self, pieces: tuple[S, ...], tokens: int, chunks: int,
              book: BookState | None) -> Packed[S]:
        """The pack of ``pieces`` at the cache's codec, and its codebook."""
        q = self.span_quant(tokens)
        if book is not None and book.chunks + chunks > self.quant.codebook_chunks:
            book = None
        if not codec_for(q).shares_codebooks:
            return Packed(pieces, q)
        if book is None:  # a new codebook: k-means caps its centroids at the span's tokens
            return Packed(pieces, q, book_after=BookState(chunks, min(q.centroids, tokens)))
        return Packed(pieces, q, joins_book=True,
                      book_after=BookState(book.chunks + chunks, book.centroids))


def chunk_infos(
    segs: Sequence[TierSegment], current: int, sink_end: int, pinned: Intervals
) -> tuple[ChunkInfo, ...]:
    """The completed chunks ``segs`` hold (``current`` excluded), by index, as a `PackingPolicy`
    reads them: what is held of each (a packed span: all of it; a chunk held in several
    segments: from the first to the last), and whether that holds sink (below ``sink_end``)
    or ``pinned`` positions."""
    acc: dict[int, tuple[int, int, bool, bool]] = {}
    for seg in segs:
        pin = any(p0 < seg.end and seg.start < p1 for p0, p1 in pinned)
        for c in seg.chunks:
            if c != current:
                a, b, sink, pin0 = acc.get(c, (seg.start, seg.end, False, False))
                acc[c] = (min(a, seg.start), max(b, seg.end), sink or seg.start < sink_end, pin0 or pin)
    return tuple(ChunkInfo(c, *acc[c]) for c in sorted(acc))


def keep_held(segs: Sequence[S], held: Intervals, cut: Callable[[S, int, int], S]) -> list[S]:
    """``segs`` (ascending, disjoint) trimmed to ``held``: a dense segment to the runs of it
    still held (``cut(seg, a, b)`` makes the part ``[a, b)``), a packed one kept whole while
    any of it is."""
    kept: list[S] = []
    for seg in segs:
        runs = iv.intersect(seg.run, held)  # none: none of it held
        if runs and (seg.packed or runs == seg.run):
            kept.append(seg)
        else:
            kept.extend(cut(seg, a, b) for a, b in runs)
    return kept
