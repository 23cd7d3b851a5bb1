"""The built-in model families' records, torch-free: each family's `StageRegistration` (its
stage as a ``"module:Class"`` string, imported only when the stage is chosen or listed), its
presets, its request record (the flags it adds to ``causalkv generate``) and its
``causalkv.json`` record. The command line's ``--help`` and the resolver read these without
importing torch; the stage modules (`causalkv.stages.wan`, `.longlive`, `.longlive2`,
`.lingbot`) hold the stages and use the records from here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from causalkv.capabilities import RECENT_WINDOW
from causalkv.config import check_text
from causalkv.errors import ConfigError, is_int, is_number
from causalkv.hooks import Preset, StageRegistration
from causalkv.options import Options, StageOptions, option

__all__ = [
    "LINGBOT",
    "LONGLIVE",
    "LONGLIVE2",
    "MOTION_LETTERS",
    "SCENE_CUT_PREFIX",
    "STAGES",
    "WAN",
    "LingBotConfig",
    "LongLive2Config",
    "MotionOptions",
    "ShotRequest",
    "check_durations",
    "parse_motion",
]


# ---- LongLive 2.0 (`causalkv.stages.longlive2`)
#: the seed runtime's default text put before the prompt of a shot's first chunk
SCENE_CUT_PREFIX = "The scene transitions. "


def _durations(value: Any) -> Any:
    """``--shot-durations 3,2,4`` as ``(3, 2, 4)`` (a sequence passes through to validation)."""
    if not isinstance(value, str):
        return value
    try:
        return tuple(int(t) for t in value.split(","))
    except ValueError:
        raise ConfigError(
            f"--shot-durations must be comma-separated chunk counts like 3,2,4, got {value!r}"
        ) from None


def check_durations(durations: Any) -> tuple[int, ...]:
    """``durations`` (chunks per shot, ``--shot-durations``) as a tuple: a non-empty iterable
    (not a str) of positive ints, else `ConfigError` naming the entry and the flag. The one check of both the
    request record (`ShotRequest`) and `causalkv.stages.longlive2.expand_shots`."""
    out = tuple(durations) if isinstance(durations, Iterable) and not isinstance(durations, str) else ()
    if not out:
        raise ConfigError(
            f"shot durations must be a non-empty list of chunk counts, got {durations!r} "
            "(--shot-durations 3,2,4)"
        )
    for d in out:
        if not is_int(d, 1):
            raise ConfigError(
                f"shot durations must be positive chunk counts, got {d!r} in {list(out)} (--shot-durations)"
            )
    return out


@dataclass(frozen=True)
class ShotRequest(StageOptions):
    """How a LongLive 2.0 request's shots map onto chunks (the seed runtime's fields).

    The family's request record (``StageRegistration(options=...)``): its flags join
    ``causalkv generate``'s and it reaches this stage as ``stage.options``. The shot prompts
    themselves are the request's prompts. Validated on construction (`ConfigError` naming the
    value and the flag).

    Attributes:
        durations: chunks per shot, one positive int per shot (``--shot-durations``); None:
            ``chunks_per_shot`` or an even split.
        chunks_per_shot: chunks of every shot when ``durations`` is None (0: even split).
        scene_cut_prefix: text put before the prompt of each shot's first chunk after the
            first shot (may be empty).
        multi_shot_sink: pin each cut chunk as its shot's sink (when the sink is non-zero).
        multi_shot_rope_offset: RoPE frames added per shot index (float; None: the model's
            ``rope_offset_frames_per_shot``).
    """

    title = "LongLive 2.0 shots"
    label = "shot flags"
    scope = "multi-shot stages"
    pick = "a LongLive 2.0 model"

    durations: tuple[int, ...] | None = option(
        None, flag="--shot-durations", parse=_durations, metavar="N,N,...",
        help="chunks per shot, one positive count per shot, e.g. 3,2,4 (clamped to the chunk "
        "count; chunks left over go to the last shot)",
    )
    chunks_per_shot: int = option(
        0, flag="--chunks-per-shot", type=int, minimum=0, metavar="N",
        help="chunks of every shot when --shot-durations is not given (0: even split, the "
        "first shots one chunk longer)",
    )
    scene_cut_prefix: str = option(
        SCENE_CUT_PREFIX, flag="--scene-cut-prefix", metavar="TEXT",
        help="text before the prompt of each shot's first chunk (may be empty)",
    )
    multi_shot_sink: bool = option(
        True, flag="--no-multi-shot-sink", action="store_false",
        help="do not pin each shot's first chunk as its sink",
    )
    multi_shot_rope_offset: float | None = option(
        None, flag="--multi-shot-rope-offset", type=float, metavar="FRAMES",
        help="RoPE frames added per shot index (float >= 0; default: the model's)",
    )

    def validate(self) -> Any:
        if self.durations is not None:
            object.__setattr__(self, "durations", check_durations(self.durations))
        if not isinstance(self.scene_cut_prefix, str):
            raise ConfigError(f"scene cut prefix must be text, got {self.scene_cut_prefix!r} (--scene-cut-prefix)")
        check_text(self.scene_cut_prefix, "--scene-cut-prefix")
        off = self.multi_shot_rope_offset
        if off is not None:
            if not is_number(off) or off < 0:
                raise ConfigError(
                    f"multi-shot RoPE offset must be a finite number >= 0, got {off!r} "
                    "(--multi-shot-rope-offset)"
                )
            object.__setattr__(self, "multi_shot_rope_offset", float(off))
        return super().validate()


@dataclass(frozen=True)
class LongLive2Config(Options):
    """LongLive 2.0's own ``causalkv.json`` keys (``StageRegistration(config=...)``)."""

    title = "LongLive 2.0 model settings"

    rope_offset_frames_per_shot: int = option(
        0, minimum=0,
        help="RoPE frames added per shot (when the request gives no --multi-shot-rope-offset)",
    )


#: LongLive 2.0 (Wan 2.2 TI2V 5B class): 8-frame chunks, 8 global + 8 pinned shot-sink frames
LONGLIVE2 = StageRegistration(
    "longlive2",
    "causalkv.stages.longlive2:LongLive2Stage",
    models=("LongLive2Pipeline",),
    options=ShotRequest,
    config=LongLive2Config,
    defaults={
        "frames_per_chunk": 8,
        "sink_frames": 8,
        "global_sink_frames": 8,
        "window_frames": 32,
        "rope_offset_frames_per_shot": 8,
        "height": 704,
        "width": 1280,
        "default_frames": 32,
    },
    presets=(
        Preset(
            "tiny-longlive2",
            {"frames_per_chunk": 2, "sink_frames": 2, "global_sink_frames": 2, "window_frames": 8,
             "rope_offset_frames_per_shot": 2, "guidance_scale": 3.0, "default_frames": 8},
            seed=103,
            description="LongLive 2.0-style: 2-frame global + pinned shot sink, 8-frame window, "
            "CFG 3.0, RoPE +2 frames per shot, 4 UniPC steps",
        ),
        Preset(
            "tiny-longlive2-1k",
            {"height": 128, "width": 128, "frames_per_chunk": 4, "sink_frames": 4,
             "global_sink_frames": 4, "window_frames": 24, "rope_offset_frames_per_shot": 4,
             "guidance_scale": 3.0, "default_frames": 24, "text_max_length": 128},
            seed=105,
            description="LongLive 2.0-style at a chunk size where compression shows: 128x128 "
            "with 1x1 patches (1,024 tokens per 4-frame chunk), 4-frame global + pinned shot "
            "sink, 24-frame window, CFG 3.0, RoPE +4 frames per shot, 128-token prompts (a "
            "sentence, the scene-cut prefix included)",
            transformer={"patch_size": [1, 1, 1], "num_attention_heads": 2, "num_layers": 2},
        ),
    ),
)


# ---- LingBot-World (`causalkv.stages.lingbot`)
#: letters of a per-chunk motion signal: ``m`` the camera moves, ``s`` it stands still
MOTION_LETTERS = ("m", "s")


def parse_motion(text: str | Sequence[str]) -> tuple[str, ...]:
    """A motion signal ``"m,m,s"`` (or a sequence of letters) as ``("m", "m", "s")``.

    `ConfigError` for an empty signal or a letter other than ``m`` (moving) / ``s`` (still).
    """
    items = [t.strip().lower() for t in text.split(",")] if isinstance(text, str) else list(text)
    if not items or any(m not in MOTION_LETTERS for m in items):
        fixed = ",".join(m if m in MOTION_LETTERS else "m" for m in items) or "m"  # as many letters
        raise ConfigError(
            f"motion must be one letter per chunk, m (camera moves) or s (still), comma separated, "
            f"got {text!r} (e.g. --motion {fixed})"
        )
    return tuple(items)


@dataclass(frozen=True)
class MotionOptions(StageOptions):
    """LingBot-World's request record (``StageRegistration(options=...)``): the per-chunk
    camera motion that drives the interactive KV window (None: no motion signal)."""

    title = "LingBot-World motion"
    scope = "LingBot-World's interactive window"
    pick = "a LingBot-World model"

    motion: tuple[str, ...] | None = option(
        None, flag="--motion", parse=parse_motion, metavar="m,s,...",
        help="camera motion per chunk: m (moves) or s (still), one letter per chunk; drives "
        "the moving/still recent KV window",
    )

    def __post_init__(self) -> None:
        if self.motion is not None:
            object.__setattr__(self, "motion", parse_motion(self.motion))
        super().__post_init__()

    def requires(self) -> dict[str, str]:
        """A motion signal samples a recent window per chunk: ``recent_window``."""
        return {RECENT_WINDOW: "--motion"} if self.motion is not None else {}


@dataclass(frozen=True)
class LingBotConfig(Options):
    """LingBot-World's own ``causalkv.json`` keys (``StageRegistration(config=...)``): the
    interactive window a motion signal drives."""

    title = "LingBot-World model settings"

    moving_window_frames: int | None = option(
        None, minimum=0, help="recent frames a chunk samples while the camera moves",
    )
    still_window_frames: int | None = option(
        None, minimum=0, help="recent frames a chunk samples once the camera stands still",
    )
    still_chunks: int = option(
        2, minimum=1,
        help="consecutive still chunks (the current one included) before the still window applies",
    )


#: LingBot-World fast (Wan 2.2 14B class): sink 3, window 45 frames, 12-frame recent window
LINGBOT = StageRegistration(
    "lingbot-world",
    "causalkv.stages.lingbot:LingBotWorldStage",
    models=("LingBotWorldPipeline", "LingBotWorldCausalDMDPipeline"),
    options=MotionOptions,
    config=LingBotConfig,
    defaults={
        "frames_per_chunk": 3,
        "sink_frames": 3,
        "window_frames": 45,
        "recent_window_frames": 12,
        "moving_window_frames": 12,
        "still_window_frames": 3,
        "still_chunks": 2,
    },
    presets=(
        Preset(
            "tiny-lingbot",
            {"frames_per_chunk": 3, "sink_frames": 3, "window_frames": 12,
             "recent_window_frames": 3, "moving_window_frames": 6, "still_window_frames": 3,
             "still_chunks": 2, "default_frames": 12},
            seed=104,
            description="LingBot-World-style: 3-frame sink, 12-frame window, 3-frame recent "
            "window; with --motion 6 frames moving, 3 still after 2 still chunks",
        ),
    ),
)


# ---- LongLive 1.0 (`causalkv.stages.longlive`)
#: LongLive 1.0 (Wan 2.1 1.3B class): 3-frame sink, 12-frame window incl. the sink
LONGLIVE = StageRegistration(
    "longlive",
    "causalkv.stages.longlive:LongLiveStage",
    models=("LongLivePipeline",),
    defaults={"frames_per_chunk": 3, "sink_frames": 3, "window_frames": 12},
    presets=(
        Preset(
            "tiny-longlive",
            {"frames_per_chunk": 3, "sink_frames": 3, "window_frames": 9, "default_frames": 12},
            seed=102,
            description="LongLive 1.0-style: 3-frame sink, 9-frame window, re-cache on prompt switch",
        ),
    ),
)


# ---- Self-Forcing / CausVid (`causalkv.stages.wan`)
#: the Self-Forcing / CausVid family: Wan 2.1 1.3B class, 3 frames per chunk, 21-frame window
WAN = StageRegistration(
    "self-forcing-wan",
    "causalkv.stages.wan:WanCausalDMDStage",
    models=("SelfForcingWanPipeline", "CausVidPipeline", "WanPipeline", "WanCausalDMDPipeline"),
    defaults={"frames_per_chunk": 3, "sink_frames": 0, "window_frames": 21},
    presets=(
        Preset(
            "tiny-wan",
            {"frames_per_chunk": 3, "sink_frames": 0, "window_frames": 9, "default_frames": 12},
            seed=101,
            description="Self-Forcing-style Wan, 3 frames/chunk, 9-frame rolling window, no sink",
        ),
    ),
)


#: the built-in families, in registration order
STAGES: tuple[StageRegistration, ...] = (WAN, LONGLIVE, LONGLIVE2, LINGBOT)
