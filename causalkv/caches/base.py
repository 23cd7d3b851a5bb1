"""`StreamCache`: the contract plumbing every causal cache shares.

Validation, the pass marks (probe / commit), reads, pins and `can_direct_current_attention`
live here once, over a `StreamState`. A cache implements only its storage: `_write` (store a
checked write, classified here with `StreamState.written`: evict, copy, commit), `probe_view`
(the view of a write, nothing stored) and `_view` (build the view).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from causalkv.caches.intervals import Intervals
from causalkv.caches.passes import CommitPass, PassMarker
from causalkv.caches.spec import (
    CausalAttentionKVView,
    CausalCacheSpec,
    check_recent_window,
    check_write,
    read_heads,
)
from causalkv.caches.stream import StreamState
from causalkv.errors import ConfigError, UsageError

__all__ = ["StreamCache"]


class StreamCache(ABC):
    """Base of the built-in caches; see `causalkv.caches.spec.CausalKVCache` for the contract."""

    spec: CausalCacheSpec
    state: StreamState

    @property
    def num_cache_heads(self) -> int:
        return self.spec.num_heads

    @property
    def global_end(self) -> int:
        return self.state.global_end

    #: the caller's `PassMarker` (shared by the caches of a stage), or None: the writes are
    #: marked by their own arguments only
    marker: PassMarker | None = None
    #: (chunk start, heads) written by the commits of the current pass
    _pass: tuple[int, frozenset[int]] = (-1, frozenset())

    def use_marker(self, marker: PassMarker | None) -> None:
        """Read the pass of every write from ``marker`` too (`causalkv.caches.passes`)."""
        if marker is not None and not isinstance(marker, PassMarker):
            raise ConfigError(f"use_marker takes a PassMarker or None, got {marker!r}")
        self.marker = marker

    def _marks(self, probe: bool, commit: CommitPass | None) -> tuple[bool, CommitPass | None]:
        """The call's marks: its own arguments, else the shared marker's."""
        m = self.marker
        if m is not None and not probe and commit is None:
            probe, commit = m.probe, m.commit
        if probe and commit is not None:
            raise UsageError("a write is a probe or a commit, not both")
        if commit is not None and not isinstance(commit, CommitPass):
            raise UsageError(f"commit must be a causalkv.caches.passes.CommitPass or None, got {commit!r}")
        return bool(probe), commit

    def _commit_pass(
        self, start: int, heads: tuple[int, int], commit: CommitPass | None
    ) -> tuple[tuple[int, frozenset[int]], bool]:
        """The pass record once ``heads`` of the chunk at ``start`` are written with
        ``commit``, and whether the chunk is then complete: the commits of this pass have
        written every head of the cache (drop what the next advance drops). A commit of heads
        already written this pass starts a new pass; an unmarked write ends it."""
        if commit is None:
            return (-1, frozenset()), False
        s0, done = self._pass
        mine = frozenset(range(*heads))
        done = done | mine if s0 == start and not done & mine else mine
        return (start, done), len(done) == self.num_cache_heads

    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and interval lists; one break")
    def update_and_get_attention_kv(
        self,
        *,
        key: torch.Tensor,
        value: torch.Tensor,
        current_chunk_start: int,
        cache_head_start: int | None = None,
        recent_window_tokens: int | None = None,
        debug_name: str = "kv_cache",
        probe: bool = False,
        commit: CommitPass | None = None,
    ) -> CausalAttentionKVView:
        """Write ``key``/``value`` ``[B, n, h, D]`` (heads ``[h0, h0 + h)``) and return the view.

        ``current_chunk_start`` equal to the current chunk's start rewrites it in place;
        equal to ``global_end`` advances the stream (evicting and, for a packed cache,
        packing). Anything else raises CacheWriteError and leaves the cache unchanged.
        ``probe=True``: the same view, and nothing stored (`probe_view`). ``commit``: the
        chunk's context pass (`causalkv.caches.passes.CommitPass`): stored as an unmarked write,
        then, once every head is written, only what the next advance keeps stays
        (`StreamState.committed`). Unmarked calls follow the `marker`'s pass.
        """
        heads = check_write(self.spec, key, value, cache_head_start, debug_name)
        check_recent_window(recent_window_tokens)
        probe, commit = self._marks(probe, commit)
        # classified once (`StreamState.written`: rewrite, advance, or CacheWriteError with
        # the cache unchanged) for the probe and the write alike
        new = self.state.written(current_chunk_start, key.shape[1], debug_name)
        if probe:
            return self.probe_view(key, value, new, heads, recent_window_tokens)
        return self._write(key, value, new, heads, recent_window_tokens, commit)

    @abstractmethod
    def _write(
        self, key: torch.Tensor, value: torch.Tensor, new: StreamState, heads: tuple[int, int],
        recent_window_tokens: int | None, commit: CommitPass | None,
    ) -> CausalAttentionKVView:
        """Store the write (checked: heads ``heads``, not a probe; ``new``: the state after
        it, `StreamState.written`, the chunk at ``new.cur_start``) and return its view; a
        refused write (CacheWriteError) leaves the cache unchanged. With ``commit``, once
        `_commit_pass` says the chunk is complete, only ``state.committed(...)`` stays."""

    @abstractmethod
    def probe_view(
        self, key: torch.Tensor, value: torch.Tensor, new: StreamState, heads: tuple[int, int],
        recent_window_tokens: int | None,
    ) -> CausalAttentionKVView:
        """The view the write of ``key``/``value`` ``[B, n, h, D]`` at ``new.cur_start`` (heads
        ``heads``, already checked; ``new``: the state the write would leave,
        `StreamState.written`) would return, with nothing stored: a probe (a denoising
        pass of the chunk being generated, whose K/V no later call reads). The cache is not
        changed, so a later call sees what it would have seen without the probe. ``new`` is
        already classified: a write that would be refused never reaches it.
        """

    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and interval lists; one break")
    def get_attention_kv(
        self,
        *,
        cache_head_start: int | None = None,
        num_heads: int | None = None,
        recent_window_tokens: int | None = None,
    ) -> CausalAttentionKVView:
        """The view of heads ``[h0, h0 + num_heads)`` without writing."""
        h0, h1 = read_heads(self.spec, cache_head_start, num_heads)
        check_recent_window(recent_window_tokens)
        return self._view(h0, h1, recent_window_tokens)

    def visible_positions(self, *, recent_window_tokens: int | None = None) -> Intervals:
        """The global positions attention sees now (``get_attention_kv``'s ``position_ranges``),
        ascending runs, without reading K/V: answered between chunks whatever the cache holds."""
        check_recent_window(recent_window_tokens)
        return self.state.visible(recent_window_tokens)

    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and interval lists; one break")
    def pin_current_chunk(self, current_num_tokens: int) -> None:
        """Pin the first ``min(sink_tokens, n)`` of the last ``n`` tokens as the shot sink.

        A later pin replaces this one (the old range rolls out like any other); ``n <= 0``
        or ``sink_tokens <= 0`` clears the pin. Pinning moves no data.
        """
        self.state = self.state.pinned_to(current_num_tokens)

    @torch.compiler.disable(reason="the cache's bookkeeping is Python ints and interval lists; one break")
    def can_direct_current_attention(self, num_new_tokens: int) -> bool:
        """True when advancing by ``num_new_tokens`` leaves attention seeing that chunk only."""
        return self.state.would_see_only_current(num_new_tokens)

    def _make_view(
        self, visible: Intervals, state: StreamState | None = None, **storage: object
    ) -> CausalAttentionKVView:
        """A view of ``visible`` carrying the reference cursors; ``storage`` is the view's
        ``k``/``v``/``segments``/``materialize``/``device`` arguments."""
        cursors = (self.state if state is None else state).cursors(visible)
        return CausalAttentionKVView(position_ranges=visible, **cursors, **storage)  # type: ignore[arg-type]

    @abstractmethod
    def _view(self, h0: int, h1: int, recent_window_tokens: int | None) -> CausalAttentionKVView:
        """The view of heads ``[h0, h1)`` over ``self.state.visible(recent_window_tokens)``."""
