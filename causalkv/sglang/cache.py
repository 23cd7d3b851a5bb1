"""The cache sglang's stages get from the bridge: sglang's exact views, causalkv's QVG storage.

`SGLangQVGKVCache` subclasses sglang's ``QVGPackedCausalKVCache`` (so sglang's checks of the
class hold) and answers every attribute and method sglang's stages and attention layers use.
Where a token lands and what a view shows follow sglang's dense cache exactly
(`causalkv.sglang.slots`); the K/V themselves are stored by global position in chunk segments,
completed chunks packed with causalkv's QVG codec under sglang's packing rule
(`causalkv.sglang.policy`). With quantization off every view equals sglang's dense cache
bit for bit.

This module imports sglang; only the bridge's hooks import it, at hook-application time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
)
from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import (
    QVGPackedCausalKVCache as _SGLangQVGCache,
)

from causalkv.caches.qvg.args import QVGKVQuantArgs
from causalkv.caches.qvg.codec import PackedSegment, dequantize, quantize
from causalkv.caches.spec import CacheWriteError
from causalkv.sglang.policy import sglang_dense_chunks
from causalkv.sglang.slots import SlotMap, SlotState, WritePlan, plan_write, visible_slots

__all__ = ["SGLangQVGKVCache", "causalkv_quant_args", "can_serve"]


def causalkv_quant_args(sglang_args: object) -> QVGKVQuantArgs:
    """causalkv's `QVGKVQuantArgs` from sglang's (the field names are shared)."""
    names = ("bits", "centroids", "block_size", "stages", "kmeans_iters", "asymmetric",
             "keep_recent_chunks", "sink", "sink_keep_chunks")
    return QVGKVQuantArgs(**{n: getattr(sglang_args, n) for n in names}).validate()


def can_serve(quant: QVGKVQuantArgs, head_dim: int, dtype: torch.dtype) -> str | None:
    """None when the adapter can hold this cache, else the reason it cannot."""
    if quant.enabled and head_dim % quant.block_size != 0:
        return f"block_size={quant.block_size} does not divide head_dim={head_dim}"
    if quant.enabled and not dtype.is_floating_point:
        return f"dtype {dtype} is not floating point"
    return None


@dataclass
class _Chunk:
    """Positions ``[g0, g1)``: dense ``k``/``v`` ``[B, len, H, D]`` or packed ``pk``/``pv``."""

    g0: int
    g1: int
    idx: int
    is_sink: bool
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pk: PackedSegment | None = None
    pv: PackedSegment | None = None

    @property
    def packed(self) -> bool:
        return self.pk is not None

    def nbytes(self) -> int:
        if self.packed:
            return int(self.pk.nbytes + self.pv.nbytes)  # type: ignore[union-attr]
        return self.k.nbytes + self.v.nbytes  # type: ignore[union-attr]


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
    ) -> None:
        quant = quant_args if isinstance(quant_args, QVGKVQuantArgs) else causalkv_quant_args(quant_args)
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
        self.quantize_calls = 0
        self._slots = SlotMap()
        self._chunks: list[_Chunk] = []
        self._heads: tuple[int, int] | None = None  # the head range written since the reset
        self._next_chunk = 0
        self._current_chunk: int | None = None
        self._chunk_tokens = 0

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
        self._chunks = []
        self._heads = None
        self._current_chunk = None
        self._chunk_tokens = 0

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

    def resident_nbytes(self) -> int:
        """Bytes of the stored K/V: dense chunks plus packed chunks' stored bytes."""
        return sum(c.nbytes() for c in self._chunks)

    def packed_chunks(self) -> int:
        return sum(c.packed for c in self._chunks)

    # ---- the write ----------------------------------------------------------------------
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

        Raises (leaving the cache unchanged): ValueError as sglang for a missing
        ``cache_head_start`` or a negative ``recent_window_tokens``; RuntimeError as sglang
        for a write range outside the buffer; CacheWriteError for a write sglang would serve
        by overwriting slots of other positions (it corrupts them), or a head range other
        than the one written since the last reset.
        """
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
        st = self._state()
        plan = plan_write(st, global_end, local_end_prev, start, n, debug_name)
        slots = SlotMap(list(self._slots.runs))
        if plan.roll is not None:
            slots.copy(*plan.roll)
        self._check_consistent(slots, plan, start, n, debug_name)
        slots.write(plan.local_start, plan.local_end, start)

        # commit (nothing above changed the cache)
        if plan.grow_to != self.cache_size:
            if self.attention_window_size == self.cache_size:
                self.attention_window_size = plan.grow_to
            self.cache_size = plan.grow_to
        if plan.evicted and self.has_pinned() and self.pinned_start >= plan.sink:
            self.pinned_start -= plan.evicted
        self._heads = heads
        self._slots = slots
        advanced = start + n > global_end
        self._store(key, value, start, global_end, heads)
        self._evict()
        if advanced and self.quant.enabled:
            self._pack()
        view_slots = visible_slots(
            self._state(), plan.local_start, plan.updated_local_end, recent_window_tokens
        )
        k, v = self._gather(view_slots, heads)
        self._write_indices(
            global_end_index=plan.updated_global_end, local_end_index=plan.updated_local_end
        )
        return CausalAttentionKVView(
            k=k, v=v, local_start_index=plan.local_start, local_end_index=plan.local_end,
            visible_local_end=plan.updated_local_end, visible_global_end=plan.updated_global_end,
        )

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

    # ---- storage by global position -----------------------------------------------------
    def _store(self, key, value, start: int, global_end: int, heads: tuple[int, int]) -> None:
        h0, h1 = heads
        end = start + key.shape[1]
        at = start
        for c in self._chunks:
            lo, hi = max(at, c.g0), min(end, c.g1)
            if lo >= hi:
                continue
            if lo > at:
                self._new_chunk(at, lo, key, value, start, heads, advance=False)
            if c.packed:
                self._unpack(c)
            c.k[:, lo - c.g0 : hi - c.g0, h0:h1].copy_(key[:, lo - start : hi - start])  # type: ignore[index]
            c.v[:, lo - c.g0 : hi - c.g0, h0:h1].copy_(value[:, lo - start : hi - start])  # type: ignore[index]
            at = hi
        if at < end:
            self._new_chunk(at, end, key, value, start, heads, advance=end > global_end)

    def _new_chunk(self, g0, g1, key, value, start, heads, *, advance: bool) -> None:
        shape = (self.batch_size, g1 - g0, self.num_heads, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        h0, h1 = heads
        k[:, :, h0:h1].copy_(key[:, g0 - start : g1 - start])
        v[:, :, h0:h1].copy_(value[:, g0 - start : g1 - start])
        chunk = _Chunk(g0, g1, self._next_chunk, g0 < self.sink_tokens, k=k, v=v)
        self._next_chunk += 1
        if advance:
            self._current_chunk = chunk.idx
            if self._chunk_tokens == 0:
                self._chunk_tokens = g1 - g0
        self._chunks.append(chunk)
        self._chunks.sort(key=lambda c: c.g0)

    def _evict(self) -> None:
        """Drop what no slot holds; trim dense chunks, keep packed ones until wholly gone."""
        held = self._slots.positions()
        kept: list[_Chunk] = []
        for c in self._chunks:
            live = [(max(a, c.g0), min(b, c.g1)) for a, b in held if min(b, c.g1) > max(a, c.g0)]
            if not live:
                continue
            if c.packed or live == [(c.g0, c.g1)]:
                kept.append(c)
                continue
            for a, b in live:
                kept.append(_Chunk(a, b, c.idx, c.is_sink,
                                   k=c.k[:, a - c.g0 : b - c.g0].clone(),  # type: ignore[index]
                                   v=c.v[:, a - c.g0 : b - c.g0].clone()))  # type: ignore[index]
        self._chunks = kept

    def _pack(self) -> None:
        """sglang's rule: pack completed chunks not kept dense (each chunk packed once)."""
        q = self.quant
        protect = q.sink_keep_chunks * max(1, self._chunk_tokens)
        completed = sorted({(c.idx, c.is_sink, c.g0 < protect) for c in self._chunks
                            if c.idx != self._current_chunk})
        dense = sglang_dense_chunks(completed, q.keep_recent_chunks, q.sink)
        for c in self._chunks:
            if c.packed or c.idx == self._current_chunk or c.idx in dense:
                continue
            c.pk = quantize(c.k.permute(0, 2, 1, 3), q)  # type: ignore[union-attr]
            c.pv = quantize(c.v.permute(0, 2, 1, 3), q)  # type: ignore[union-attr]
            c.k = c.v = None
            self.quantize_calls += 1

    def _unpack(self, c: _Chunk) -> None:
        """A write into a packed chunk: back to dense (sglang's dense cache keeps it exact)."""
        c.k = dequantize(c.pk, dtype=self.dtype).permute(0, 2, 1, 3).contiguous()  # type: ignore[arg-type]
        c.v = dequantize(c.pv, dtype=self.dtype).permute(0, 2, 1, 3).contiguous()  # type: ignore[arg-type]
        c.pk = c.pv = None

    def _gather(self, view_slots, heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The view's K/V ``[B, visible, h, D]``: slot ranges -> positions -> stored chunks."""
        h0, h1 = heads
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for a, b in view_slots:
            a, b = max(0, min(a, self.cache_size)), max(0, min(b, self.cache_size))
            if b <= a:
                continue
            for ln, p in self._slots.read(a, b):
                pieces.extend(self._positions(p, ln, h0, h1))
        if not pieces:
            empty = torch.zeros((self.batch_size, 0, h1 - h0, self.head_dim),
                                dtype=self.dtype, device=self.device)
            return empty, empty
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=1)

    def _positions(self, p: int | None, ln: int, h0: int, h1: int):
        if p is None:
            z = torch.zeros((self.batch_size, ln, h1 - h0, self.head_dim),
                            dtype=self.dtype, device=self.device)
            return [(z, z)]
        out = []
        for c in self._chunks:
            lo, hi = max(p, c.g0), min(p + ln, c.g1)
            if lo >= hi:
                continue
            if c.packed:
                k = dequantize(c.pk, dtype=self.dtype).permute(0, 2, 1, 3)  # type: ignore[arg-type]
                v = dequantize(c.pv, dtype=self.dtype).permute(0, 2, 1, 3)  # type: ignore[arg-type]
            else:
                k, v = c.k, c.v
            out.append((k[:, lo - c.g0 : hi - c.g0, h0:h1], v[:, lo - c.g0 : hi - c.g0, h0:h1]))  # type: ignore[index]
        return out
