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
Reads (`gather`, `decode`, `locate_pieces`; `held`, `resident_nbytes`) are `store_reads`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import torch

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals
from causalkv.caches.qvg.chunk_scratch import ChunkScratch
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
    PendingScratchKV,
    ScratchKV,
    Segment,
    StorePlan,
    copy_write,
    dense_storage,
)
from causalkv.caches.qvg.store_pack import Packer
from causalkv.caches.qvg.store_reads import StoreReads
from causalkv.caches.qvg.tiering import chunk_infos, keep_held, tier_policy
from causalkv.caches.spec import CacheProtocolError
from causalkv.errors import ConfigError

__all__ = [
    "Codebook",
    "DenseKV",
    "KVWrite",
    "PackedKV",
    "PackingReport",
    "ScratchKV",
    "Segment",
    "SegmentStore",
    "StorePlan",
]

_PACKED = "packed"


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------
class SegmentStore(StoreReads):
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
        scratch: the stage's `ChunkScratch`: the chunk being generated lives there (one
            buffer for all layers), not in this store; the host then ends every chunk with a
            context write (`plan_commit`), and the store reports its bytes to the scratch's
            ledger. None keeps the chunk being generated here.

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
        scratch: ChunkScratch | None = None,
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
        if scratch is not None and not isinstance(scratch, ChunkScratch):
            raise ConfigError(f"SegmentStore scratch must be a ChunkScratch or None, got {scratch!r}")
        self.scratch = scratch
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
        #: heads of the chunk being generated written since its advance
        self.chunk_heads: frozenset[int] = frozenset()
        #: (context pass number, heads written in it) of the chunk the last pass wrote
        self.pass_heads: tuple[int, frozenset[int]] | None = None
        #: heads of the chunk being generated another layer overwrote in the shared scratch
        self.lost_heads: frozenset[int] = frozenset()

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
        """Copy ``w`` in place into the dense segments holding its positions (`covers_dense`).

        Raises:
            CacheProtocolError: the chunk lives in a shared scratch another layer has
                written since, and ``w`` does not rewrite every head written to it (nothing
                is changed).
        """
        self.commit(self.plan_write(w))

    def plan_write(self, w: KVWrite) -> StorePlan:
        """The store after ``w``, a rewrite of positions dense segments hold (`covers_dense`):
        the layout stays, ``w`` is copied in by `commit` (``self`` untouched).

        Raises:
            CacheProtocolError: ``w`` rewrites part of a chunk in the shared scratch that
                another layer has written since (its other rows are gone).
        """
        self._check_partial_scratch(w)
        return StorePlan(
            _rewritten(self.segments, w, self.num_heads), self.codebook, self.current, self.chunk_tokens,
            self._next_chunk, w, reasons=dict(self._reasons),
            chunk_heads=self.chunk_heads | _heads(w), pass_heads=self.pass_heads,
            lost_heads=self._lost_after(w),
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
        plan = StorePlan(
            kept, book, current, chunk_tokens, next_chunk, write,
            chunk_heads=_heads(write) if advance else self.chunk_heads | _heads(write),
            pass_heads=self.pass_heads,
            lost_heads=frozenset() if advance else self._lost_after(write),
        )
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
        self, base: StorePlan, *, held: Intervals, sink_end: int = 0, pinned: Intervals = ()
    ) -> StorePlan:
        """The store once the chunk ``base`` writes is context (a context pass writes it last).

        ``base`` is this call's write planned on this very state (`plan` or `plan_write`),
        not yet committed: the two are committed as one (`commit` of the result), so a
        refusal here changes nothing, the shared scratch included. The chunk leaves the
        scratch for its tier at once: packed straight from the write's K/V when the policy
        does not keep it, else its own dense copy (or its recency-tier packing). Only the
        positions in ``held`` stay: the host passes what its next advance will keep, so
        nothing is held only to be evicted at the next chunk. ``sink_end``/``pinned`` as in
        `plan`, for the stream after this chunk (a pin announced for this chunk included).

        A context write of some of the chunk's heads (one part of a head-parallel write)
        moves the chunk to its own dense copy and waits: it is packed by the pass's write
        that completes the heads the chunk was written with since its advance.

        The returned plan's ``view_segments`` is what this call's view reads: the layout
        before the drop, the chunk as written (views of the write's K/V or its copy).

        Raises:
            CacheProtocolError (a UsageError): ``base`` writes nothing, or the chunk's K/V in
                the scratch were overwritten by another layer (`_check_scratch_rewrite`).
        """
        w = base.write
        if w.key is None or w.value is None or w.end <= w.start:
            raise CacheProtocolError(
                "SegmentStore.plan_commit: the context pass's write carries no K/V; commit the "
                "write of the chunk's clean K/V made inside ChunkScratch.context_pass()"
            )
        number = self.scratch.passes if self.scratch is not None else 0
        before = self.pass_heads[1] if self.pass_heads and self.pass_heads[0] == number else frozenset()
        pass_heads = (number, before | _heads(w))
        written = [
            replace(seg, storage=self._as_written(seg, w))
            if seg.start < w.end and w.start < seg.end and not seg.packed else seg
            for seg in base.segments
        ]
        if not pass_heads[1] >= base.chunk_heads or base.lost_heads:  # more heads are coming
            return replace(
                base, segments=[_owned(seg) for seg in written], write=_NO_WRITE,
                pass_heads=pass_heads, view_segments=written,
            )
        kept, book = self._held_only(written, held, base.codebook)
        ahead = base.next_chunk  # the chunk after this one: every chunk held is completed
        plan = StorePlan(
            kept, book, None, base.chunk_tokens, ahead, _NO_WRITE, packs=list(base.packs),
            chunk_heads=base.chunk_heads, pass_heads=pass_heads, view_segments=written,
        )
        if not self.quant.enabled:
            plan = replace(plan, reasons={c: QUANT_OFF for s in kept for c in s.chunks})
        else:
            decision = self.policy.decide(
                self.quant, chunk_infos(kept, ahead, sink_end, pinned), ahead,
                sink_open=bool(kept) and sink_end > kept[-1].end, chunk_tokens=base.chunk_tokens,
            )
            plan = self.packer.pack_cold(plan, decision, ahead)
        # what stays dense gets its own copy (the write's tensors are the caller's)
        return replace(plan, segments=[_owned(seg) for seg in plan.segments])

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
        whole (`BorrowedKV`), else a copy with ``w`` copied in."""
        lo, hi = max(w.start, seg.start), min(w.end, seg.end)
        assert w.key is not None and w.value is not None
        if (lo, hi) == (seg.start, seg.end) and w.heads == (0, self.num_heads):
            return BorrowedKV(w.key[:, lo - w.start : hi - w.start], w.value[:, lo - w.start : hi - w.start])
        st = seg.storage
        if isinstance(st, PendingScratchKV):
            own = DenseKV(torch.zeros(st.shape, dtype=self.dtype, device=self.device),
                          torch.zeros(st.shape, dtype=self.dtype, device=self.device))
        else:
            st = dense_storage(seg)
            if isinstance(st, ScratchKV) and not st.scratch.intact(self):
                # another layer wrote the scratch: only heads never written were zeros
                own = DenseKV(torch.zeros_like(st.k), torch.zeros_like(st.v))
            else:  # a chunk decoded from packed stays marked so (never packed twice)
                own = (DecodedKV if isinstance(st, DecodedKV) else DenseKV)(st.k.clone(), st.v.clone())
        patched = replace(seg, storage=own)
        copy_write([patched], w)
        return own

    def commit(self, plan: StorePlan) -> None:
        """Apply ``plan`` (from `plan`, `plan_write` or `plan_commit` on this very state);
        nothing here can fail. A new chunk planned into the shared scratch takes its buffer
        now (the scratch is this store's from here on)."""
        segments = [self._bind(seg) for seg in plan.segments]
        self._claim_scratch(segments, plan.write)
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
        self.chunk_heads, self.pass_heads = plan.chunk_heads, plan.pass_heads
        self.lost_heads = plan.lost_heads
        if self.scratch is not None:
            self.scratch.ledger.hold(self, self.resident_nbytes())

    def _bind(self, seg: Segment) -> Segment:
        """``seg`` with a planned scratch chunk given the scratch's buffer (zeroed, now ours)."""
        st = seg.storage
        if not isinstance(st, PendingScratchKV):
            return seg
        k, v = st.scratch.buffer(st.shape, self.dtype, self.device, self)
        return replace(seg, storage=ScratchKV(k, v, scratch=st.scratch))

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
        self.chunk_heads, self.pass_heads, self.lost_heads = frozenset(), None, frozenset()
        if self.scratch is not None:
            self.scratch.ledger.hold(self, 0)

    def check_readable(self, seg: Segment) -> None:
        """`CacheProtocolError` for a segment in the shared scratch that another store has
        written since this one (its K/V are gone): readable only by the scratch's last writer."""
        if isinstance(seg.storage, ScratchKV):
            seg.storage.scratch.check_reader(self, "SegmentStore read")

    # ---- internals: writes ----------------------------------------------------------------
    def _lost_after(self, w: KVWrite) -> frozenset[int]:
        """Heads of the chunk being generated whose K/V are unknown once ``w`` is written:
        those written to the shared scratch before another layer overwrote it, and not
        rewritten since (``w`` included). Nothing reads them (`check_heads`) until rewritten."""
        lost = self.lost_heads
        for seg in self.segments:
            st = seg.storage
            if (isinstance(st, ScratchKV) and seg.start < w.end and w.start < seg.end
                    and not st.scratch.intact(self)):
                lost = lost | self.chunk_heads
        return lost - _heads(w) if w.key is not None else lost

    def check_view(
        self, layout: Sequence[Segment], positions: Intervals, h0: int, h1: int, what: str,
        plan: StorePlan | None = None,
    ) -> None:
        """Refuse a view of ``positions`` (heads ``[h0, h1)``) that ``layout`` cannot give: the
        segments the view reads, now or (with ``plan``, checked before it is committed) once
        ``plan`` is committed. So a view never shows what the store does not hold, and a
        refused call changes nothing.

        Raises:
            CacheProtocolError (a UsageError): positions the last context pass dropped (it kept
                what the next advance by a chunk of its size keeps); heads of the chunk being
                generated another layer overwrote in the shared scratch and nobody rewrote
                (``plan.lost_heads``); or a chunk in the shared scratch another layer has
                written since that ``plan``'s write does not rewrite whole.
        """
        missing = iv.subtract(positions, iv.normalize((s.start, s.end) for s in layout))
        if missing:
            raise CacheProtocolError(
                f"{what}: the view of positions {iv.describe(positions)} needs "
                f"{iv.describe(missing)}, which were dropped at the last context pass (it keeps "
                "only what the next advance by a chunk of its size keeps; nothing was changed); "
                "advance by chunks of the committed size and read a view inside the call that "
                "wrote it, or leave the scratch unshared (ChunkScratch(shared=False)) to keep "
                "every visible position until the advance"
            )
        lost = self.lost_heads if plan is None else plan.lost_heads
        heads = sorted(lost & frozenset(range(h0, h1)))
        if heads:
            raise CacheProtocolError(
                f"{what}: heads {heads} of the chunk being generated were written to the stage's "
                "shared scratch, which another layer has written since, and were not rewritten "
                "(nothing was changed); write every head of the chunk before another layer "
                "writes, or leave the scratch unshared (ChunkScratch(shared=False))"
            )
        w = _NO_WRITE if plan is None else plan.write
        for seg in layout:
            st = seg.storage
            if (isinstance(st, ScratchKV) and iv.intersect(seg.run, positions)
                    and not st.scratch.intact(self)
                    and not (w.key is not None and w.start <= seg.start and seg.end <= w.end)):
                raise CacheProtocolError(
                    f"{what}: the view needs chunk [{seg.start}, {seg.end}), generated in the "
                    "stage's shared scratch, which another layer has written since (nothing was "
                    "changed); end every chunk with its context pass inside "
                    "ChunkScratch.context_pass() before another layer writes, or leave the "
                    "scratch unshared (ChunkScratch(shared=False))"
                )

    def _check_partial_scratch(self, w: KVWrite) -> None:
        """`CacheProtocolError` for a write into part of a chunk in the shared scratch that
        another layer has written since: its other rows would be that layer's K/V."""
        for seg in self.segments:
            st = seg.storage
            if (isinstance(st, ScratchKV) and seg.start < w.end and w.start < seg.end
                    and not (w.start <= seg.start and seg.end <= w.end)
                    and not st.scratch.intact(self)):
                raise CacheProtocolError(
                    f"SegmentStore: the write of [{w.start}, {w.end}) rewrites part of chunk "
                    f"[{seg.start}, {seg.end}), generated in the stage's shared scratch, which "
                    "another layer has written since: its other rows are gone (nothing was "
                    "changed); end every chunk with its context pass inside "
                    "ChunkScratch.context_pass(), or leave the scratch unshared "
                    "(ChunkScratch(shared=False))"
                )

    def check_heads(self, h0: int, h1: int, what: str) -> None:
        """`CacheProtocolError` when heads ``[h0, h1)`` of the chunk being generated are lost
        (another layer overwrote them in the shared scratch and they were not rewritten)."""
        lost = sorted(self.lost_heads & frozenset(range(h0, h1)))
        if lost:
            raise CacheProtocolError(
                f"{what}: heads {lost} of the chunk being generated were written to the stage's "
                "shared scratch, which another layer has written since, and were not rewritten "
                "(nothing was changed); write every head of the chunk before another layer "
                "writes, or leave the scratch unshared (ChunkScratch(shared=False))"
            )

    def _claim_scratch(self, segs: Sequence[Segment], w: KVWrite) -> None:
        """Before ``w`` is copied into a scratch segment of ``segs``: the scratch is this
        store's now, and heads outside ``w`` read as zeros (another layer wrote them)."""
        if w.key is None or self.scratch is None:
            return
        for seg in segs:
            if isinstance(seg.storage, ScratchKV) and seg.start < w.end and w.start < seg.end:
                if seg.storage.scratch.writer is not self:
                    h0, h1 = w.heads
                    if (h0, h1) != (0, self.num_heads):
                        seg.storage.k.zero_()
                        seg.storage.v.zero_()
                seg.storage.scratch.claim(self)

    def _covered(self, w: KVWrite, advance: bool) -> tuple[list[Segment], int, int | None, int]:
        """The segments once ``w``'s positions are all held: new zero chunks where none held
        them, packed ones it touches decoded to dense. Returns (segments, next chunk index,
        current chunk, chunk_tokens)."""
        out: list[Segment] = []
        nxt, current, chunk_tokens = self._next_chunk, self.current, self.chunk_tokens
        at = w.start

        def new_chunk(a: int, b: int, scratch: ChunkScratch | None = None) -> Segment:
            nonlocal nxt
            shape = (self.batch_size, b - a, self.num_heads, self.head_dim)
            storage: DenseKV | PendingScratchKV
            if scratch is not None and scratch.shared:  # the stage's one buffer, at commit
                storage = PendingScratchKV(scratch, shape)
            else:
                storage = DenseKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                                  torch.zeros(shape, dtype=self.dtype, device=self.device))
            nxt += 1
            return Segment(a, b, nxt - 1, nxt - 1, storage)

        if advance and self.lost_heads and self.current is not None:
            self.check_heads(0, self.num_heads, f"SegmentStore: the advance to [{w.start}, {w.end})")
        segments = _rewritten(self.segments, w, self.num_heads)
        for i, seg in enumerate(segments):
            if not isinstance(seg.storage, ScratchKV) or (seg.start, seg.end) == (w.start, w.end):
                continue
            # a chunk that leaves the scratch without a context pass: its own copy while the
            # scratch still holds its K/V (no other layer wrote it since), else it is lost
            if not seg.storage.scratch.intact(self) or self.lost_heads:
                raise CacheProtocolError(
                    f"SegmentStore: chunk [{seg.start}, {seg.end}) was generated in the stage's "
                    "shared scratch, another layer has written the scratch since, and the chunk "
                    f"was never committed by a context pass, so the write of [{w.start}, "
                    f"{w.end}) would lose it (nothing was changed); end every chunk with its "
                    "context pass inside ChunkScratch.context_pass(), or leave the scratch "
                    "unshared (ChunkScratch(shared=False), no context_pass) to keep each "
                    "layer's chunk in its own cache"
                )
            segments[i] = replace(seg, storage=DenseKV(seg.storage.k.clone(), seg.storage.v.clone()))
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
            tail = new_chunk(at, w.end, self.scratch if advance else None)
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


_NO_WRITE = KVWrite(0, 0, (0, 0))


def _heads(w: KVWrite) -> frozenset[int]:
    """The heads ``w`` writes."""
    return frozenset(range(*w.heads))


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
