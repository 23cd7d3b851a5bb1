"""The KV memory planner behind ``causalkv memory``: exact bytes of a request's caches, no tensors.

For a model's geometry (`ModelGeometry`: a built-in one, `BUILTIN_MODELS`, or a local
diffusers / sglang folder read by its config, `read_model_geometry`) and a request
(`MemoryRequest`: video size, frames, CFG, shots), `plan_memory` gives per QVG setting
(`SETTINGS`: ``off``, ``int4-default``, ``int4-recent0``, ``int2-default``,
``int2-recent0``, ``int2-recent-int4``; the names `benchmarks/sglang_bridge.py` uses) the
bytes the caches of one stage hold, beside what sglang's dense cache allocates for the same
request. Nothing is allocated: the bytes of a packed chunk are `packed_nbytes_formula`'s
(the codec's exact stored bytes), which chunk is held is the host's own position bookkeeping
(`StreamState` for causalkv's cache, `causalkv.sglang.slots` for the sglang bridge), and which
chunk gets which tier is the packing policy object's decision (`SGLANG` / `CAUSALKV`), so
the planner and the caches share one implementation of every rule.

The memory model (docs/design.md, "Memory math"; issue 23):

- The chunk being generated lives in one scratch buffer shared by every layer of the stage
  (and by the CFG branch's caches): ``2 x B x chunk_tokens x H x D x itemsize``.
- After each chunk's context pass a layer's cache holds context only, already trimmed to what
  the next chunk's advance keeps (the sink, a pinned shot sink, the newest chunks: at most
  ``cache_tokens - chunk_tokens`` tokens), each chunk at its tier: bf16
  (``2 x B x n x H x D x itemsize``), packed at the setting's bits, or, with
  ``recent_tier="int4"``, packed at 4 bits while the policy keeps it for recency (reason
  ``recent``) or as a sink with ``sink=0`` (reason ``sink``); such a chunk is re-packed at the
  main bits when it leaves recency. A chunk is packed only if that stores fewer bytes.
- ``kv_bytes``: the most the caches hold after any chunk's context pass (all layers, all CFG
  sets) plus the scratch; ``peak_bytes``: the most held at once over the request: per chunk
  i, the caches (chunk i-1's context during the denoising passes, then layer by layer chunk
  i's during the context pass) plus the scratch plus one call's buffer: with attention
  ``gathered`` (sglang's) one layer's visible window as one dense buffer
  (``2 x B x visible x H x D x itemsize``; the whole window, ``cache_tokens``, once the
  cache is full), with ``streamed`` (causalkv's `attend`) the largest packed segment
  decoded alone (`_call_buffers` has the hosts' exact rules); at most ``kv_bytes`` plus the
  window, equal to it once the window is full and the context no longer changes;
  ``dense_bytes``: sglang's dense cache,
  ``layers x sets x 2 x B x cache_tokens x H x D x itemsize``, allocated whole at the start.

Out of scope: sequence-parallel and head-sliced caches (each rank would hold its heads'
share), the text cross-attention cache, weights and activations.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from causalkv.caches import intervals as iv
from causalkv.caches.intervals import Intervals
from causalkv.caches.qvg.format import packed_nbytes_formula
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
from causalkv.caches.stream import StreamState
from causalkv.errors import ConfigError
from causalkv.runtime.model_config import read_json
from causalkv.sglang.slots import SlotMap, SlotState, plan_write, visible_slots

__all__ = [
    "ATTENTION",
    "BUILTIN_MODELS",
    "DTYPE_BYTES",
    "HOSTS",
    "SETTINGS",
    "ChunkState",
    "MemoryPlan",
    "MemoryRequest",
    "ModelGeometry",
    "Setting",
    "SettingPlan",
    "StreamLayout",
    "attention_of",
    "format_bytes",
    "parse_bytes",
    "plan_memory",
    "plan_setting",
    "preset_geometry",
    "read_model_geometry",
    "resolve_model",
    "stream_layout",
]

#: bytes per element of the KV dtypes a request may name
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

#: the hosts whose caches the planner models: sglang's stages through the bridge
#: (`causalkv.sglang.cache.SGLangQVGKVCache`, sglang's packing rule, the centroids as given)
#: and causalkv's own host (`QVGPackedCausalKVCache`, causalkv's rule, `centroids_for`)
HOSTS = ("sglang", "causalkv")

#: how a call's attention reads the window it sees: ``gathered`` into one dense buffer
#: (sglang's attention reads the view's ``k``/``v``: the bridge's default) or ``streamed``, one
#: packed segment decoded at a time (`causalkv.caches.attend`: causalkv generate's attention)
ATTENTION = ("gathered", "streamed")


def attention_of(host: str, attention: str | None) -> str:
    """``attention`` checked (`ConfigError`), or the host's own way when None."""
    if attention is None:
        return "gathered" if host == "sglang" else "streamed"
    if attention not in ATTENTION:
        raise ConfigError(f"--attention must be one of {list(ATTENTION)}, got {attention!r}")
    return attention


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One QVG setting of the planner's table (the benchmark's names).

    Attributes:
        name: the row's name.
        bits: residual bits (None: quantization off).
        keep_recent_chunks: completed chunks the recency guard keeps out of the main bits.
        recent_tier: ``"bf16"`` (the chunks the policy keeps dense stay bf16) or ``"int4"``
            (the ones it keeps for recency, or as sinks with ``sink=0``, are packed at 4 bits).
        help: one line for ``--help``.
        sink: the row's own ``--kv-cache-quant-sink`` (None: the request's).
    """

    name: str
    bits: int | None
    keep_recent_chunks: int = 1
    recent_tier: str = "bf16"
    help: str = ""
    sink: bool | None = None

    def quant_args(self, *, sink: bool = True) -> QVGKVQuantArgs:
        """The cache's settings record (sglang's defaults for everything the row does not set:
        128 centroids, block 64, 1 stage, symmetric; ``sink`` unless the row sets its own).
        ``recent_tier`` is passed only where `QVGKVQuantArgs` declares it."""
        if self.bits is None:
            return QVGKVQuantArgs()
        kw: dict[str, Any] = {"bits": self.bits, "keep_recent_chunks": self.keep_recent_chunks,
                              "sink": sink if self.sink is None else self.sink}
        if "recent_tier" in QVGKVQuantArgs.specs():
            kw["recent_tier"] = self.recent_tier
        return QVGKVQuantArgs(**kw)


#: the planner's rows, in table order (names shared with benchmarks/sglang_bridge.py)
SETTINGS: Mapping[str, Setting] = {
    s.name: s
    for s in (
        Setting("off", None, help="the QVG cache with quantization off: every context chunk bf16 "
                "(the benchmark's row; a run with --kv-cache-quant off keeps the dense cache, "
                "dense_bytes)"),
        Setting("int4-default", 4, 1, help="int4, sglang's defaults (keep-recent 1, sink packed)"),
        Setting("int4-recent0", 4, 0, help="int4, keep-recent 0 (every context chunk packed)"),
        Setting("int2-default", 2, 1, help="int2, sglang's defaults (keep-recent 1, sink packed)"),
        Setting("int2-recent0", 2, 0, help="int2, keep-recent 0 (every context chunk packed)"),
        Setting("int2-recent-int4", 2, 1, "int4",
                help="int2, keep-recent 1 with the recent chunk held at int4 (recent tier int4)"),
        Setting("int2-sink0", 2, 1, sink=False,
                help="int2, sglang's defaults but --kv-cache-quant-sink 0: the sink and the "
                "pinned shot sink bf16"),
    )
}


# ---------------------------------------------------------------------------------------------
# Validation helpers (every message names the value and the fix)
# ---------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(name: str, value: Any, fix: str) -> int:
    return _at_least(name, value, 1, fix)


def _at_least(name: str, value: Any, minimum: int, fix: str) -> int:
    if not _is_int(value) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ConfigError(f"{name} must be {what}, got {value!r}; {fix}")
    return value


# ---------------------------------------------------------------------------------------------
# Model geometry and the request
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelGeometry:
    """What the planner needs of a model (all frame counts are latent frames).

    Attributes:
        name: shown in the header.
        num_layers, num_heads, head_dim: the self-attention caches' geometry.
        vae_scale_spatial, vae_scale_temporal: the VAE's compression.
        patch: the transformer's spatial patch ``(ph, pw)``.
        frames_per_chunk: latent frames per chunk.
        sink_frames: the sink (LongLive 2.0: also the most a pinned shot sink keeps).
        global_sink_frames: the stream-start sink kept while a shot sink is pinned.
        window_frames: the frames attention sees, = the frames each cache holds (sglang's
            ``local_attn_size`` or ``sliding_window_num_frames``).
        height, width: the default video size in pixels.
        fps: frames per second of the video (for ``--seconds``).
        default_frames: video frames of a request that gives none (sglang's ``num_frames``).
        shot_sinks: a scene cut pins a shot sink (LongLive 2.0); other models take one shot.
        window_is_video: the cache holds the whole video (Self-Forcing's global attention
            over a 21-frame video): the budget answer is the longest video, not a window.
    """

    name: str
    num_layers: int
    num_heads: int
    head_dim: int
    vae_scale_spatial: int
    vae_scale_temporal: int
    patch: tuple[int, int]
    frames_per_chunk: int
    sink_frames: int
    global_sink_frames: int
    window_frames: int
    height: int
    width: int
    fps: int = 16
    default_frames: int = 81
    shot_sinks: bool = False
    window_is_video: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "vae_scale_spatial",
                     "vae_scale_temporal", "frames_per_chunk", "window_frames", "height",
                     "width", "fps", "default_frames"):
            _positive(f"{self.name}: {name}", getattr(self, name), "fix the model's config")
        for name in ("sink_frames", "global_sink_frames"):
            _at_least(f"{self.name}: {name}", getattr(self, name), 0, "fix the model's config")
        if len(self.patch) != 2 or any(not _is_int(p) or p < 1 for p in self.patch):
            raise ConfigError(f"{self.name}: patch must be 2 positive ints, got {self.patch!r}")
        if self.global_sink_frames > self.sink_frames:
            raise ConfigError(
                f"{self.name}: global_sink_frames={self.global_sink_frames} exceeds "
                f"sink_frames={self.sink_frames}; fix the model's config"
            )

    def tokens_per_frame(self, height: int, width: int) -> int:
        """Latent tokens per latent frame at ``height x width`` pixels (`ConfigError` when the
        VAE and the patch do not divide them)."""
        for label, px, p in (("--height", height, self.patch[0]), ("--width", width, self.patch[1])):
            unit = self.vae_scale_spatial * p
            _positive(label, px, f"pass a multiple of {unit}")
            if px % unit:
                lo = px - px % unit
                near = f"{lo} or {lo + unit}" if lo else f"{unit}"
                raise ConfigError(
                    f"{label} {px} is not a multiple of {unit} (VAE scale {self.vae_scale_spatial} "
                    f"x patch {p} of {self.name}); pass {label} {near}"
                )
        return (height // self.vae_scale_spatial // self.patch[0]) * (
            width // self.vae_scale_spatial // self.patch[1]
        )

    def latent_frames(self, video_frames: int) -> int:
        """Latent frames of a ``video_frames`` video (Wan's causal VAE: ``(F - 1) // s + 1``)."""
        return (video_frames - 1) // self.vae_scale_temporal + 1

    def video_frames(self, latent_frames: int) -> int:
        return 1 + self.vae_scale_temporal * (latent_frames - 1)

    def describe(self) -> str:
        return f"{self.name} ({self.num_layers} layers x {self.num_heads} heads x {self.head_dim})"


#: the built-in models (published geometry; docs/design.md, "Models"), by ``causalkv memory`` name
BUILTIN_MODELS: Mapping[str, ModelGeometry] = {
    "longlive2": ModelGeometry(
        "LongLive 2.0 5B", 30, 24, 128, vae_scale_spatial=16, vae_scale_temporal=4,
        patch=(2, 2), frames_per_chunk=8, sink_frames=8, global_sink_frames=8,
        window_frames=32, height=704, width=1280, fps=24, default_frames=61, shot_sinks=True,
    ),
    "lingbot": ModelGeometry(
        "LingBot-World", 40, 40, 128, vae_scale_spatial=8, vae_scale_temporal=4,
        patch=(2, 2), frames_per_chunk=3, sink_frames=3, global_sink_frames=3,
        window_frames=45, height=480, width=832, fps=16, default_frames=117,
    ),
    "self-forcing": ModelGeometry(
        "Self-Forcing Wan 1.3B", 30, 12, 128, vae_scale_spatial=8, vae_scale_temporal=4,
        patch=(2, 2), frames_per_chunk=3, sink_frames=0, global_sink_frames=0,
        window_frames=21, height=480, width=832, fps=16, default_frames=81,
        window_is_video=True,
    ),
}

#: other spellings of the built-in names
_ALIASES = {
    "longlive2-5b": "longlive2", "longlive-2.0": "longlive2", "lingbot-world": "lingbot",
    "self-forcing-wan": "self-forcing", "wan-causal": "self-forcing", "selfforcing": "self-forcing",
}


@dataclass(frozen=True)
class MemoryRequest:
    """One request, as the planner sees it.

    Attributes:
        height, width: video size in pixels (None: the model's).
        frames: video frames (sglang's ``--num-frames``); or ``latent_frames``; or
            ``seconds`` at ``fps`` (at most one of the three; none: the model's default).
        cfg: classifier-free guidance on (a second cache set, the negative branch's).
        shots: shots (LongLive 2.0: each after the first starts with a pinned cut chunk).
        batch_size: B of the caches.
        host: ``"sglang"`` (the bridge) or ``"causalkv"`` (causalkv's own host).
        dtype: the KV dtype (what sglang's dense cache and the bf16 tier store).
        window_frames: a window override in latent frames (None: the model's).
        sink: ``--kv-cache-quant-sink``: pack sink chunks (True, sglang's default) or keep
            them bf16 (or at the recent tier, ``int2-recent-int4``).
        attention: how a call reads its window (`ATTENTION`; None: the host's way).
    """

    height: int | None = None
    width: int | None = None
    frames: int | None = None
    latent_frames: int | None = None
    seconds: float | None = None
    fps: int | None = None
    cfg: bool = False
    shots: int = 1
    batch_size: int = 1
    host: str = "sglang"
    dtype: str = "bfloat16"
    window_frames: int | None = None
    sink: bool = True
    attention: str | None = None


@dataclass(frozen=True)
class StreamLayout:
    """A request's stream in tokens: what the position bookkeeping runs on.

    Attributes:
        tokens_per_frame, frames_per_chunk, chunk_tokens: chunk geometry.
        num_chunks: chunks of the request.
        latent_frames, video_frames: the request's length.
        sink_tokens, global_sink_tokens, cache_tokens: one layer's cache (``cache_tokens`` =
            the window: sglang's cache size).
        pins: indices of the chunks pinned as shot sinks after their context pass.
        sets: cache sets (2 with CFG).
        height, width: pixels.
    """

    tokens_per_frame: int
    frames_per_chunk: int
    num_chunks: int
    latent_frames: int
    video_frames: int
    sink_tokens: int
    global_sink_tokens: int
    cache_tokens: int
    window_frames: int
    pins: frozenset[int]
    sets: int
    height: int
    width: int

    @property
    def chunk_tokens(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_bytes(text: str | int, what: str = "--budget") -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5TiB"``, ``"85899345920"`` -> bytes (`ConfigError` otherwise).

    GiB/MiB/KiB/TiB (and G/M/K/T) are powers of 1024, GB/MB/KB/TB powers of 1000.
    """
    if _is_int(text):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what} {text!r} is not a size; pass a number with a unit such as 80GiB, "
                "80GB, 512MiB (GiB = 2^30 bytes, GB = 10^9) or a plain byte count"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    nbytes = value * _UNITS[unit]
    if not math.isfinite(nbytes) or nbytes < 1:
        raise ConfigError(f"{what} {text!r} must be at least 1 byte; pass e.g. 80GiB")
    return int(nbytes)


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units (``"19.33 GiB"``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------
# Models: built in, or read from a local folder's config
# ---------------------------------------------------------------------------------------------
def _family_defaults(model_class: str | None) -> Mapping[str, Any]:
    """The stream defaults of the stage registration serving ``model_class`` (``{}`` if none)."""
    if not model_class:
        return {}
    from causalkv.plugin.builtin import STAGES  # the built-in families' defaults

    for reg in STAGES:
        if model_class in reg.models:
            return reg.defaults
    return {}


def read_model_geometry(path: str | Path) -> ModelGeometry:
    """A local diffusers or sglang model folder's `ModelGeometry`, from its JSON only.

    Reads ``transformer/config.json`` (``num_layers``, ``num_attention_heads``,
    ``attention_head_dim``, ``patch_size``; an sglang folder's ``num_frames_per_block``,
    ``sink_size``, ``local_attn_size`` / ``sliding_window_num_frames``), ``vae/config.json``
    (``scale_factor_spatial`` / ``scale_factor_temporal``, else derived from ``dim_mult`` and
    ``temperal_downsample`` as `causalkv.runtime.model_config` does), ``model_index.json``'s
    ``_class_name`` (the family's defaults) and ``causalkv.json`` (the stream keys), in that
    order of precedence from last to first.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model {str(path)!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor "
            "a folder; pass one of those names or a diffusers / sglang model folder"
        )
    tcfg_path = folder / "transformer" / "config.json"
    if not tcfg_path.is_file():
        raise ConfigError(
            f"model folder {str(folder)!r} has no transformer/config.json; pass a diffusers or "
            "sglang model folder (model_index.json, transformer/, vae/)"
        )
    tcfg = read_json(tcfg_path)
    vae_path = folder / "vae" / "config.json"
    vae = read_json(vae_path) if vae_path.is_file() else {}
    index_path = folder / "model_index.json"
    index = read_json(index_path) if index_path.is_file() else {}
    model_class = index.get("_class_name") if isinstance(index.get("_class_name"), str) else None
    ck_path = folder / "causalkv.json"
    user = read_json(ck_path) if ck_path.is_file() else {}
    where = str(tcfg_path)
    fix = "restore the file (re-download or re-convert the model)"

    def field_int(cfg: Mapping[str, Any], key: str, at: str, minimum: int = 1) -> int:
        if key not in cfg:
            raise ConfigError(f"{at} lacks {key!r}; {fix}")
        return _at_least(f"{at}: {key}", cfg[key], minimum, fix)

    layers = field_int(tcfg, "num_layers", where)
    heads = field_int(tcfg, "num_attention_heads", where)
    head_dim = field_int(tcfg, "attention_head_dim", where)
    patch = tcfg.get("patch_size", [1, 2, 2])
    if not (isinstance(patch, (list, tuple)) and len(patch) == 3 and all(_is_int(p) and p > 0 for p in patch)):
        raise ConfigError(f"{where}: patch_size must be 3 positive ints, got {patch!r}; {fix}")
    vwhere = str(vae_path)
    dim_mult = vae.get("dim_mult", [1, 2, 4, 4])
    temporal = vae.get("temperal_downsample", [False, True, True])
    if not isinstance(dim_mult, list) or not isinstance(temporal, list):
        raise ConfigError(f"{vwhere}: dim_mult and temperal_downsample must be lists; {fix}")
    spatial_scale = vae.get("scale_factor_spatial") or 2 ** (len(dim_mult) - 1)
    temporal_scale = vae.get("scale_factor_temporal") or 2 ** sum(bool(t) for t in temporal)
    _positive(f"{vwhere}: scale_factor_spatial", spatial_scale, fix)
    _positive(f"{vwhere}: scale_factor_temporal", temporal_scale, fix)

    s: dict[str, Any] = {"frames_per_chunk": 3, "sink_frames": 0, "global_sink_frames": None,
                         "window_frames": 21, "height": 480, "width": 832, "fps": 16}
    s.update({k: v for k, v in _family_defaults(model_class).items() if k in s})
    native = {"num_frames_per_block": "frames_per_chunk", "sink_size": "sink_frames",
              "sliding_window_num_frames": "window_frames"}
    for key, target in native.items():
        if key in tcfg:
            s[target] = tcfg[key]
    local = tcfg.get("local_attn_size")
    if _is_int(local) and local != -1:
        s["window_frames"] = local  # sglang: a local window is the cache size
    for key in s:
        if key in user:
            s[key] = user[key]
    if user.get("realtime_causal_sink_size") is not None:
        s["sink_frames"] = user["realtime_causal_sink_size"]
    if user.get("realtime_causal_kv_cache_num_frames") is not None:
        s["window_frames"] = user["realtime_causal_kv_cache_num_frames"]
    sink_frames, global_sink = s["sink_frames"], s["global_sink_frames"]
    if global_sink is None:
        global_sink = sink_frames
    elif _is_int(global_sink) and _is_int(sink_frames):
        global_sink = min(global_sink, sink_frames)  # as the stages read it
    window = s["window_frames"]
    return ModelGeometry(
        str(folder), layers, heads, head_dim, vae_scale_spatial=spatial_scale,
        vae_scale_temporal=temporal_scale, patch=(int(patch[1]), int(patch[2])),
        frames_per_chunk=s["frames_per_chunk"], sink_frames=sink_frames,
        global_sink_frames=global_sink, window_frames=window, height=s["height"],
        width=s["width"], fps=s["fps"],
        # a request that gives no length fills the window once (sglang's own tiny requests)
        default_frames=1 + temporal_scale * (window - 1) if _is_int(window) and window > 0 else 1,
        shot_sinks=model_class == "LongLive2Pipeline",
        # global attention without a sink (Self-Forcing): the cache holds the whole video
        window_is_video=(not _is_int(local) or local == -1) and sink_frames == 0,
    )


def preset_geometry(name: str) -> ModelGeometry | None:
    """The `ModelGeometry` of a causalkv preset (``causalkv generate --model NAME``: the tiny
    models the plugins declare; no files needed), or None when no plugin declares ``name``."""
    from causalkv.runtime.model_config import (
        ModelFolderError,
        preset_info,
        preset_transformer_config,
    )

    try:
        info = preset_info(name)
    except ModelFolderError:
        return None
    cfg = info.config
    patch = preset_transformer_config(name).get("patch_size", [1, 2, 2])
    sink = cfg.sink_frames
    global_sink = sink if cfg.global_sink_frames is None else min(cfg.global_sink_frames, sink)
    return ModelGeometry(
        f"preset {name}", cfg.num_layers, cfg.num_heads, cfg.head_dim,
        vae_scale_spatial=info.vae_scale_spatial, vae_scale_temporal=info.vae_scale_temporal,
        patch=(int(patch[1]), int(patch[2])), frames_per_chunk=cfg.frames_per_chunk,
        sink_frames=sink, global_sink_frames=global_sink,
        window_frames=max(cfg.window_frames, cfg.cache_frames or 0), height=info.height,
        width=info.width, fps=info.fps, default_frames=info.video_frames(info.default_frames),
        shot_sinks=cfg.model_class == "LongLive2Pipeline", window_is_video=sink == 0,
    )


def resolve_model(model: str) -> ModelGeometry:
    """A built-in model by name (`BUILTIN_MODELS`, or an alias), a causalkv preset
    (`preset_geometry`), else a model folder (`read_model_geometry`)."""
    key = model.strip().lower()
    key = _ALIASES.get(key, key)
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    if not Path(model).expanduser().exists():
        geom = preset_geometry(model)
        if geom is not None:
            return geom
        raise ConfigError(
            f"unknown model {model!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}), not "
            "a causalkv preset (causalkv plugins lists them) and not a folder; pass one of those "
            "names or a local diffusers / sglang model folder"
        )
    return read_model_geometry(model)


# ---------------------------------------------------------------------------------------------
# The request's stream
# ---------------------------------------------------------------------------------------------
def even_split(num_chunks: int, num_shots: int) -> list[int]:
    """Chunks per shot, the first shots one longer (causalkv's and LongLive 2.0's even split)."""
    base, extra = divmod(num_chunks, num_shots)
    return [base + (k < extra) for k in range(num_shots)]


def _request_latent_frames(geom: ModelGeometry, req: MemoryRequest) -> tuple[int, int]:
    """``(latent frames, video frames)`` of the request (`ConfigError` for a bad length)."""
    given = [n for n, v in (("--frames", req.frames), ("--latent-frames", req.latent_frames),
                            ("--seconds", req.seconds)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both give the video's length; pass one of them")
    fpc, s = geom.frames_per_chunk, geom.vae_scale_temporal
    if req.fps is not None:
        _positive("--fps", req.fps, "pass e.g. 16")
        if req.seconds is None:
            raise ConfigError(
                f"--fps {req.fps} sets the frame rate of --seconds, which is not given; pass "
                "--seconds or drop --fps"
            )
    if req.latent_frames is not None:
        latent = _positive("--latent-frames", req.latent_frames,
                           f"pass a multiple of {fpc} (frames per chunk)")
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
        _positive("--frames", frames, "pass the video frames, e.g. "
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


def _work(chunks: int, slots: int) -> int:
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
    _positive("--batch-size", req.batch_size, "pass 1 or more")
    height = geom.height if req.height is None else req.height
    width = geom.width if req.width is None else req.width
    tpf = geom.tokens_per_frame(height, width)
    latent, video = _request_latent_frames(geom, req)
    fpc = geom.frames_per_chunk
    window = geom.window_frames if req.window_frames is None else req.window_frames
    _positive("--window-frames", window, f"pass a multiple of {fpc} (frames per chunk)")
    shots = _positive("--shots", req.shots, "pass 1 for a single shot")
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
    if num_chunks > MAX_CHUNKS or _work(num_chunks, slots) > MAX_WORK:
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
    return 2 * packed_nbytes_formula((b, h, s, d), q)


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

    tier: str  # "bf16" or "int2" / "int4"
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
    q4 = replace(q, bits=4) if q.enabled else q
    policy = _policy(host)
    main = f"int{q.bits}"
    int4_tier = setting.recent_tier == "int4"
    store: dict[int, _Held] = {}
    resident: list[int] = []
    tiers: list[dict[int, str]] = []
    infos_seen: dict[tuple[int, int, int, bool, bool], ChunkInfo] = {}
    packed_of: dict[tuple[int, int], int] = {}  # (bits, tokens) -> packed bytes

    def packed(bits: int, tokens: int) -> int:
        key = (bits, tokens)
        if key not in packed_of:
            packed_of[key] = _packed_nbytes(B, H, tokens, D, q if bits == q.bits else q4, host)
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
                    nb = packed(q.bits, span[1] - span[0])
                    if nb < (span[1] - span[0]) * per_token:
                        store[c] = _Held(main, nb, span)
                elif int4_tier and h.tier == "bf16" and reason in (RECENT, SINK):
                    nb = packed(4, tokens)
                    if nb < tokens * per_token:
                        store[c] = _Held("int4", nb, (lo, hi))
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
            latent = max(_request_latent_frames(geom, req)[0], window + 2 * fpc)
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
    chunks = _request_latent_frames(geom, req)[0] // fpc

    def work(w: int) -> int:
        slots = w // fpc
        n = slots if geom.window_is_video else max(chunks, slots + 2)
        return _work(n, slots) if n <= MAX_CHUNKS else MAX_WORK + 1

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
        _positive("--budget", budget, "pass e.g. 80GiB")
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

