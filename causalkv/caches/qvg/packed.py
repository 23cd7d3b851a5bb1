"""`QVGPackedCausalKVCache`: the causal cache contract over chunk segments, cold ones PRQ-packed.

Storage is a list of `Segment` in ascending global position. A segment covers a run of
global positions and holds its K/V in ``storage``: either `DenseKV` (``[B, len, H, D]`` in the
spec dtype) or `PackedKV` (one codec `PackedSegment` for K and one for V, ``[B, H, len, D]``).

Which positions are retained and visible is decided by the same `StreamState` as the
dense cache, so views agree on positions by construction; with quantization off every
segment stays dense and views are bit-for-bit those of `DenseCausalKVCache`.

Packing policy, applied once per advance (a segment is quantized at most once):

- the current chunk and the newest ``keep_recent_chunks`` completed chunks stay dense;
- sink chunks (those holding stream-start sink or pinned shot-sink tokens) are packed too
  with ``sink=True`` (the reference default), one segment per chunk (``sink_span="chunk"``)
  or the whole sink as one span once all of it is cold (``"full"``); the leading
  ``sink_keep_chunks`` sink chunks stay dense forever; ``sink=False`` keeps sink chunks dense;
- every other completed chunk is packed, ``span_chunks`` consecutive chunks at a time
  (one codebook per span; 1 = the reference behaviour);
- never worse than bf16: a span is packed only if its packed bytes (`packed_nbytes_formula`,
  decided before any quantize) are smaller than its dense bytes; otherwise it stays dense;
- the k-means centroids adapt to the span's tokens: `centroids_for` gives
  ``min(quant.centroids, largest power of two <= tokens / 32)`` (at least 1), so the bf16
  centroids cost at most half a bit per element, as the reference's 128 do on its
  4,680-token chunks (docs/packed_cache.md has the measurements behind the rule);
- a segment whose positions all rolled out is freed; a dense segment that lost some is
  trimmed; a packed one is kept whole until all of it rolled out.

An advance computes the new segment list, codebook and bookkeeping as values and commits
them at the end, so a failure (e.g. non-finite K/V in a cold chunk) leaves the cache as it was.
`packing_report()` tells what was decided for every chunk written so far, and why.

Views are lazy: ``view.k``/``view.v`` materialize the window on first access (packed
segments dequantized straight into the output), while `causalkv.caches.attend` walks
``view.iter_segments()`` and so holds one dequantized segment at a time, or, on its fused
path, ``view.iter_stored_segments()`` (packed head/token slices that are never decoded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from causalkv.caches import intervals as iv
from causalkv.caches.base import StreamCache
from causalkv.caches.intervals import Intervals
from causalkv.caches.qvg.args import QVGKVQuantArgs
from causalkv.caches.qvg.codec import PackedSegment, packed_nbytes_formula
from causalkv.caches.spec import (
    GROWTH,
    HEAD_SLICE,
    INT_INDICES,
    PINNED_SINK,
    QUANT_QVG,
    RECENT_WINDOW,
    CacheCapabilities,
    CausalAttentionKVView,
    KVCacheSpec,
    KVSegment,
    StoredSegment,
)
from causalkv.caches.stream import StreamState

__all__ = [
    "DENSE_REASONS",
    "MIN_TOKENS_PER_CENTROID",
    "Codebook",
    "DenseKV",
    "PackedKV",
    "PackingReport",
    "QVGPackedCausalKVCache",
    "Segment",
    "centroids_for",
]

MIN_TOKENS_PER_CENTROID = 32
"""Default of the centroid rule: at least this many tokens per k-means centroid (see module doc)."""

# Why a completed chunk is held dense (the keys of `PackingReport.chunks_dense`).
RECENT = "recent"  # one of the newest keep_recent_chunks
SINK_KEEP = "sink_keep"  # one of the leading sink_keep_chunks sink chunks
SINK = "sink"  # a sink chunk with sink=False
WAITING = "waiting for span"  # its span (span_chunks, or the whole sink with "full") is not cold yet
NOT_SMALLER = "not smaller than dense"  # packing it would not save bytes
QUANT_OFF = "quant off"  # quantization is off
POLICY = "policy"  # kept by a policy rule not named above
DENSE_REASONS = (RECENT, SINK_KEEP, SINK, WAITING, NOT_SMALLER, QUANT_OFF, POLICY)
_PACKED = "packed"


def centroids_for(tokens: int, centroids: int, min_tokens_per_centroid: int = MIN_TOKENS_PER_CENTROID) -> int:
    """K-means centroids for a span of ``tokens``: ``min(centroids, 2**floor(log2(tokens // m)))``.

    ``m = min_tokens_per_centroid``; at least 1. With ``m = 32`` the bf16 centroids cost at
    most ``16 * K / tokens = 0.5`` bits per element; a 4,680-token chunk keeps the reference's
    128 (146 tokens/32 rounds down to 128), 880 tokens get 16 and 48 tokens 1.
    """
    cap = max(1, tokens // min_tokens_per_centroid)
    return min(centroids, 1 << (cap.bit_length() - 1))


# ---------------------------------------------------------------------------------------------
# Typed storage
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DenseKV:
    """Dense K and V ``[B, len, H, D]`` in the spec dtype."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slice(self, lo: int, hi: int) -> DenseKV:
        """Tokens ``[lo, hi)`` as a copy (so the rest can be freed)."""
        return DenseKV(self.k[:, lo:hi].clone(), self.v[:, lo:hi].clone())

    def heads(self, lo: int, hi: int, h0: int, h1: int) -> KVSegment:
        """Views of tokens ``[lo, hi)``, heads ``[h0, h1)``: ``[B, hi - lo, h1 - h0, D]``."""
        return self.k[:, lo:hi, h0:h1], self.v[:, lo:hi, h0:h1]


@dataclass(frozen=True, eq=False)
class PackedKV:
    """K and V packed by the QVG codec, each a `PackedSegment` of logical shape ``[B, H, len, D]``."""

    k: PackedSegment
    v: PackedSegment

    @property
    def nbytes(self) -> int:
        """Stored bytes of both (a shared codebook counted in each; see `resident_nbytes`)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def num_centroids(self) -> int:
        return self.k.num_centroids

    def select_heads(self, h0: int, h1: int) -> PackedKV:
        """Heads ``[h0, h1)`` as views (no copy)."""
        if h0 == 0 and h1 == self.k.shape[1]:
            return self
        return PackedKV(self.k.select_heads(h0, h1), self.v.select_heads(h0, h1))

    def offloaded(self) -> PackedKV:
        """The same K/V in CPU memory (pinned when it was on a GPU)."""
        k, v = self.k.to("cpu"), self.v.to("cpu")
        if self.device.type == "cuda":
            k, v = k.pin_memory(), v.pin_memory()
        return PackedKV(k, v)

    def onloaded(self, device: torch.device) -> PackedKV:
        """The same K/V on ``device`` (itself when already there)."""
        here = self.device
        if here == device or (here.type == device.type and device.index is None):
            return self
        return PackedKV(self.k.to(device, non_blocking=True), self.v.to(device, non_blocking=True))


@dataclass(frozen=True, eq=False)
class Segment:
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
    def run(self) -> Intervals:
        return ((self.start, self.end),)

    @property
    def chunks(self) -> range:
        return range(self.first_chunk, self.last_chunk + 1)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def dense_slice(self, a: int, b: int) -> Segment:
        """A dense segment of positions ``[a, b)`` (a copy, so the rest can be freed)."""
        return replace(self, start=a, end=b, storage=_dense(self).slice(a - self.start, b - self.start))


@dataclass(frozen=True, eq=False)
class Codebook:
    """The k-means centroids that consecutive cold chunks share (``codebook_chunks > 1``).

    Attributes:
        k, v: per stage ``[B, H, K, D]`` bf16, the very tensors the packed segments reference.
        chunks: chunks packed with it so far.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    chunks: int

    def used_by(self, seg: Segment) -> bool:
        return isinstance(seg.storage, PackedKV) and seg.storage.k.centroids[0] is self.k[0]


@dataclass(frozen=True)
class PackingReport:
    """What a packed cache decided for every chunk written so far (the current one excluded).

    Counts are cumulative since the cache was built (across `reset_indices`). A chunk still
    held counts with its present storage (a ``"recent"`` chunk may be packed later); a chunk
    that rolled out counts with the storage it had last.

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
        packed, calls = 0, 0
        dense: Counter[str] = Counter()
        books: Counter[int] = Counter()
        for r in reports:
            packed += r.chunks_packed
            calls += r.quantize_calls
            dense.update(r.chunks_dense)
            books.update(r.centroids)
        return cls(packed, dict(sorted(dense.items())), dict(sorted(books.items())), calls)


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------
@dataclass
class _Advance:
    """What one advance builds before committing (discarded if anything raises)."""

    segments: list[Segment] = field(default_factory=list)
    codebook: Codebook | None = None
    packs: list[Segment] = field(default_factory=list)
    dense_reason: dict[int, str] = field(default_factory=dict)  # chunk -> why it stays dense


class QVGPackedCausalKVCache(StreamCache):
    """Causal KV cache whose cold chunks are packed with QVG/PRQ (see module docstring).

    Args:
        spec: the layer's cache spec (same as the dense cache).
        quant: QVG settings; ``None`` or ``bits=None`` keeps every segment dense.
        offload: keep packed segments in CPU memory (pinned when the cache is on a GPU)
            and move them back transparently when a view reads them.
        seed: k-means seed (the reference runtime's 1234); each packed segment is seeded
            with ``seed`` so packing is reproducible and the global RNG is untouched.
        head_offset: global index of the first head (default ``spec.head_offset``): each
            head's k-means draws are keyed by it, so a rank holding heads ``[a, b)`` packs
            them exactly as one process packs the same heads of the whole tensor.
        min_tokens_per_centroid: the centroid rule's ``m`` (`centroids_for`, default 32);
            1 allows up to one centroid per token (never more than ``quant.centroids``).
        policy: which completed chunks stay dense: ``"causalkv"`` (the rule above) or
            ``"sglang"`` (sglang's: the newest ``keep_recent_chunks`` non-sink chunks; sink
            chunks, those starting before ``sink_tokens``, are packed as soon as they are
            completed unless ``sink=False`` or among the leading ``sink_keep_chunks``).

    Attributes:
        segments: the storage, ascending global position; the last one is the current chunk.
        quantize_calls: how many times the codec packed a K/V pair (tests assert that no
            segment is packed twice).
        peak_transient_nbytes: the largest dense K+V temporary built from packed data in
            one go (one segment when streaming, the window when materialized).
    """

    capabilities = CacheCapabilities.of(
        PINNED_SINK, HEAD_SLICE, RECENT_WINDOW, GROWTH, INT_INDICES, QUANT_QVG
    )

    def __init__(
        self,
        spec: KVCacheSpec,
        quant: QVGKVQuantArgs | None = None,
        *,
        offload: bool = False,
        seed: int = 1234,
        min_tokens_per_centroid: int = MIN_TOKENS_PER_CENTROID,
        head_offset: int | None = None,
        policy: str = "causalkv",
    ) -> None:
        if policy not in ("causalkv", "sglang"):
            raise ValueError(
                f"QVGPackedCausalKVCache policy must be one of ['causalkv', 'sglang'], got {policy!r}"
            )
        self.policy = policy
        quant = (quant or QVGKVQuantArgs()).validate()
        if quant.enabled and spec.head_dim % quant.block_size != 0:
            raise ValueError(
                f"QVG block_size={quant.block_size} does not divide head_dim={spec.head_dim}; "
                f"choose --kv-cache-quant-block-size among the divisors of {spec.head_dim}"
            )
        if quant.enabled and not spec.dtype.is_floating_point:
            raise ValueError(f"QVG packs floating-point K/V, the spec dtype is {spec.dtype}")
        m = min_tokens_per_centroid
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise ValueError(f"min_tokens_per_centroid must be a positive int, got {m!r}")
        self.spec = spec
        self.quant = quant
        self.offload = offload
        self.seed = seed
        #: global index of the first head: the codec keys each head's k-means draws by it
        self.head_offset = spec.head_offset if head_offset is None else head_offset
        self.min_tokens_per_centroid = m
        self.state = StreamState.from_spec(spec)
        self.segments: list[Segment] = []
        self.quantize_calls = 0
        self.peak_transient_nbytes = 0
        self._codebook: Codebook | None = None
        self._live: dict[int, str] = {}  # completed chunk still held -> "packed" or dense reason
        self._settled: Counter[str] = Counter()  # the same for chunks no longer held
        self._centroids_used: Counter[int] = Counter()

    def resident_nbytes(self) -> int:
        """Exact bytes held now: dense segments' K/V plus packed segments' stored bytes.

        A codebook shared by several packed segments (``codebook_chunks > 1``) is one
        tensor referenced by each of them and is counted once.
        """
        total, seen = 0, set()
        for seg in self.segments:
            total += seg.nbytes
            if isinstance(seg.storage, PackedKV):
                for packed in (seg.storage.k, seg.storage.v):
                    for c in packed.centroids:
                        key = (c.device, c.data_ptr())
                        if key in seen:
                            total -= c.nbytes
                        seen.add(key)
        return total

    def packed_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.packed]

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

    # ---- storage ------------------------------------------------------------------
    def _advance(self, new: StreamState, heads: tuple[int, int]) -> None:
        """Evict, pack cold chunks and append the new chunk, then commit it all at once."""
        current_chunk = self.segments[-1].last_chunk + 1 if self.segments else 0
        plan = self._plan(new, current_chunk)
        spec = self.spec
        shape = (spec.batch_size, new.cur_n, spec.num_heads, spec.head_dim)
        assert new.cur_start is not None
        plan.segments.append(
            Segment(
                start=new.cur_start, end=new.global_end,
                first_chunk=current_chunk, last_chunk=current_chunk,
                storage=DenseKV(
                    torch.zeros(shape, dtype=spec.dtype, device=spec.device),
                    torch.zeros(shape, dtype=spec.dtype, device=spec.device),
                ),
            )
        )
        live = {
            c: _PACKED if seg.packed else plan.dense_reason.get(c, POLICY)
            for seg in plan.segments[:-1] for c in seg.chunks
        }
        # commit (nothing below can fail)
        self._settled.update(s for c, s in self._live.items() if c not in live)
        self._live = live
        for seg in plan.packs:
            assert isinstance(seg.storage, PackedKV)
            self._centroids_used[seg.storage.num_centroids] += len(seg.chunks)
        self.quantize_calls += len(plan.packs)
        self.state, self.segments, self._codebook = new, plan.segments, plan.codebook

    def _write_current(self, key: torch.Tensor, value: torch.Tensor, h0: int, h1: int) -> None:
        current = _dense(self.segments[-1])  # the current chunk is always the last, dense segment
        current.k[:, :, h0:h1].copy_(key)
        current.v[:, :, h0:h1].copy_(value)

    def _plan(self, new: StreamState, current_chunk: int) -> _Advance:
        """The completed chunks' segments after advancing to ``new`` (``self`` untouched)."""
        kept: list[Segment] = []
        for seg in self.segments:
            live = iv.intersect(seg.run, new.retained)
            if not live:
                continue
            if seg.packed or live == seg.run:
                kept.append(seg)
            else:
                kept.extend(seg.dense_slice(a, b) for a, b in live)
        book = self._codebook
        if book is not None and not any(book.used_by(seg) for seg in kept):
            book = None  # every segment using it rolled out: start a fresh one
        if not self.quant.enabled:
            plan = _Advance(kept, book)
            plan.dense_reason = {c: QUANT_OFF for seg in kept for c in seg.chunks}
            return plan
        return self._pack_cold(kept, new, current_chunk, book)

    def _policy(self, new: StreamState, current_chunk: int) -> tuple[set[int], list[frozenset[int]]]:
        """Chunks that stay dense now, and the sink groups packed as one span (``"full"``)."""
        q = self.quant
        if self.policy == "sglang":  # sglang's rule: sink chunks do not count in keep_recent
            from causalkv.sglang.policy import sglang_dense_chunks

            completed = sorted({
                (c, s.start < self.spec.sink_tokens, c < q.sink_keep_chunks)
                for s in self.segments for c in range(s.first_chunk, s.last_chunk + 1)
            })
            return sglang_dense_chunks(completed, q.keep_recent_chunks, q.sink) | {current_chunk}, []
        keep: set[int] = set(range(current_chunk - q.keep_recent_chunks, current_chunk))
        prefix_end = new.sink_prefix_end()
        prefix = sorted(
            c for s in self.segments if s.start < prefix_end
            for c in range(s.first_chunk, s.last_chunk + 1)
        )
        if new.cur_start < prefix_end:  # the sink is still being written: its group is open
            prefix.append(current_chunk)
        pinned = sorted(
            c for s in self.segments if new.pinned and iv.intersect(s.run, (new.pinned,))
            for c in range(s.first_chunk, s.last_chunk + 1)
        )
        keep |= set(prefix[: q.sink_keep_chunks])
        if not q.sink:
            return keep | set(prefix) | set(pinned), []
        groups = [frozenset(g) for g in (prefix, pinned) if g] if q.sink_span == "full" else []
        return keep, groups

    def _keep_reason(self, chunk: int, current_chunk: int) -> str:
        """Why `_policy` keeps ``chunk`` dense (for the packing report)."""
        q = self.quant
        if current_chunk - q.keep_recent_chunks <= chunk < current_chunk:
            return RECENT
        if not q.sink:
            return SINK
        return SINK_KEEP if q.sink_keep_chunks else POLICY

    def _pack_cold(
        self, segs: list[Segment], new: StreamState, current_chunk: int, book: Codebook | None
    ) -> _Advance:
        """Pack the cold dense segments of ``segs`` (see the module docstring's policy)."""
        keep, groups = self._policy(new, current_chunk)
        plan = _Advance(codebook=book)
        pending: list[Segment] = []  # adjacent packable dense segments of one group
        pending_group: frozenset[int] | None = None

        def flush_dense(reason: str) -> None:
            plan.segments.extend(pending)
            plan.dense_reason.update((c, reason) for p in pending for c in p.chunks)
            pending.clear()

        for seg in segs:
            chunks = set(seg.chunks)
            if seg.packed or chunks & keep:
                flush_dense(WAITING)
                plan.segments.append(seg)
                plan.dense_reason.update((c, self._keep_reason(c, current_chunk)) for c in chunks)
                continue
            group = next((g for g in groups if chunks & g), None)
            if pending and (group != pending_group or pending[-1].end != seg.start):
                flush_dense(WAITING)
            pending.append(seg)
            pending_group = group
            have = set().union(*(p.chunks for p in pending))
            if (group is not None and have >= group) or (
                group is None and len(have) >= self.quant.span_chunks
            ):
                if not self._pays(pending, plan.codebook):
                    flush_dense(NOT_SMALLER)
                    continue
                packed, plan.codebook = self._pack(pending, plan.codebook)
                plan.segments.append(packed)
                plan.packs.append(packed)
                pending.clear()
        flush_dense(WAITING)
        return plan

    def _span_quant(self, tokens: int) -> QVGKVQuantArgs:
        """The settings a span of ``tokens`` is packed with (the centroid rule applied)."""
        k = centroids_for(tokens, self.quant.centroids, self.min_tokens_per_centroid)
        return self.quant if k == self.quant.centroids else replace(self.quant, centroids=k)

    def _pays(self, pieces: list[Segment], book: Codebook | None) -> bool:
        """True when packing ``pieces`` stores fewer bytes than keeping them dense (no quantize).

        Counted without sharing: a span that would join ``book`` is charged its centroids too.
        """
        spec = self.spec
        tokens = pieces[-1].end - pieces[0].start
        q = self._span_quant(tokens)
        chunks = pieces[-1].last_chunk - pieces[0].first_chunk + 1
        if book is not None and book.chunks + chunks <= q.codebook_chunks:
            q = replace(q, centroids=int(book.k[0].shape[2]))  # it would assign to ``book``
        shape = (spec.batch_size, spec.num_heads, tokens, spec.head_dim)
        dense = spec.batch_size * tokens * spec.num_heads * spec.head_dim * spec.element_size
        return packed_nbytes_formula(shape, q) < dense

    def _pack(self, pieces: list[Segment], book: Codebook | None) -> tuple[Segment, Codebook]:
        """One packed segment of ``pieces`` (dense, adjacent) and the codebook after it."""
        from causalkv.caches.qvg.codec import quantize

        stores = [_dense(p) for p in pieces]
        k = torch.cat([s.k for s in stores], dim=1) if len(stores) > 1 else stores[0].k
        v = torch.cat([s.v for s in stores], dim=1) if len(stores) > 1 else stores[0].v
        chunks = pieces[-1].last_chunk - pieces[0].first_chunk + 1
        if book is not None and book.chunks + chunks > self.quant.codebook_chunks:
            book = None
        q = self._span_quant(k.shape[1])
        pk = quantize(k.permute(0, 2, 1, 3), q, seed=self.seed, head_offset=self.head_offset,
                      codebooks=list(book.k) if book else None)
        pv = quantize(v.permute(0, 2, 1, 3), q, seed=self.seed, head_offset=self.head_offset,
                      codebooks=list(book.v) if book else None)
        after = Codebook(tuple(pk.centroids), tuple(pv.centroids), (book.chunks if book else 0) + chunks)
        storage = PackedKV(pk, pv)
        if self.offload:
            storage = storage.offloaded()
        seg = Segment(
            start=pieces[0].start, end=pieces[-1].end,
            first_chunk=pieces[0].first_chunk, last_chunk=pieces[-1].last_chunk,
            storage=storage,
        )
        return seg, after

    # ---- views ------------------------------------------------------------------------
    def _pieces(self, visible: Intervals) -> list[tuple[Segment, Intervals]]:
        pieces = []
        for seg in self.segments:
            runs = iv.intersect(seg.run, visible)
            if runs:
                pieces.append((seg, runs))
        return pieces

    def _dense_pieces(
        self, seg: Segment, runs: Intervals, h0: int, h1: int
    ) -> KVSegment:
        """Visible K/V ``[B, count(runs), h, D]`` of one segment (dequantized if packed)."""
        storage = seg.storage
        if isinstance(storage, DenseKV):
            parts = [storage.heads(a - seg.start, b - seg.start, h0, h1) for a, b in runs]
        else:
            k_full, v_full = self._dequantize(storage, h0, h1)
            self.peak_transient_nbytes = max(
                self.peak_transient_nbytes, k_full.nbytes + v_full.nbytes
            )
            parts = [(k_full[:, a - seg.start : b - seg.start],
                      v_full[:, a - seg.start : b - seg.start]) for a, b in runs]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)

    def _dequantize(
        self, storage: PackedKV, h0: int, h1: int, out: KVSegment | None = None
    ) -> KVSegment:
        """K/V ``[B, len, h, D]`` of packed storage, written into ``out`` when given."""
        from causalkv.caches.qvg.codec import dequantize

        packed = storage.onloaded(self.spec.torch_device).select_heads(h0, h1)
        res = []
        for i, half in enumerate((packed.k, packed.v)):
            target = None if out is None else out[i].permute(0, 2, 1, 3)
            res.append(dequantize(half, dtype=self.spec.dtype, out=target).permute(0, 2, 1, 3))
        return res[0], res[1]

    def _view(self, h0: int, h1: int, recent_window_tokens: int | None) -> CausalAttentionKVView:
        st = self.state
        visible = st.visible(recent_window_tokens)
        pieces = self._pieces(visible)

        def segments() -> Iterator[KVSegment]:
            for seg, runs in pieces:
                yield self._dense_pieces(seg, runs, h0, h1)

        def materialize() -> KVSegment:
            return self._materialize(pieces, h0, h1, iv.count(visible))

        def stored() -> Iterator[StoredSegment]:
            # one piece per visible run: dense views, or packed head/token slices (no decode)
            for seg, runs in pieces:
                st = seg.storage
                if isinstance(st, PackedKV):
                    st = st.onloaded(self.spec.torch_device).select_heads(h0, h1)
                for a, b in runs:
                    lo, hi = a - seg.start, b - seg.start
                    if isinstance(st, PackedKV):
                        yield st.k.select_tokens(lo, hi), st.v.select_tokens(lo, hi)
                    else:
                        yield st.heads(lo, hi, h0, h1)

        all_dense = all(not seg.packed for seg, _ in pieces)
        k = v = None
        if all_dense:  # nothing to dequantize: build k/v now, exactly like the dense cache
            k, v = materialize()
        return self._make_view(
            visible, k=k, v=v, segments=segments, materialize=materialize, stored=stored,
            device=self.spec.torch_device,
        )

    def _materialize(
        self, pieces: list[tuple[Segment, Intervals]], h0: int, h1: int, total: int
    ) -> KVSegment:
        spec = self.spec
        if not pieces:
            empty = torch.zeros(
                (spec.batch_size, 0, h1 - h0, spec.head_dim), dtype=spec.dtype, device=spec.device
            )
            return empty, empty
        if len(pieces) == 1 and not pieces[0][0].packed:
            return self._dense_pieces(pieces[0][0], pieces[0][1], h0, h1)
        shape = (spec.batch_size, total, h1 - h0, spec.head_dim)
        k = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        v = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        at = 0
        for seg, runs in pieces:
            m = iv.count(runs)
            if isinstance(seg.storage, PackedKV) and runs == seg.run:
                # dequantize straight into the window
                self._dequantize(seg.storage, h0, h1, out=(k[:, at : at + m], v[:, at : at + m]))
            else:
                pk, pv = self._dense_pieces(seg, runs, h0, h1)
                k[:, at : at + m].copy_(pk)
                v[:, at : at + m].copy_(pv)
            at += m
        if any(seg.packed for seg, _ in pieces):
            self.peak_transient_nbytes = max(self.peak_transient_nbytes, k.nbytes + v.nbytes)
        return k, v

    # ---- control ----------------------------------------------------------------------
    def reset_indices(self) -> None:
        """Forget the stream (new request) and free every segment.

        `packing_report` keeps counting: the dropped chunks count with their last storage.
        """
        self.state = StreamState.from_spec(self.spec)
        self.segments = []
        self._codebook = None
        self._settled.update(self._live.values())
        self._live = {}


def _dense(seg: Segment) -> DenseKV:
    if not isinstance(seg.storage, DenseKV):
        raise TypeError(f"segment [{seg.start}, {seg.end}) is packed; only dense segments are sliced or packed")
    return seg.storage
