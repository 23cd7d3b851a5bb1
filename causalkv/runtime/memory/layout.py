"""A request's stream in tokens, and what each host's position bookkeeping holds after each chunk."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals
from causalkv.caches.stream import StreamState
from causalkv.errors import ConfigError, check_int
from causalkv.runtime.memory.geometry import ModelGeometry
from causalkv.runtime.memory.records import DTYPE_BYTES, HOSTS, MemoryRequest, StreamLayout
from causalkv.sglang.slots import SlotMap, SlotState, plan_write, visible_slots
from causalkv.stages.settings import even_split  # the stages' own split of chunks into shots


# ---------------------------------------------------------------------------------------------
# The request's stream
# ---------------------------------------------------------------------------------------------
def request_latent_frames(geom: ModelGeometry, req: MemoryRequest) -> tuple[int, int]:
    """``(latent frames, video frames)`` of the request (`ConfigError` for a bad length)."""
    given = [n for n, v in (("--frames", req.frames), ("--latent-frames", req.latent_frames),
                            ("--seconds", req.seconds)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both give the video's length; pass one of them")
    fpc, s = geom.frames_per_chunk, geom.vae_scale_temporal
    if req.fps is not None:
        check_int("--fps", req.fps, minimum=1, hint="pass e.g. 16")
        if req.seconds is None:
            raise ConfigError(
                f"--fps {req.fps} sets the frame rate of --seconds, which is not given; pass "
                "--seconds or drop --fps"
            )
    if req.latent_frames is not None:
        latent = check_int("--latent-frames", req.latent_frames, minimum=1, hint=f"pass a multiple of {fpc} (frames per chunk)")
    elif req.seconds is not None:
        sec = req.seconds
        if isinstance(sec, bool) or not isinstance(sec, (int, float)) or not math.isfinite(sec) or sec <= 0:
            raise ConfigError(f"--seconds must be a finite number > 0, got {sec!r}; pass e.g. 10")
        fps = geom.fps if req.fps is None else req.fps
        need = max(1, math.ceil(sec * fps - 1e-9))
        latent = geom.latent_frames(need)
        if geom.video_frames(latent) < need:
            latent += 1
        latent = -(-latent // fpc) * fpc  # whole chunks: the shortest video that lasts
    else:
        frames = geom.default_frames if req.frames is None else req.frames
        check_int("--frames", frames, minimum=1, hint="pass the video frames, e.g. "
                  f"{geom.video_frames(2 * fpc)}")
        if (frames - 1) % s:
            lo = frames - (frames - 1) % s
            raise ConfigError(
                f"--frames {frames} is not 1 + a multiple of {s} (the VAE's temporal compression "
                f"of {geom.name}); pass --frames {lo} or {lo + s}"
            )
        latent = geom.latent_frames(frames)
    if latent % fpc:
        lo = latent - latent % fpc
        choices = [geom.video_frames(f) for f in (lo, lo + fpc) if f > 0]
        raise ConfigError(
            f"{latent} latent frames is not a multiple of {fpc} frames per chunk ({geom.name}); "
            f"pass --frames {' or '.join(map(str, choices))} (--latent-frames "
            f"{' or '.join(str(f) for f in (lo, lo + fpc) if f > 0)})"
        )
    return latent, geom.video_frames(latent)


#: the most chunk x held-slot steps one plan takes (a few seconds): a request needs
#: chunks x min(chunks, slots) of them; and the most chunks
MAX_WORK = 2_000_000
MAX_CHUNKS = 20_000


def plan_work(chunks: int, slots: int) -> int:
    return chunks * min(chunks, slots)


def _most_chunks(slots: int) -> int:
    """The most chunks a plan with ``slots`` chunk slots steps through (`MAX_CHUNKS`,
    `MAX_WORK`)."""
    if slots * slots >= MAX_WORK:
        return max(1, math.isqrt(MAX_WORK))
    return max(1, min(MAX_CHUNKS, MAX_WORK // slots))


def stream_layout(geom: ModelGeometry, req: MemoryRequest) -> StreamLayout:
    """The request's stream in tokens (validates every field of ``req``: `ConfigError`)."""
    if req.host not in HOSTS:
        raise ConfigError(f"--host must be one of {list(HOSTS)}, got {req.host!r}")
    if req.dtype not in DTYPE_BYTES:
        raise ConfigError(f"--kv-dtype must be one of {list(DTYPE_BYTES)}, got {req.dtype!r}")
    check_int("--batch-size", req.batch_size, minimum=1, hint="pass 1 or more")
    height = geom.height if req.height is None else req.height
    width = geom.width if req.width is None else req.width
    tpf = geom.tokens_per_frame(height, width)
    latent, video = request_latent_frames(geom, req)
    fpc = geom.frames_per_chunk
    window = geom.window_frames if req.window_frames is None else req.window_frames
    check_int("--window-frames", window, minimum=1, hint=f"pass a multiple of {fpc} (frames per chunk)")
    shots = check_int("--shots", req.shots, minimum=1, hint="pass 1 for a single shot")
    if shots > 1 and not geom.shot_sinks:
        raise ConfigError(
            f"--shots {shots}: {geom.name} has no shot sinks (only LongLive 2.0 pins a scene-cut "
            "chunk); pass --shots 1"
        )
    num_chunks = latent // fpc
    if shots > num_chunks:
        raise ConfigError(
            f"--shots {shots} needs at least {shots} chunks, the request has {num_chunks} "
            f"({latent} latent frames of {fpc}); pass more --frames or fewer --shots"
        )
    multi = shots > 1 and geom.sink_frames > 0
    need = (geom.global_sink_frames + geom.sink_frames if multi else geom.sink_frames) + fpc
    if window < need or window % fpc:
        lo = max(need, -(-window // fpc) * fpc)
        lo = -(-lo // fpc) * fpc
        what = "the global sink plus a pinned shot sink" if multi else "the sink"
        raise ConfigError(
            f"--window-frames {window} must be a multiple of {fpc} frames per chunk that holds "
            f"{what} plus a chunk ({need} frames); pass --window-frames {lo}"
        )
    slots = window // fpc
    if num_chunks > MAX_CHUNKS or plan_work(num_chunks, slots) > MAX_WORK:
        most = _most_chunks(slots)
        raise ConfigError(
            f"{latent} latent frames = {num_chunks:,} chunks with {slots:,} chunk slots is more "
            f"than the planner steps through ({MAX_CHUNKS:,} chunks, {MAX_WORK:,} chunk x slot "
            "steps); the bytes stop "
            f"changing once the window is full, so pass --latent-frames {most * fpc} (--frames "
            f"{geom.video_frames(most * fpc)}) or fewer"
        )
    pins: set[int] = set()
    if multi:
        at = 0
        for n in even_split(num_chunks, shots)[:-1]:
            at += n
            pins.add(at)  # a cut: the first chunk of every shot after the first
    return StreamLayout(
        tokens_per_frame=tpf, frames_per_chunk=fpc, num_chunks=num_chunks, latent_frames=latent,
        video_frames=video, sink_tokens=geom.sink_frames * tpf,
        global_sink_tokens=geom.global_sink_frames * tpf, cache_tokens=window * tpf,
        window_frames=window, pins=frozenset(pins), sets=2 if req.cfg else 1,
        height=height, width=width,
    )


# ---------------------------------------------------------------------------------------------
# Positions: what each host's cache holds after each chunk's context pass
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkState:
    """One layer's positions after chunk ``index``'s context pass.

    Attributes:
        index: the chunk.
        held: the positions held (trimmed to what the next chunk's advance keeps).
        sink_end: positions below it are stream-start sink (the host's bookkeeping).
        pinned: the pinned shot-sink positions (as the host gives them to its store: some
            may be no longer held).
        visible: tokens the chunk's calls see (their one-call window).
        seen: the positions of that window (sglang: zero slots are not positions).
    """

    index: int
    held: Intervals
    sink_end: int
    pinned: Intervals
    visible: int
    seen: Intervals = ()


def _own_host_positions(lay: StreamLayout) -> list[ChunkState]:
    n = lay.chunk_tokens
    st = StreamState(sink_tokens=lay.sink_tokens, global_sink_tokens=lay.global_sink_tokens,
                     window=lay.cache_tokens, capacity=lay.cache_tokens, allow_growth=False)
    out = []
    for i in range(lay.num_chunks):
        st = st.advanced(n, "causalkv memory")
        seen = st.visible()
        visible = iv.count(seen)
        if i in lay.pins:
            st = st.pinned_to(n)
        nxt = st.advanced(n, "causalkv memory")
        held = iv.subtract(nxt.retained, ((st.global_end, nxt.global_end),))
        pinned = (nxt.pinned,) if nxt.pinned else ()
        out.append(ChunkState(i, held, nxt.sink_prefix_end(), pinned, visible, seen))
    return out


def _merged_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A `SlotMap`'s runs with adjacent ones that continue each other merged (same map)."""
    out: list[tuple[int, int, int]] = []
    for s0, s1, p0 in runs:
        if out and out[-1][1] == s0 and out[-1][2] + (out[-1][1] - out[-1][0]) == p0:
            out[-1] = (out[-1][0], s1, out[-1][2])
        else:
            out.append((s0, s1, p0))
    return out


def _sglang_positions(lay: StreamLayout) -> list[ChunkState]:
    n = lay.chunk_tokens
    st = SlotState(cache_size=lay.cache_tokens, sink_tokens=lay.sink_tokens,
                   attention_window_size=lay.cache_tokens, allow_growth=False,
                   global_sink_tokens=lay.global_sink_tokens)
    slots, global_end, local_end = SlotMap(), 0, 0
    out = []

    def write(slots: SlotMap, st: SlotState, global_end: int, local_end: int):
        plan = plan_write(st, global_end, local_end, global_end, n, "causalkv memory")
        slots = SlotMap(list(slots.runs))
        if plan.roll is not None:
            slots.copy(*plan.roll)
        slots.write(plan.local_start, plan.local_end, global_end)
        slots.runs = _merged_runs(slots.runs)
        pinned_start = st.pinned_start
        if plan.evicted and st.has_pinned_sink() and pinned_start >= plan.sink:
            pinned_start -= plan.evicted
        return plan, slots, replace(st, pinned_start=pinned_start)

    for i in range(lay.num_chunks):
        plan, slots, st = write(slots, st, global_end, local_end)
        global_end, local_end = plan.updated_global_end, plan.updated_local_end
        view = visible_slots(st, plan.local_start, local_end, None)
        visible = sum(b - a for a, b in view)
        seen = iv.normalize(
            (p, p + ln) for a, b in view for ln, p in slots.read(a, b) if p is not None
        )
        if i in lay.pins and st.sink_tokens > 0:
            st = replace(st, pinned_start=local_end - n, pinned_len=min(st.sink_tokens, n))
        _, nslots, _ = write(slots, st, global_end, local_end)
        held = iv.subtract(iv.normalize(nslots.positions()), ((global_end, global_end + n),))
        pinned: Intervals = ()  # the positions the pinned slots hold now (the bridge's rule)
        if st.has_pinned_sink():
            a, b = max(0, st.pinned_start), min(st.cache_size, st.pinned_start + st.pinned_len)
            if a < b:
                pinned = iv.normalize((p, p + ln) for ln, p in slots.read(a, b) if p is not None)
        out.append(ChunkState(i, held, lay.sink_tokens, pinned, visible, seen))
    return out


def positions(lay: StreamLayout, host: str) -> list[ChunkState]:
    """Per chunk, what one layer's cache holds after its context pass (the host's bookkeeping)."""
    return _sglang_positions(lay) if host == "sglang" else _own_host_positions(lay)
