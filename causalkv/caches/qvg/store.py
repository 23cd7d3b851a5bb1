"""`SegmentStore`: K/V by global position in chunk segments, cold ones packed by a codec.

The one storage both QVG hosts use: causalkv's `QVGPackedCausalKVCache` (positions by
`StreamState`) and the host adapters' caches (by their own cursor arithmetic). A
host tells the store *which* positions it holds and *what* to write; the store keeps the
values: ``segments``, `Segment` s in ascending position, each a run of one chunk (or a packed
span) whose ``storage`` is `DenseKV` ``[B, len, H, D]`` or `PackedKV` (a codec record each
for K and V). A write that changes the layout is planned (`plan`: new chunks where none were
held, a packed segment the write touches decoded, what the host no longer holds freed, a
packed one kept whole until all of it is gone, cold chunks packed on an advance), then
committed (`commit`, which cannot fail: a write that raises leaves the store as it was); a
rewrite of the current chunk is one in-place copy (`write`). Which chunks stay dense is the
`PackingPolicy` object's; what is packed by which codec in which spans is the tier policy's
(`causalkv.caches.qvg.tiering`, counted by the memory planner too), encoded by `store_pack`.
Reads go straight into one preallocated buffer: `gather` fills ``[B, n, h, D]`` for a list of
position runs (dense rows copied, packed token ranges decoded in place: no dequantized
temporary, no concatenation); `decode` does the same for one segment (streaming attention
holds one segment at a time); `locate_pieces` gives `gather`'s pieces as the stored runs they
read, and `stored_segments` yields those runs as stored (dense views, packed slices: nothing
decoded). Every buffer a read fills is reported to the store's ledger, if it has one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals
from causalkv.caches.ledger import ByteLedger
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import (
    MIN_TOKENS_PER_CENTROID,
    POLICY,
    QUANT_OFF,
    RECENT_CHUNKS,
    PackingPolicy,
)
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
)
from causalkv.caches.qvg.store_pack import Packer
from causalkv.caches.qvg.tiering import chunk_infos, keep_held, tier_policy
from causalkv.caches.spec import CacheProtocolError, CacheReadError, KVSegment, StoredSegment
from causalkv.errors import ConfigError

__all__ = [
    "Codebook",
    "DenseKV",
    "KVWrite",
    "PackedKV",
    "PackingReport",
    "Segment",
    "SegmentStore",
    "StorePlan",
]

_PACKED = "packed"


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------
class SegmentStore:
    """K/V of one layer by global position, cold chunks packed by a codec (see the module docstring).

    Args:
        batch_size, num_heads, head_dim, dtype, device: the K/V it stores, ``[B, ., H, D]``.
        quant: QVG settings; ``bits=None`` keeps every segment dense.
        policy: which completed chunks stay dense (a `PackingPolicy` object).
        seed: k-means seed (the reference runtime's 1234): packing is reproducible.
        head_offset: global index of the first head (the codec keys each head's draws by it).
        offload: keep packed segments in CPU memory (pinned when on a GPU), moved back to
            ``device`` when read.
        min_tokens_per_centroid: the centroid rule's ``m`` (`centroids_for`); None packs with
            ``quant.centroids`` as given.
        ledger: the `ByteLedger` the store reports to (what it holds after each commit,
            every buffer a read fills), shared by the caches of a request; None: no report.

    Raises:
        ConfigError: settings whose codec (or recency tier) cannot pack ``head_dim``
            channels (the codec's own rule, `QVGKVQuantArgs.layout_problem`: PRQ's block
            size, fp8's block), a non-float dtype with quantization on, or a bad
            ``min_tokens_per_centroid``.
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
        quant = quant.validate()
        m = min_tokens_per_centroid
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m <= 0):
            raise ConfigError(f"min_tokens_per_centroid must be a positive int or None, got {m!r}")
        # checked once per settings and geometry (the codecs' own layout rules,
        # `QVGKVQuantArgs.layout_problem`): every layer's store shares the policy
        tiering = tier_policy(quant, m, batch_size, num_heads, head_dim,
                              torch.empty((), dtype=dtype).element_size())
        if quant.enabled and not dtype.is_floating_point:
            raise ConfigError(f"QVG packs floating-point K/V, the cache dtype is {dtype}")
        if not isinstance(policy, PackingPolicy):
            raise ConfigError(f"SegmentStore policy must be a PackingPolicy, got {policy!r}")
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant = quant
        self.policy = policy
        self.seed = seed
        self.head_offset = head_offset
        self.offload = offload
        self.min_tokens_per_centroid = m
        #: what is packed by which codec, in which spans (`causalkv.caches.qvg.tiering`)
        self.tiering = tiering
        #: packs the cold segments as ``tiering`` decides (`causalkv.caches.qvg.store_pack`)
        self.packer = Packer(tiering, self.device, dtype, seed, head_offset, offload)
        if ledger is not None and not isinstance(ledger, ByteLedger):
            raise ConfigError(f"SegmentStore ledger must be a ByteLedger or None, got {ledger!r}")
        self.ledger = ledger
        self.segments: list[Segment] = []
        self.codebook: Codebook | None = None
        #: index of the chunk being written (None before the first advance)
        self.current: int | None = None
        #: tokens of the stream's first chunk (the ``sink_keep_chunks`` unit of `RECENT_NON_SINK`)
        self.chunk_tokens = 0
        #: codec calls so far (K and V together): a segment is never packed twice
        self.quantize_calls = 0
        #: the largest dense K+V buffer filled from packed data in one go
        self.peak_transient_nbytes = 0
        self._next_chunk = 0
        self._reasons: dict[int, str] = {}
        self._live: dict[int, str] = {}  # completed chunk still held -> "packed" or dense reason
        self._settled: Counter[str] = Counter()  # the same for chunks no longer held
        self._centroids_used: Counter[int] = Counter()

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
    def write(self, w: KVWrite) -> None:
        """Copy ``w`` in place into the dense segments holding its positions (`covers_dense`)."""
        self.commit(self.plan_write(w))

    def plan_write(self, w: KVWrite) -> StorePlan:
        """The store after ``w``, a rewrite of positions dense segments hold (`covers_dense`):
        the layout stays, ``w`` is copied in by `commit` (``self`` untouched)."""
        return StorePlan(
            _rewritten(self.segments, w, self.num_heads), self.codebook, self.current, self.chunk_tokens,
            self._next_chunk, w, reasons=dict(self._reasons),
        )

    def plan(
        self,
        *,
        held: Intervals,
        write: KVWrite,
        advance: bool,
        sink_end: int = 0,
        pinned: Intervals = (),
    ) -> StorePlan:
        """The store after ``write``, keeping only the positions in ``held`` (``self`` untouched).

        Positions of ``write`` no segment holds become new dense chunks; with ``advance`` the
        one at the write's end is the new current chunk, and the policy's cold chunks are
        packed (``sink_end``: positions below it are stream-start sink; ``pinned``: the
        pinned shot-sink positions, both by the host's bookkeeping). Raises what the codec
        raises for a chunk it cannot pack (e.g. NaN/inf K/V on the CPU).
        """
        segs, next_chunk, current, chunk_tokens = self._covered(write, advance)
        kept, book = self._held_only(segs, held, self.codebook)
        plan = StorePlan(kept, book, current, chunk_tokens, next_chunk, write)
        completed = {c for s in kept for c in s.chunks if c != current}
        if not self.quant.enabled:
            return replace(plan, reasons=dict.fromkeys(completed, QUANT_OFF))
        if advance and current is not None:
            decision = self.policy.decide(
                self.quant, chunk_infos(kept, current, sink_end, pinned), current,
                sink_open=any(s.start < sink_end for s in kept if current in s.chunks),
                chunk_tokens=chunk_tokens,
            )
            return self.packer.pack_cold(plan, decision, current)
        return replace(plan, reasons={c: self._reasons.get(c, POLICY) for c in completed})

    def plan_commit(
        self, base: StorePlan, *, held: Intervals, sink_end: int = 0, pinned: Intervals = (),
    ) -> StorePlan:
        """The store once the chunk ``base`` writes is committed (the context pass writes it).

        ``base`` is this call's write planned on this very state (`plan` or `plan_write`),
        not yet committed: the two are committed as one (`commit` of the result), so a
        refusal here changes nothing. The chunk goes to its tier at once: packed straight
        from the write's K/V when the policy does not keep it, else its own dense copy (or
        its recency-tier packing). Only the positions in ``held`` stay: the host passes
        what its next advance will keep. ``sink_end``/``pinned`` as in `plan`, for the
        stream after this chunk (a pin announced for this chunk included).

        The returned plan's ``view_segments`` is what this call's view reads: the layout
        before the drop, the chunk as written (views of the write's K/V or its copy).
        """
        w = base.write
        assert w.key is not None and w.value is not None and w.end > w.start
        written = [
            replace(seg, storage=self._as_written(seg, w))
            if seg.start < w.end and w.start < seg.end and not seg.packed else seg
            for seg in base.segments
        ]
        kept, book = self._held_only(written, held, base.codebook)
        ahead = base.next_chunk  # the chunk after this one: every chunk held is completed
        plan = StorePlan(kept, book, None, base.chunk_tokens, ahead, _NO_WRITE,
                         packs=list(base.packs), view_segments=written)
        if not self.quant.enabled:
            plan = replace(plan, reasons={c: QUANT_OFF for s in kept for c in s.chunks})
        else:
            decision = self.policy.decide(
                self.quant, chunk_infos(kept, ahead, sink_end, pinned), ahead,
                sink_open=bool(kept) and sink_end > kept[-1].end, chunk_tokens=base.chunk_tokens,
            )
            plan = self.packer.pack_cold(plan, decision, ahead)
        return plan

    def _held_only(
        self, segs: Sequence[Segment], held: Intervals, book: Codebook | None
    ) -> tuple[list[Segment], Codebook | None]:
        """``segs`` trimmed to ``held`` (a packed segment is kept whole while any of it is),
        and ``book`` if it is still in use."""
        kept = keep_held(segs, held, Segment.dense_slice)
        if book is not None and not any(book.used_by(seg) for seg in kept):
            book = None  # every segment using it rolled out: start a fresh one
        return kept, book

    def _as_written(self, seg: Segment, w: KVWrite) -> DenseKV:
        """``seg``'s dense K/V once ``w`` is written: views of ``w`` when it covers the segment
        whole (`BorrowedKV`), else a copy with ``w`` copied in (a chunk decoded from packed
        stays marked so: never packed twice)."""
        lo, hi = max(w.start, seg.start), min(w.end, seg.end)
        assert w.key is not None and w.value is not None
        if (lo, hi) == (seg.start, seg.end) and self._borrows(w):
            return BorrowedKV(w.key[:, lo - w.start : hi - w.start], w.value[:, lo - w.start : hi - w.start])
        st = dense_storage(seg)
        own = (DecodedKV if isinstance(st, DecodedKV) else DenseKV)(st.k.clone(), st.v.clone())
        patched = replace(seg, storage=own)
        copy_write([patched], w)
        return own

    def _borrows(self, w: KVWrite) -> bool:
        """True when the store may hold views of ``w``'s K/V until its commit copies them: every
        head, in the store's dtype and on its device."""
        return (w.key is not None and w.value is not None and w.heads == (0, self.num_heads)
                and w.key.dtype == w.value.dtype == self.dtype
                and w.key.device == w.value.device == self.device)

    def commit(self, plan: StorePlan) -> None:
        """Apply ``plan`` (from `plan`, `plan_write` or `plan_commit` on this very state);
        nothing here can fail. K/V the plan borrowed from a write get their own copy."""
        segments = [_owned(seg) for seg in plan.segments]
        copy_write(segments, plan.write)
        live = {
            c: _PACKED if seg.packed else plan.reasons.get(c, POLICY)
            for seg in segments for c in seg.chunks if c != plan.current
        }
        self._settled.update(s for c, s in self._live.items() if c not in live)
        self._live = live
        for seg in plan.packs:
            assert isinstance(seg.storage, PackedKV)
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
        self.segments = []
        self.codebook = None
        self.current = None
        self.chunk_tokens = 0
        self._next_chunk = 0
        self._reasons = {}
        self._settled.update(self._live.values())
        self._live = {}
        if self.ledger is not None:
            self.ledger.hold(self, 0)

    def check_view(self, layout: Sequence[Segment], positions: Intervals, what: str) -> None:
        """Refuse a view of ``positions`` that ``layout`` (the segments the view reads) does
        not hold, before anything changes: a view never shows what the store does not hold.

        Raises:
            CacheProtocolError (a UsageError): positions a commit dropped because the caller
                said the next advance drops them (`causalkv.caches.passes.Commit`), read by a
                host whose cursor does not follow the commit (nothing was changed).
        """
        missing = iv.subtract(positions, iv.normalize((s.start, s.end) for s in layout))
        if missing:
            raise CacheProtocolError(
                f"{what}: the view of positions {iv.describe(positions)} needs "
                f"{iv.describe(missing)}, which the last commit dropped (it kept what the next "
                "advance it was told of keeps; nothing was changed); give the commit the next "
                "chunk's size and pin (Commit(next_tokens=..., pin=...)), or write the context "
                "pass unmarked"
            )

    # ---- internals: writes ----------------------------------------------------------------
    def _covered(self, w: KVWrite, advance: bool) -> tuple[list[Segment], int, int | None, int]:
        """The segments once ``w``'s positions are all held: new zero chunks where none held
        them, packed ones it touches decoded to dense. Returns (segments, next chunk index,
        current chunk, chunk_tokens)."""
        out: list[Segment] = []
        nxt, current, chunk_tokens = self._next_chunk, self.current, self.chunk_tokens
        at = w.start

        def new_chunk(a: int, b: int) -> Segment:
            nonlocal nxt
            storage: DenseKV
            if self._borrows(w):
                # every row comes from the write: borrow it (`commit` copies, a commit packs it)
                storage = BorrowedKV(w.key[:, a - w.start : b - w.start],
                                     w.value[:, a - w.start : b - w.start])
            else:
                shape = (self.batch_size, b - a, self.num_heads, self.head_dim)
                storage = DenseKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                                  torch.zeros(shape, dtype=self.dtype, device=self.device))
            nxt += 1
            return Segment(a, b, nxt - 1, nxt - 1, storage)

        segments = _rewritten(self.segments, w, self.num_heads)
        for seg in segments:
            if seg.end <= w.start or seg.start >= w.end:
                out.append(seg)
                continue
            if seg.start > at:
                out.append(new_chunk(at, seg.start))
            if isinstance(seg.storage, PackedKV):  # a write into it: back to dense
                seg = replace(seg, storage=self._unpacked(seg, w))
            out.append(seg)
            at = max(at, min(seg.end, w.end))
        if at < w.end:
            tail = new_chunk(at, w.end)
            out.append(tail)
            if advance:
                current = tail.first_chunk
                chunk_tokens = chunk_tokens or tail.end - tail.start
        out.sort(key=lambda s: s.start)
        return out, nxt, current, chunk_tokens

    def _unpacked(self, seg: Segment, w: KVWrite) -> DenseKV:
        """Dense storage for packed ``seg`` that ``w`` writes into: zeros when ``w`` rewrites
        all of it (every position and head: nothing to decode), else its decoded K/V as
        `DecodedKV` (the rows ``w`` leaves carry the codec's error: never packed again)."""
        assert isinstance(seg.storage, PackedKV)
        if w.start <= seg.start and seg.end <= w.end and w.heads == (0, self.num_heads):
            shape = (self.batch_size, seg.end - seg.start, self.num_heads, self.head_dim)
            return DenseKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
        st = seg.storage.decoded(self.device, self.dtype)
        return DecodedKV(st.k, st.v)

    # ---- what it holds --------------------------------------------------------------------
    def held(self) -> Intervals:
        """The positions stored."""
        return iv.normalize((s.start, s.end) for s in self.segments)

    def resident_nbytes(self) -> int:
        """Exact bytes held now: dense segments' K/V plus packed segments' stored bytes.

        A codebook shared by several packed segments (``codebook_chunks > 1``) is one
        tensor referenced by each of them and is counted once.
        """
        total, seen = 0, set()
        for seg in self.segments:
            total += seg.nbytes
            if isinstance(seg.storage, PackedKV):
                for c in seg.storage.shared_tensors():
                    key = (c.device, c.data_ptr())
                    if key in seen:
                        total -= c.nbytes
                    seen.add(key)
        return total

    def packed_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.packed]

    def covers_dense(self, start: int, end: int) -> bool:
        """True when dense segments hold every position of ``[start, end)``."""
        at = start
        for seg in self.segments:
            if seg.end <= at or seg.start >= end:
                continue
            if seg.start > at or seg.packed:
                return False
            at = seg.end
            if at >= end:
                return True
        return at >= end

    # ---- reads ----------------------------------------------------------------------------
    def locate(
        self, positions: Intervals, segments: Sequence[Segment] | None = None
    ) -> list[tuple[Segment, Intervals]]:
        """The segments (of ``segments``, default the store's) holding any of ``positions``,
        each with the runs of them it holds."""
        out = []
        for seg in self.segments if segments is None else segments:
            runs = iv.intersect(seg.run, positions)
            if runs:
                out.append((seg, runs))
        return out

    def locate_pieces(
        self, pieces: Sequence[tuple[int | None, int]], segments: Sequence[Segment] | None = None,
    ) -> list[tuple[Segment | None, int, int]]:
        """``pieces`` (as `gather` takes them) as stored runs, in order: ``(segment, a, b)`` for
        positions ``[a, b)`` held by ``segment``, ``(None, 0, n)`` for ``n`` zero rows. A piece
        repeated or out of position order stays so: this is a reader's order, not a set.
        ``segments``: the layout to read (default: the store's now).

        Raises:
            CacheReadError (a RuntimeError): a position the store does not hold.
        """
        segs = self.segments if segments is None else segments
        out: list[tuple[Segment | None, int, int]] = []
        for p, n in pieces:
            if p is None:
                out.append((None, 0, n))
            else:
                out.extend(self._walk(segs, p, p + n))
        return out

    def gather(
        self, pieces: Sequence[tuple[int | None, int]], h0: int, h1: int,
        segments: Sequence[Segment] | None = None,
    ) -> KVSegment:
        """K/V ``[B, n, h1 - h0, D]`` of ``pieces`` in order: ``(position, length)`` reads the
        positions ``[position, position + length)``, ``(None, length)`` gives zeros.
        ``segments``: the layout to read (default: the store's now; a lazy view passes the
        one it was made from, which a later commit replaces but never mutates).

        One buffer is allocated and filled in place (packed ranges decoded into it); a single
        piece held by one dense segment is returned as views of it, as a dense cache would.

        Raises:
            CacheReadError (a RuntimeError): a position the store does not hold.
        """
        segs = self.segments if segments is None else segments
        total = sum(n for _, n in pieces)
        shape = (self.batch_size, total, h1 - h0, self.head_dim)
        if len(pieces) == 1 and pieces[0][0] is not None:
            p, n = pieces[0]
            for seg in segs:
                if seg.start <= p and p + n <= seg.end and isinstance(seg.storage, DenseKV):
                    return seg.storage.heads(p - seg.start, p + n - seg.start, h0, h1)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        at, decoded = 0, False
        for p, n in pieces:
            if p is None:
                k[:, at : at + n].zero_()
                v[:, at : at + n].zero_()
            else:
                decoded |= self._fill(segs, p, p + n, h0, h1, k[:, at : at + n], v[:, at : at + n])
            at += n
        if decoded:
            self.peak_transient_nbytes = max(self.peak_transient_nbytes, k.nbytes + v.nbytes)
        if self.ledger is not None:
            self.ledger.transient(k.nbytes + v.nbytes)
        return k, v

    def decode(self, seg: Segment, runs: Intervals, h0: int, h1: int) -> KVSegment:
        """K/V ``[B, count(runs), h1 - h0, D]`` of the runs ``seg`` holds, in one buffer (views
        of a dense segment when one run); for attention that visits one segment at a time."""
        if isinstance(seg.storage, DenseKV) and len(runs) == 1:
            (a, b), = runs
            return seg.storage.heads(a - seg.start, b - seg.start, h0, h1)
        shape = (self.batch_size, iv.count(runs), h1 - h0, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        at = 0
        for a, b in runs:
            self._copy_into(seg, a, b, h0, h1, k[:, at : at + b - a], v[:, at : at + b - a])
            at += b - a
        if seg.packed:
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

    def stored_segments(
        self, located: Sequence[tuple[Segment | None, Intervals]], h0: int, h1: int,
    ) -> Iterator[StoredSegment]:
        """The position runs ``located`` names, as stored, in order (nothing decoded): per run
        ``(a, b)`` of a dense segment views ``[B, b - a, h1 - h0, D]`` of it, of a packed one
        the codec's `PackedSegment` head/token slices of K and V (the segment onloaded to
        ``device`` once per entry), and for a None segment zeros ``[B, b - a, h, D]``. What a
        view's ``iter_stored_segments`` yields (`causalkv.caches.attend`'s fused path).

        ``located``: ``(segment, runs)`` pairs as `locate` gives them (a None segment: runs
        of rows with no position)."""
        for seg, runs in located:
            if seg is None:
                for a, b in runs:
                    yield self.zeros(b - a, h0, h1)
                continue
            storage = seg.storage
            if isinstance(storage, PackedKV):
                storage = storage.onloaded(self.device).select_heads(h0, h1)
            for a, b in runs:
                lo, hi = a - seg.start, b - seg.start
                if isinstance(storage, PackedKV):
                    yield storage.k.select_tokens(lo, hi), storage.v.select_tokens(lo, hi)
                else:
                    yield storage.heads(lo, hi, h0, h1)

    # ---- internals: reads -----------------------------------------------------------------
    def _fill(
        self, segs: Sequence[Segment], p0: int, p1: int, h0: int, h1: int,
        k: torch.Tensor, v: torch.Tensor,
    ) -> bool:
        """Positions ``[p0, p1)`` of ``segs`` into ``k``/``v`` ``[B, p1 - p0, h, D]``; True if any
        was packed."""
        decoded = False
        for seg, a, b in self._walk(segs, p0, p1):
            self._copy_into(seg, a, b, h0, h1, k[:, a - p0 : b - p0], v[:, a - p0 : b - p0])
            decoded |= seg.packed
        return decoded

    def _walk(self, segs: Sequence[Segment], p0: int, p1: int) -> list[tuple[Segment, int, int]]:
        """``[(segment, a, b)]`` covering positions ``[p0, p1)`` of ``segs`` in order; raises
        `CacheReadError` (a RuntimeError) for a position no segment holds."""
        out: list[tuple[Segment, int, int]] = []
        at = p0
        for seg in segs:
            if seg.end <= at or seg.start >= p1:
                continue
            if seg.start > at:
                break
            b = min(seg.end, p1)
            out.append((seg, at, b))
            at = b
            if at >= p1:
                return out
        raise CacheReadError(
            f"SegmentStore: positions [{at}, {p1}) are not held (held: "
            f"{iv.describe(iv.normalize((s.start, s.end) for s in segs))})"
        )

    def _copy_into(
        self, seg: Segment, a: int, b: int, h0: int, h1: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Positions ``[a, b)`` of ``seg``, heads ``[h0, h1)``, into ``k``/``v`` (decoded in place)."""
        seg.storage.read_into(a - seg.start, b - seg.start, h0, h1, k, v, self.device)


_NO_WRITE = KVWrite(0, 0, (0, 0))


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


def _owned(seg: Segment) -> Segment:
    """``seg`` with storage of its own: K/V borrowed from a write are copied."""
    if isinstance(seg.storage, BorrowedKV):
        return replace(seg, storage=DenseKV(seg.storage.k.clone(), seg.storage.v.clone()))
    return seg
