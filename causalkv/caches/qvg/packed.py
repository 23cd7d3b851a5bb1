"""`QVGPackedCausalKVCache`: the causal cache contract over chunk segments, cold ones PRQ-packed.

Storage is a list of segments in ascending global position. A segment covers a run of
global positions and holds its K/V either densely (``[B, len, H, D]`` in the spec dtype) or
packed by the QVG codec (one `PackedSegment` for K and one for V, ``[B, H, len, D]``).

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
- a segment whose positions all rolled out is freed; a dense segment that lost some is
  trimmed; a packed one is kept whole until all of it rolled out.

Views are lazy: ``view.k``/``view.v`` materialize the window on first access (packed
segments dequantized straight into the output), while `causalkv.caches.attend` walks
``view.iter_segments()`` and so holds one dequantized segment at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from causalkv.caches import intervals as iv
from causalkv.caches.base import StreamCache
from causalkv.caches.intervals import Intervals
from causalkv.caches.qvg.args import QVGKVQuantArgs
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
)
from causalkv.caches.stream import StreamState

__all__ = ["QVGPackedCausalKVCache", "Segment"]


@dataclass(frozen=True, eq=False)
class Segment:
    """A run ``[start, end)`` of global positions and its K/V storage.

    Exactly one of (``k``, ``v``) dense ``[B, len, H, D]`` or (``pk``, ``pv``) packed
    ``[B, H, len, D]`` is set. ``first_chunk``/``last_chunk`` are the indices of the chunks
    it came from (a packed span covers several).
    """

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pk: object | None = None
    pv: object | None = None

    @property
    def packed(self) -> bool:
        return self.pk is not None

    @property
    def run(self) -> Intervals:
        return ((self.start, self.end),)

    @property
    def nbytes(self) -> int:
        if self.packed:
            return int(self.pk.nbytes + self.pv.nbytes)  # type: ignore[attr-defined]
        return self.k.nbytes + self.v.nbytes  # type: ignore[union-attr]

    def dense_slice(self, a: int, b: int) -> Segment:
        """A dense segment of positions ``[a, b)`` (a copy, so the rest can be freed)."""
        lo, hi = a - self.start, b - self.start
        return replace(
            self, start=a, end=b,
            k=self.k[:, lo:hi].clone(), v=self.v[:, lo:hi].clone(),  # type: ignore[index]
        )


class QVGPackedCausalKVCache(StreamCache):
    """Causal KV cache whose cold chunks are packed with QVG/PRQ (see module docstring).

    Args:
        spec: the layer's cache spec (same as the dense cache).
        quant: QVG settings; ``None`` or ``bits=None`` keeps every segment dense.
        offload: keep packed segments in CPU memory (pinned when the cache is on a GPU)
            and move them back transparently when a view reads them.
        seed: k-means seed (the reference runtime's 1234); each packed segment is seeded
            with ``seed`` so packing is reproducible and the global RNG is untouched.
        policy: which completed chunks stay dense: ``"causalkv"`` (the rule above) or
            ``"sglang"`` (sglang's: the newest ``keep_recent_chunks`` non-sink chunks; sink
            chunks, those starting before ``sink_tokens``, are packed as soon as they are
            completed unless ``sink=False`` or among the leading ``sink_keep_chunks``).

    Attributes:
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
        self.spec = spec
        self.quant = quant
        self.offload = offload
        self.seed = seed
        self.state = StreamState.from_spec(spec)
        self.segments: list[Segment] = []
        self.quantize_calls = 0
        self.peak_transient_nbytes = 0
        # (K codebooks, V codebooks, chunks packed with them) for ``codebook_chunks > 1``
        self._codebook: tuple[list[torch.Tensor], list[torch.Tensor], int] | None = None

    def resident_nbytes(self) -> int:
        """Exact bytes held now: dense segments' K/V plus packed segments' stored bytes.

        A codebook shared by several packed segments (``codebook_chunks > 1``) is one
        tensor referenced by each of them and is counted once.
        """
        total, seen = 0, set()
        for seg in self.segments:
            if not seg.packed:
                total += seg.nbytes
                continue
            for packed in (seg.pk, seg.pv):
                total += packed.nbytes  # type: ignore[attr-defined]
                for c in packed.centroids:  # type: ignore[attr-defined]
                    key = (c.device, c.data_ptr())
                    if key in seen:
                        total -= c.nbytes
                    seen.add(key)
        return total

    def packed_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.packed]

    # ---- storage ------------------------------------------------------------------
    def _advance(self, new: StreamState, heads: tuple[int, int]) -> None:
        """Evict, pack cold chunks and append the new chunk; restore counters on failure."""
        counters = (self.quantize_calls, self._codebook)
        try:
            segments = self._advanced_segments(new)
        except BaseException:
            self.quantize_calls, self._codebook = counters
            raise
        self.state, self.segments = new, segments

    def _write_current(self, key: torch.Tensor, value: torch.Tensor, h0: int, h1: int) -> None:
        current = self.segments[-1]  # the current chunk is always the last, dense segment
        current.k[:, :, h0:h1].copy_(key)  # type: ignore[index]
        current.v[:, :, h0:h1].copy_(value)  # type: ignore[index]

    def _advanced_segments(self, new: StreamState) -> list[Segment]:
        """The segment list after advancing to ``new``.

        ``self.segments`` and ``self.state`` are not touched; only the packing counters and
        the open codebook are, which the caller restores if this raises.
        """
        kept: list[Segment] = []
        for seg in self.segments:
            live = iv.intersect(seg.run, new.retained)
            if not live:
                continue
            if seg.packed or live == seg.run:
                kept.append(seg)
            else:
                kept.extend(seg.dense_slice(a, b) for a, b in live)
        new_chunk = self.segments[-1].last_chunk + 1 if self.segments else 0
        if self._codebook is not None and not any(
            seg.packed and seg.pk.centroids[0] is self._codebook[0][0] for seg in kept  # type: ignore[attr-defined]
        ):
            self._codebook = None  # every segment using it rolled out: start a fresh one
        if self.quant.enabled:
            kept = self._pack_cold(kept, new, current_chunk=new_chunk)
        spec = self.spec
        shape = (spec.batch_size, new.cur_n, spec.num_heads, spec.head_dim)
        kept.append(
            Segment(
                start=new.cur_start, end=new.global_end,  # type: ignore[arg-type]
                first_chunk=new_chunk, last_chunk=new_chunk,
                k=torch.zeros(shape, dtype=spec.dtype, device=spec.device),
                v=torch.zeros(shape, dtype=spec.dtype, device=spec.device),
            )
        )
        return kept

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

    def _pack_cold(self, segs: list[Segment], new: StreamState, current_chunk: int) -> list[Segment]:
        """Pack the cold dense segments of ``segs`` (see the module docstring's policy)."""
        keep, groups = self._policy(new, current_chunk)
        out: list[Segment] = []
        pending: list[Segment] = []  # adjacent packable dense segments of one group
        pending_group: frozenset[int] | None = None

        def chunks_of(seg: Segment) -> set[int]:
            return set(range(seg.first_chunk, seg.last_chunk + 1))

        def flush_dense() -> None:
            out.extend(pending)
            pending.clear()

        for seg in segs:
            chunks = chunks_of(seg)
            if seg.packed or chunks & keep:
                flush_dense()
                out.append(seg)
                continue
            group = next((g for g in groups if chunks & g), None)
            if pending and (group != pending_group or pending[-1].end != seg.start):
                flush_dense()
            pending.append(seg)
            pending_group = group
            have = set().union(*(chunks_of(p) for p in pending))
            if (group is not None and have >= group) or (
                group is None and len(have) >= self.quant.span_chunks
            ):
                out.append(self._pack(pending))
                pending.clear()
        flush_dense()
        return out

    def _pack(self, pieces: list[Segment]) -> Segment:
        from causalkv.caches.qvg.codec import quantize

        k = torch.cat([p.k for p in pieces], dim=1) if len(pieces) > 1 else pieces[0].k
        v = torch.cat([p.v for p in pieces], dim=1) if len(pieces) > 1 else pieces[0].v
        chunks = pieces[-1].last_chunk - pieces[0].first_chunk + 1
        book = self._codebook
        if book is not None and book[2] + chunks > self.quant.codebook_chunks:
            book = None
        pk = quantize(k.permute(0, 2, 1, 3), self.quant, seed=self.seed,  # type: ignore[union-attr]
                      codebooks=book[0] if book else None)
        pv = quantize(v.permute(0, 2, 1, 3), self.quant, seed=self.seed,  # type: ignore[union-attr]
                      codebooks=book[1] if book else None)
        self._codebook = (pk.centroids, pv.centroids, (book[2] if book else 0) + chunks)
        self.quantize_calls += 1
        if self.offload:
            pk, pv = _offload(pk), _offload(pv)
        return Segment(
            start=pieces[0].start, end=pieces[-1].end,
            first_chunk=pieces[0].first_chunk, last_chunk=pieces[-1].last_chunk,
            pk=pk, pv=pv,
        )

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
        if not seg.packed:
            parts = [(seg.k[:, a - seg.start : b - seg.start, h0:h1],  # type: ignore[index]
                      seg.v[:, a - seg.start : b - seg.start, h0:h1]) for a, b in runs]  # type: ignore[index]
        else:
            k_full, v_full = self._dequantize(seg, h0, h1)
            self.peak_transient_nbytes = max(
                self.peak_transient_nbytes, k_full.nbytes + v_full.nbytes
            )
            parts = [(k_full[:, a - seg.start : b - seg.start],
                      v_full[:, a - seg.start : b - seg.start]) for a, b in runs]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)

    def _dequantize(
        self, seg: Segment, h0: int, h1: int, out: KVSegment | None = None
    ) -> KVSegment:
        """K/V ``[B, len, h, D]`` of a packed segment, written into ``out`` when given."""
        from causalkv.caches.qvg.codec import dequantize

        res = []
        for i, packed in enumerate((seg.pk, seg.pv)):
            packed = _select_heads(_onload(packed, self.spec.torch_device), h0, h1)
            target = None if out is None else out[i].permute(0, 2, 1, 3)
            res.append(dequantize(packed, dtype=self.spec.dtype, out=target).permute(0, 2, 1, 3))
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

        all_dense = all(not seg.packed for seg, _ in pieces)
        k = v = None
        if all_dense:  # nothing to dequantize: build k/v now, exactly like the dense cache
            k, v = materialize()
        return self._make_view(
            visible, k=k, v=v, segments=segments, materialize=materialize,
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
            if seg.packed and runs == seg.run:  # dequantize straight into the window
                self._dequantize(seg, h0, h1, out=(k[:, at : at + m], v[:, at : at + m]))
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
        """Forget the stream (new request) and free every segment."""
        self.state = StreamState.from_spec(self.spec)
        self.segments = []
        self._codebook = None


def _select_heads(packed: object, h0: int, h1: int) -> object:
    if h0 == 0 and h1 == packed.shape[1]:  # type: ignore[attr-defined]
        return packed
    return packed.select_heads(h0, h1)  # type: ignore[attr-defined]


def _offload(packed: object) -> object:
    moved = packed.to("cpu")  # type: ignore[attr-defined]
    if packed.device.type == "cuda":  # type: ignore[attr-defined]
        moved = moved.pin_memory()  # type: ignore[attr-defined]
    return moved


def _onload(packed: object, device: torch.device) -> object:
    if packed.device == device or (  # type: ignore[attr-defined]
        packed.device.type == device.type and device.index is None  # type: ignore[attr-defined]
    ):
        return packed
    return packed.to(device, non_blocking=True)  # type: ignore[attr-defined]
