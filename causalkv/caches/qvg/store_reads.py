"""The segment store's reads: what it holds, and its K/V filled into one buffer.

Reads go straight into one preallocated buffer: `gather` fills ``[B, n, h, D]`` for a list of
position runs (dense rows copied, packed token ranges decoded in place with
``dequantize(out=...)``: no dequantized temporary, no concatenation); `decode` does the same
for one segment (streaming attention holds one segment at a time); `locate_pieces` gives
`gather`'s pieces as the stored runs they read, for a reader that attends them one at a time
without building the buffer (a host's segment view), and `stored_segments` yields those runs
as stored (dense views, packed slices: nothing decoded). Every read of a segment in
the stage's shared scratch is checked first (`SegmentStore.check_readable`: only the
scratch's last writer reads it). `held`, `resident_nbytes` (a shared codebook counted once), `covers_dense` say
what the store holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals
from causalkv.caches.qvg.chunk_scratch import ChunkScratch
from causalkv.caches.qvg.segments import DenseKV, PackedKV, Segment
from causalkv.caches.spec import CacheReadError, KVSegment, StoredSegment

__all__ = ["StoreReads"]


class StoreReads:
    """`SegmentStore`'s reads (see the module docstring); a base class of the store only."""

    if TYPE_CHECKING:  # set by SegmentStore.__init__
        segments: list[Segment]
        batch_size: int
        head_dim: int
        dtype: torch.dtype
        device: torch.device
        scratch: ChunkScratch | None
        peak_transient_nbytes: int

        def check_readable(self, seg: Segment) -> None: ...

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
                    self.check_readable(seg)
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
        if self.scratch is not None:
            self.scratch.ledger.transient(k.nbytes + v.nbytes)
        return k, v

    def decode(self, seg: Segment, runs: Intervals, h0: int, h1: int) -> KVSegment:
        """K/V ``[B, count(runs), h1 - h0, D]`` of the runs ``seg`` holds, in one buffer (views
        of a dense segment when one run); for attention that visits one segment at a time."""
        if isinstance(seg.storage, DenseKV) and len(runs) == 1:
            (a, b), = runs
            self.check_readable(seg)
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
        if self.scratch is not None:
            self.scratch.ledger.transient(k.nbytes + v.nbytes)
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
        self.check_readable(seg)
        seg.storage.read_into(a - seg.start, b - seg.start, h0, h1, k, v, self.device)
