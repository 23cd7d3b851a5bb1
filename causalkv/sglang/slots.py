"""sglang's dense-cache index arithmetic on Python ints: which global position each slot holds.

sglang's ``CausalSelfAttentionKVCache`` keeps one ``[B, cache_size, H, D]`` buffer per layer
and decides, per write, where the chunk lands, which slots roll left, and which slot ranges
the view concatenates. `SlotMap` tracks the global position held by every slot as runs, and
`plan_write` / `visible_slots` reproduce sglang's arithmetic step for step, so a cache can
store K/V by global position (dense or packed) and still return sglang's exact views.
No sglang import: the arithmetic is read from sglang 0.5.23's source and re-derived here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SlotMap", "SlotState", "WritePlan", "plan_write", "visible_slots", "effective_sink"]

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
        runs = self._cut(a, b)
        runs.append((a, b, position))
        self.runs = sorted(runs)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Slots ``[dst, dst + n)`` take what ``[src, src + n)`` held (sglang's roll)."""
        moved = [(dst + off, dst + off + ln, p) for off, (ln, p) in _offsets(self.read(src, src + n))]
        runs = self._cut(dst, dst + n)
        runs.extend(r for r in moved if r[2] is not None)
        self.runs = sorted(runs)  # type: ignore[arg-type]

    def slots_of(self, p0: int, p1: int) -> list[tuple[int, int]]:
        """Slot ranges currently holding any position in ``[p0, p1)``."""
        out = []
        for s0, s1, q0 in self.runs:
            lo, hi = max(p0, q0), min(p1, q0 + (s1 - s0))
            if lo < hi:
                out.append((s0 + lo - q0, s0 + hi - q0))
        return out

    def positions(self) -> list[tuple[int, int]]:
        """Every position held by some slot, as sorted merged runs."""
        runs = sorted((p0, p0 + (s1 - s0)) for s0, s1, p0 in self.runs)
        out: list[list[int]] = []
        for a, b in runs:
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b) for a, b in out]


def _offsets(pieces: list[tuple[int, int | None]]):
    at = 0
    for ln, p in pieces:
        yield at, (ln, p)
        at += ln


@dataclass
class SlotState:
    """The int fields of sglang's dense cache that decide positions (not the index tensors)."""

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
    """sglang's ``_effective_sink_tokens``: the protected slot prefix."""
    if st.has_pinned_sink():
        if st.pinned_start == st.global_sink_tokens:
            return st.global_sink_tokens + st.pinned_len
        return st.global_sink_tokens
    return max(st.global_sink_tokens, st.sink_tokens)


@dataclass(frozen=True)
class WritePlan:
    """What one ``update_and_get_attention_kv`` call does to the slots."""

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
    """sglang's write arithmetic; raises sglang's RuntimeError for an invalid range.

    Pure: nothing is changed, so a refused write leaves the cache as it was.
    """
    end = start + n
    size = st.cache_size
    sink = effective_sink(st)
    window_start = global_end - local_end_prev
    roll = None
    evicted = 0
    if end <= global_end:
        ls = start - window_start
        le = ls + n
        ule, uge = local_end_prev, global_end
    else:
        appended = end - global_end
        if st.allow_growth and local_end_prev + appended > size:
            size = max(local_end_prev + appended, size * 2)
        if local_end_prev + appended > size:
            evicted = local_end_prev + appended - size
            rolled = max(0, local_end_prev - evicted - sink)
            if rolled > 0:
                roll = (sink + evicted, sink, rolled)
            le = size
        else:
            le = local_end_prev + appended
        ls = le - n
        ule, uge = le, end
    if ls < 0 or le > size or le - ls != n:
        raise RuntimeError(
            f"Invalid {debug_name} write range: "
            f"local=[{ls}, {le}), global_end={global_end}, prev_local_end={local_end_prev}, "
            f"kv_cache_size={size}, num_new_tokens={n}, current_start={start}, current_end={end}"
        )
    return WritePlan(ls, le, ule, uge, size, roll, evicted, sink)


def visible_slots(
    st: SlotState, local_start: int, updated_local_end: int, recent_window_tokens: int | None
) -> list[tuple[int, int]]:
    """Slot ranges sglang's view concatenates (``_visible_attention_kv``), in order."""
    attn_start = max(0, updated_local_end - st.attention_window_size)
    if recent_window_tokens is None:
        if st.global_sink_tokens > 0 or st.has_pinned_sink():
            return _pinned_view(st, attn_start, updated_local_end)
        return [(attn_start, updated_local_end)]
    sink_end = min(effective_sink(st), updated_local_end)
    recent_start = max(sink_end, local_start - recent_window_tokens)
    if recent_start <= sink_end:
        return [(0, updated_local_end)]
    out = []
    if sink_end > 0:
        out.append((0, sink_end))
    if st.has_pinned_sink() and sink_end <= st.pinned_start < recent_start:
        out.append((st.pinned_start, st.pinned_start + st.pinned_len))
    out.append((recent_start, updated_local_end))
    return out


def _pinned_view(st: SlotState, attn_start: int, ule: int) -> list[tuple[int, int]]:
    es = effective_sink(st)
    prepend_sink = es > 0 and attn_start > 0
    prepend_pinned = st.has_pinned_sink() and es <= st.pinned_start < attn_start
    pinned = (st.pinned_start, st.pinned_start + st.pinned_len)
    if prepend_sink and prepend_pinned:
        local = max(0, st.attention_window_size - (es + st.pinned_len))
        return [(0, es), pinned, (max(es, ule - local), ule)]
    if prepend_sink:
        local = max(0, st.attention_window_size - es)
        return [(0, es), (max(es, ule - local), ule)]
    if prepend_pinned:
        local = max(0, st.attention_window_size - st.pinned_len)
        return [pinned, (max(0, ule - local), ule)]
    return [(attn_start, ule)]
