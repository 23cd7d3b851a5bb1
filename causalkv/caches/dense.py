"""`DenseCausalKVCache`: one preallocated ``[B, cache_size, H, D]`` K and V buffer per layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from causalkv.caches import intervals as iv
from causalkv.caches.base import StreamCache
from causalkv.caches.passes import CommitPass
from causalkv.caches.spec import CausalAttentionKVView, CausalCacheSpec, concat_segments
from causalkv.caches.stream import StreamState
from causalkv.capabilities import (
    GROWTH,
    HEAD_SLICE,
    INT_INDICES,
    PINNED_SINK,
    RECENT_WINDOW,
    CacheCapabilities,
)
from causalkv.errors import ConfigError

__all__ = ["DenseCausalKVCache"]


class DenseCausalKVCache(StreamCache):
    """Rolling causal KV cache with a sink, a pinned shot sink and head-slice writes.

    Storage: ``k_cache``/``v_cache`` of shape ``[B, capacity, H, D]``. Slots ``[0, n_retained)``
    hold the retained tokens compacted in ascending global position, so slot = rank of the
    position among the retained ones. An advance compacts the survivors to the left (one
    copy of the kept tokens, like the reference runtime's roll) and writes the new chunk
    after them. Which positions survive is decided by `StreamState` on Python ints.
    """

    capabilities = CacheCapabilities.of(PINNED_SINK, HEAD_SLICE, RECENT_WINDOW, GROWTH, INT_INDICES)
    #: the whole ``cache_size`` is allocated when the cache is built (the host's memory check
    #: counts all of it, whatever the video's length)
    preallocates = True

    def __init__(self, spec: CausalCacheSpec, quant: object | None = None) -> None:
        if getattr(quant, "enabled", False):
            raise ConfigError(
                "DenseCausalKVCache stores bf16 only; for QVG quantization use "
                "QVGPackedCausalKVCache (cache 'qvg') or --kv-cache-quant off"
            )
        self.spec = spec
        shape = (spec.batch_size, spec.cache_size, spec.num_heads, spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v_cache = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.state = StreamState.from_spec(spec)

    def resident_nbytes(self) -> int:
        """Bytes of the K and V buffers (preallocated, so constant until growth)."""
        return self.k_cache.nbytes + self.v_cache.nbytes

    # ---- writes -------------------------------------------------------------------
    def _write(
        self, key: torch.Tensor, value: torch.Tensor, new: StreamState, heads: tuple[int, int],
        recent_window_tokens: int | None, commit: CommitPass | None,
    ) -> CausalAttentionKVView:
        """`StreamCache._write`: an advance moves the survivors (`_relayout`), then the chunk
        is copied into its slots; a complete commit keeps only what the next advance keeps."""
        passed, done = self._commit_pass(new.cur_start, heads, commit)
        # a refused commit (a pin whose range is gone) raises here, before anything is stored
        after = new.committed(commit.pin, commit.next_tokens) if done else None
        if new is not self.state:
            self._relayout(new, fresh_heads=heads)
        self._write_current(key, value, *heads)
        self._pass = passed
        if after is None:
            return self._view(*heads, recent_window_tokens)
        # the view reads the positions before the commit drops them: its own buffer
        visible = self.state.visible(recent_window_tokens)
        k, v = self._read_pieces([(a, b - a) for a, b in visible], *heads)
        view = self._make_view(visible, k=k, v=v)
        self._relayout(after, fresh_heads=(0, self.spec.num_heads))
        return view

    def probe_view(
        self, key: torch.Tensor, value: torch.Tensor, new: StreamState, heads: tuple[int, int],
        recent_window_tokens: int | None,
    ) -> CausalAttentionKVView:
        """`StreamCache.probe_view`: the history (the visible positions outside the chunk, as
        the write would leave them: eviction applied) read into one ``[B, visible, h, D]`` K
        and V buffer, the chunk's visible rows copied from the caller's K/V after it."""
        start, n = new.cur_start, key.shape[1]
        visible = new.visible(recent_window_tokens)
        # the chunk holds the newest positions: the history's visible rows come first
        history = iv.subtract(visible, ((start, start + n),))
        own = iv.intersect(visible, ((start, start + n),))
        pieces = [(a, b - a) for a, b in history] + [(None, iv.count(own))]
        k, v = self._read_pieces(pieces, *heads)
        at = iv.count(history)
        for a, b in own:  # the chunk's visible rows: the caller's own K/V
            k[:, at : at + b - a].copy_(key[:, a - start : b - start])
            v[:, at : at + b - a].copy_(value[:, a - start : b - start])
            at += b - a
        return self._make_view(visible, state=new, k=k, v=v)

    def _write_current(self, key: torch.Tensor, value: torch.Tensor, h0: int, h1: int) -> None:
        """Copy the chunk's ``[B, n, h, D]`` K/V into heads ``[h0, h1)`` of its retained slots."""
        st = self.state
        start = st.cur_start
        # the chunk's retained runs (a commit may have dropped some of them)
        for a, b in iv.intersect(st.retained, ((start, start + st.cur_n),)):
            slot = iv.rank(st.retained, a)
            self.k_cache[:, slot : slot + b - a, h0:h1].copy_(key[:, a - start : b - start])
            self.v_cache[:, slot : slot + b - a, h0:h1].copy_(value[:, a - start : b - start])

    def _relayout(self, new: StreamState, fresh_heads: tuple[int, int]) -> None:
        """Move the survivors of ``self.state.retained`` into their slots under ``new`` (an
        advance, or a commit keeping a subset), and commit ``new``. Heads outside
        ``fresh_heads`` of the new chunk read as zeros until written."""
        old_retained = self.state.retained
        grow = new.capacity - self.k_cache.shape[1]
        if grow > 0:  # the buffers copied into larger ones, the new slots zero
            self.k_cache = F.pad(self.k_cache, (0, 0, 0, 0, 0, grow))
            self.v_cache = F.pad(self.v_cache, (0, 0, 0, 0, 0, grow))
        for a, b in iv.intersect(old_retained, new.retained):  # the survivors
            src, dst = iv.rank(old_retained, a), iv.rank(new.retained, a)
            if src != dst:
                for buf in (self.k_cache, self.v_cache):
                    buf[:, dst : dst + (b - a)] = buf[:, src : src + (b - a)].clone()
        if fresh_heads != (0, self.spec.num_heads):
            # Heads outside the write's slice are zero until their own write arrives.
            slot = iv.rank(new.retained, new.cur_start)
            self.k_cache[:, slot : slot + new.cur_n].zero_()
            self.v_cache[:, slot : slot + new.cur_n].zero_()
        self.state = new

    # ---- views ------------------------------------------------------------------------
    def _read_pieces(
        self, pieces: list[tuple[int | None, int]], h0: int, h1: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, sum(lengths), h1 - h0, D]`` of ``pieces`` in order, one new buffer each:
        ``(position, length)`` copies held positions (a run of them is a run of slots),
        ``(None, length)`` leaves rows to fill."""
        st = self.state
        total = sum(m for _, m in pieces)
        shape = (self.spec.batch_size, total, h1 - h0, self.spec.head_dim)
        k = self.k_cache.new_empty(shape)  # the (None, n) rows are the caller's to fill
        v = self.v_cache.new_empty(shape)
        at = 0
        for p, m in pieces:
            if p is not None:
                slot = iv.rank(st.retained, p)
                k[:, at : at + m].copy_(self.k_cache[:, slot : slot + m, h0:h1])
                v[:, at : at + m].copy_(self.v_cache[:, slot : slot + m, h0:h1])
            at += m
        return k, v

    def _view(self, h0: int, h1: int, recent_window_tokens: int | None) -> CausalAttentionKVView:
        st = self.state
        visible = st.visible(recent_window_tokens)
        slot_runs = iv.to_slots(st.retained, visible)
        pieces = [(self.k_cache[:, a:b, h0:h1], self.v_cache[:, a:b, h0:h1]) for a, b in slot_runs]
        k, v = concat_segments(pieces) if pieces else (self.k_cache[:, :0, h0:h1],) * 2
        return self._make_view(visible, k=k, v=v, segments=lambda: iter(pieces))

    # ---- control ----------------------------------------------------------------------
    def reset_indices(self) -> None:
        """Forget the stream (new request). The buffers are kept and overwritten later."""
        self.state = StreamState.from_spec(self.spec)
        self._pass = (-1, frozenset())
        if self.k_cache.shape[1] != self.spec.cache_size:
            self.__init__(self.spec)  # drop growth (the marker stays)
