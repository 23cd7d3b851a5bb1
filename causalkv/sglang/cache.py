"""The cache sglang's stages get from the bridge: sglang's exact views, causalkv's QVG storage.

`SGLangQVGKVCache` subclasses sglang's ``QVGPackedCausalKVCache`` (so sglang's checks of the
class hold) and answers every attribute and method sglang's stages and attention layers use.
Where a token lands and what a view shows follow sglang's dense cache exactly
(`causalkv.sglang.slots`); the K/V themselves live in causalkv's one QVG segment store
(`causalkv.caches.qvg.store.SegmentStore`, the same store causalkv's own packed cache uses),
completed chunks packed with causalkv's codec under sglang's packing rule (the policy object
`causalkv.caches.qvg.policy.RECENT_NON_SINK`). With quantization off every view equals sglang's dense
cache bit for bit.

`SGLangQVGKVCache.update_and_get_segment_view` makes the same write and returns the same
visible rows as causalkv's lazy `causalkv.caches.CausalAttentionKVView`, which
`causalkv.caches.attend` consumes piece by piece (the fused-attention route,
`causalkv.sglang.attention`): the window is never one buffer.

This module imports sglang; only the bridge's hooks import it, at hook-application time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
)
from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import (
    QVGPackedCausalKVCache as _SGLangQVGCache,
)

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals, normalize
from causalkv.caches.qvg.chunk_scratch import ChunkScratch
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import RECENT_NON_SINK
from causalkv.caches.qvg.store import KVWrite, Segment, SegmentStore
from causalkv.caches.spec import CacheProtocolError, CacheWriteError, KVSegment, StoredSegment
from causalkv.caches.spec import CausalAttentionKVView as CausalKVView
from causalkv.sglang.slots import SlotMap, SlotState, WritePlan, plan_write, visible_slots

__all__ = ["SGLangQVGKVCache", "SegmentView", "causalkv_quant_args", "can_serve"]


def causalkv_quant_args(sglang_args: object, recent_tier: str = "bf16") -> QVGKVQuantArgs:
    """causalkv's `QVGKVQuantArgs` from sglang's (the field names are shared); ``recent_tier``
    is causalkv's own setting (sglang has no such field: the bridge reads it from
    ``CAUSALKV_SGLANG_RECENT_TIER``)."""
    if isinstance(sglang_args, QVGKVQuantArgs):
        return sglang_args
    names = ("centroids", "block_size", "stages", "kmeans_iters", "asymmetric",
             "keep_recent_chunks", "sink", "sink_keep_chunks")
    bits = sglang_args.bits  # sglang's selector: 2, 4 or None -> int2, int4, off
    return QVGKVQuantArgs(
        codec=None if bits is None else f"int{bits}",
        **{n: getattr(sglang_args, n) for n in names}, recent_tier=recent_tier,
    ).validate()


def can_serve(quant: QVGKVQuantArgs, head_dim: int, dtype: torch.dtype) -> str | None:
    """None when the adapter can hold this cache, else the reason it cannot: the codec's own
    layout rule (`QVGKVQuantArgs.layout_problem`: PRQ's block size divides ``head_dim``; fp8
    and nvfp4 have their own), or a dtype that is not floating point."""
    problem = quant.layout_problem(head_dim)
    if problem is not None:
        return problem
    if quant.enabled and not dtype.is_floating_point:
        return (f"dtype {dtype} is not floating point; run the model in bfloat16, float16 or "
                "float32, or turn quantization off")
    return None


class SGLangQVGKVCache(_SGLangQVGCache):
    """sglang's causal KV cache contract (dense-cache semantics), causalkv QVG storage.

    Args (sglang's ``QVGPackedCausalKVCache`` keywords, plus the dense cache's extras):
        batch_size, cache_size, num_heads, head_dim, dtype, device: the buffer sglang would
            allocate, ``[batch_size, cache_size, num_heads, head_dim]``.
        global_end_index, local_end_index: ``[1]`` long tensors (sglang's cursors).
        use_int_indices: keep the ``*_int`` twins (sglang's host-side cursors).
        sink_tokens, global_sink_tokens, attention_window_size, allow_growth: as sglang's
            dense cache.
        quant_args: sglang's or causalkv's QVG settings (``bits=None``: nothing is packed).
        scratch: the stage's `ChunkScratch` (shared by every block of the stage, CFG sets
            included): the chunk being generated lives there, once, instead of in every
            block, and the writes made inside ``scratch.context_pass()`` move the chunk to its
            tier at once. None keeps it in each block (sglang's layout).
    """

    def __init__(
        self,
        *,
        batch_size: int,
        cache_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        global_end_index: torch.Tensor,
        local_end_index: torch.Tensor,
        use_int_indices: bool = False,
        sink_tokens: int = 0,
        attention_window_size: int | None = None,
        quant_args: object,
        global_sink_tokens: int = 0,
        allow_growth: bool = False,
        scratch: ChunkScratch | None = None,
    ) -> None:
        quant = causalkv_quant_args(quant_args)
        reason = can_serve(quant, head_dim, dtype)
        if reason is not None:
            raise ValueError(f"SGLangQVGKVCache cannot hold this cache: {reason}")
        super().__init__(
            batch_size=batch_size, cache_size=cache_size, num_heads=num_heads,
            head_dim=head_dim, dtype=dtype, device=torch.device(device),
            global_end_index=global_end_index, local_end_index=local_end_index,
            use_int_indices=use_int_indices, sink_tokens=sink_tokens,
            attention_window_size=attention_window_size, quant_args=quant_args,
        )
        self.quant = quant
        self.global_sink_tokens = global_sink_tokens
        self.allow_growth = allow_growth
        self.pinned_start = -1
        self.pinned_len = 0
        self._slots = SlotMap()
        self._heads: tuple[int, int] | None = None  # the head range written since the reset
        #: the K/V by global position (causalkv's segment store, sglang's packing rule; the
        #: centroids as sglang's flags give them, capped at a chunk's tokens by the codec)
        self.store = SegmentStore(
            batch_size=batch_size, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
            device=device, quant=quant, policy=RECENT_NON_SINK, min_tokens_per_centroid=None,
            scratch=scratch,
        )
        self.scratch = scratch

    # ---- sglang's dense-cache surface ----------------------------------------------------
    def _state(self) -> SlotState:
        return SlotState(
            cache_size=self.cache_size, sink_tokens=self.sink_tokens,
            attention_window_size=self.attention_window_size, allow_growth=self.allow_growth,
            global_sink_tokens=self.global_sink_tokens, pinned_start=self.pinned_start,
            pinned_len=self.pinned_len,
        )

    def _read_indices(self) -> tuple[int, int]:
        g, loc = self.global_end_index_int, self.local_end_index_int
        if g is None or loc is None:  # sglang reads the tensors once, then keeps int twins
            g, loc = int(self.global_end_index.item()), int(self.local_end_index.item())
            self.global_end_index_int, self.local_end_index_int = g, loc
        return g, loc

    def _write_indices(self, *, global_end_index: int, local_end_index: int) -> None:
        if (self.global_end_index_int, self.local_end_index_int) == (global_end_index, local_end_index):
            return
        if self.global_end_index_int is not None:
            self.global_end_index_int = global_end_index
        if self.local_end_index_int is not None:
            self.local_end_index_int = local_end_index
        self.global_end_index.fill_(global_end_index)
        self.local_end_index.fill_(local_end_index)

    def reset_indices(self) -> None:
        """Forget the stream (sglang's semantics) and free every stored chunk."""
        self.global_end_index.zero_()
        self.local_end_index.zero_()
        if self.global_end_index_int is not None:
            self.global_end_index_int = 0
        if self.local_end_index_int is not None:
            self.local_end_index_int = 0
        self.reset_pinned_sink()
        self._slots = SlotMap()
        self._heads = None
        self.store.reset()

    def reset_pinned_sink(self) -> None:
        self.pinned_start = -1
        self.pinned_len = 0

    def pin_current_chunk(self, current_num_tokens: int) -> None:
        """sglang's pin: the last ``current_num_tokens`` slots' first ``sink_tokens`` slots."""
        if self.sink_tokens <= 0 or current_num_tokens <= 0:
            self.reset_pinned_sink()
            return
        _, local_end = self._read_indices()
        self.pinned_start = local_end - current_num_tokens
        self.pinned_len = min(self.sink_tokens, current_num_tokens)

    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        """sglang's static rule; its attention then skips the write, which is safe only here."""
        return (
            self.sink_tokens == 0
            and self.cache_size == num_new_tokens
            and self.attention_window_size == num_new_tokens
        )

    @property
    def num_cache_heads(self) -> int:
        return self.num_heads

    @property
    def quantize_calls(self) -> int:
        """Codec calls so far (K and V together; a chunk is packed at most once)."""
        return self.store.quantize_calls

    def resident_nbytes(self) -> int:
        """Bytes of the stored K/V: dense chunks plus packed chunks' stored bytes (the stage's
        `ChunkScratch`, when given, is counted once by the scratch, not here)."""
        return self.store.resident_nbytes()

    def packed_chunks(self) -> int:
        """Chunks stored packed now."""
        return sum(len(seg.chunks) for seg in self.store.packed_segments())

    # ---- the write ----------------------------------------------------------------------
    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and lists; one break")
    def update_and_get_attention_kv(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str = "causal KV cache",
    ) -> CausalAttentionKVView:
        """Write ``key``/``value`` ``[B, n, h, D]`` and return sglang's view of the cache.

        Planned, then committed: raises (leaving the cache unchanged) ValueError as sglang
        for a missing ``cache_head_start`` or a negative ``recent_window_tokens``;
        RuntimeError as sglang for a write range outside the buffer; CacheWriteError for a
        write sglang would serve by overwriting slots of other positions (it corrupts them),
        or a head range other than the one written since the last reset; CacheProtocolError
        (a UsageError) once the stage's scratch is shared, for a call its protocol does not
        allow (a context pass of a chunk other than the newest, a chunk another block has
        overwritten in the scratch, positions the last context pass dropped).

        The view's ``k``/``v`` ``[B, visible, h, D]`` are one buffer the visible slots are
        read into (packed chunks decoded into it), or views of one dense chunk when the view
        is one run of it.

        Runs outside torch.compile's graphs (one graph break at sglang's call site): every
        decision here is integer bookkeeping that would only specialize and recompile.
        """
        w = self._update(key, value, current_chunk_start, cache_head_start,
                         recent_window_tokens, debug_name)
        k, v = self.store.gather(w.pieces, *w.heads, w.layout)
        return CausalAttentionKVView(
            k=k, v=v, local_start_index=w.local_start, local_end_index=w.local_end,
            visible_local_end=w.visible_local_end, visible_global_end=w.visible_global_end,
        )

    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and lists; one break")
    def update_and_get_segment_view(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str = "causal KV cache",
    ) -> SegmentView:
        """The write of `update_and_get_attention_kv` (same arguments, errors and effects on the
        cache), returning the same visible tokens as a lazy causalkv view for
        `causalkv.caches.attend`, never the window as one buffer.

        The view's pieces are exactly the rows sglang's view shows, in its order: per visible
        slot range, the runs of global positions the slots hold (a run crossing stored
        segments is split there), and zeros ``[B, s, h, D]`` for slots sglang's buffer shows
        but nothing was written to; heads are the write's head slice. ``iter_segments()``
        yields them dense (a packed run decoded, one at a time); ``iter_stored_segments()``
        yields dense runs as views of the store and packed runs as the codec's
        `PackedSegment` head/token slices (views, nothing decoded). ``view.k``/``view.v``
        would build the window buffer (`update_and_get_attention_kv`'s); they are built
        already only when that costs nothing (the view is one run of one dense chunk: views
        of it). ``position_ranges`` lists the pieces' position runs in view order (zero pieces
        have no position); ``rows`` counts every row, zeros included (sglang's ``k.shape[1]``).
        """
        w = self._update(key, value, current_chunk_start, cache_head_start,
                         recent_window_tokens, debug_name)
        store, (h0, h1), pieces = self.store, w.heads, w.pieces
        layout = w.layout  # a commit replaces this list, never mutates it
        located = store.locate_pieces(pieces, layout)

        def segments() -> Iterator[KVSegment]:
            for seg, a, b in located:
                yield store.zeros(b - a, h0, h1) if seg is None else store.decode(seg, ((a, b),), h0, h1)

        def stored() -> Iterator[StoredSegment]:
            return store.stored_segments([(seg, ((a, b),)) for seg, a, b in located], h0, h1)

        def materialize() -> KVSegment:
            return store.gather(pieces, h0, h1, layout)

        k = v = None
        if len(located) == 1 and located[0][0] is not None and not located[0][0].packed:
            k, v = materialize()  # views of the one dense chunk: free
        return SegmentView(
            rows=sum(n for _, n in pieces),
            position_ranges=tuple((a, b) for seg, a, b in located if seg is not None),
            local_start_index=w.local_start, local_end_index=w.local_end,
            visible_local_end=w.visible_local_end, visible_global_end=w.visible_global_end,
            k=k, v=v, segments=segments, materialize=materialize, stored=stored,
            device=store.device,
        )

    def _update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None,
        recent_window_tokens: int | None,
        debug_name: str,
    ) -> _Written:
        """Plan and commit one write (see `update_and_get_attention_kv`); what the view shows."""
        n, h_in = key.shape[1], key.shape[2]
        if h_in != self.num_heads:
            if cache_head_start is None:
                raise ValueError(
                    f"{debug_name} requires cache_head_start when cache heads "
                    f"({self.num_heads}) differ from input heads ({h_in})."
                )
            heads = (cache_head_start, cache_head_start + h_in)
        else:
            heads = (0, self.num_heads)  # sglang ignores cache_head_start for all heads
        if recent_window_tokens is not None and recent_window_tokens < 0:
            raise ValueError("recent_window_tokens must be non-negative or None")
        if self._heads is not None and heads != self._heads:
            raise CacheWriteError(
                f"{debug_name}: heads {list(heads)} differ from the heads {list(self._heads)} "
                f"written since the last reset; one cache serves one head range"
            )
        start = current_chunk_start
        global_end, local_end_prev = self._read_indices()
        if self.scratch is not None and self.scratch.committing and start + n < global_end:
            raise CacheProtocolError(
                f"{debug_name}: a context pass writes the chunk just generated, which ends at "
                f"{global_end}; the write of [{start}, {start + n}) ends before it (nothing was "
                "changed): write the newest chunk inside ChunkScratch.context_pass(), or leave "
                "the scratch unshared (ChunkScratch(shared=False))"
            )
        st = self._state()
        plan = plan_write(st, global_end, local_end_prev, start, n, debug_name)
        slots = SlotMap(list(self._slots.runs))
        if plan.roll is not None:
            slots.copy(*plan.roll)
        self._check_consistent(slots, plan, start, n, debug_name)
        slots.write(plan.local_start, plan.local_end, start)
        pinned_start = self.pinned_start
        if plan.evicted and self.has_pinned() and pinned_start >= plan.sink:
            pinned_start -= plan.evicted
        write = KVWrite(start, start + n, heads, key, value)
        held = tuple(slots.positions())
        advanced = start + n > global_end
        store = self.store
        if held == store.held() and store.covers_dense(start, start + n):
            stored = store.plan_write(write)  # the layout stays: one in-place copy
        else:
            stored = store.plan(
                held=held, write=write, advance=advanced, sink_end=self.sink_tokens,
                pinned=self._pinned_positions(slots, pinned_start, self.pinned_len, plan.grow_to),
            )
        if self.scratch is not None and self.scratch.committing:
            # a context write: the chunk then moves to its tier, planned with the write
            stored = store.plan_commit(
                stored, **self._after_context(slots, plan, pinned_start, start, n))
        # the view, checked before anything changes: every position it shows is held
        size = plan.grow_to
        window = size if self.attention_window_size == self.cache_size else self.attention_window_size
        after = SlotState(
            cache_size=size, sink_tokens=self.sink_tokens, attention_window_size=window,
            allow_growth=self.allow_growth, global_sink_tokens=self.global_sink_tokens,
            pinned_start=pinned_start, pinned_len=self.pinned_len,
        )
        pieces = self._pieces(
            slots, size,
            visible_slots(after, plan.local_start, plan.updated_local_end, recent_window_tokens),
        )
        layout = stored.view_segments or stored.segments  # what this call's view reads
        shown = normalize((p, p + ln) for p, ln in pieces if p is not None)
        store.check_view(layout, shown, *heads, debug_name, stored)

        # the commit (nothing above changed anything, nothing below can fail)
        store.commit(stored)
        if stored.view_segments is None:
            layout = store.segments  # the chunk as bound in the scratch
        self.cache_size, self.attention_window_size = size, window
        self.pinned_start = pinned_start
        self._heads = heads
        self._slots = slots
        self._write_indices(
            global_end_index=plan.updated_global_end, local_end_index=plan.updated_local_end
        )
        return _Written(
            pieces=pieces, heads=heads, local_start=plan.local_start,
            local_end=plan.local_end, visible_local_end=plan.updated_local_end,
            visible_global_end=plan.updated_global_end, layout=layout,
        )

    def _after_context(
        self, slots: SlotMap, plan: WritePlan, pinned_start: int, start: int, n: int
    ) -> dict[str, Any]:
        """`SegmentStore.plan_commit`'s arguments once the chunk ``[start, start + n)`` is
        context: the positions sglang's buffer keeps after the next advance by a chunk of
        the same size (nothing else is read again), the sink, and the pinned shot sink (the
        one announced for this chunk by ``scratch.context_pass(pin=True)``, else the
        current one). A next chunk smaller than this one would need positions dropped here:
        the store then refuses the read (`UsageError`) instead of showing other values."""
        assert self.scratch is not None
        pin_len = self.pinned_len
        if self.scratch.pin:  # sglang's pin_current_chunk(n), made right after this pass
            if self.sink_tokens > 0 and n > 0:
                pinned_start, pin_len = plan.updated_local_end - n, min(self.sink_tokens, n)
            else:
                pinned_start, pin_len = -1, 0
        size = plan.grow_to
        pinned = self._pinned_positions(slots, pinned_start, pin_len, size)
        held = tuple(slots.positions())
        ahead = SlotState(
            cache_size=size, sink_tokens=self.sink_tokens,
            attention_window_size=(size if self.attention_window_size == self.cache_size
                                   else self.attention_window_size),
            allow_growth=self.allow_growth, global_sink_tokens=self.global_sink_tokens,
            pinned_start=pinned_start, pinned_len=pin_len,
        )
        end = plan.updated_global_end
        try:
            nxt = plan_write(ahead, end, plan.updated_local_end, end, n, "next chunk")
        except RuntimeError:
            nxt = None  # sglang would refuse that advance: keep everything
        if nxt is not None and nxt.grow_to == size:
            later = SlotMap(list(slots.runs))
            if nxt.roll is not None:
                later.copy(*nxt.roll)
            later.write(nxt.local_start, nxt.local_end, end)
            held = iv.subtract(normalize(later.positions()), ((end, end + n),))
        return {"held": held, "sink_end": self.sink_tokens, "pinned": pinned}

    def has_pinned(self) -> bool:
        return self.pinned_start >= 0 and self.pinned_len > 0

    def _check_consistent(
        self, slots: SlotMap, plan: WritePlan, start: int, n: int, debug_name: str
    ) -> None:
        """Refuse a write whose positions also sit in slots it does not overwrite."""
        for a, b in slots.slots_of(start, start + n):
            if a < plan.local_start or b > plan.local_end:
                raise CacheWriteError(
                    f"{debug_name}: positions [{start}, {start + n}) land in slots "
                    f"[{plan.local_start}, {plan.local_end}) while slots [{a}, {b}) still hold "
                    f"some of them; sglang's dense cache would leave two versions (not served)"
                )

    # ---- positions -> the store ------------------------------------------------------------
    def _pinned_positions(
        self, slots: SlotMap, pinned_start: int, pinned_len: int, size: int
    ) -> Intervals:
        """Global positions held by the pinned slots (the LongLive 2.0 shot sink): with
        ``sink=False`` the store keeps their chunks dense, as causalkv's own cache does."""
        if not (pinned_start >= 0 and pinned_len > 0):
            return ()
        a, b = max(0, pinned_start), min(size, pinned_start + pinned_len)
        if b <= a:
            return ()
        return normalize((p, p + ln) for ln, p in slots.read(a, b) if p is not None)

    @staticmethod
    def _pieces(slots: SlotMap, size: int, view_slots) -> list[tuple[int | None, int]]:
        """The view's rows as ``(position or None, length)`` pieces: the slot ranges of
        ``view_slots`` (clipped to ``size`` slots) -> the positions ``slots`` hold there."""
        pieces: list[tuple[int | None, int]] = []
        for a, b in view_slots:
            a, b = max(0, min(a, size)), max(0, min(b, size))
            if b > a:
                pieces.extend((p, ln) for ln, p in slots.read(a, b))
        return pieces


class SegmentView(CausalKVView):
    """causalkv's lazy view (`causalkv.caches.CausalAttentionKVView`) of what sglang's view of
    the bridge cache shows; ``rows``: the rows sglang's view has, zero rows included."""

    __slots__ = ("rows",)

    def __init__(self, *, rows: int, **kw: Any) -> None:
        self.rows = rows
        super().__init__(**kw)

    @property
    def num_rows(self) -> int:
        return self.rows


@dataclass(frozen=True)
class _Written:
    """What one committed write makes visible: the view's pieces (`SegmentStore.gather`'s
    ``(position or None, length)``), its heads and sglang's view cursors."""

    pieces: list[tuple[int | None, int]]
    heads: tuple[int, int]
    local_start: int
    local_end: int
    visible_local_end: int
    visible_global_end: int
    layout: list[Segment]  # the store's segments this view reads
