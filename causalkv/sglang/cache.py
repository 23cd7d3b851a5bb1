"""The cache sglang's stages get from the bridge: sglang's exact views, causalkv's QVG storage.

`SGLangQVGKVCache` subclasses sglang's ``QVGPackedCausalKVCache`` (so sglang's checks of the
class hold) and answers every attribute and method sglang's stages and attention layers use.
Where a token lands and what a view shows follow sglang's dense cache exactly: its slot
arithmetic is a fixed slot buffer that rolls, the core's cursor model
`causalkv.caches.rolling_slots.RollingSlots` (read from sglang 0.5.23's source, no sglang
import there); the K/V themselves live in causalkv's one QVG segment store
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

from dataclasses import fields
from typing import Any

import torch
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
    CausalSelfAttentionKVCache,
)
from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import (
    QVGPackedCausalKVCache as _SGLangQVGCache,
)

from causalkv.caches import intervals as iv
from causalkv.caches.passes import PassMarker
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import RECENT_NON_SINK
from causalkv.caches.qvg.segments import KVWrite, Segment
from causalkv.caches.qvg.store import SegmentStore
from causalkv.caches.rolling_slots import RollingSlots, SlotMap, SlotState
from causalkv.caches.spec import CacheWriteError
from causalkv.caches.spec import CausalAttentionKVView as CausalKVView

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
    if problem is None and quant.enabled and not dtype.is_floating_point:
        problem = (f"dtype {dtype} is not floating point; run the model in bfloat16, float16 or "
                   "float32, or turn quantization off")
    return problem


class SGLangQVGKVCache(_SGLangQVGCache):
    """sglang's causal KV cache contract (dense-cache semantics), causalkv QVG storage.

    Args (sglang's ``QVGPackedCausalKVCache`` keywords, passed on to it as ``dense``, plus the
    dense cache's extras):
        batch_size, cache_size, num_heads, head_dim, dtype, device: the buffer sglang would
            allocate, ``[batch_size, cache_size, num_heads, head_dim]``.
        global_end_index, local_end_index: ``[1]`` long tensors (sglang's cursors).
        use_int_indices: keep the ``*_int`` twins (sglang's host-side cursors).
        sink_tokens, global_sink_tokens, attention_window_size, allow_growth: as sglang's
            dense cache.
        quant_args: sglang's or causalkv's QVG settings (``bits=None``: nothing is packed).
        marker: the stage's `causalkv.caches.passes.PassMarker` (shared by every block of the
            stage, CFG sets included): the writes of its denoising passes are probes (nothing
            stored), its context pass commits the chunk to its tier at once and drops what
            the next advance drops; the store reports to its ledger. None: every write is
            unmarked (sglang's dense semantics).
    """

    def __init__(
        self,
        *,
        quant_args: object,
        global_sink_tokens: int = 0,
        allow_growth: bool = False,
        marker: PassMarker | None = None,
        **dense: Any,
    ) -> None:
        quant = causalkv_quant_args(quant_args)
        reason = can_serve(quant, dense["head_dim"], dense["dtype"])
        if reason is not None:
            raise ValueError(f"SGLangQVGKVCache cannot hold this cache: {reason}")
        dense["device"] = torch.device(dense["device"])
        super().__init__(quant_args=quant_args, **dense)
        self.quant = quant
        self.global_sink_tokens = global_sink_tokens
        self.allow_growth = allow_growth
        self.reset_pinned_sink()
        self._slots = SlotMap()
        self._heads: tuple[int, int] | None = None  # the head range written since the reset
        #: the K/V by global position (causalkv's segment store, sglang's packing rule; the
        #: centroids as sglang's flags give them, capped at a chunk's tokens by the codec)
        self.store = SegmentStore(
            batch_size=self.batch_size, num_heads=self.num_heads, head_dim=self.head_dim,
            dtype=self.dtype, device=self.device, quant=quant, policy=RECENT_NON_SINK,
            min_tokens_per_centroid=None, ledger=None if marker is None else marker.ledger,
        )
        self.marker = marker

    # ---- sglang's dense-cache surface ----------------------------------------------------
    # the cursors' int twins and the pin are sglang's dense cache's own code: the pin is the
    # last ``current_num_tokens`` slots' first ``sink_tokens`` slots (`RollingSlots.pinned_to`);
    # without a pin the cursors are not read (its int twins stay unset)
    _read_indices = CausalSelfAttentionKVCache._read_indices
    _write_indices = CausalSelfAttentionKVCache._write_indices
    pin_current_chunk = CausalSelfAttentionKVCache.pin_current_chunk
    reset_pinned_sink = CausalSelfAttentionKVCache.reset_pinned_sink
    has_pinned = CausalSelfAttentionKVCache._has_pinned_sink
    # can_direct_current_attention and num_cache_heads: sglang's QVG cache's (the dense rule)

    def _cursor(self) -> RollingSlots:
        """sglang's int fields and the slot map as the slot buffer's cursor."""
        state = SlotState(**{f.name: getattr(self, f.name) for f in fields(SlotState)})
        return RollingSlots(state, self._slots, *self._read_indices())

    def reset_indices(self) -> None:
        """Forget the stream (sglang's semantics) and free every stored chunk."""
        CausalSelfAttentionKVCache.reset_indices(self)  # sglang's: the cursors to 0, no pin
        self._slots = SlotMap()
        self._heads = None
        self.store.reset()

    @property
    def quantize_calls(self) -> int:
        """Codec calls so far (K and V together; a chunk is packed at most once)."""
        return self.store.quantize_calls

    def resident_nbytes(self) -> int:
        """Bytes of the stored K/V: dense chunks plus packed chunks' stored bytes."""
        return self.store.resident_nbytes()

    def packed_chunks(self) -> int:
        """Chunks stored packed now."""
        return sum(len(seg.chunks) for seg in self.store.packed_segments())

    # ---- the write ----------------------------------------------------------------------
    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and lists; one break")
    def update_and_get_attention_kv(self, **write: Any) -> CausalAttentionKVView:
        """Write ``key``/``value`` ``[B, n, h, D]`` and return sglang's view of the cache.

        Keywords (sglang's): ``key``, ``value``, ``current_chunk_start``, ``cache_head_start``
        (None), ``recent_window_tokens`` (None), ``debug_name`` (`_update`'s signature).

        Planned, then committed: raises (leaving the cache unchanged) ValueError as sglang
        for a missing ``cache_head_start`` or a negative ``recent_window_tokens``;
        RuntimeError as sglang for a write range outside the buffer; CacheWriteError for a
        write sglang would serve by overwriting slots of other positions (it corrupts them),
        or a head range other than the one written since the last reset; CacheProtocolError
        (a UsageError) for a view that needs positions a commit dropped because it was told
        a different next chunk or pin (`causalkv.caches.passes.CommitPass`).

        Marks come from the stage's `marker`: a probe returns the same view and stores
        nothing (the cursors stay; the chunk's rows are the call's own K/V; with
        ``allow_growth`` the size grows as sglang's buffer does for it); a commit
        stores the chunk, moves it to its tier and drops what the next advance drops.

        The view's ``k``/``v`` ``[B, visible, h, D]`` are one buffer the visible slots are
        read into (packed chunks decoded into it), or views of one dense chunk when the view
        is one run of it.

        Runs outside torch.compile's graphs (one graph break at sglang's call site): every
        decision here is integer bookkeeping that would only specialize and recompile.
        """
        cursors, pieces, heads, layout = self._update(**write)
        k, v = self.store.gather(pieces, *heads, layout)
        return CausalAttentionKVView(k=k, v=v, **cursors)

    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and lists; one break")
    def update_and_get_segment_view(self, **write: Any) -> SegmentView:
        """The write of `update_and_get_attention_kv` (same arguments, errors and effects on the
        cache), returning the same visible tokens as a lazy causalkv view for
        `causalkv.caches.attend`, never the window as one buffer: the store's view
        (`SegmentStore.view`, the one view builder causalkv's packed cache uses too).

        The view's pieces are exactly the rows sglang's view shows, in its order: per visible
        slot range, the runs of global positions the slots hold (a run crossing stored
        segments is split there), and zeros ``[B, s, h, D]`` for slots sglang's buffer shows
        but nothing was written to; heads are the write's head slice; a probe's chunk rows are
        its own K/V. ``iter_segments()`` yields them dense (a packed run decoded, one at a
        time); ``iter_stored_segments()`` yields dense runs as views and packed runs as the
        codec's `PackedSegment` head/token slices (views, nothing decoded). ``view.k``/``view.v``
        would build the window buffer (`update_and_get_attention_kv`'s); they are built
        already only when that costs nothing (the view is one run of one dense chunk: views
        of it). ``position_ranges`` lists the pieces' position runs in view order (zero pieces
        have no position); ``rows`` counts every row, zeros included (sglang's ``k.shape[1]``).
        """
        cursors, pieces, heads, layout = self._update(**write)
        return self.store.view(pieces, *heads, layout, make=lambda ranges, **kw: SegmentView(
            rows=sum(n for _, n in pieces), position_ranges=ranges, **cursors, **kw))

    def _update(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str = "causal KV cache",
    ) -> tuple[dict[str, int], list[tuple[int | None, int]], tuple[int, int], list[Segment]]:
        """Plan and commit one write (see `update_and_get_attention_kv`); what the view shows:
        sglang's view cursors after the write, the view's pieces (`SegmentStore.gather`'s
        ``(position or None, length)``), its heads, and the store's segments it reads (a
        probe's: its own K/V too)."""
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
        start, cur = current_chunk_start, self._cursor()
        m = self.marker
        probe, commit = (m.probe, m.commit) if m is not None else (False, None)
        if commit is not None and start + n < cur.global_end:
            commit = None  # a commit is the newest chunk's context pass: an older one is unmarked
        plan = cur.plan(start, n, debug_name)
        for a, b in cur.rolled(plan).slots_of(start, start + n):  # its positions in other slots
            if a < plan.local_start or b > plan.local_end:
                raise CacheWriteError(
                    f"{debug_name}: positions [{start}, {start + n}) land in slots "
                    f"[{plan.local_start}, {plan.local_end}) while slots [{a}, {b}) still hold "
                    f"some of them; sglang's dense cache would leave two versions (not served)"
                )
        after = cur.written(plan, start)
        pieces = after.pieces(recent_window_tokens)
        store = self.store
        shown = iv.normalize((p, p + ln) for p, ln in pieces if p is not None)
        if probe:  # the view the write would return, nothing stored: the chunk's own K/V
            layout = store.with_own(start, key, value, heads[0])
            store.check_view(layout, shown, debug_name)
        else:
            write = KVWrite(start, start + n, heads, key, value)
            # a rewrite in place where it can
            stored = store.plan(write, after.holding(), advance=start + n > cur.global_end)
            if commit is not None:
                # the context pass: the chunk moves to its tier, planned with the write; the
                # store keeps what sglang's buffer keeps after the next advance the commit
                # names (the pin included). A next chunk that needs more is refused by
                # `check_view`.
                stored = store.plan_commit(stored, after.after_context(commit.pin, commit.next_tokens))
            # the view, checked before anything changes: every position it shows is held
            layout = stored.view_segments or stored.segments  # what this call's view reads
            store.check_view(layout, shown, debug_name)
            # the commit (nothing above changed anything, nothing below can fail)
            store.commit(stored)
            if stored.view_segments is None:
                layout = store.segments  # the copies the store owns
            self.pinned_start = after.state.pinned_start
            self._heads = heads
            self._slots = after.slots
            self._write_indices(global_end_index=after.global_end, local_end_index=after.local_end)
        # sglang's buffer grows for every write it serves, a probe's too (it hears no marks),
        # and keeps that size through reset_indices: so does this cache, storing nothing more
        self.cache_size = after.state.cache_size
        self.attention_window_size = after.state.attention_window_size
        cursors = {"local_start_index": plan.local_start, "local_end_index": plan.local_end,
                   "visible_local_end": plan.updated_local_end,
                   "visible_global_end": plan.updated_global_end}
        return cursors, pieces, heads, layout

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

