"""An independent token-position oracle for the causal KV cache contract, and a driver.

Part 1, `OracleCache`: the contract of docs/design.md / docs/caches.md written again in
plain Python over *sets of ints*, one token at a time. It shares no code with
``causalkv.caches.stream`` or ``causalkv.caches.intervals`` (it must not import them), so a
bug there cannot hide in here. It tracks which positions the cache retains and, per
(position, head), which write last stored a value there (0 = never written, reads as zeros).

Part 2, values that encode where they came from: ``key[b, i, h, d]`` is channel ``d % 4`` of
``(position, head, write id, batch)`` (plus ``1000 * (d // 4)`` for wide heads) and
``value = -(key + 1)``, so a misplaced, stale or cross-head token shows up as a wrong number.

Part 3, the driver, reusable for any cache class: ops (advance, rewrite, resized rewrite,
skipped start, pin, read, reset, can-direct query), `run_sequence(make_cache, spec, ops)`
which checks a cache against the oracle after every op, `assert_caches_agree(make_a,
make_b, spec, ops)` which checks two caches against each other bit for bit, and the
hypothesis strategy `scenarios()` producing ``(spec, ops)``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st

from causalkv.caches.spec import CacheWriteError, CausalCacheSpec

# ======================================================================================
# Part 1: the oracle (plain Python, sets of ints)
# ======================================================================================


class OracleError(Exception):
    """The oracle's verdict that a call breaks the contract.

    ``reasons`` is a subset of {"head_slice", "recent_window", "non_sequential", "resize",
    "fit", "pin"}; only "recent_window" alone may be a plain ValueError, every other reason
    must surface as CacheWriteError.
    """

    def __init__(self, *reasons: str) -> None:
        super().__init__(", ".join(reasons))
        self.reasons = frozenset(reasons)


@dataclass
class OracleView:
    """What the oracle says a view must hold."""

    positions: list[int]
    heads: range
    stamps: list[list[int]]  # stamps[i][j]: write id of positions[i], heads[j]; 0 = zeros
    local_start_index: int
    local_end_index: int
    visible_local_end: int
    visible_global_end: int

    def ranges(self) -> list[tuple[int, int]]:
        return runs_of(self.positions)


def runs_of(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Ascending positions as half-open ``(start, end)`` runs."""
    out: list[list[int]] = []
    for p in positions:
        if out and p == out[-1][1]:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]


@dataclass
class OracleCache:
    """The cache contract over token positions, written for clarity, not speed."""

    batch_size: int
    num_heads: int
    head_dim: int
    cache_size: int
    sink_tokens: int = 0
    global_sink_tokens: int = 0
    window: int | None = None
    allow_growth: bool = False
    element_size: int = 4
    # state
    global_end: int = 0
    cur_start: int | None = None
    cur_n: int = 0
    pinned: tuple[int, int] | None = None
    retained: set[int] = field(default_factory=set)
    capacity: int = 0
    stamps: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window is None:
            self.window = self.cache_size
        self.capacity = self.cache_size

    @classmethod
    def from_spec(cls, spec: CausalCacheSpec) -> OracleCache:
        return cls(
            batch_size=spec.batch_size,
            num_heads=spec.num_heads,
            head_dim=spec.head_dim,
            cache_size=spec.cache_size,
            sink_tokens=spec.sink_tokens,
            global_sink_tokens=spec.global_sink_tokens,
            window=spec.attention_window_size,
            allow_growth=spec.allow_growth,
            element_size=torch.empty((), dtype=spec.dtype).element_size(),
        )

    # ---- sets -----------------------------------------------------------------------
    def prefix_end(self) -> int:
        """The stream-start sink: ``global_sink_tokens`` while pinned, else ``sink_tokens``."""
        return self.global_sink_tokens if self.pinned is not None else self.sink_tokens

    def sink_positions(self, held: set[int]) -> set[int]:
        """Sink = prefix + pinned range, among the positions the cache still ``held``.

        A position evicted earlier (e.g. ``[global_sink, sink)`` rolled out while a shot sink
        was pinned, then the pin was cleared) cannot come back: the sink never invents data.
        """
        s = set(range(self.prefix_end()))
        if self.pinned is not None:
            s |= set(range(*self.pinned))
        return s & held

    def visible(self, recent_window_tokens: int | None = None) -> list[int]:
        if self.cur_start is None:
            return []
        sink = self.sink_positions(self.retained)
        tail_start = self.prefix_end()
        if recent_window_tokens is not None:
            tail_start = max(tail_start, self.cur_start - recent_window_tokens)
        candidates = sorted(p for p in self.retained - sink if p >= tail_start)
        room = self.window - len(sink)
        tail = candidates[-room:] if room > 0 else []
        return sorted(sink | set(tail))

    def slot(self, p: int) -> int:
        """Compact slot of a position: how many retained positions are smaller."""
        return sum(1 for q in self.retained if q < p)

    def view(self, h0: int = 0, h1: int | None = None, recent: int | None = None) -> OracleView:
        h1 = self.num_heads if h1 is None else h1
        vis = self.visible(recent)
        heads = range(h0, h1)
        local_start = self.slot(self.cur_start) if self.cur_start is not None else 0
        vis_end = vis[-1] + 1 if vis else 0
        return OracleView(
            positions=vis,
            heads=heads,
            stamps=[[self.stamps[p][h] for h in heads] for p in vis],
            local_start_index=local_start,
            local_end_index=local_start + self.cur_n,
            visible_local_end=self.slot(vis_end),
            visible_global_end=vis_end,
        )

    def resident_nbytes(self) -> int:
        """Dense storage: K and V buffers of ``capacity`` slots."""
        return 2 * self.batch_size * self.capacity * self.num_heads * self.head_dim * self.element_size

    # ---- transitions (raise OracleError and leave self unchanged, or mutate) ----------
    def write(
        self, start: int, n: int, h0: int | None, h: int, recent: int | None, wid: int
    ) -> str:
        """Apply a write; return "rewrite" or "advance"."""
        first = 0 if h0 is None else h0
        if first < 0 or first + h > self.num_heads:
            raise OracleError("head_slice")
        if recent is not None and recent < 0:
            raise OracleError("recent_window")
        if self.cur_start is not None and start == self.cur_start:
            if n != self.cur_n:
                raise OracleError("resize")
            kind = "rewrite"
        elif start == self.global_end:
            kind = "advance"
        else:
            raise OracleError("non_sequential")
        if kind == "advance":
            self._advance(n)
        for p in range(start, start + n):
            for hh in range(first, first + h):
                self.stamps[p][hh] = wid
        return kind

    def _advance(self, n: int) -> None:
        end = self.global_end + n
        chunk = set(range(self.global_end, end))
        held = self.retained | chunk
        sink = {p for p in self.sink_positions(held) if p < end}
        capacity = self.capacity
        need = len(sink | chunk)
        if need > capacity:
            if not self.allow_growth:
                raise OracleError("fit")
            capacity = need
        ordinary = sorted(held - sink)
        room = capacity - len(sink)
        keep = set(ordinary[-room:]) if room > 0 else set()
        self.retained = sink | keep
        self.capacity = capacity
        self.stamps = {p: s for p, s in self.stamps.items() if p in self.retained}
        for p in chunk:
            self.stamps[p] = [0] * self.num_heads
        self.cur_start, self.cur_n, self.global_end = self.global_end, n, end

    def pin(self, n: int) -> None:
        if self.sink_tokens <= 0 or n <= 0:
            self.pinned = None
            return
        if n > self.global_end:
            raise OracleError("pin")
        start = self.global_end - n
        rng = (start, start + min(self.sink_tokens, n))
        if not set(range(*rng)) <= self.retained:
            raise OracleError("pin")
        self.pinned = rng

    def clone(self) -> OracleCache:
        twin = copy.copy(self)
        twin.retained = set(self.retained)
        twin.stamps = {p: list(s) for p, s in self.stamps.items()}
        return twin

    def can_direct(self, n: int) -> bool:
        if n <= 0:
            return False
        trial = self.clone()
        try:
            trial._advance(n)
        except OracleError:
            return False
        return trial.visible() == list(range(self.global_end, self.global_end + n))

    def reset(self) -> None:
        fresh = OracleCache(
            self.batch_size, self.num_heads, self.head_dim, self.cache_size, self.sink_tokens,
            self.global_sink_tokens, self.window, self.allow_growth, self.element_size,
        )
        self.__dict__.update(fresh.__dict__)


# ======================================================================================
# Part 2: values that encode (position, head, write id, batch)
# ======================================================================================


def _fields(pos: torch.Tensor, heads: torch.Tensor, wid: torch.Tensor, batch: int) -> torch.Tensor:
    """float64 ``[B, n, h, 4]``: (position, head, write id, batch); zeros where wid == 0."""
    n, h = wid.shape
    f = torch.stack(
        [
            pos.double().view(1, n, 1).expand(batch, n, h),
            heads.double().view(1, 1, h).expand(batch, n, h),
            wid.double().view(1, n, h).expand(batch, n, h),
            torch.arange(batch, dtype=torch.float64).view(batch, 1, 1).expand(batch, n, h),
        ],
        dim=-1,
    )
    return f * (wid != 0).view(1, n, h, 1)


def _to_kv(f: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    written = f[..., 2:3] != 0
    if head_dim == 4:
        k = f
    else:
        d = torch.arange(head_dim)
        k = f[..., d % 4] + 1000.0 * (d // 4).double() * written
    return k, (-(k + 1)) * written


def encode_kv(
    spec: CausalCacheSpec, start: int, n: int, h0: int, h: int, wid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value ``[B, n, h, D]`` for positions ``[start, start + n)`` and heads ``[h0, h0 + h)``."""
    pos = torch.arange(start, start + n)
    heads = torch.arange(h0, h0 + h)
    k, v = _to_kv(_fields(pos, heads, torch.full((n, h), wid), spec.batch_size), spec.head_dim)
    k_out, v_out = k.to(spec.dtype), v.to(spec.dtype)
    if not (torch.equal(k_out.double(), k) and torch.equal(v_out.double(), v)):
        raise AssertionError(
            f"{spec.dtype} cannot hold the test's marker values exactly (positions up to "
            f"{start + n}, write id {wid}); use float32 or smaller streams"
        )
    return k_out.to(spec.torch_device), v_out.to(spec.torch_device)


def expected_kv(ov: OracleView, spec: CausalCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[B, visible, h, D]`` the view's k and v must equal."""
    pos = torch.tensor(ov.positions, dtype=torch.int64)
    heads = torch.tensor(list(ov.heads), dtype=torch.int64)
    wid = torch.tensor(ov.stamps, dtype=torch.int64).view(len(ov.positions), len(ov.heads))
    return _to_kv(_fields(pos, heads, wid, spec.batch_size), spec.head_dim)


# ======================================================================================
# Part 3: ops, the driver and the strategy
# ======================================================================================


@dataclass(frozen=True)
class Write:
    """A write relative to the cache's state when it runs.

    ``mode``: "advance" (start = global_end, ``n`` tokens), "rewrite" (start and size of the
    current chunk), "resize" (the current chunk's start, size + ``delta``), "skip"
    (start = global_end + ``delta``). On an empty cache "rewrite"/"resize" start at 0 with
    ``n`` tokens. ``h0=None`` writes all heads without a ``cache_head_start``.
    """

    mode: str
    n: int = 1
    h0: int | None = None
    h: int | None = None
    recent: int | None = None
    delta: int = 0


@dataclass(frozen=True)
class Pin:
    """``pin_current_chunk(n)``; ``n=None`` pins the current chunk's size."""

    n: int | None = None


@dataclass(frozen=True)
class Read:
    """``get_attention_kv(cache_head_start=h0, num_heads=h, recent_window_tokens=recent)``."""

    h0: int | None = None
    h: int | None = None
    recent: int | None = None


@dataclass(frozen=True)
class Reset:
    """Start a new request: ``reset_indices()``."""


@dataclass(frozen=True)
class CanDirect:
    n: int = 1


Op = Write | Pin | Read | Reset | CanDirect


@dataclass(frozen=True)
class Call:
    """An op resolved to concrete arguments (the same for every cache under test)."""

    kind: str  # "write" | "pin" | "read" | "reset" | "can_direct"
    start: int = 0
    n: int = 0
    h0: int | None = None
    h: int = 0
    recent: int | None = None
    wid: int = 0


def resolve(op: Op, oracle: OracleCache, wid: int) -> Call:
    H = oracle.num_heads
    if isinstance(op, Write):
        h = H if op.h is None else op.h
        if op.mode == "advance":
            start, n = oracle.global_end, op.n
        elif op.mode == "skip":
            start, n = max(0, oracle.global_end + op.delta), op.n
        else:
            start = oracle.cur_start if oracle.cur_start is not None else 0
            n = oracle.cur_n if oracle.cur_start is not None else op.n
            if op.mode == "resize":
                n = max(1, n + op.delta)
        return Call("write", start=start, n=n, h0=op.h0, h=h, recent=op.recent, wid=wid)
    if isinstance(op, Pin):
        return Call("pin", n=oracle.cur_n if op.n is None else op.n)
    if isinstance(op, Read):
        return Call("read", h0=op.h0, h=H if op.h is None else op.h, recent=op.recent)
    if isinstance(op, Reset):
        return Call("reset")
    return Call("can_direct", n=op.n)


def apply_to_cache(cache: Any, spec: CausalCacheSpec, call: Call) -> Any:
    """Run ``call`` on a cache; return its result (a view, a bool or None)."""
    if call.kind == "write":
        k, v = encode_kv(spec, call.start, call.n, call.h0 or 0, call.h, call.wid)
        return cache.update_and_get_attention_kv(
            key=k,
            value=v,
            current_chunk_start=call.start,
            cache_head_start=call.h0,
            recent_window_tokens=call.recent,
            debug_name="prop",
        )
    if call.kind == "pin":
        return cache.pin_current_chunk(call.n)
    if call.kind == "read":
        return cache.get_attention_kv(
            cache_head_start=call.h0, num_heads=call.h, recent_window_tokens=call.recent
        )
    if call.kind == "reset":
        return cache.reset_indices()
    return cache.can_direct_current_attention(call.n)


def apply_to_oracle(oracle: OracleCache, call: Call) -> Any:
    """Run ``call`` on the oracle; return the expected view / bool / None, or raise OracleError.

    On OracleError the oracle is unchanged (the call runs on a copy first).
    """
    if call.kind == "write":
        trial = oracle.clone()
        trial.write(call.start, call.n, call.h0, call.h, call.recent, call.wid)
        oracle.__dict__.update(trial.__dict__)
        h0 = call.h0 or 0
        return oracle.view(h0, h0 + call.h, call.recent)
    if call.kind == "pin":
        trial = oracle.clone()
        trial.pin(call.n)
        oracle.__dict__.update(trial.__dict__)
        return None
    if call.kind == "read":
        if call.recent is not None and call.recent < 0:
            raise OracleError("recent_window")
        h0 = call.h0 or 0
        return oracle.view(h0, h0 + call.h, call.recent)
    if call.kind == "reset":
        oracle.reset()
        return None
    return oracle.can_direct(call.n)


def cursors(view: Any) -> tuple[int, int, int, int]:
    return (
        view.local_start_index,
        view.local_end_index,
        view.visible_local_end,
        view.visible_global_end,
    )


def assert_view_matches(view: Any, ov: OracleView, spec: CausalCacheSpec, where: str) -> None:
    """Positions, cursors and exact K/V values of ``view`` against the oracle's."""
    got = view.positions.tolist()
    assert got == ov.positions, f"{where}: positions {runs_of(got)} != oracle {ov.ranges()}"
    assert view.positions.dtype == torch.int64, f"{where}: positions dtype {view.positions.dtype}"
    want = (ov.local_start_index, ov.local_end_index, ov.visible_local_end, ov.visible_global_end)
    assert cursors(view) == want, f"{where}: cursors {cursors(view)} != oracle {want}"
    ek, ev = expected_kv(ov, spec)
    shape = (spec.batch_size, len(ov.positions), len(ov.heads), spec.head_dim)
    for label, t, e in (("k", view.k, ek), ("v", view.v, ev)):
        assert tuple(t.shape) == shape, f"{where}: {label} shape {tuple(t.shape)} != {shape}"
        assert t.dtype == spec.dtype, f"{where}: {label} dtype {t.dtype} != {spec.dtype}"
        if not torch.equal(t.double().cpu(), e):
            bad = (t.double().cpu() != e).nonzero()[0].tolist()
            raise AssertionError(
                f"{where}: {label}[{bad}] = {t[tuple(bad)].item()} != {e[tuple(bad)].item()} "
                f"(position {ov.positions[bad[1]]}, head {ov.heads[bad[2]]}; "
                "channels: position, head, write id, batch)"
            )


def _expect_error(exc: BaseException | None, err: OracleError, where: str) -> None:
    assert exc is not None, f"{where}: oracle expects an error ({err}), the cache raised nothing"
    if err.reasons == {"recent_window"}:
        assert isinstance(exc, ValueError), f"{where}: expected ValueError, got {exc!r}"
    else:
        assert isinstance(exc, CacheWriteError), (
            f"{where}: expected CacheWriteError ({err}), got {exc!r}"
        )


def run_sequence(
    make_cache: Callable[[CausalCacheSpec], Any],
    spec: CausalCacheSpec,
    ops: Sequence[Op],
    *,
    check_resident_nbytes: bool = True,
) -> OracleCache:
    """Drive ``make_cache(spec)`` through ``ops``; after every op compare with the oracle.

    Checks: errors (kind and that the cache is unchanged: its next views and ops still
    match the oracle), the returned view of every write/read (positions, cursors, k, v),
    the full-head view after every op, ``global_end``, ``can_direct_current_attention`` and
    (dense layout) ``resident_nbytes``. Returns the final oracle.
    """
    cache = make_cache(spec)
    oracle = OracleCache.from_spec(spec)
    for step, op in enumerate(ops):
        where = f"op {step} {op}"
        call = resolve(op, oracle, wid=step + 1)
        try:
            expected = apply_to_oracle(oracle, call)
            err = None
        except OracleError as e:
            expected, err = None, e
        try:
            got = apply_to_cache(cache, spec, call)
            exc = None
        except ValueError as e:
            got, exc = None, e
        if err is not None:
            _expect_error(exc, err, f"{where} {call}")
        else:
            assert exc is None, f"{where} {call}: unexpected {exc!r}"
            if isinstance(expected, OracleView):
                assert_view_matches(got, expected, spec, f"{where} {call}")
            elif call.kind == "can_direct":
                assert got is expected, f"{where}: can_direct_current_attention {got} != {expected}"
        assert cache.global_end == oracle.global_end, f"{where}: global_end"
        assert_view_matches(cache.get_attention_kv(), oracle.view(), spec, f"{where} full view")
        if check_resident_nbytes:
            assert cache.resident_nbytes() == oracle.resident_nbytes(), f"{where}: resident_nbytes"
    return oracle


def assert_views_equal(a: Any, b: Any, where: str) -> None:
    """Two views are the same bit for bit: positions, cursors, k, v (dtype included)."""
    assert torch.equal(a.positions, b.positions), f"{where}: positions differ"
    assert cursors(a) == cursors(b), f"{where}: cursors {cursors(a)} != {cursors(b)}"
    for label in ("k", "v"):
        ta, tb = getattr(a, label), getattr(b, label)
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{where}: {label} dtype/shape"
        assert torch.equal(ta, tb), f"{where}: {label} differs"


def assert_caches_agree(
    make_a: Callable[[CausalCacheSpec], Any],
    make_b: Callable[[CausalCacheSpec], Any],
    spec: CausalCacheSpec,
    ops: Sequence[Op],
    *,
    compare_views: Callable[[Any, Any, str], None] = assert_views_equal,
) -> tuple[Any, Any]:
    """Apply the same calls to two caches; their results must be identical bit for bit.

    Errors must match in type; views (returned and full-head after every op) must agree
    under ``compare_views`` (default: positions, cursors, k and v bit for bit);
    ``global_end`` and ``can_direct_current_attention`` too. The oracle only turns relative
    ops into concrete arguments here. Returns the two caches.
    """
    a, b = make_a(spec), make_b(spec)
    tracker = OracleCache.from_spec(spec)
    for step, op in enumerate(ops):
        where = f"op {step} {op}"
        call = resolve(op, tracker, wid=step + 1)
        with contextlib.suppress(OracleError):
            apply_to_oracle(tracker, call)
        results = []
        for cache in (a, b):
            try:
                results.append((apply_to_cache(cache, spec, call), None))
            except ValueError as e:
                results.append((None, e))
        (ra, ea), (rb, eb) = results
        assert type(ea) is type(eb), f"{where}: errors differ: {ea!r} vs {eb!r}"
        if ea is None:
            if call.kind in ("write", "read"):
                compare_views(ra, rb, where)
            else:
                assert ra == rb, f"{where}: {ra!r} != {rb!r}"
        assert a.global_end == b.global_end, f"{where}: global_end"
        compare_views(a.get_attention_kv(), b.get_attention_kv(), f"{where} full view")
    return a, b


# ---- hypothesis strategies ----------------------------------------------------------


@st.composite
def specs(draw: st.DrawFn, dtype: torch.dtype = torch.float32) -> CausalCacheSpec:
    """Tiny specs: B <= 2, H <= 4, D = 4, cache <= 20 tokens, every sink/window/growth mode."""
    cache_size = draw(st.integers(1, 20))
    sink = draw(st.integers(0, min(cache_size, 8)))
    global_sink = draw(st.integers(0, sink))
    window = draw(st.none() | st.integers(1, cache_size))
    return CausalCacheSpec(
        batch_size=draw(st.integers(1, 2)),
        num_heads=draw(st.integers(1, 4)),
        head_dim=4,
        cache_size=cache_size,
        sink_tokens=sink,
        global_sink_tokens=global_sink,
        attention_window_size=window,
        dtype=dtype,
        allow_growth=draw(st.booleans()),
    )


def ops_for(spec: CausalCacheSpec, *, errors: bool = True) -> st.SearchStrategy[Op]:
    """One op; mostly valid, with invalid writes and pins mixed in when ``errors``."""
    return _ops_for(spec.num_heads, errors)


@functools.cache
def _ops_for(H: int, errors: bool) -> st.SearchStrategy[Op]:
    # Built once per head count: hypothesis validates a fresh strategy on every draw.
    n = st.integers(1, 8)
    recent = st.none() | st.integers(0, 24)

    @st.composite
    def heads(draw: st.DrawFn) -> tuple[int | None, int | None]:
        if draw(st.booleans()):
            return None, None
        h0 = draw(st.integers(0, H - 1))
        return h0, draw(st.integers(1, H - h0))

    @st.composite
    def write(draw: st.DrawFn, mode: str) -> Write:
        h0, h = draw(heads())
        return Write(mode, n=draw(n), h0=h0, h=h, recent=draw(recent))

    @st.composite
    def read(draw: st.DrawFn) -> Read:
        h0, h = draw(heads())
        return Read(h0=h0, h=h, recent=draw(recent))

    valid = [
        *[write("advance")] * 5,
        write("rewrite"),
        write("rewrite"),
        st.just(Pin()),  # pin the chunk just written (the LongLive 2.0 scene cut)
        st.just(Pin()),
        st.just(Pin(0)),  # clears the pin: the stream-start sink is the sink again
        st.builds(Pin, st.integers(-1, 12)),  # other sizes
        read(),
        read(),
        st.just(Reset()),
        st.builds(CanDirect, st.integers(0, 10)),
    ]
    if not errors:
        return st.one_of(*valid)
    invalid = [
        st.builds(Write, st.just("resize"), n=n, delta=st.sampled_from([-2, -1, 1, 3])),
        st.builds(Write, st.just("skip"), n=n, delta=st.sampled_from([-3, -1, 1, 2])),
        st.builds(
            Write, st.just("advance"), n=n, h0=st.integers(0, H), h=st.integers(H, H + 1)
        ),  # head slice outside the cache's heads (unless h0 == 0 and h == H)
        st.builds(Write, st.just("rewrite"), n=n, recent=st.just(-1)),
    ]
    return st.one_of(*valid, *invalid)


@functools.cache
def _op_lists(H: int, errors: bool, max_ops: int) -> st.SearchStrategy[list[Op]]:
    return st.lists(_ops_for(H, errors), min_size=max_ops // 3, max_size=max_ops)


@st.composite
def scenarios(
    draw: st.DrawFn, dtype: torch.dtype = torch.float32, max_ops: int = 24, errors: bool = True
) -> tuple[CausalCacheSpec, list[Op]]:
    """A spec and a sequence of ops for it."""
    spec = draw(specs(dtype))
    ops = draw(_op_lists(spec.num_heads, errors, max_ops))
    return spec, ops


def examples(n: int) -> int:
    """Example count for a property test: ``n`` (profile ``ci``), or n/10 under ``dev``."""
    return max(10, n // 10) if settings.get_current_profile_name() == "dev" else n
