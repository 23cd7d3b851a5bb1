"""`ModelConfig` and `ServerArgs`: what the resolver and the stages read, before any weights load.

A torch-free leaf module (it imports only the QVG settings), so hooks, plugins, stages and
the runtime share these records without import cycles and a plugin author imports it without
loading torch. The runtime re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from causalkv.errors import ConfigError, check_int
from causalkv.quant_config import QVGKVQuantArgs

__all__ = [
    "DEFAULT_SCENE_CUT_PREFIX",
    "DTYPES",
    "MOTION_LETTERS",
    "ModelConfig",
    "ServerArgs",
    "ShotRequest",
    "check_prompts",
    "check_text",
    "parse_motion",
]


@dataclass(frozen=True)
class ModelConfig:
    """A causal video model's shape and streaming policy.

    Attributes:
        name: preset name or the folder it was read from.
        model_class: diffusers ``_class_name`` of the pipeline (``model_index.json``); stages
            are matched on it (or on the preset name).
        num_layers, num_heads, head_dim: transformer self-attention geometry.
        tokens_per_frame: latent tokens per latent frame after patchify.
        frames_per_chunk: latent frames generated per chunk.
        sink_frames: sink in latent frames (LongLive 2.0: the pinned shot sink's size too).
        global_sink_frames: frames of the stream-start sink kept while a shot sink is pinned
            (defaults to ``sink_frames``).
        window_frames: frames attention sees at most (sink included).
        cache_frames: frames the cache retains (defaults to ``window_frames``).
        recent_window_frames: LingBot-World recent-window sampling (frames before the chunk).
        timesteps: denoising timesteps before the shift (Self-Forcing: 1000, 750, 500, 250).
        shift: flow-matching shift.
        context_noise: timestep of the context pass that writes the clean K/V.
        rope_offset_frames_per_shot: RoPE frame offset added per shot (LongLive 2.0; the
            default of a request's ``multi_shot_rope_offset`` when it gives none).
        moving_window_frames, still_window_frames: LingBot-World's interactive recent window
            (frames before the chunk a chunk samples) while the camera moves / stands still;
            used when a request carries a motion signal (None: no interactive window).
        still_chunks: consecutive still chunks (the current one included) after which the
            still window applies (LingBot-World's ``interactive_kv_still_chunks``, 2).
        path: the model folder, or None for a preset not yet materialized.
    """

    name: str
    model_class: str
    num_layers: int
    num_heads: int
    head_dim: int
    tokens_per_frame: int
    frames_per_chunk: int
    sink_frames: int = 0
    global_sink_frames: int | None = None
    window_frames: int = 21
    cache_frames: int | None = None
    recent_window_frames: int | None = None
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0
    context_noise: float = 0.0
    rope_offset_frames_per_shot: int = 0
    moving_window_frames: int | None = None
    still_window_frames: int | None = None
    still_chunks: int = 2
    path: str | None = None

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk


#: dtypes a request may name
DTYPES = ("bfloat16", "float16", "float32")

#: the seed runtime's default text put before the prompt of a shot's first chunk
DEFAULT_SCENE_CUT_PREFIX = "The scene transitions. "

#: letters of a per-chunk motion signal: ``m`` the camera moves, ``s`` it stands still
MOTION_LETTERS = ("m", "s")


@dataclass(frozen=True)
class ShotRequest:
    """How a LongLive 2.0 request's shots map onto chunks (the seed runtime's fields).

    The shot prompts themselves are the request's prompts. Validated on construction
    (`ConfigError` naming the value and the flag).

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

    durations: tuple[int, ...] | None = None
    chunks_per_shot: int = 0
    scene_cut_prefix: str = DEFAULT_SCENE_CUT_PREFIX
    multi_shot_sink: bool = True
    multi_shot_rope_offset: float | None = None

    def __post_init__(self) -> None:
        if self.durations is not None:
            durations = tuple(self.durations) if not isinstance(self.durations, str) else ()
            if not durations:
                raise ConfigError(
                    f"shot durations must be a non-empty list of chunk counts, got {self.durations!r} "
                    "(--shot-durations 3,2,4)"
                )
            for d in durations:
                if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
                    raise ConfigError(
                        f"shot durations must be positive chunk counts, got {d!r} in "
                        f"{list(durations)} (--shot-durations)"
                    )
            object.__setattr__(self, "durations", durations)
        check_int("--chunks-per-shot", self.chunks_per_shot, minimum=0, hint="or 0 for an even split")
        if not isinstance(self.scene_cut_prefix, str):
            raise ConfigError(f"scene cut prefix must be text, got {self.scene_cut_prefix!r} (--scene-cut-prefix)")
        check_text(self.scene_cut_prefix, "--scene-cut-prefix")
        if not isinstance(self.multi_shot_sink, bool):
            raise ConfigError(f"multi_shot_sink must be True or False, got {self.multi_shot_sink!r}")
        off = self.multi_shot_rope_offset
        if off is not None:
            if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off) or off < 0:
                raise ConfigError(
                    f"multi-shot RoPE offset must be a finite number >= 0, got {off!r} "
                    "(--multi-shot-rope-offset)"
                )
            object.__setattr__(self, "multi_shot_rope_offset", float(off))

    @property
    def is_default(self) -> bool:
        """True when no shot field was given (a plain request)."""
        return self == ShotRequest()


def parse_motion(text: str | Sequence[str]) -> tuple[str, ...]:
    """A motion signal ``"m,m,s"`` (or a sequence of letters) as ``("m", "m", "s")``.

    `ConfigError` for an empty signal or a letter other than ``m`` (moving) / ``s`` (still).
    """
    items = [t.strip().lower() for t in text.split(",")] if isinstance(text, str) else list(text)
    if not items or any(m not in MOTION_LETTERS for m in items):
        raise ConfigError(
            f"motion must be one letter per chunk, m (camera moves) or s (still), comma separated, "
            f"got {text!r} (--motion m,m,s,s)"
        )
    return tuple(items)


@dataclass
class ServerArgs:
    """Per-request and per-server options that shape resolution and generation.

    Validated on construction (`ConfigError`, a ValueError, naming the value and the flag);
    derive a changed copy with ``dataclasses.replace`` so the copy is validated too.

    Attributes:
        kv_cache_quant_config: QVG settings (``bits=None`` = off).
        sink_frames, window_frames, recent_window_frames: overrides of the model config.
        multi_shot: LongLive 2.0 scene cuts pin a shot sink (needs ``pinned_sink``).
        heads_sharded: ranks sharing the heads (> 1 needs ``head_slice``).
        cache: force a cache factory by name (None: let resolution choose).
        seed, dtype, device: generation settings.
        kv_cache_dtype: dtype of the KV caches (None: ``dtype``). On CPUs without bf16
            instructions (AVX2) bf16 matmuls run several times slower than fp32: computing in
            float32 with bf16 caches keeps the caches' bytes at bf16 and the speed of fp32.
        guidance_scale: classifier-free guidance (> 1 runs a negative branch with its own cache).
        shots: LongLive 2.0 shot layout (`ShotRequest`; the default: a plain request).
        motion: LingBot-World per-chunk motion signal, ``"m"``/``"s"`` per chunk (None: none;
            its length is checked against the chunk count when the request is planned).
    """

    kv_cache_quant_config: QVGKVQuantArgs = field(default_factory=QVGKVQuantArgs)
    sink_frames: int | None = None
    window_frames: int | None = None
    recent_window_frames: int | None = None
    multi_shot: bool = False
    heads_sharded: int = 1
    cache: str | None = None
    seed: int = 0
    dtype: str = "bfloat16"
    device: str = "cpu"
    guidance_scale: float = 1.0
    shots: ShotRequest = field(default_factory=ShotRequest)
    motion: tuple[str, ...] | None = None
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_quant_config, QVGKVQuantArgs):
            raise ConfigError(
                f"kv_cache_quant_config must be a QVGKVQuantArgs, got {self.kv_cache_quant_config!r}"
            )
        for name, flag, minimum in (
            ("sink_frames", "--sink-frames", 0),
            ("window_frames", "--window-frames", 1),
            ("recent_window_frames", "--recent-window-frames", 0),
        ):
            value = getattr(self, name)
            if value is not None:
                check_int(flag, value, minimum=minimum, hint="or leave it unset for the model's value")
        check_int("--heads-sharded", self.heads_sharded, minimum=1)
        check_int("--seed", self.seed)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in DTYPES:
            raise ConfigError(
                f"kv cache dtype must be one of {list(DTYPES)} or None (same as --dtype), got "
                f"{self.kv_cache_dtype!r} (--kv-cache-dtype)"
            )
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise ConfigError(f"guidance scale must be a finite number >= 0, got {g!r} (--guidance-scale)")
        if self.cache is not None and (not isinstance(self.cache, str) or not self.cache):
            raise ConfigError(f"cache must be a cache name or None, got {self.cache!r} (--cache)")
        if not isinstance(self.shots, ShotRequest):
            raise ConfigError(f"shots must be a ShotRequest, got {self.shots!r}")
        if self.motion is not None:
            self.motion = parse_motion(self.motion)


def check_text(text: str, flag: str) -> str:
    """``text`` if it encodes as UTF-8; else `ConfigError` naming ``flag`` and the first bad byte.

    A command-line argument that is not valid UTF-8 reaches Python with its bad bytes as
    lone surrogates (PEP 383); a tokenizer cannot encode them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        if _escaped(text):  # show the bytes as they were given
            raw = text.encode("utf-8", "surrogateescape")
            at = len(text[: exc.start].encode("utf-8", "surrogateescape"))
            shown, where = repr(raw), f"byte {raw[at:at + 1]!r} at byte {at}"
        else:
            shown, where = repr(text), f"character {text[exc.start]!r} at position {exc.start}"
        raise ConfigError(
            f"{flag} {shown} is not valid UTF-8 text ({where}); pass it as UTF-8 "
            "(e.g. through iconv -t UTF-8) or fix the file it comes from"
        ) from None
    return text


def _escaped(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def check_prompts(prompts: str | Sequence[str], flag: str = "--prompt") -> list[str]:
    """The prompts as a list; `ConfigError` if it is empty or holds an empty prompt or text
    that is not valid UTF-8 (`check_text`).

    The one prompt check of the package (requests, per-chunk prompt lists, shots).
    """
    items = [prompts] if isinstance(prompts, str) else list(prompts)
    if not items:
        raise ConfigError("the prompt list is empty; pass at least one --prompt TEXT")
    for p in items:
        if not isinstance(p, str) or not p.strip():
            raise ConfigError(f"prompts must be non-empty text, got {p!r}; fix the --prompt value")
        check_text(p, flag)
    return items
