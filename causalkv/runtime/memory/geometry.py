"""Model geometry for the planner: the built-in models, or a local diffusers / sglang folder's config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from causalkv.errors import ConfigError, check_int
from causalkv.runtime.model_io.model_config import read_json


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
            check_int(f"{self.name}: {name}", getattr(self, name), minimum=1, hint="fix the model's config")
        for name in ("sink_frames", "global_sink_frames"):
            check_int(f"{self.name}: {name}", getattr(self, name), minimum=0, hint="fix the model's config")
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
            check_int(label, px, minimum=1, hint=f"pass a multiple of {unit}")
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
        return check_int(f"{at}: {key}", cfg[key], minimum=minimum, hint=fix)

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
    check_int(f"{vwhere}: scale_factor_spatial", spatial_scale, minimum=1, hint=fix)
    check_int(f"{vwhere}: scale_factor_temporal", temporal_scale, minimum=1, hint=fix)

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
    from causalkv.runtime.model_io.model_config import (
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
