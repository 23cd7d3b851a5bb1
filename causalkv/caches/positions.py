"""The positions a cache's cursor implies: one protocol, one implementation per cursor model.

A cache decides *which* global token positions it holds and shows from its cursor alone
(plain ints, no tensors); the values live elsewhere (a dense buffer, a `SegmentStore`). Every
rule that turns a cursor into positions is written once, by the cursor model's class:

- `causalkv.caches.stream.StreamState`: a stream of positions, the newest kept beside the
  sink and a pinned shot sink (causalkv's caches);
- `causalkv.caches.rolling_slots.RollingSlots`: a fixed buffer of token slots that rolls left
  on eviction, a slot's position tracked by a slot map (a cache that must reproduce such a
  buffer's views slot for slot).

The caches, the host adapters and the memory planner (`causalkv.memory`) ask the
cursor; none re-derives a rule. Positions are sorted, disjoint, half-open runs
(`causalkv.caches.intervals.Intervals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from causalkv.caches.intervals import Intervals

__all__ = ["HeldPositions", "PositionModel"]

_Cursor = TypeVar("_Cursor", bound="PositionModel")


@dataclass(frozen=True)
class HeldPositions:
    """What a cache holds, as its store is told (`SegmentStore.plan`, `plan_commit`).

    Attributes:
        held: the positions held.
        sink_end: positions below it are the stream-start sink (the cursor's bookkeeping).
        pinned: the positions of the pinned shot sink (empty when none is pinned; some may be
            no longer held).
    """

    held: Intervals
    sink_end: int
    pinned: Intervals


class PositionModel(Protocol):
    """A cache's cursor, as the positions it implies. Immutable: a step returns a new cursor.

    ``n`` counts tokens; a chunk ``[start, start + n)`` is written at ``global_end`` (an
    advance) or over the current chunk (a rewrite, the cursor unchanged).
    """

    @classmethod
    def opened(
        cls: type[_Cursor], *, sink_tokens: int, global_sink_tokens: int, cache_tokens: int,
    ) -> _Cursor:
        """The cursor of an empty cache holding at most ``cache_tokens`` tokens (its window:
        no growth), ``sink_tokens`` of them the stream-start sink (``global_sink_tokens``
        while a shot sink is pinned)."""
        ...

    def advanced(self: _Cursor, n: int, debug_name: str) -> _Cursor:
        """The cursor after a chunk of ``n`` tokens is written at the end (eviction applied);
        an error naming ``debug_name`` when the cache cannot take it."""
        ...

    def pinned_to(self: _Cursor, current_num_tokens: int) -> _Cursor:
        """The cursor after ``pin_current_chunk(current_num_tokens)``: the first
        ``sink_tokens`` tokens of the last ``current_num_tokens`` pinned as the shot sink
        (no pin when either is 0)."""
        ...

    def visible(self, recent_window_tokens: int | None = None) -> Intervals:
        """The positions the last write's view shows (attention's window)."""
        ...

    def visible_rows(self, recent_window_tokens: int | None = None) -> int:
        """Rows of that view: its positions, plus any rows the cursor model shows that hold
        no position (a slot buffer's unwritten slots)."""
        ...

    def holding(self) -> HeldPositions:
        """The positions held now, the sink and the pinned shot sink."""
        ...

    def after_context(self, pin: bool = False, next_tokens: int | None = None) -> HeldPositions:
        """What the next advance keeps once the chunk just written is context: the positions
        held after the next advance by ``next_tokens`` (default: the chunk's size), minus
        that chunk (nothing else is read again), the sink and the pinned shot sink; ``pin``:
        after the pin announced for this chunk (`pinned_to` of its size). Everything held
        now when the cache could not take that advance."""
        ...
