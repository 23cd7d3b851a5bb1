"""Bytes per setting (`plan_setting`) and the whole plan with the budget search (`plan_memory`).

`plan_setting` models one layer's segment store as bytes (`_Seg`): per chunk the positions the
cache's cursor model holds (`causalkv.memory.layout.positions`), the cache's
`PackingPolicy` (a `CacheModel` gives both, and its centroid rule), then the store's own tier
policy (`causalkv.caches.qvg.tiering.TierPolicy`) deciding what is packed by
which codec in which spans; the bytes of a packed span are the codec's ``nbytes`` formula, a
shared codebook counted once. No tiering rule lives here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from causalkv.caches import intervals as iv
from causalkv.caches.codecs import make_codec
from causalkv.caches.codecs.base import CodecError
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.tiering import (
    BookState,
    Packed,
    TierPolicy,
    TierSegment,
    codec_for,
    keep_held,
)
from causalkv.config import DTYPE_BYTES
from causalkv.errors import ConfigError, first_line
from causalkv.memory.geometry import ModelGeometry
from causalkv.memory.layout import (
    ChunkState,
    min_window,
    plannable,
    positions,
    request_latent_frames,
    stream_layout,
)
from causalkv.memory.records import (
    SETTINGS,
    CacheModel,
    MemoryRequest,
    Setting,
    StreamLayout,
    attention_of,
    check_budget,
)


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SettingPlan:
    """One setting's figures for one request (bytes; all layers and CFG sets).

    Attributes:
        setting: the row's name.
        kv_bytes: the most held after any chunk's context pass.
        peak_bytes: the most held at once (the module docstring): at most ``kv_bytes`` plus
            the largest one-call buffer (`transient_bytes`).
        dense_bytes: what sglang's dense cache allocates for the request.
        chunk_bytes: one layer's K/V of one chunk, dense.
        transient_bytes: one layer's largest visible window gathered dense.
        resident_per_chunk: per chunk, one layer's resident bytes after its context pass.
        tiers_per_chunk: per chunk, the tier of every chunk held (chunk -> ``"bf16"``,
            ``"int4"``, ``"int2"``).
        fits: ``peak_bytes <= budget`` (None without a budget).
        max_window_frames / max_video_frames: the budget answer (None without a budget, or
            when even the smallest does not fit).
        at_search_limit: the answer is the longest the search tries (`MAX_SEARCH_FRAMES`,
            `MAX_WORK`) and it fits: the true answer is at least that.
    """

    setting: str
    kv_bytes: int
    peak_bytes: int
    dense_bytes: int
    chunk_bytes: int
    transient_bytes: int
    resident_per_chunk: tuple[int, ...] = ()
    tiers_per_chunk: tuple[Mapping[int, str], ...] = ()
    fits: bool | None = None
    max_window_frames: int | None = None
    max_video_frames: int | None = None
    at_search_limit: bool = False

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.dense_bytes

    @property
    def peak_ratio(self) -> float:
        return self.peak_bytes / self.dense_bytes

    def as_json(self, budget: int | None, window_is_video: bool) -> dict[str, Any]:
        keys = ["setting", "kv_bytes", "dense_bytes", "peak_bytes", "chunk_bytes", "transient_bytes",
                "kv_ratio", "peak_ratio"]
        if budget is not None:
            keys += ["fits", "max_video_frames" if window_is_video else "max_window_frames"]
            if self.at_search_limit:  # it fits there: the search stopped, the answer is more
                keys.append("at_search_limit")
        return {k: round(getattr(self, k), 6) if k.endswith("_ratio") else getattr(self, k) for k in keys}


def _call_buffers(
    cs: ChunkState, segs: Sequence[_Seg], n: int, cache: CacheModel, attention: str
) -> tuple[int, int, bool]:
    """``(denoising, context, after the move)``: tokens of the one-call buffer of chunk
    ``cs.index``'s denoising passes (probes) and context pass (the commit; both read chunk
    i-1's layout, ``segs``, plus the chunk's own K/V), and whether the context pass fills it
    after the layer moved the chunk to its tier.

    A window that is the chunk alone is read as views (no buffer). A cache without lazy
    views (`CacheModel.lazy_views`) gathers the window when the call is done (after the
    move). A lazy view builds it when the view is made (before the move) if nothing packed
    is visible and the move drops nothing the view shows; otherwise when it is read:
    gathered (``view.k``) or streamed (one packed segment decoded at a time, the dense
    pieces views), both after the move.
    """
    chunk = ((cs.index * n, (cs.index + 1) * n),)
    if not iv.subtract(cs.seen, chunk):
        return 0, 0, True
    if not cache.lazy_views:
        return cs.visible, cs.visible, True
    packed = max((iv.count(iv.intersect(s.run, cs.seen)) for s in segs if s.packed), default=0)
    if packed:
        return (cs.visible,) * 2 + (True,) if attention == "gathered" else (packed, packed, True)
    if not iv.subtract(cs.seen, cs.held):  # built when made, on both passes
        return cs.visible, cs.visible, False
    return cs.visible, cs.visible if attention == "gathered" else 0, True


@dataclass(frozen=True)
class _Book(BookState):
    """The tier policy's codebook as bytes: its ``id`` (a `_Seg`'s ``book``) and the bytes of
    its centroids, which the store counts once (``shared``)."""

    id: int = -1
    shared: int = 0


@dataclass(frozen=True, slots=True)
class _Seg(TierSegment):
    """A segment of one layer's store, as bytes (`causalkv.caches.qvg.tiering.TierSegment`):
    positions ``[start, end)`` of chunks ``first_chunk..last_chunk``, dense (``codec`` bf16)
    or packed (its stored bytes; ``book``: the shared codebook it references, whose
    ``shared`` bytes the store counts once)."""

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    codec: str = "bf16"
    recent: bool = False
    nbytes: int = 0
    book: int = -1
    shared: int = 0
    packed: bool = False
    rewritten: bool = False  # a planned stream never writes into a packed chunk


def _resident(segs: Sequence[_Seg], per_token: int) -> int:
    """One layer's bytes held, a shared codebook counted once (`SegmentStore.resident_nbytes`):
    every packed segment's bytes include its book's ``shared`` bytes."""
    dense = sum(s.end - s.start for s in segs if not s.packed) * per_token
    books = [(s.book, s.shared) for s in segs if s.packed and s.book >= 0]
    repeats = sum(shared for _, shared in books) - sum(dict(books).values())
    return dense + sum(s.nbytes for s in segs if s.packed) - repeats


def plan_setting(
    geom: ModelGeometry, lay: StreamLayout, setting: Setting, *, cache: CacheModel,
    dtype: str = "bfloat16", batch_size: int = 1, sink: bool = True,
    states: Sequence[ChunkState] | None = None, record: bool = True,
    attention: str | None = None, quant: QVGKVQuantArgs | None = None,
) -> SettingPlan:
    """``setting``'s figures for the stream ``lay`` held by ``cache`` (see the module
    docstring); ``states``: `positions` of ``lay`` for ``cache.positions`` when already
    computed; ``record``: keep the per-chunk tiers; ``attention``: how a call reads its
    window (`ATTENTION`; None: the cache's way); ``quant``: settings to plan instead of the
    row's (spans, shared codebooks, a sink span).

    Each chunk's context pass is the store's: its held positions trimmed as the cache's
    cursor model says, then the cache's `PackingPolicy` and the store's own tier policy
    (`causalkv.caches.qvg.tiering.TierPolicy`, with the cache's centroid rule) decide what
    is packed, counted by the codec's ``nbytes`` formula."""
    attention = attention_of(cache, attention)
    B, H, D = batch_size, geom.num_heads, geom.head_dim
    item = DTYPE_BYTES[dtype]
    n = lay.chunk_tokens
    states = positions(lay, cache.positions) if states is None else states
    per_token = 2 * B * H * D * item  # K and V of one token, one layer, dense
    LS = geom.num_layers * lay.sets  # the layers of every cache set
    q = setting.quant_args(sink=sink) if quant is None else quant.validate()
    q.check_layout(D)
    tiering = TierPolicy(q, cache.min_tokens_per_centroid, B, H, D, item)
    segs: list[_Seg] = []
    book: _Book | None = None
    books = itertools.count(1)
    resident: list[int] = []
    tiers: list[dict[int, str]] = []

    def pack(step: Packed[_Seg], book: _Book | None) -> tuple[_Seg, _Book | None]:
        """A packed step as bytes, and the codebook after it (its id and shared bytes)."""
        sq, after = step.quant, step.book_after
        seg = _Seg(step.pieces[0].start, step.pieces[-1].end, step.pieces[0].first_chunk,
                   step.pieces[-1].last_chunk, sq.codec, step.recent, packed=True)
        if step.tier:
            after = book  # a recency-tier pack leaves the codebook as it is
        elif step.joins_book and book is not None:  # assigned to the book's centroids
            sq = replace(sq, centroids=book.centroids)
            after = _Book(after.chunks, after.centroids, book.id, book.shared)
            seg = replace(seg, book=book.id, shared=book.shared)
        elif after is not None:  # a new codebook
            shared = 2 * codec_for(sq).shared_nbytes((B, H, step.tokens, D))
            after = _Book(after.chunks, after.centroids, next(books), shared)
            seg = replace(seg, book=after.id, shared=shared)
        return replace(seg, nbytes=tiering.packed_nbytes(sq, step.tokens)), after

    # per chunk, the tokens of the one-call buffer of its denoising passes and of its context
    # pass (both read chunk i-1's layout plus the chunk's own K/V), and whether the context
    # pass fills its buffer after the layer's move (True) or before it
    window: list[tuple[int, int, bool]] = []
    for cs in states:
        window.append(_call_buffers(cs, segs, n, cache, attention))
        segs.append(_Seg(cs.index * n, (cs.index + 1) * n, cs.index, cs.index))
        segs = keep_held(segs, cs.held, lambda seg, a, b: replace(seg, start=a, end=b))
        if book is not None and all(s.book != book.id for s in segs):
            book = None  # every segment using it rolled out: a fresh one next
        if q.enabled:
            ahead = cs.index + 1  # the chunk after this one: every chunk held is completed
            segs, book, _ = tiering.settle(cache.policy, segs, ahead, book, pack,
                                           sink_end=cs.sink_end, pinned=cs.pinned,
                                           sink_open=cs.sink_end > ahead * n, chunk_tokens=n)
        resident.append(_resident(segs, per_token))
        if record:
            tiers.append({c: s.codec for s in segs for c in s.chunks})
    # while chunk i is generated every layer holds chunk i-1's context (its denoising passes:
    # probes store nothing),
    # then, layer by layer, chunk i's (its context pass): when layer j fills its buffer, the
    # layers before it (and, when it fills it after its move, layer j too) hold chunk i's
    # context (``held``), the others chunk i-1's (``other``); the most over j is at one end
    transient = peak = 0
    for before, after, (deno, ctx, moved) in zip((0, *resident), resident, window):
        held, other = (after, before) if moved else (before, after)
        transient = max(transient, max(deno, ctx) * per_token)
        peak = max(peak, LS * before + deno * per_token, LS * after,
                   max(LS * held, held + (LS - 1) * other) + ctx * per_token)
    return SettingPlan(
        setting=setting.name, kv_bytes=LS * max(resident, default=0), peak_bytes=peak,
        dense_bytes=LS * lay.cache_tokens * per_token, chunk_bytes=n * per_token,
        transient_bytes=transient, resident_per_chunk=tuple(resident), tiers_per_chunk=tuple(tiers),
    )


# ---------------------------------------------------------------------------------------------
# The plan and the budget
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """`plan_memory`'s answer: the request's layout and one `SettingPlan` per setting."""

    geometry: ModelGeometry
    request: MemoryRequest
    cache: CacheModel
    layout: StreamLayout
    rows: tuple[SettingPlan, ...]
    budget: int | None = None
    #: ``(setting, why)`` of each codec setting left out of an all-settings plan because its
    #: codec cannot be used (a plugin codec that does not import or failed its conformance check)
    left_out: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> list[dict[str, Any]]:
        return [r.as_json(self.budget, self.geometry.window_is_video) for r in self.rows]


#: the budget search stops here (latent frames)
MAX_SEARCH_FRAMES = 1 << 16


def _peak_at(geom: ModelGeometry, req: MemoryRequest, cache: CacheModel, setting: Setting,
             window: int, memo: dict[int, Any]) -> int:
    """``setting``'s peak bytes with a ``window``-frame window once that window is full (the
    request is lengthened to fill it when shorter; a window-is-video model's video is the
    window)."""
    if window not in memo:  # the positions are the same for every setting
        r = replace(req, frames=None, seconds=None, fps=None,
                    latent_frames=_filled(geom, req, window), window_frames=window)
        lay = stream_layout(geom, r)  # valid: the search starts at the smallest valid window
        memo[window] = (lay, positions(lay, cache.positions), {})
    lay, states, peaks = memo[window]
    if setting.name not in peaks:
        peaks[setting.name] = plan_setting(
            geom, lay, setting, cache=cache, dtype=req.dtype, batch_size=req.batch_size,
            sink=req.sink, states=states, record=False, attention=req.attention,
        ).peak_bytes
    return peaks[setting.name]


def _filled(geom: ModelGeometry, req: MemoryRequest, window: int) -> int:
    """The latent frames `_peak_at` plans for a ``window``-frame window: the request's,
    lengthened to fill the window and two chunks after it when shorter (a window-is-video
    model's video is the window)."""
    if geom.window_is_video:
        return window
    return max(request_latent_frames(geom, req)[0], window + 2 * geom.frames_per_chunk)


def _search_top(geom: ModelGeometry, req: MemoryRequest, smallest: int) -> int:
    """The longest window the search tries: within `MAX_SEARCH_FRAMES`, and `plannable` with
    the request lengthened as `_peak_at` does (the work grows with the window)."""
    fpc = geom.frames_per_chunk

    def within(w: int) -> bool:
        return plannable(_filled(geom, req, w) // fpc, w // fpc)

    hi = max(smallest, MAX_SEARCH_FRAMES // fpc * fpc)
    return hi if within(hi) else _bisect(smallest, hi, fpc, within)


def _bisect(lo: int, hi: int, fpc: int, ok: Callable[[int], bool]) -> int:
    """The last chunk multiple from ``lo`` before ``hi`` where ``ok`` holds (``ok(lo)``, not
    ``ok(hi)``; ``ok`` holds up to a window and not after it)."""
    while hi - lo > fpc:
        mid = lo + (hi - lo) // (2 * fpc) * fpc
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _longest(geom: ModelGeometry, req: MemoryRequest, cache: CacheModel, setting: Setting,
             budget: int, smallest: int, memo: dict[int, Any]) -> int | None:
    """The longest window (chunk multiple, >= ``smallest``, <= `MAX_SEARCH_FRAMES`) whose
    peak fits ``budget``; None when ``smallest`` does not fit.

    The bytes grow with the window, about linearly once it is full: the search starts at the
    linear guess from two windows, gallops to a window that fits and one that does not, and
    bisects between them (every step an exact evaluation).
    """
    fpc = geom.frames_per_chunk
    top = _search_top(geom, req, smallest)

    def fits(w: int) -> bool:
        return _peak_at(geom, req, cache, setting, w, memo) <= budget

    if not fits(smallest):
        return None
    # secant steps on the peak (about affine in the window once it is full)
    pts = [(w, _peak_at(geom, req, cache, setting, w, memo))
           for w in dict.fromkeys((smallest, min(top, smallest + 4 * fpc)))]
    guess = smallest
    for _ in range(4):
        (wa, pa), (wb, pb) = pts[-2] if len(pts) > 1 else pts[-1], pts[-1]
        if wb == wa or pb <= pa:
            break
        guess = int(wb + (budget - pb) * (wb - wa) / (pb - pa)) // fpc * fpc
        guess = min(top, max(smallest, guess))
        if guess in (wa, wb):
            break
        pts.append((guess, _peak_at(geom, req, cache, setting, guess, memo)))
    step = fpc
    if fits(guess):
        lo = guess
        while lo < top and fits(min(top, lo + step)):
            lo, step = min(top, lo + step), step * 2
        hi = min(top, lo + step)  # lo itself once lo is the top
    else:
        hi = guess
        while hi - step > smallest and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(smallest, hi - step)
    return _bisect(lo, hi, fpc, fits)


def _unusable(codec: str | None) -> bool:
    """Whether codec setting ``codec`` cannot be made at all (its target does not import, or
    it fails its conformance check): False for None (off) and ``"bf16"``."""
    if codec in (None, "bf16"):
        return False
    try:
        make_codec(codec, QVGKVQuantArgs(codec=codec))
    except (CodecError, ConfigError):
        return True
    return False


def plan_memory(
    geom: ModelGeometry, req: MemoryRequest, cache: CacheModel, *,
    settings: Iterable[str] | None = None, budget: int | None = None,
) -> MemoryPlan:
    """Every setting's figures for ``req`` held by ``cache`` (`causalkv.memory.cache_models`;
    and, with ``budget`` in bytes, whether it fits and the longest window, or video for a
    window-is-video model, that fits).

    ``settings`` None plans every registered setting; one whose codec cannot be used (a plugin
    codec that does not import or fails its conformance check) is left out and named in
    `MemoryPlan.left_out` with why, so one broken plugin does not hide the other rows. A
    setting named in ``settings`` is planned or its error raised."""
    names = list(SETTINGS) if settings is None else list(settings)
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        raise ConfigError(
            f"--setting {', '.join(unknown)} is not a setting; choose among {', '.join(SETTINGS)}"
        )
    if not names:
        raise ConfigError(f"no setting chosen; pass --setting among {', '.join(SETTINGS)}")
    check_budget(budget)
    lay = stream_layout(geom, req)
    attention_of(cache, req.attention)
    states = positions(lay, cache.positions)
    rows = []
    fpc = geom.frames_per_chunk
    smallest = -(-min_window(geom, bool(lay.pins)) // fpc) * fpc
    memo: dict[int, Any] = {}
    left_out = []
    for name in dict.fromkeys(names):
        try:
            row = plan_setting(geom, lay, SETTINGS[name], cache=cache, dtype=req.dtype,
                               batch_size=req.batch_size, sink=req.sink, states=states,
                               attention=req.attention)
        except (CodecError, ConfigError) as exc:
            codecs = (SETTINGS[name].codec, SETTINGS[name].recent_tier)
            if settings is not None or not any(map(_unusable, codecs)):
                raise
            left_out.append((name, first_line(exc)))
            continue
        if budget is not None:
            best = _longest(geom, req, cache, SETTINGS[name], budget, smallest, memo)
            row = replace(
                row, fits=row.peak_bytes <= budget,
                max_window_frames=None if geom.window_is_video else best,
                max_video_frames=best if geom.window_is_video else None,
                at_search_limit=best is not None and best == _search_top(geom, req, smallest),
            )
        rows.append(row)
    return MemoryPlan(geom, req, cache, lay, tuple(rows), budget, tuple(left_out))
