"""`SegmentStore`: K/V by global position in chunk segments, cold ones packed by a codec.

The one storage every QVG host uses: causalkv's `QVGPackedCausalKVCache` (positions by
`StreamState`) and the host adapters' caches (by their own cursor arithmetic). A
host tells the store *which* positions it holds and *what* to write; the store keeps the
values: ``segments``, `Segment` s in ascending position, each a run of one chunk (or a packed
span) whose ``storage`` is `DenseKV` ``[B, len, H, D]`` or `PackedKV` (a codec record each
for K and V). A write that changes the layout is planned (`plan`: new chunks where none were
held, the write applied to copies of what it touches, a packed segment it touches decoded,
what the host no longer holds freed, a packed one kept whole until all of it is gone, cold
chunks packed on an advance), then committed (`commit`, which cannot fail: a write that
raises leaves the store as it was); a rewrite of the current chunk is one in-place copy.
Which chunks stay dense is the `PackingPolicy` object's; what is packed by which codec in
which spans is the tier policy's (`causalkv.caches.qvg.tiering`, counted by
the memory planner too), encoded by `store_pack`.

Reads: `view` is the one view builder every host's cache uses: a lazy view of
``(position or None, length)`` pieces whose ``iter_segments`` decodes one stored run at a
time, ``iter_stored_segments`` yields the runs as stored (dense views, packed slices: nothing
decoded) and ``k``/``v`` fill one buffer (`gather`: dense rows copied, packed token ranges
decoded in place: no dequantized temporary, no concatenation). `with_own` is the layout a
probe reads: the store's, with the chunk's positions read from the caller's own K/V. Every
buffer a read fills is reported to the store's ledger, if it has one.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from causalkv.caches import intervals as iv
from causalkv.caches.codecs.prq.centroids import MIN_TOKENS_PER_CENTROID
from causalkv.caches.intervals import Intervals
from causalkv.caches.ledger import ByteLedger
from causalkv.caches.positions import HeldPositions
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import POLICY, QUANT_OFF, RECENT_CHUNKS, PackingPolicy
from causalkv.caches.qvg.segments import (
    BorrowedKV,
    Codebook,
    DecodedKV,
    DenseKV,
    KVWrite,
    PackedKV,
    PackingReport,
    Segment,
    StorePlan,
    copy_write,
    dense_storage,
    held_nbytes,
)
from causalkv.caches.qvg.store_pack import Packer
from causalkv.caches.qvg.tiering import Packed, keep_held, tier_policy
from causalkv.caches.spec import (
    CacheProtocolError,
    CacheReadError,
    CausalAttentionKVView,
    KVSegment,
    StoredSegment,
)
from causalkv.errors import ConfigError, is_int

__all__ = ["Piece", "SegmentStore"]

_PACKED = "packed"
#: a piece of a read: ``(position, length)`` reads ``[position, position + length)``,
#: ``(None, length)`` gives zero rows
Piece = tuple[int | None, int]
#: where one piece's rows are stored: ``(segment, a, b)`` for positions ``[a, b)`` of it,
#: ``(None, 0, n)`` for ``n`` zero rows
_Run = tuple[Segment | None, int, int]


class SegmentStore:
    """K/V of one layer by global position, cold chunks packed by a codec (see the module docstring).

    Args:
        batch_size, num_heads, head_dim, dtype, device: the K/V it stores, ``[B, ., H, D]``.
        quant: QVG settings; ``codec=None`` keeps every segment dense.
        policy: which completed chunks stay dense (a `PackingPolicy` object).
        seed: k-means seed (the reference runtime's 1234): packing is reproducible.
        head_offset: global index of the first head (the codec keys each head's draws by it).
        offload: keep packed segments in CPU memory (pinned when on a GPU), moved back to
            ``device`` when read.
        min_tokens_per_centroid: PRQ's centroid rule's ``m``
            (`causalkv.caches.codecs.prq.centroids`); None packs with ``quant.centroids`` as given.
        ledger: the `ByteLedger` the store reports to (what it holds after each commit,
            every buffer a read fills), shared by the caches of a request; None: no report.

    Raises:
        ConfigError: settings whose codec (or recency tier) cannot pack ``head_dim``
            channels (the codec's own rule, `QVGKVQuantArgs.layout_problem`), a non-float
            dtype with quantization on, or a bad ``min_tokens_per_centroid``.

    Attributes:
        segments: the `Segment` s held, ascending position.
        codebook: the codebook the next span at the cache's codec may join, or None.
        current: index of the chunk being written (None before the first advance).
        chunk_tokens: tokens of the stream's first chunk (the ``sink_keep_chunks`` unit of
            `RECENT_NON_SINK`).
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: QVGKVQuantArgs,
        policy: PackingPolicy = RECENT_CHUNKS,
        seed: int = 1234,
        head_offset: int = 0,
        offload: bool = False,
        min_tokens_per_centroid: int | None = MIN_TOKENS_PER_CENTROID,
        ledger: ByteLedger | None = None,
    ) -> None:
        m = min_tokens_per_centroid
        if m is not None and not is_int(m, 1):
            raise ConfigError(f"min_tokens_per_centroid must be a positive int or None, got {m!r}")
        # checked once per settings and geometry (the codecs' own layout rules,
        # `QVGKVQuantArgs.layout_problem`): every layer's store shares the policy
        tiering = tier_policy(quant, m, batch_size, num_heads, head_dim,
                              torch.empty((), dtype=dtype).element_size())
        if quant.enabled and not dtype.is_floating_point:
            raise ConfigError(f"QVG packs floating-point K/V, the cache dtype is {dtype}")
        if not isinstance(policy, PackingPolicy):
            raise ConfigError(f"SegmentStore policy must be a PackingPolicy, got {policy!r}")
        if ledger is not None and not isinstance(ledger, ByteLedger):
            raise ConfigError(f"SegmentStore ledger must be a ByteLedger or None, got {ledger!r}")
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant = quant
        self.policy = policy
        #: what is packed by which codec, in which spans (`causalkv.caches.qvg.tiering`)
        self.tiering = tiering
        #: packs the cold segments as ``tiering`` decides (`causalkv.caches.qvg.store_pack`)
        self.packer = Packer(self.device, dtype, seed, head_offset, offload)
        self.ledger = ledger
        #: codec calls so far (K and V together): a segment is never packed twice
        self.quantize_calls = 0
        #: the largest dense K+V buffer filled from packed data in one go
        self.peak_transient_nbytes = 0
        self._live: dict[int, str] = {}  # completed chunk still held -> "packed" or dense reason
        self._settled: Counter[str] = Counter()  # the same for chunks no longer held
        self._centroids_used: Counter[int] = Counter()
        self.reset()  # empty: the layout attributes (see the class docstring) set by `commit`

    def packing_report(self) -> PackingReport:
        """Chunks packed and kept dense (and why) so far, and the centroids used."""
        counts = self._settled + Counter(self._live.values())
        packed = counts.pop(_PACKED, 0)
        return PackingReport(
            chunks_packed=packed,
            chunks_dense=dict(sorted(counts.items())),
            centroids=dict(sorted(self._centroids_used.items())),
            quantize_calls=self.quantize_calls,
        )

    # ---- writes ---------------------------------------------------------------------------
    def plan(self, write: KVWrite, keep: HeldPositions, *, advance: bool) -> StorePlan:
        """The store after ``write``, keeping only the positions ``keep.held`` (``self``
        untouched).

        A rewrite of positions dense segments hold, ``keep.held`` what the store holds now,
        keeps the layout: ``write`` is copied in place by `commit`. Otherwise positions of
        ``write`` no segment holds become new dense chunks; with ``advance`` the
        one at the write's end is the new current chunk, and the policy's cold chunks are
        packed (``keep.sink_end``: positions below it are stream-start sink; ``keep.pinned``:
        the pinned shot-sink positions, both by the host's bookkeeping). Raises what the codec
        raises for a chunk it cannot pack (e.g. NaN/inf K/V on the CPU).
        """
        dense = iv.normalize((s.start, s.end) for s in self.segments if not s.packed)
        if keep.held == self.held() and iv.contains(dense, ((write.start, write.end),)):
            return StorePlan(_rewritten(self.segments, write, self.num_heads), self.codebook,
                             self.current, self.chunk_tokens, self._next_chunk, write,
                             reasons=dict(self._reasons))
        segs, next_chunk, current, chunk_tokens = self._covered(write, advance)
        kept, book = self._held_only(segs, keep.held, self.codebook)
        plan = StorePlan(kept, book, current, chunk_tokens, next_chunk, _NO_WRITE)
        if advance and current is not None:
            return self._pack(plan, current, keep,
                              any(s.start < keep.sink_end for s in kept if current in s.chunks))
        return replace(plan, reasons=dict(self._reasons))  # nothing packed: the reasons stay

    def plan_commit(self, base: StorePlan, keep: HeldPositions) -> StorePlan:
        """The store once the chunk ``base`` writes is committed (the context pass writes it).

        ``base`` is this call's write planned on this very state (`plan`),
        not yet committed: the two are committed as one (`commit` of the result), so a
        refusal here changes nothing. The chunk goes to its tier at once: packed straight
        from the write's K/V when the policy does not keep it, else its own dense copy (or
        its recency-tier packing). Only the positions ``keep.held`` stay: the host passes
        what its next advance will keep; ``keep.sink_end``/``pinned`` as in `plan`, for the
        stream after this chunk (a pin announced for this chunk included).

        The returned plan's ``view_segments`` is what this call's view reads: the layout
        before the drop, the chunk as written (views of the write's K/V or its copy).
        """
        w = base.write  # a rewrite in place (`plan`): applied here to copies
        written = [self._written(seg, w) if _overlaps(seg, w) else seg for seg in base.segments]
        kept, book = self._held_only(written, keep.held, base.codebook)
        ahead = base.next_chunk  # the chunk after this one: every chunk held is completed
        plan = StorePlan(kept, book, None, base.chunk_tokens, ahead, _NO_WRITE,
                         packs=list(base.packs), view_segments=written)
        return self._pack(plan, ahead, keep, bool(kept) and keep.sink_end > kept[-1].end)

    def _pack(self, plan: StorePlan, current: int, keep: HeldPositions, sink_open: bool) -> StorePlan:
        """``plan`` with its cold chunks packed as the policy and the tier policy decide
        (``current``: the chunk being written, or the one after a committed chunk; a new plan):
        one encode per packed span (`Packer.encode`), a recency-tier segment re-packed at the
        cache's codec decoded first, once."""
        if not self.quant.enabled:
            return plan  # every chunk dense, QUANT_OFF (`commit`)
        as_dense = functools.cache(self.packer.dense)
        packs = list(plan.packs)

        def pack(step: Packed[Segment], book: Codebook | None) -> tuple[Segment, Codebook | None]:
            seg, book = self.packer.encode(step, [as_dense(p) for p in step.pieces], book)
            packs.append(seg)
            return seg, book

        segments, codebook, reasons = self.tiering.settle(
            self.policy, plan.segments, current, plan.codebook, pack,
            sink_end=keep.sink_end, pinned=keep.pinned, sink_open=sink_open,
            chunk_tokens=plan.chunk_tokens,
            finite=lambda pieces: self.packer.finite([as_dense(p) for p in pieces]),
        )
        return replace(plan, segments=segments, packs=packs, reasons=reasons, codebook=codebook)

    def _held_only(
        self, segs: Sequence[Segment], held: Intervals, book: Codebook | None
    ) -> tuple[list[Segment], Codebook | None]:
        """``segs`` trimmed to ``held`` (a packed segment is kept whole while any of it is),
        and ``book`` if it is still in use."""
        kept = keep_held(segs, held, Segment.dense_slice)
        if book is not None and not any(book.used_by(seg) for seg in kept):
            book = None  # every segment using it rolled out: start a fresh one
        return kept, book

    def _borrows(self, w: KVWrite) -> bool:
        """True when the store may hold views of ``w``'s K/V until its commit copies them: every
        head, in the store's dtype and on its device."""
        return (w.key is not None and w.value is not None and w.heads == (0, self.num_heads)
                and w.key.dtype == w.value.dtype == self.dtype
                and w.key.device == w.value.device == self.device)

    def commit(self, plan: StorePlan) -> None:
        """Apply ``plan`` (from `plan` or `plan_commit` on this very state);
        nothing here can fail. K/V the plan borrowed from a write get their own copy. A dense
        chunk the plan gives no reason for is dense by the policy (`POLICY`), or because
        quantization is off (`QUANT_OFF`)."""
        segments = [replace(seg, storage=seg.storage.copy()) if isinstance(seg.storage, BorrowedKV)
                    else seg for seg in plan.segments]
        copy_write(segments, plan.write)
        dense = POLICY if self.quant.enabled else QUANT_OFF
        live = {
            c: _PACKED if seg.packed else plan.reasons.get(c, dense)
            for seg in segments for c in seg.chunks if c != plan.current
        }
        self._settled.update(s for c, s in self._live.items() if c not in live)
        self._live = live
        for seg in plan.packs:
            self._centroids_used[seg.storage.num_centroids] += len(seg.chunks)
        self.quantize_calls += len(plan.packs)
        self._reasons = plan.reasons
        self.segments, self.codebook = segments, plan.codebook
        self.current, self.chunk_tokens = plan.current, plan.chunk_tokens
        self._next_chunk = plan.next_chunk
        if self.ledger is not None:
            self.ledger.hold(self, self.resident_nbytes())

    def reset(self) -> None:
        """Free every segment (a new stream); the packing report keeps counting."""
        self.commit(StorePlan([], None, None, 0, 0, _NO_WRITE))

    def check_view(self, layout: Sequence[Segment], positions: Intervals, what: str) -> None:
        """Refuse a view of ``positions`` that ``layout`` (the segments the view reads) does
        not hold, before anything changes: a view never shows what the store does not hold.

        Raises:
            CacheProtocolError (a UsageError): positions a commit dropped because the caller
                said the next advance drops them (`causalkv.caches.passes.CommitPass`), read by a
                host whose cursor does not follow the commit (nothing was changed).
        """
        missing = iv.subtract(positions, iv.normalize((s.start, s.end) for s in layout))
        if missing:
            raise CacheProtocolError(
                f"{what}: the view of positions {iv.describe(positions)} needs "
                f"{iv.describe(missing)}, which the last commit dropped (it kept what the next "
                "advance it was told of keeps; nothing was changed); give the commit the next "
                "chunk's size and pin (CommitPass(next_tokens=..., pin=...)), or write the context "
                "pass unmarked"
            )

    def _covered(self, w: KVWrite, advance: bool) -> tuple[list[Segment], int, int | None, int]:
        """The segments once ``w`` is written: new chunks where no segment held its positions,
        the ones it touches written (copies; a packed one decoded first). Returns (segments,
        next chunk index, current chunk, chunk_tokens)."""
        out: list[Segment] = []
        nxt, current, chunk_tokens = self._next_chunk, self.current, self.chunk_tokens
        at = w.start

        def new_chunk(a: int, b: int) -> Segment:
            nonlocal nxt
            nxt += 1
            storage = w.borrowed(a, b) if self._borrows(w) else self._zeros(b - a)
            return self._written(Segment(a, b, nxt - 1, nxt - 1, storage), w, fresh=True)

        for seg in self.segments:
            if not _overlaps(seg, w):
                out.append(seg)
                continue
            if seg.start > at:
                out.append(new_chunk(at, seg.start))
            out.append(self._written(seg, w))
            at = max(at, min(seg.end, w.end))
        if at < w.end:
            tail = new_chunk(at, w.end)
            out.append(tail)
            if advance:
                current = tail.first_chunk
                chunk_tokens = chunk_tokens or tail.end - tail.start
        out.sort(key=lambda s: s.start)
        return out, nxt, current, chunk_tokens

    def _written(self, seg: Segment, w: KVWrite, fresh: bool = False) -> Segment:
        """``seg`` with ``w`` written into it, what the store holds left untouched. ``w``
        rewriting every position and head of it: views of ``w`` where they may be borrowed,
        else zeros ``w`` is copied into (plain `DenseKV`: no row keeps a codec error). Else
        ``seg``'s own K/V (``fresh``: the plan's own new buffer already), a copy of them, or a
        packed one decoded (`DecodedKV`: the rows ``w`` leaves carry the codec's error, never
        packed again), with ``w`` copied in."""
        if w.key is None or w.value is None:
            return seg
        whole = w.start <= seg.start and seg.end <= w.end and w.heads == (0, self.num_heads)
        if whole and self._borrows(w):
            return replace(seg, storage=w.borrowed(seg.start, seg.end))
        if whole and not fresh:
            storage = self._zeros(seg.end - seg.start)
        elif isinstance(seg.storage, PackedKV):
            decoded = seg.storage.decoded(self.device, self.dtype)
            storage = DecodedKV(decoded.k, decoded.v)
        else:
            storage = seg.storage if fresh else dense_storage(seg).copy()
        seg = replace(seg, storage=storage)
        copy_write([seg], w)
        return seg

    def _zeros(self, n: int) -> DenseKV:
        shape = (self.batch_size, n, self.num_heads, self.head_dim)
        return DenseKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))

    # ---- what it holds --------------------------------------------------------------------
    def held(self) -> Intervals:
        """The positions stored."""
        return iv.normalize((s.start, s.end) for s in self.segments)

    def resident_nbytes(self) -> int:
        """Exact bytes held now (`held_nbytes`: a shared codebook counted once)."""
        return held_nbytes(self.segments)

    def packed_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.packed]

    # ---- reads ----------------------------------------------------------------------------
    def with_own(self, start: int, key: torch.Tensor, value: torch.Tensor, h0: int) -> list[Segment]:
        """The layout a probe's view reads: the store's segments, with positions ``[start,
        start + n)`` read from the caller's own ``key``/``value`` ``[B, n, h, D]`` (heads from
        ``h0``) instead; views throughout, nothing stored or copied."""
        end = start + key.shape[1]
        out = [Segment(start, end, -1, -1, BorrowedKV(key, value, h0))]
        for seg in self.segments:
            for a, b in iv.subtract(seg.run, ((start, end),)):
                out.append(seg if (a, b) == (seg.start, seg.end) else replace(
                    seg, start=a, end=b, storage=seg.storage.select_tokens(a - seg.start, b - seg.start)))
        return sorted(out, key=lambda s: s.start)

    def view(
        self, pieces: Sequence[Piece], h0: int, h1: int, layout: Sequence[Segment] | None = None,
        *, make: Callable[..., CausalAttentionKVView], dense_now: bool = False,
    ) -> CausalAttentionKVView:
        """The lazy view of heads ``[h0, h1)`` of ``pieces`` (`Piece`: held positions, or zero
        rows), read from ``layout`` (default: the store's segments now; a commit replaces that
        list, never mutates it): ``make(position_ranges, k=, v=, segments=, materialize=,
        stored=, device=)`` builds it (the host's view type and cursors).

        ``iter_segments()`` yields each stored run of a piece dense (a packed run decoded, one
        at a time), ``iter_stored_segments()`` as stored (dense views; a packed run the codec's
        record sliced to the heads and tokens: nothing decoded), ``k``/``v`` are `gather`'s one
        buffer. They are built at once when that costs nothing (the view is one run of one
        dense segment: views of it) and, with ``dense_now``, whenever nothing is packed.
        ``position_ranges``: the pieces' positions in view order.

        Raises:
            CacheReadError (a RuntimeError): a position ``layout`` does not hold.
        """
        layout = self.segments if layout is None else layout
        located = self._locate(pieces, layout)
        packed = any(seg is not None and seg.packed for seg, _, _ in located)

        def segments() -> Iterator[KVSegment]:
            for seg, a, b in located:
                yield self.zeros(b - a, h0, h1) if seg is None else self.gather([(a, b - a)], h0, h1, [seg])

        def stored() -> Iterator[StoredSegment]:
            for seg, a, b in located:
                if seg is None:
                    yield self.zeros(b - a, h0, h1)
                elif isinstance(seg.storage, PackedKV):
                    part = seg.storage.onloaded(self.device).select_heads(h0, h1)
                    part = part.select_tokens(a - seg.start, b - seg.start)
                    yield part.k, part.v
                else:
                    yield seg.storage.heads(a - seg.start, b - seg.start, h0, h1)

        def materialize() -> KVSegment:
            return self.gather(pieces, h0, h1, layout)

        one = len(located) == 1 and located[0][0] is not None
        k, v = materialize() if not packed and (one or dense_now) else (None, None)
        return make(tuple((p, p + n) for p, n in pieces if p is not None), k=k, v=v,
                    segments=segments, materialize=materialize, stored=stored, device=self.device)

    def gather(
        self, pieces: Sequence[Piece], h0: int, h1: int, layout: Sequence[Segment] | None = None,
    ) -> KVSegment:
        """K/V ``[B, n, h1 - h0, D]`` of ``pieces`` in order (`Piece`), read from ``layout``
        (default: the store's segments now); one run of one segment is what a lazy view's
        ``iter_segments`` yields per piece.

        One buffer is allocated and filled in place (packed ranges decoded into it); a single
        piece held by one dense segment is returned as views of it, as a dense cache would.

        Raises:
            CacheReadError (a RuntimeError): a position the store does not hold.
        """
        located = self._locate(pieces, self.segments if layout is None else layout)
        if len(located) == 1 and located[0][0] is not None and not located[0][0].packed:
            seg, a, b = located[0]
            return seg.storage.heads(a - seg.start, b - seg.start, h0, h1)
        shape = (self.batch_size, sum(n for _, n in pieces), h1 - h0, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        at = 0
        for seg, a, b in located:
            if seg is None:
                k[:, at : at + b - a].zero_()
                v[:, at : at + b - a].zero_()
            else:
                seg.storage.read_into(a - seg.start, b - seg.start, h0, h1, k[:, at : at + b - a],
                                      v[:, at : at + b - a], self.device)
            at += b - a
        if any(seg is not None and seg.packed for seg, _, _ in located):  # filled from packed data
            self.peak_transient_nbytes = max(self.peak_transient_nbytes, k.nbytes + v.nbytes)
        if self.ledger is not None:
            self.ledger.transient(k.nbytes + v.nbytes)
        return k, v

    def zeros(self, n: int, h0: int, h1: int) -> KVSegment:
        """K/V zeros ``[B, n, h1 - h0, D]`` (one buffer for both): rows a reader shows that
        hold no position."""
        z = torch.zeros((self.batch_size, n, h1 - h0, self.head_dim), dtype=self.dtype,
                        device=self.device)
        return z, z

    def _locate(self, pieces: Sequence[Piece], segs: Sequence[Segment]) -> list[_Run]:
        """``pieces`` as the stored runs of ``segs`` they read, in order (a piece repeated or
        out of position order stays so: a reader's order, not a set); `CacheReadError` (a
        RuntimeError) for a position no segment holds."""
        out: list[_Run] = []
        for p, n in pieces:
            if p is None:
                out.append((None, 0, n))
                continue
            at, end = p, p + n
            for seg in segs:
                if seg.end <= at or seg.start >= end:
                    continue
                if seg.start > at:
                    break
                out.append((seg, at, min(seg.end, end)))
                at = min(seg.end, end)
            if at < end:
                raise CacheReadError(
                    f"SegmentStore: positions [{at}, {end}) are not held (held: "
                    f"{iv.describe(iv.normalize((s.start, s.end) for s in segs))})"
                )
        return out


_NO_WRITE = KVWrite(0, 0, (0, 0))


def _overlaps(seg: Segment, w: KVWrite) -> bool:
    return w.key is not None and seg.start < w.end and w.start < seg.end


def _rewritten(segs: Sequence[Segment], w: KVWrite, num_heads: int) -> list[Segment]:
    """``segs`` with each `DecodedKV` segment that ``w`` rewrites whole (every position and
    head) plain `DenseKV` again: none of its rows carries a codec error any more."""
    if w.key is None or w.heads != (0, num_heads):
        return list(segs)
    return [
        replace(seg, storage=DenseKV(seg.storage.k, seg.storage.v))
        if isinstance(seg.storage, DecodedKV) and w.start <= seg.start and seg.end <= w.end
        else seg
        for seg in segs
    ]
