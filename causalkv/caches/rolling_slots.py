"""A fixed buffer of token slots that rolls: which global position each slot holds (plain ints).

The cursor model of a dense cache that keeps one ``[B, cache_size, H, D]`` buffer per layer
and decides, per write, where the chunk lands (appended after the last written slot; at the
end of the buffer once it is full), which slots roll left on eviction (everything after the
protected sink prefix, by the tokens evicted), and which slot ranges the view concatenates
(the sink, a pinned shot-sink range, the newest slots of the window; unwritten slots show as
zero rows). `SlotMap` tracks the global position held by every slot as runs; `plan_write` and
`visible_slots` are the buffer's arithmetic; `RollingSlots` is the cursor
(`causalkv.caches.positions.PositionModel`), so a cache can store K/V by global position
(dense or packed) and still return that buffer's exact views, and the memory planner counts
the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals
from causalkv.caches.positions import HeldPositions
from causalkv.errors import UsageError

__all__ = [
    "RollingSlots",
    "SlotRangeError",
    "SlotMap",
    "SlotState",
    "WritePlan",
    "effective_sink",
    "plan_write",
    "visible_slots",
]

class SlotRangeError(UsageError):
    """A write whose slots fall outside the buffer (`plan_write`): a RuntimeError, with the
    buffer's own message (callers of such a buffer match both)."""


Run = tuple[int, int, int]  # (slot_start, slot_end, position of slot_start)


@dataclass
class SlotMap:
    """Runs of consecutive slots holding consecutive global positions; unlisted slots are zero."""

    runs: list[Run] = field(default_factory=list)

    def _cut(self, a: int, b: int) -> list[Run]:
        out: list[Run] = []
        for s0, s1, p0 in self.runs:
            if s1 <= a or s0 >= b:
                out.append((s0, s1, p0))
                continue
            if s0 < a:
                out.append((s0, a, p0))
            if s1 > b:
                out.append((b, s1, p0 + (b - s0)))
        return out

    def read(self, a: int, b: int) -> list[tuple[int, int | None]]:
        """``[(length, position or None)]`` covering slots ``[a, b)`` in order (None: zeros)."""
        out: list[tuple[int, int | None]] = []
        at = a
        for s0, s1, p0 in self.runs:
            if s1 <= at or s0 >= b:
                continue
            lo, hi = max(s0, at), min(s1, b)
            if lo > at:
                out.append((lo - at, None))
            out.append((hi - lo, p0 + (lo - s0)))
            at = hi
        if at < b:
            out.append((b - at, None))
        return out

    def write(self, a: int, b: int, position: int) -> None:
        self.runs = sorted([*self._cut(a, b), (a, b, position)])

    def copy(self, src: int, dst: int, n: int) -> None:
        """Slots ``[dst, dst + n)`` take what ``[src, src + n)`` held (the roll)."""
        runs, at = self._cut(dst, dst + n), dst
        for ln, p in self.read(src, src + n):
            if p is not None:
                runs.append((at, at + ln, p))
            at += ln
        self.runs = sorted(runs)

    def slots_of(self, p0: int, p1: int) -> list[tuple[int, int]]:
        """Slot ranges currently holding any position in ``[p0, p1)``."""
        out = []
        for s0, s1, q0 in self.runs:
            lo, hi = max(p0, q0), min(p1, q0 + (s1 - s0))
            if lo < hi:
                out.append((s0 + lo - q0, s0 + hi - q0))
        return out

    def positions(self) -> Intervals:
        """Every position held by some slot."""
        return iv.normalize((p0, p0 + (s1 - s0)) for s0, s1, p0 in self.runs)

    def merged(self) -> SlotMap:
        """The same map with adjacent runs that continue each other merged (fewer runs; a
        reader then gets longer pieces)."""
        out: list[Run] = []
        for s0, s1, p0 in self.runs:
            if out and out[-1][1] == s0 and out[-1][2] + (out[-1][1] - out[-1][0]) == p0:
                out[-1] = (out[-1][0], s1, out[-1][2])
            else:
                out.append((s0, s1, p0))
        return SlotMap(out)


@dataclass(frozen=True)
class SlotState:
    """The buffer's int fields that decide positions: its size, the sink, the attention
    window, growth, and the pinned shot-sink slots (``pinned_start`` -1: none)."""

    cache_size: int
    sink_tokens: int
    attention_window_size: int
    allow_growth: bool
    global_sink_tokens: int
    pinned_start: int = -1
    pinned_len: int = 0

    def has_pinned_sink(self) -> bool:
        return self.pinned_start >= 0 and self.pinned_len > 0


def effective_sink(st: SlotState) -> int:
    """The protected slot prefix: the global sink plus the pinned range when it follows it,
    else the global sink while a shot sink is pinned, else the larger sink."""
    if st.has_pinned_sink():
        if st.pinned_start == st.global_sink_tokens:
            return st.global_sink_tokens + st.pinned_len
        return st.global_sink_tokens
    return max(st.global_sink_tokens, st.sink_tokens)


@dataclass(frozen=True)
class WritePlan:
    """What one write does to the slots: the slots it fills ``[local_start, local_end)``,
    the cursors after it, the size after growth, the roll ``(src, dst, n)``, the slots
    evicted and the protected prefix at the time of the write."""

    local_start: int
    local_end: int
    updated_local_end: int
    updated_global_end: int
    grow_to: int  # new cache_size (== old when no growth)
    roll: tuple[int, int, int] | None  # (src, dst, n) or None
    evicted: int  # slots the pinned start moves left by (0 when no eviction)
    sink: int  # effective sink at the time of the write


def plan_write(
    st: SlotState, global_end: int, local_end_prev: int, start: int, n: int, debug_name: str
) -> WritePlan:
    """The write of ``n`` tokens at global position ``start``, given the cursors
    ``global_end`` and ``local_end_prev``; `SlotRangeError` (a RuntimeError) for a range
    outside the buffer (the buffer's own message, naming ``debug_name``).

    Pure: nothing is changed, so a refused write leaves the cache as it was.
    """
    end = start + n
    size = st.cache_size
    sink = effective_sink(st)
    roll, evicted = None, 0
    if end <= global_end:
        ls = start - (global_end - local_end_prev)  # the buffer's slot 0 holds that position
        le = ls + n
        ule, uge = local_end_prev, global_end
    else:
        need = local_end_prev + end - global_end  # slots the appended tokens would fill up to
        if st.allow_growth and need > size:
            size = max(need, size * 2)
        evicted, le = max(0, need - size), min(need, size)
        rolled = local_end_prev - evicted - sink
        if evicted and rolled > 0:
            roll = (sink + evicted, sink, rolled)
        ls = le - n
        ule, uge = le, end
    if ls < 0 or le > size or le - ls != n:
        raise SlotRangeError(
            f"Invalid {debug_name} write range: "
            f"local=[{ls}, {le}), global_end={global_end}, prev_local_end={local_end_prev}, "
            f"kv_cache_size={size}, num_new_tokens={n}, current_start={start}, current_end={end}"
        )
    return WritePlan(ls, le, ule, uge, size, roll, evicted, sink)


def visible_slots(
    st: SlotState, local_start: int, updated_local_end: int, recent_window_tokens: int | None
) -> list[tuple[int, int]]:
    """Slot ranges the view concatenates, in order: the last ``attention_window_size`` slots
    up to ``updated_local_end``, with the sink and the pinned range prepended when the window
    no longer covers them; with ``recent_window_tokens`` the sink, the pinned range and the
    slots from ``local_start - recent_window_tokens`` on. The window's slots shrink by those
    of the sink and the pinned range prepended to it."""
    ule = updated_local_end
    attn_start = max(0, ule - st.attention_window_size)
    if recent_window_tokens is None:
        if st.global_sink_tokens == 0 and not st.has_pinned_sink():
            return [(attn_start, ule)]
        es = effective_sink(st)
        before = [(0, es)] if es > 0 and attn_start > 0 else []
        if st.has_pinned_sink() and es <= st.pinned_start < attn_start:
            before.append((st.pinned_start, st.pinned_start + st.pinned_len))
        local = max(0, st.attention_window_size - sum(b - a for a, b in before))
        return [*before, (max(es if before and before[0][0] == 0 else 0, ule - local), ule)]
    sink_end = min(effective_sink(st), ule)
    recent_start = max(sink_end, local_start - recent_window_tokens)
    if recent_start <= sink_end:
        return [(0, ule)]
    out = [(0, sink_end)] if sink_end > 0 else []
    if st.has_pinned_sink() and sink_end <= st.pinned_start < recent_start:
        out.append((st.pinned_start, st.pinned_start + st.pinned_len))
    return [*out, (recent_start, ule)]


# ---------------------------------------------------------------------------------------------
# The cursor
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RollingSlots:
    """The buffer's cursor (`causalkv.caches.positions.PositionModel`): its int fields, the
    slot map and the write cursors. Immutable: `written` and the steps return a new cursor
    (``slots`` is copied, never changed in place).

    Attributes:
        state: size, sink, window, growth and the pinned slots.
        slots: the global position each slot holds.
        global_end: positions written so far.
        local_end: slots filled so far (the next advance lands after them, or rolls).
        local_start: the first slot of the last write (a recent window starts there).
        chunk: tokens of the last write.
        merge_runs: keep ``slots`` merged (`SlotMap.merged`): the same positions in fewer
            runs, for a caller that steps through thousands of chunks (the memory planner);
            a cache's views then read longer pieces.
    """

    state: SlotState
    slots: SlotMap = field(default_factory=SlotMap)
    global_end: int = 0
    local_end: int = 0
    local_start: int = 0
    chunk: int = 0
    merge_runs: bool = False

    @classmethod
    def opened(
        cls, *, sink_tokens: int, global_sink_tokens: int, cache_tokens: int,
    ) -> RollingSlots:
        """An empty buffer of ``cache_tokens`` slots, its window the whole buffer, no growth;
        runs merged (a plan's many steps)."""
        return cls(SlotState(cache_size=cache_tokens, sink_tokens=sink_tokens,
                             attention_window_size=cache_tokens, allow_growth=False,
                             global_sink_tokens=global_sink_tokens), merge_runs=True)

    # ---- writes -----------------------------------------------------------------------------
    def plan(self, start: int, n: int, debug_name: str) -> WritePlan:
        """`plan_write` of ``n`` tokens at ``start`` on this cursor (`SlotRangeError` when the
        buffer refuses it)."""
        return plan_write(self.state, self.global_end, self.local_end, start, n, debug_name)

    def rolled(self, plan: WritePlan) -> SlotMap:
        """The slot map after ``plan``'s roll, before its write."""
        slots = SlotMap(list(self.slots.runs))
        if plan.roll is not None:
            slots.copy(*plan.roll)
        return slots

    def written(self, plan: WritePlan, start: int) -> RollingSlots:
        """The cursor after ``plan`` (from `plan`) writes positions from ``start``: the roll,
        the write, the size after growth (a window that was the whole buffer grows with it)
        and the pinned slots moved left with the roll when they sit after the protected
        prefix."""
        slots = self.rolled(plan)
        slots.write(plan.local_start, plan.local_end, start)
        st = self.state
        moves = st.has_pinned_sink() and st.pinned_start >= plan.sink
        window = plan.grow_to if st.attention_window_size == st.cache_size else st.attention_window_size
        return replace(
            self, state=replace(st, cache_size=plan.grow_to, attention_window_size=window,
                                pinned_start=st.pinned_start - (plan.evicted if moves else 0)),
            slots=slots.merged() if self.merge_runs else slots,
            global_end=plan.updated_global_end, local_end=plan.updated_local_end,
            local_start=plan.local_start, chunk=plan.local_end - plan.local_start,
        )

    def advanced(self, n: int, debug_name: str) -> RollingSlots:
        """The cursor after ``n`` tokens are written at ``global_end``."""
        return self.written(self.plan(self.global_end, n, debug_name), self.global_end)

    def pinned_to(self, current_num_tokens: int) -> RollingSlots:
        """The cursor after ``pin_current_chunk(current_num_tokens)``: the first ``sink_tokens``
        of the last ``current_num_tokens`` filled slots pinned (none when either is 0)."""
        n, st = current_num_tokens, self.state
        if st.sink_tokens <= 0 or n <= 0:
            return replace(self, state=replace(st, pinned_start=-1, pinned_len=0))
        return replace(self, state=replace(st, pinned_start=self.local_end - n,
                                           pinned_len=min(st.sink_tokens, n)))

    # ---- positions ----------------------------------------------------------------------------
    def pieces(self, recent_window_tokens: int | None = None) -> list[tuple[int | None, int]]:
        """The last write's view as ``(position or None, length)`` pieces in view order: the
        slot ranges of `visible_slots` (clipped to the buffer) read through the slot map
        (None: unwritten slots, zero rows)."""
        size = self.state.cache_size
        out: list[tuple[int | None, int]] = []
        for a, b in visible_slots(self.state, self.local_start, self.local_end,
                                  recent_window_tokens):
            a, b = max(0, min(a, size)), max(0, min(b, size))
            if b > a:
                out.extend((p, ln) for ln, p in self.slots.read(a, b))
        return out

    def visible(self, recent_window_tokens: int | None = None) -> Intervals:
        return iv.normalize((p, p + ln) for p, ln in self.pieces(recent_window_tokens)
                            if p is not None)

    def visible_rows(self, recent_window_tokens: int | None = None) -> int:
        return sum(ln for _, ln in self.pieces(recent_window_tokens))

    def pinned(self) -> Intervals:
        """The positions the pinned slots hold now (empty when none are pinned)."""
        st = self.state
        if not st.has_pinned_sink():
            return ()
        a, b = max(0, st.pinned_start), min(st.cache_size, st.pinned_start + st.pinned_len)
        # b <= a: every piece read is empty, and normalize drops it
        return iv.normalize((p, p + ln) for ln, p in self.slots.read(a, b) if p is not None)

    def holding(self) -> HeldPositions:
        return HeldPositions(self.slots.positions(), self.state.sink_tokens, self.pinned())

    def after_context(self, pin: bool = False, next_tokens: int | None = None) -> HeldPositions:
        """`PositionModel.after_context`: the positions the buffer holds after the next advance
        by ``next_tokens`` (default ``chunk``) tokens (after the pin when ``pin``), minus that
        chunk; everything held now when the buffer would refuse that advance or grow for it."""
        cur = self.pinned_to(self.chunk) if pin else self
        now = cur.holding()
        end, n = cur.global_end, next_tokens or cur.chunk
        try:
            nxt = cur.plan(end, n, "next chunk")
        except SlotRangeError:
            return now
        if nxt.grow_to != cur.state.cache_size:
            return now
        held = iv.subtract(cur.written(nxt, end).slots.positions(), ((end, end + n),))
        return replace(now, held=held)
