"""Which global positions a causal cache retains and shows: one state machine for all caches.

`StreamState` implements the token-position half of the cache contract (docs/design.md):
write classification (rewrite / advance / error), rolling eviction that keeps the sink and
the pinned shot sink, pins, the visible set and what the next advance keeps
(`causalkv.caches.positions.PositionModel`). It never touches tensors. Every cache
delegates here, so the dense and the packed cache agree on positions by construction and
differ only in how they store the values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import EMPTY, Intervals
from causalkv.caches.positions import HeldPositions
from causalkv.caches.spec import CacheWriteError, CausalCacheSpec
from causalkv.errors import is_int


@dataclass(frozen=True)
class StreamState:
    """Immutable snapshot of a cache's token bookkeeping (plain ints).

    Attributes:
        global_end: tokens written so far; the next advance must start here.
        cur_start, cur_n: the current (last written) chunk; ``cur_start`` is None when empty.
        pinned: the pinned shot-sink range, or None.
        retained: the positions the cache holds.
        capacity: token slots (``cache_size``, larger after growth).
    """

    sink_tokens: int
    global_sink_tokens: int
    window: int
    capacity: int
    allow_growth: bool
    global_end: int = 0
    cur_start: int | None = None
    cur_n: int = 0
    pinned: tuple[int, int] | None = None
    retained: Intervals = EMPTY

    @classmethod
    def from_spec(cls, spec: CausalCacheSpec) -> StreamState:
        return cls(spec.sink_tokens, spec.global_sink_tokens, spec.window, spec.cache_size,
                   spec.allow_growth)

    @classmethod
    def opened(cls, *, sink_tokens: int, global_sink_tokens: int, cache_tokens: int) -> StreamState:
        """An empty stream holding at most ``cache_tokens`` tokens, its window as large, no
        growth (`PositionModel.opened`)."""
        return cls(sink_tokens, global_sink_tokens, cache_tokens, cache_tokens, False)

    # ---- sets -------------------------------------------------------------------------
    def sink_prefix_end(self) -> int:
        """End of the stream-start sink: ``global_sink_tokens`` while pinned, else ``sink_tokens``."""
        return self.global_sink_tokens if self.pinned is not None else self.sink_tokens

    def sink(self, held: Intervals | None = None) -> Intervals:
        """Sink positions still held: prefix plus pinned range, within ``held`` (default retained).

        Intersecting with what is held matters after a pin is cleared: the stream-start
        sink ``[0, sink_tokens)`` is the sink again, but the part of it beyond
        ``global_sink_tokens`` may have rolled out while the pin was in place.
        """
        held = self.retained if held is None else held
        runs = [(0, self.sink_prefix_end())]
        if self.pinned is not None:
            runs.append(self.pinned)
        return iv.intersect(iv.normalize(runs), held)

    def visible(self, recent_window_tokens: int | None = None) -> Intervals:
        """Positions attention sees: sink, pinned range, newest retained tokens in the window."""
        if self.cur_start is None:
            return EMPTY
        sink = self.sink()
        tail_start = min(self.sink_prefix_end(), self.global_end)
        if recent_window_tokens is not None:
            tail_start = max(tail_start, self.cur_start - recent_window_tokens)
        candidates = iv.intersect(iv.subtract(self.retained, sink),
                                  ((tail_start, self.global_end),))
        tail = iv.newest(candidates, self.window - iv.count(sink))
        return iv.union(sink, tail)

    def visible_rows(self, recent_window_tokens: int | None = None) -> int:
        """Rows of the view: its positions (a stream shows no empty rows)."""
        return iv.count(self.visible(recent_window_tokens))

    def holding(self) -> HeldPositions:
        """The positions retained, the sink prefix's end and the pinned range."""
        return HeldPositions(self.retained, self.sink_prefix_end(),
                             (self.pinned,) if self.pinned else ())

    def after_context(self, pin: bool = False, next_tokens: int | None = None) -> HeldPositions:
        """What the next advance keeps once the current chunk is context
        (`PositionModel.after_context`): the positions retained after an advance by
        ``next_tokens`` (default ``cur_n``) tokens (after ``pinned_to(cur_n)`` when ``pin``),
        minus that chunk; all retained now when the advance would not fit."""
        after = self.pinned_to(self.cur_n) if pin else self
        now = after.holding()
        try:
            ahead = after.advanced(next_tokens or self.cur_n, "the next chunk")
        except CacheWriteError:  # the next chunk would not fit: keep everything (a pin moves none)
            return now
        chunk = ((self.global_end, ahead.global_end),)
        return replace(now, held=iv.subtract(ahead.retained, chunk))

    def committed(self, pin: bool = False, next_tokens: int | None = None) -> StreamState:
        """The state once the current chunk is committed (`causalkv.caches.passes.CommitPass`):
        only what the next advance keeps (`after_context`) stays retained."""
        return replace(self, retained=self.after_context(pin, next_tokens).held)

    def cursors(self, visible: Intervals) -> dict[str, int]:
        """Reference-runtime cursors for a view of ``visible``, in compact retained slots: the
        view's ``local_start_index``, ``local_end_index``, ``visible_local_end`` and
        ``visible_global_end`` (`CausalAttentionKVView`'s keywords)."""
        local_start = iv.rank(self.retained, self.cur_start) if self.cur_start is not None else 0
        vis_end = visible[-1][1] if visible else 0
        return {"local_start_index": local_start, "local_end_index": local_start + self.cur_n,
                "visible_local_end": iv.rank(self.retained, vis_end), "visible_global_end": vis_end}

    # ---- transitions (pure: return a new state or raise) --------------------------------
    def written(self, start: int, n: int, debug_name: str) -> StreamState:
        """The state after a write of ``n`` tokens at ``start``: an advance's (`advanced`) when
        ``start`` is ``global_end``, this very state for a rewrite of the current chunk (same
        size); CacheWriteError otherwise."""
        if not is_int(start, None):
            raise CacheWriteError(
                f"{debug_name}: current_chunk_start must be an int, got {type(start).__name__}"
            )
        if self.cur_start is not None and start == self.cur_start:
            if n != self.cur_n:
                raise CacheWriteError(
                    f"{debug_name}: rewrite of chunk at {start} changed size: {n} tokens, "
                    f"the chunk has {self.cur_n}"
                )
            return self
        if start == self.global_end:
            return self.advanced(n, debug_name)
        raise CacheWriteError(
            f"{debug_name}: non-sequential write current_start={start} "
            f"global_end={self.global_end} cur={self.cur_start}"
        )

    def advanced(self, n: int, debug_name: str) -> StreamState:
        """The state after appending ``n`` tokens at ``global_end`` (eviction applied)."""
        end = self.global_end + n
        chunk: Intervals = ((self.global_end, end),)
        held = iv.union(self.retained, chunk)
        sink = self.sink(held)
        need = iv.count(iv.union(sink, chunk))
        if need > self.capacity and not self.allow_growth:
            raise CacheWriteError(
                f"{debug_name}: a chunk of {n} tokens plus {iv.count(sink)} sink tokens does not "
                f"fit cache_size={self.capacity}; raise cache_size or set allow_growth=True"
            )
        capacity = max(self.capacity, need)  # grown to fit
        retained = iv.union(sink, iv.newest(iv.subtract(held, sink), capacity - iv.count(sink)))
        return replace(
            self, global_end=end, cur_start=self.global_end, cur_n=n, retained=retained,
            capacity=capacity,
        )

    def pinned_to(self, current_num_tokens: int) -> StreamState:
        """The state after ``pin_current_chunk(current_num_tokens)``."""
        n = current_num_tokens
        if not is_int(n, None):
            raise CacheWriteError(f"pin_current_chunk: current_num_tokens must be an int, got {n!r}")
        if self.sink_tokens <= 0 or n <= 0:
            return replace(self, pinned=None)
        if n > self.global_end:
            raise CacheWriteError(
                f"pin_current_chunk({n}): only {self.global_end} tokens were written"
            )
        start = self.global_end - n
        rng = (start, start + min(self.sink_tokens, n))
        if not iv.contains(self.retained, (rng,)):
            raise CacheWriteError(
                f"pin_current_chunk({n}): range [{rng[0]}, {rng[1]}) is no longer retained "
                f"(retained {iv.describe(self.retained)}); pin right after writing the chunk"
            )
        return replace(self, pinned=rng)

    def would_see_only_current(self, num_new_tokens: int) -> bool:
        """True when an advance of ``num_new_tokens`` would leave attention seeing that chunk only."""
        if num_new_tokens <= 0:
            return False
        try:
            nxt = self.advanced(num_new_tokens, "can_direct_current_attention")
        except CacheWriteError:
            return False
        return nxt.visible() == ((self.global_end, nxt.global_end),)
