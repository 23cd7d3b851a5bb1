"""Model geometry for the planner: the built-in models, a causalkv preset, or a local diffusers /
sglang folder, the last two read by the runtime's model reader
(`causalkv.runtime.model_io.model_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from causalkv.errors import ConfigError, check_int
from causalkv.plugin import Registry, collect, get_plugin_manager
from causalkv.runtime.model_io.model_config import (
    CAUSALKV_FILE,
    ModelFolderError,
    ModelInfo,
    model_info_from_dicts,
    preset_info,
    preset_transformer_config,
    read_json,
)


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
# Models: built in, or read through the runtime's model reader
# ---------------------------------------------------------------------------------------------
#: sglang's own stream fields of ``transformer/config.json`` -> the ``causalkv.json`` key each
#: sets (under ``causalkv.json``; ``local_attn_size`` other than -1 is the window too)
_SGLANG_FIELDS = {"num_frames_per_block": "frames_per_chunk", "sink_size": "sink_frames",
                  "sliding_window_num_frames": "window_frames"}


def _registry() -> Registry:
    return collect(get_plugin_manager())


def _geometry(name: str, info: ModelInfo, patch: Any, registry: Registry, *,
              local_window: bool = False) -> ModelGeometry:
    """The planner's geometry of a model the runtime read (`causalkv.runtime.model_io.model_config`):
    the stream as ``causalkv generate`` runs it (the family's defaults under the model's own
    settings), ``shot_sinks`` when the registered stage serving it declares multi-shot
    generation (a scene cut pins a shot sink), the whole video as the window when there is
    no sink and no local window (global attention, Self-Forcing's)."""
    cfg = info.config
    sink = cfg.sink_frames
    global_sink = sink if cfg.global_sink_frames is None else min(cfg.global_sink_frames, sink)
    serving = registry.serving(cfg.model_class)
    return ModelGeometry(
        name, cfg.num_layers, cfg.num_heads, cfg.head_dim,
        vae_scale_spatial=info.vae_scale_spatial, vae_scale_temporal=info.vae_scale_temporal,
        patch=(int(patch[1]), int(patch[2])), frames_per_chunk=cfg.frames_per_chunk,
        sink_frames=sink, global_sink_frames=global_sink,
        window_frames=max(cfg.window_frames, cfg.cache_frames or 0), height=info.height,
        width=info.width, fps=info.fps, default_frames=info.video_frames(info.default_frames),
        shot_sinks=bool(serving) and serving[0].supports("multi_shot"),
        window_is_video=sink == 0 and not local_window,
    )


def read_model_geometry(path: str | Path) -> ModelGeometry:
    """A local diffusers or sglang model folder's `ModelGeometry`, from its JSON only.

    Read as ``causalkv generate`` reads a model folder (`model_info_from_dicts`: the family's
    defaults from the registered stage serving ``model_index.json``'s ``_class_name``, then
    ``causalkv.json``), with sglang's own stream fields of ``transformer/config.json``
    (``num_frames_per_block``, ``sink_size``, ``local_attn_size`` /
    ``sliding_window_num_frames``) between the two. Needs ``model_index.json`` and
    ``transformer/config.json``; ``vae/config.json`` and ``causalkv.json`` when present.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model {str(path)!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor "
            "a folder; pass one of those names or a diffusers / sglang model folder"
        )
    for needed in ("model_index.json", "transformer/config.json"):
        if not (folder / needed).is_file():
            raise ConfigError(
                f"model folder {str(folder)!r} has no {needed}; pass a diffusers or sglang model "
                "folder (model_index.json, transformer/, vae/)"
            )
    try:
        tcfg = read_json(folder / "transformer" / "config.json")
        vae_path, ck_path = folder / "vae" / "config.json", folder / CAUSALKV_FILE
        native = {key: tcfg[field] for field, key in _SGLANG_FIELDS.items() if field in tcfg}
        local = tcfg.get("local_attn_size")
        local_window = isinstance(local, int) and not isinstance(local, bool) and local != -1
        if local_window:
            native["window_frames"] = local  # sglang: a local window is the cache size
        user = read_json(ck_path) if ck_path.is_file() else None
        registry = _registry()
        info = model_info_from_dicts(
            str(folder), read_json(folder / "model_index.json"), tcfg,
            read_json(vae_path) if vae_path.is_file() else {},
            {**native, **(user or {})} if user is not None or native else None,
            path=folder, registry=registry,
        )
    except ModelFolderError as exc:
        raise ConfigError(str(exc)) from None
    return _geometry(str(folder), info, tcfg.get("patch_size", [1, 2, 2]), registry,
                     local_window=local_window)


def preset_geometry(name: str) -> ModelGeometry | None:
    """The `ModelGeometry` of a causalkv preset (``causalkv generate --model NAME``: the tiny
    models the plugins declare; no files needed), or None when no plugin declares ``name``."""
    registry = _registry()
    try:
        info = preset_info(name, registry=registry)
    except ModelFolderError:
        return None
    patch = preset_transformer_config(name, registry=registry).get("patch_size", [1, 2, 2])
    return _geometry(f"preset {name}", info, patch, registry)


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
