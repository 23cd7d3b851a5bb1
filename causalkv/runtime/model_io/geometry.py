"""A model's `causalkv.memory.geometry.ModelGeometry` by name: a built-in model, a causalkv
preset, or a local diffusers / sglang folder, the last two read by the runtime's model reader
(`causalkv.runtime.model_io.model_config`). What ``causalkv memory MODEL`` plans."""

from __future__ import annotations

import contextlib
from pathlib import Path

from causalkv.errors import ConfigError, is_int
from causalkv.memory.geometry import BUILTIN_MODELS, ModelGeometry
from causalkv.plugin import Registry, collect, get_plugin_manager
from causalkv.runtime.model_io.model_config import (
    CAUSALKV_FILE,
    ModelFolderError,
    RuntimeModelInfo,
    model_info_from_dicts,
    preset_info,
    read_json,
)

__all__ = ["read_model_geometry", "resolve_model"]

#: other spellings of the built-in names
_ALIASES = {
    "longlive2-5b": "longlive2", "longlive-2.0": "longlive2", "lingbot-world": "lingbot",
    "self-forcing-wan": "self-forcing", "wan-causal": "self-forcing", "selfforcing": "self-forcing",
}
#: sglang's own stream fields of ``transformer/config.json`` -> the ``causalkv.json`` key each
#: sets (under ``causalkv.json``; ``local_attn_size`` other than -1 is the window too)
_SGLANG_FIELDS = {"num_frames_per_block": "frames_per_chunk", "sink_size": "sink_frames",
                  "sliding_window_num_frames": "window_frames"}


def _geometry(name: str, info: RuntimeModelInfo, registry: Registry, *, local_window: bool = False) -> ModelGeometry:
    """The planner's geometry of a model the runtime read (`causalkv.runtime.model_io.model_config`):
    the stream as ``causalkv generate`` runs it (the family's defaults under the model's own
    settings), ``shot_sinks`` when the registered stage serving it declares multi-shot
    generation (a scene cut pins a shot sink), the whole video as the window when there is
    no sink and no local window (global attention, Self-Forcing's)."""
    cfg = info.config
    sink = cfg.sink_frames
    global_sink = sink if cfg.global_sink_frames is None else min(cfg.global_sink_frames, sink)
    serving = registry.serving(cfg.model_class)
    patch = info.transformer.get("patch_size", (1, 2, 2))
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
        local_window = is_int(local, None) and local != -1
        if local_window:
            native["window_frames"] = local  # sglang: a local window is the cache size
        user = read_json(ck_path) if ck_path.is_file() else None
        registry = collect(get_plugin_manager())
        info = model_info_from_dicts(
            str(folder), read_json(folder / "model_index.json"), tcfg,
            read_json(vae_path) if vae_path.is_file() else {},
            {**native, **(user or {})} if user is not None or native else None,
            path=folder, registry=registry,
        )
    except ModelFolderError as exc:
        raise ConfigError(str(exc)) from None
    return _geometry(str(folder), info, registry, local_window=local_window)


def resolve_model(model: str) -> ModelGeometry:
    """A built-in model by name (`BUILTIN_MODELS`, or an alias), a causalkv preset (``causalkv
    generate --model NAME``: the tiny models the plugins declare; no files needed), else a model
    folder (`read_model_geometry`)."""
    key = model.strip().lower()
    key = _ALIASES.get(key, key)
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    if not Path(model).expanduser().exists():
        registry = collect(get_plugin_manager())
        with contextlib.suppress(ModelFolderError):  # no plugin declares a preset of that name
            return _geometry(f"preset {model}", preset_info(model, registry=registry), registry)
        raise ConfigError(
            f"unknown model {model!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}), not "
            "a causalkv preset (causalkv plugins lists them) and not a folder; pass one of those "
            "names or a local diffusers / sglang model folder"
        )
    return read_model_geometry(model)
