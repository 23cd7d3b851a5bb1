"""The position model (`causalkv.caches.positions`): one protocol, one implementation per cursor
model (`StreamState`, `RollingSlots`), the rules each cache, host adapter and the memory planner
ask instead of re-deriving them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from causalkv.caches import intervals as iv
from causalkv.caches.positions import HeldPositions
from causalkv.caches.rolling_slots import RollingSlots, SlotMap, SlotRangeError, SlotState
from causalkv.caches.stream import StreamState
from causalkv.errors import UsageError

MODELS = [StreamState, RollingSlots]
N = 4  # tokens per chunk


def _opened(model, sink: int = N, global_sink: int = N, cache: int = 4 * N):
    return model.opened(sink_tokens=sink, global_sink_tokens=global_sink, cache_tokens=cache)


def _minus_chunk(held: HeldPositions, start: int) -> iv.Intervals:
    return iv.subtract(held.held, ((start, start + N),))


@pytest.mark.parametrize("model", MODELS)
def test_after_context_is_what_the_next_advance_keeps(model) -> None:
    """Per chunk, with and without a pin: `after_context` is the next advance's positions
    minus that chunk, with the pin applied first; the view never shows what is not held."""
    cur = _opened(model)
    for i in range(9):
        cur = cur.advanced(N, "test")
        assert iv.contains(cur.holding().held, cur.visible())
        assert cur.visible_rows() >= iv.count(cur.visible())
        for pin in (False, True):
            ctx = cur.after_context(pin)
            base = cur.pinned_to(N) if pin else cur
            nxt = base.advanced(N, "test")
            assert ctx.held == _minus_chunk(nxt.holding(), (i + 1) * N), (i, pin)
            assert (ctx.sink_end, ctx.pinned) == (base.holding().sink_end, base.holding().pinned)
            assert iv.contains(cur.holding().held, ctx.held)
        if i == 3:
            cur = cur.pinned_to(N)
            assert cur.holding().pinned == ((3 * N, 4 * N),)


@pytest.mark.parametrize("model", MODELS)
def test_without_a_pin_both_cursor_models_hold_the_sink_and_the_newest(model) -> None:
    cur = _opened(model)
    for _ in range(6):
        cur = cur.advanced(N, "test")
    assert cur.holding().held == ((0, N), (3 * N, 6 * N))
    assert cur.visible() == ((0, N), (3 * N, 6 * N))
    assert cur.after_context().held == ((0, N), (4 * N, 6 * N))
    assert cur.holding().sink_end == N and cur.holding().pinned == ()


def test_the_pinned_slots_move_left_with_the_roll() -> None:
    """A pin after the protected prefix moves left by the slots evicted: it keeps holding the
    pinned chunk's positions while the buffer rolls."""
    cur = _opened(RollingSlots, sink=2, global_sink=0, cache=8)
    for _ in range(2):
        cur = cur.advanced(2, "test")
    cur = cur.pinned_to(2)  # chunk [2, 4), in slots [2, 4)
    assert (cur.state.pinned_start, cur.pinned()) == (2, ((2, 4),))
    for end, start in ((6, 2), (8, 2), (10, 0), (12, 0)):
        cur = cur.advanced(2, "test")
        assert cur.global_end == end and cur.state.pinned_start == start, end
        assert cur.pinned() == ((2, 4),) and iv.contains(cur.holding().held, ((2, 4),))


def test_a_write_outside_the_buffer_is_the_buffers_runtime_error() -> None:
    cur = _opened(RollingSlots, sink=0, global_sink=0, cache=N)
    with pytest.raises(SlotRangeError, match="Invalid test write range") as exc:
        cur.advanced(2 * N, "test")
    assert isinstance(exc.value, RuntimeError) and isinstance(exc.value, UsageError)
    # a full buffer: the next chunk replaces the whole of it, nothing is kept for it
    cur = cur.advanced(N, "test")
    assert cur.after_context().held == ()
    # a buffer that would grow for the next chunk keeps everything
    growing = RollingSlots(SlotState(cache_size=N, sink_tokens=0, attention_window_size=N,
                                     allow_growth=True, global_sink_tokens=0))
    cur = growing.advanced(N, "test")
    assert cur.after_context() == cur.holding() == HeldPositions(((0, N),), 0, ())


def test_slot_map_positions_and_merged_runs() -> None:
    m = SlotMap([(0, 2, 10), (2, 4, 12), (4, 6, 0), (6, 8, 2)])
    assert m.positions() == iv.normalize([(10, 14), (0, 4)]) == ((0, 4), (10, 14))
    merged = m.merged()
    assert merged.runs == [(0, 4, 10), (4, 8, 0)]
    assert merged.positions() == m.positions()
    assert [p for _, p in merged.read(0, 8)] == [10, 0]


def test_the_planner_imports_no_host_adapter() -> None:
    """The memory planner takes a cache model; it imports no host adapter to get one."""
    code = ("import sys, causalkv.memory.plan, causalkv.memory.cache_models\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('causalkv.sglang', "
            "'causalkv.vllm_omni')))\nassert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
