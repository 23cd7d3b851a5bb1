"""A request's stream in tokens, and what a cursor model holds after each chunk's context pass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

from causalkv.caches.intervals import Intervals
from causalkv.caches.positions import PositionModel
from causalkv.config import DTYPE_BYTES
from causalkv.errors import ConfigError, alternatives, check_int, is_number, multiples_around
from causalkv.memory.geometry import ModelGeometry
from causalkv.memory.records import MemoryRequest, StreamLayout
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
        if not is_number(sec) or sec <= 0:
            raise ConfigError(f"--seconds must be a finite number > 0, got {sec!r}; pass e.g. 10")
        fps = geom.fps if req.fps is None else req.fps
        need = max(1, math.ceil(sec * fps - 1e-9))
        latent = -(-(need - 1) // s) + 1  # the fewest latent frames whose video lasts
        latent = -(-latent // fpc) * fpc  # in whole chunks
    else:
        frames = geom.default_frames if req.frames is None else req.frames
        check_int("--frames", frames, minimum=1, hint="pass the video frames, e.g. "
                  f"{geom.video_frames(2 * fpc)}")
        if (frames - 1) % s:
            near = alternatives(multiples_around(frames, s, base=1))
            raise ConfigError(
                f"--frames {frames} is not 1 + a multiple of {s} (the VAE's temporal compression "
                f"of {geom.name}); pass --frames {near}"
            )
        latent = geom.latent_frames(frames)
    if latent % fpc:
        near = multiples_around(latent, fpc)
        raise ConfigError(
            f"{latent} latent frames is not a multiple of {fpc} frames per chunk ({geom.name}); "
            f"pass --frames {alternatives(geom.video_frames(f) for f in near)} (--latent-frames "
            f"{alternatives(near)})"
        )
    return latent, geom.video_frames(latent)


#: the most chunk x held-slot steps one plan takes (a few seconds): a request needs
#: chunks x min(chunks, slots) of them; and the most chunks
MAX_WORK = 2_000_000
MAX_CHUNKS = 20_000


def plannable(chunks: int, slots: int) -> bool:
    """Whether a plan of ``chunks`` chunks with ``slots`` chunk slots is within `MAX_CHUNKS`
    and `MAX_WORK`."""
    return chunks <= MAX_CHUNKS and chunks * min(chunks, slots) <= MAX_WORK


def min_window(geom: ModelGeometry, multi: bool) -> int:
    """The fewest frames a window holds: the sink (``multi``: the global sink plus a pinned
    shot sink) plus a chunk."""
    return (geom.global_sink_frames + geom.sink_frames if multi else geom.sink_frames) + geom.frames_per_chunk


def stream_layout(geom: ModelGeometry, req: MemoryRequest) -> StreamLayout:
    """The request's stream in tokens (validates every field of ``req``: `ConfigError`)."""
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
    need = min_window(geom, multi)
    if window < need or window % fpc:
        lo = -(-max(need, window) // fpc) * fpc
        what = "the global sink plus a pinned shot sink" if multi else "the sink"
        raise ConfigError(
            f"--window-frames {window} must be a multiple of {fpc} frames per chunk that holds "
            f"{what} plus a chunk ({need} frames); pass --window-frames {lo}"
        )
    slots = window // fpc
    if not plannable(num_chunks, slots):
        # the most chunks a plan with ``slots`` chunk slots steps through
        most = max(1, math.isqrt(MAX_WORK) if slots * slots >= MAX_WORK
                   else min(MAX_CHUNKS, MAX_WORK // slots))
        raise ConfigError(
            f"{latent} latent frames = {num_chunks:,} chunks with {slots:,} chunk slots is more "
            f"than the planner steps through ({MAX_CHUNKS:,} chunks, {MAX_WORK:,} chunk x slot "
            "steps); the bytes stop "
            f"changing once the window is full, so pass --latent-frames {most * fpc} (--frames "
            f"{geom.video_frames(most * fpc)}) or fewer"
        )
    # a cut: the first chunk of every shot after the first
    pins = frozenset(accumulate(even_split(num_chunks, shots)[:-1]) if multi else ())
    return StreamLayout(
        tokens_per_frame=tpf, frames_per_chunk=fpc, num_chunks=num_chunks, latent_frames=latent,
        video_frames=video, sink_tokens=geom.sink_frames * tpf,
        global_sink_tokens=geom.global_sink_frames * tpf, cache_tokens=window * tpf,
        window_frames=window, pins=pins, sets=2 if req.cfg else 1,
        height=height, width=width,
    )


# ---------------------------------------------------------------------------------------------
# Positions: what a cache's cursor holds after each chunk's context pass
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkState:
    """One layer's positions after chunk ``index``'s context pass.

    Attributes:
        index: the chunk.
        held: the positions held (trimmed to what the next chunk's advance keeps).
        sink_end: positions below it are stream-start sink (the cursor's bookkeeping).
        pinned: the pinned shot-sink positions (as the cursor gives them to its store: some
            may be no longer held).
        visible: rows the chunk's calls see (their one-call window; a slot buffer's
            unwritten slots count).
        seen: the positions of that window.
    """

    index: int
    held: Intervals
    sink_end: int
    pinned: Intervals
    visible: int
    seen: Intervals = ()


def positions(lay: StreamLayout, model: type[PositionModel]) -> list[ChunkState]:
    """Per chunk, what one layer holds after its context pass: ``model``'s cursor
    (`PositionModel.opened` on the layout's sink and window) advanced chunk by chunk, each
    chunk's view, what the next advance keeps (`PositionModel.after_context`, after the pin
    of a shot's cut chunk, ``lay.pins``)."""
    n = lay.chunk_tokens
    cur = model.opened(sink_tokens=lay.sink_tokens, global_sink_tokens=lay.global_sink_tokens,
                       cache_tokens=lay.cache_tokens)
    out = []
    for i in range(lay.num_chunks):
        cur = cur.advanced(n, "causalkv memory")
        pin = i in lay.pins
        ctx = cur.after_context(pin)
        out.append(ChunkState(i, ctx.held, ctx.sink_end, ctx.pinned, cur.visible_rows(),
                              cur.visible()))
        if pin:
            cur = cur.pinned_to(n)
    return out
