"""Bytes per setting (`plan_setting`) and the whole plan with the budget search (`plan_memory`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from causalkv.caches import intervals as iv
from causalkv.caches.codecs import make_codec
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.policy import (
    CAUSALKV,
    RECENT,
    SGLANG,
    SINK,
    ChunkInfo,
    PackingPolicy,
    centroids_for,
)
from causalkv.errors import ConfigError, check_int
from causalkv.runtime.memory.geometry import ModelGeometry
from causalkv.runtime.memory.layout import (
    MAX_CHUNKS,
    MAX_WORK,
    ChunkState,
    plan_work,
    positions,
    request_latent_frames,
    stream_layout,
)
from causalkv.runtime.memory.records import (
    DTYPE_BYTES,
    SETTINGS,
    MemoryRequest,
    Setting,
    StreamLayout,
    attention_of,
)


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SettingPlan:
    """One setting's figures for one request (bytes; all layers and CFG sets).

    Attributes:
        setting: the row's name.
        kv_bytes: the most held after any chunk's context pass, plus the scratch.
        peak_bytes: the most held at once (the module docstring): at most ``kv_bytes`` plus
            the largest one-call buffer (`transient_bytes`).
        dense_bytes: what sglang's dense cache allocates for the request.
        scratch_bytes: the shared buffer of the chunk being generated.
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
    scratch_bytes: int
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
        out: dict[str, Any] = {
            "setting": self.setting, "kv_bytes": self.kv_bytes, "dense_bytes": self.dense_bytes,
            "peak_bytes": self.peak_bytes, "scratch_bytes": self.scratch_bytes,
            "transient_bytes": self.transient_bytes,
            "kv_ratio": round(self.kv_ratio, 6), "peak_ratio": round(self.peak_ratio, 6),
        }
        if budget is not None:
            out["fits"] = self.fits
            key = "max_video_frames" if window_is_video else "max_window_frames"
            out[key] = self.max_video_frames if window_is_video else self.max_window_frames
            if self.at_search_limit:  # it fits there: the search stopped, the answer is more
                out["at_search_limit"] = True
        return out


def _policy(host: str) -> PackingPolicy:
    return SGLANG if host == "sglang" else CAUSALKV


def _packed_nbytes(b: int, h: int, s: int, d: int, q: QVGKVQuantArgs, host: str) -> int:
    """K and V of a span of ``s`` tokens packed with ``q`` (the host's centroid rule)."""
    if host == "causalkv":
        k = centroids_for(s, q.centroids)
        if k != q.centroids:
            q = replace(q, centroids=k)
    return 2 * make_codec(q.codec, q).nbytes((b, h, s, d))


def _call_buffers(
    cs: ChunkState, store: Mapping[int, _Held], n: int, host: str, attention: str
) -> tuple[int, int, bool]:
    """``(denoising, context, after the move)``: tokens of the one-call buffer of chunk
    ``cs.index``'s denoising and context passes (both read chunk i-1's layout, whose tiers
    ``store`` holds, plus the chunk in the scratch), and whether the context pass fills it
    after the layer moved the chunk to its tier.

    A window that is the chunk alone is read as views (no buffer). The bridge gathers the
    window when the call is done (after the move). causalkv's own cache builds it when the
    view is made (before the move) if nothing packed is visible and the move drops nothing
    the view shows; otherwise when it is read: gathered (``view.k``) or streamed (one packed
    segment decoded at a time, the dense pieces views), both after the move.
    """
    chunk = ((cs.index * n, (cs.index + 1) * n),)
    if not iv.subtract(cs.seen, chunk):
        return 0, 0, True
    if host == "sglang":
        return cs.visible, cs.visible, True
    packed = max((iv.count(iv.intersect((h.span,), cs.seen))
                  for h in store.values() if h.tier != "bf16"), default=0)
    if packed:
        return (cs.visible,) * 2 + (True,) if attention == "gathered" else (packed, packed, True)
    if not iv.subtract(cs.seen, cs.held):  # built when made, on both passes
        return cs.visible, cs.visible, False
    return cs.visible, cs.visible if attention == "gathered" else 0, True


@dataclass
class _Held:
    """A chunk in one layer's store: its tier and, once packed, its bytes (kept whole)."""

    tier: str  # "bf16" or a codec setting ("int2", "fp8", ...)
    nbytes: int = 0  # packed bytes (a packed chunk is kept whole until all of it rolled out)
    span: tuple[int, int] = (0, 0)  # the positions it was packed from

    @property
    def tokens(self) -> int:
        return self.span[1] - self.span[0]


def plan_setting(
    geom: ModelGeometry, lay: StreamLayout, setting: Setting, *, host: str = "sglang",
    dtype: str = "bfloat16", batch_size: int = 1, sink: bool = True,
    states: Sequence[ChunkState] | None = None, record: bool = True,
    attention: str | None = None,
) -> SettingPlan:
    """``setting``'s figures for the stream ``lay`` (see the module docstring); ``states``:
    `positions` of ``lay`` when already computed; ``record``: keep the per-chunk tiers;
    ``attention``: how a call reads its window (`ATTENTION`; None: the host's way)."""
    attention = attention_of(host, attention)
    B, H, D = batch_size, geom.num_heads, geom.head_dim
    item = DTYPE_BYTES[dtype]
    n = lay.chunk_tokens
    states = positions(lay, host) if states is None else states
    per_token = 2 * B * H * D * item  # K and V of one token, one layer, dense
    scratch = n * per_token
    sets_layers = geom.num_layers * lay.sets
    dense_bytes = sets_layers * lay.cache_tokens * 2 * B * H * D * item
    q = setting.quant_args(sink=sink)
    q.check_layout(D)
    tier_codec = setting.recent_tier
    q_tier = replace(q, codec=tier_codec) if q.enabled and tier_codec != "bf16" else q
    policy = _policy(host)
    main = q.codec
    store: dict[int, _Held] = {}
    resident: list[int] = []
    tiers: list[dict[int, str]] = []
    infos_seen: dict[tuple[int, int, int, bool, bool], ChunkInfo] = {}
    packed_of: dict[tuple[str, int], int] = {}  # (codec, tokens) -> packed bytes

    def packed(codec: str, tokens: int) -> int:
        key = (codec, tokens)
        if key not in packed_of:
            packed_of[key] = _packed_nbytes(B, H, tokens, D, q if codec == main else q_tier, host)
        return packed_of[key]

    # per chunk, the tokens of the one-call buffer of its denoising passes and of its context
    # pass (both read chunk i-1's layout plus the chunk in the scratch), and whether the
    # context pass fills its buffer after the layer's move (True) or before it
    window: list[tuple[int, int, bool]] = []
    for cs in states:
        window.append(_call_buffers(cs, store, n, host, attention))
        # the chunks held (ascending), each with its held part: (chunk, start, end, tokens)
        held: list[tuple[int, int, int, int]] = []
        for a, b in cs.held:
            for c in range(a // n, (b - 1) // n + 1):
                lo, hi = max(a, c * n), min(b, (c + 1) * n)
                if held and held[-1][0] == c:  # a chunk cut in two by a rolled-out range
                    c0, lo0, _, t0 = held.pop()
                    held.append((c, lo0, hi, t0 + hi - lo))
                else:
                    held.append((c, lo, hi, hi - lo))
        live = {c for c, *_ in held}
        for c in [c for c in store if c not in live]:
            del store[c]  # every position rolled out: freed
        store.setdefault(cs.index, _Held("bf16"))
        if q.enabled:
            infos = []
            for c, lo, hi, _t in held:
                if store[c].tier != "bf16":  # a packed chunk is its whole segment to the policy
                    lo, hi = store[c].span
                is_pinned = bool(cs.pinned) and bool(iv.intersect(((lo, hi),), cs.pinned))
                key = (c, lo, hi, lo < cs.sink_end, is_pinned)
                info = infos_seen.get(key)
                if info is None:
                    info = infos_seen[key] = ChunkInfo(c, lo, hi, sink=key[3], pinned=is_pinned)
                infos.append(info)
            decision = policy.decide(q, tuple(infos), cs.index + 1,
                                     sink_open=cs.sink_end > (cs.index + 1) * n, chunk_tokens=n)
            if decision.groups:
                raise ConfigError("causalkv memory models sink_span='chunk' only")
            for c, lo, hi, tokens in held:
                h = store[c]
                if h.tier == main:
                    continue  # packed at the main bits: never again
                reason = decision.dense.get(c)
                if reason is None:  # cold: packed at the main bits (re-packed from the tier)
                    span = (lo, hi) if h.tier == "bf16" else h.span
                    nb = packed(main, span[1] - span[0])
                    if nb < (span[1] - span[0]) * per_token:
                        store[c] = _Held(main, nb, span)
                elif tier_codec != "bf16" and h.tier == "bf16" and reason in (RECENT, SINK):
                    nb = packed(tier_codec, tokens)
                    if nb < tokens * per_token:
                        store[c] = _Held(tier_codec, nb, (lo, hi))
        total = 0
        for c, _lo, _hi, tokens in held:
            h = store[c]
            total += tokens * per_token if h.tier == "bf16" else h.nbytes
        resident.append(total)
        if record:
            tiers.append({c: store[c].tier for c, *_ in held})
    kv = sets_layers * max(resident, default=0) + scratch
    transient = max((max(deno, ctx) for deno, ctx, _ in window), default=0) * per_token
    # while chunk i is generated every layer holds chunk i-1's context (its denoising passes),
    # then, layer by layer, chunk i's (its context pass): when layer j fills its buffer, the
    # layers before it (and, when it fills it after its move, layer j too) hold chunk i's
    # context, the others chunk i-1's; the most over j is at one end
    LS = sets_layers

    def context(before: int, after: int, moved: bool) -> int:
        if moved:
            return max(LS * after, after + (LS - 1) * before)
        return max(LS * before, (LS - 1) * after + before)

    peak = max(
        (scratch + max(LS * before + deno * per_token, LS * after,
                       context(before, after, moved) + ctx * per_token)
         for before, after, (deno, ctx, moved) in zip((0, *resident), resident, window)),
        default=scratch,
    )
    return SettingPlan(
        setting=setting.name, kv_bytes=kv, peak_bytes=peak, dense_bytes=dense_bytes,
        scratch_bytes=scratch, transient_bytes=transient, resident_per_chunk=tuple(resident),
        tiers_per_chunk=tuple(tiers),
    )


# ---------------------------------------------------------------------------------------------
# The plan and the budget
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """`plan_memory`'s answer: the request's layout and one `SettingPlan` per setting."""

    geometry: ModelGeometry
    request: MemoryRequest
    layout: StreamLayout
    rows: tuple[SettingPlan, ...]
    budget: int | None = None

    def as_json(self) -> list[dict[str, Any]]:
        return [r.as_json(self.budget, self.geometry.window_is_video) for r in self.rows]


#: the budget search stops here (latent frames)
MAX_SEARCH_FRAMES = 1 << 16


def _peak_at(geom: ModelGeometry, req: MemoryRequest, setting: Setting, window: int,
             memo: dict[int, Any]) -> int:
    """``setting``'s peak bytes with a ``window``-frame window once that window is full (the
    request is lengthened to fill it when shorter; a window-is-video model's video is the
    window)."""
    fpc = geom.frames_per_chunk
    if window not in memo:  # the positions are the same for every setting
        if geom.window_is_video:
            latent = window
        else:
            latent = max(request_latent_frames(geom, req)[0], window + 2 * fpc)
        r = replace(req, frames=None, seconds=None, fps=None, latent_frames=latent,
                    window_frames=window)
        lay = stream_layout(geom, r)  # valid: the search starts at the smallest valid window
        memo[window] = (lay, positions(lay, req.host), {})
    lay, states, peaks = memo[window]
    if setting.name not in peaks:
        peaks[setting.name] = plan_setting(
            geom, lay, setting, host=req.host, dtype=req.dtype, batch_size=req.batch_size,
            sink=req.sink, states=states, record=False, attention=req.attention,
        ).peak_bytes
    return peaks[setting.name]


def _search_top(geom: ModelGeometry, req: MemoryRequest, smallest: int) -> int:
    """The longest window the search tries: within `MAX_SEARCH_FRAMES` and `MAX_WORK` (with the
    request lengthened as `_peak_at` does)."""
    fpc = geom.frames_per_chunk
    chunks = request_latent_frames(geom, req)[0] // fpc

    def work(w: int) -> int:
        slots = w // fpc
        n = slots if geom.window_is_video else max(chunks, slots + 2)
        return plan_work(n, slots) if n <= MAX_CHUNKS else MAX_WORK + 1

    lo, hi = smallest, max(smallest, MAX_SEARCH_FRAMES // fpc * fpc)
    if work(hi) <= MAX_WORK:
        return hi
    while hi - lo > fpc:  # work grows with the window
        mid = lo + (hi - lo) // (2 * fpc) * fpc
        lo, hi = (mid, hi) if work(mid) <= MAX_WORK else (lo, mid)
    return lo


def _longest(geom: ModelGeometry, req: MemoryRequest, setting: Setting, budget: int,
             smallest: int, memo: dict[int, Any]) -> int | None:
    """The longest window (chunk multiple, >= ``smallest``, <= `MAX_SEARCH_FRAMES`) whose
    peak fits ``budget``; None when ``smallest`` does not fit.

    The bytes grow with the window, about linearly once it is full: the search starts at the
    linear guess from two windows, gallops to a window that fits and one that does not, and
    bisects between them (every step an exact evaluation).
    """
    fpc = geom.frames_per_chunk
    top = _search_top(geom, req, smallest)

    def fits(w: int) -> bool:
        return _peak_at(geom, req, setting, w, memo) <= budget

    if not fits(smallest):
        return None
    # secant steps on the peak (about affine in the window once it is full)
    pts = [(w, _peak_at(geom, req, setting, w, memo))
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
        pts.append((guess, _peak_at(geom, req, setting, guess, memo)))
    step = fpc
    if fits(guess):
        lo = guess
        while lo < top and fits(min(top, lo + step)):
            lo = min(top, lo + step)
            step *= 2
        if lo >= top:
            return top
        hi = min(top, lo + step)
    else:
        hi = guess
        while hi - step > smallest and not fits(hi - step):
            hi -= step
            step *= 2
        lo = max(smallest, hi - step)
    while hi - lo > fpc:  # lo fits, hi does not
        mid = lo + (hi - lo) // (2 * fpc) * fpc
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def plan_memory(
    geom: ModelGeometry, req: MemoryRequest, *, settings: Iterable[str] | None = None,
    budget: int | None = None,
) -> MemoryPlan:
    """Every setting's figures for ``req`` (and, with ``budget`` in bytes, whether it fits and
    the longest window, or video for a window-is-video model, that fits)."""
    names = list(SETTINGS) if settings is None else list(settings)
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        raise ConfigError(
            f"--setting {', '.join(unknown)} is not a setting; choose among {', '.join(SETTINGS)}"
        )
    if not names:
        raise ConfigError(f"no setting chosen; pass --setting among {', '.join(SETTINGS)}")
    if budget is not None:
        check_int("--budget", budget, minimum=1, hint="pass e.g. 80GiB")
    lay = stream_layout(geom, req)
    attention_of(req.host, req.attention)
    states = positions(lay, req.host)
    rows = []
    fpc = geom.frames_per_chunk
    multi = bool(lay.pins)
    smallest = (geom.global_sink_frames + geom.sink_frames if multi else geom.sink_frames) + fpc
    smallest = -(-smallest // fpc) * fpc
    memo: dict[int, Any] = {}
    for name in dict.fromkeys(names):
        row = plan_setting(geom, lay, SETTINGS[name], host=req.host, dtype=req.dtype,
                           batch_size=req.batch_size, sink=req.sink, states=states,
                           attention=req.attention)
        if budget is not None:
            best = _longest(geom, req, SETTINGS[name], budget, smallest, memo)
            row = replace(
                row, fits=row.peak_bytes <= budget,
                max_window_frames=None if geom.window_is_video else best,
                max_video_frames=best if geom.window_is_video else None,
                at_search_limit=best is not None and best == _search_top(geom, req, smallest),
            )
        rows.append(row)
    return MemoryPlan(geom, req, lay, tuple(rows), budget)
