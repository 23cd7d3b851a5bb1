"""Reading a causal Wan model's configuration from a diffusers-format folder or a preset.

A model folder is a diffusers Wan pipeline folder plus one small causalkv file::

    model_index.json            _class_name picks the stage (e.g. "SelfForcingWanPipeline")
    transformer/config.json     WanTransformer3DModel (+ weights)
    vae/config.json             AutoencoderKLWan (+ weights)
    text_encoder/config.json    UMT5EncoderModel (+ weights)
    tokenizer/                  the UMT5 tokenizer files
    causalkv.json               frames per chunk, sink, window, ... (optional for known classes)

``causalkv.json`` holds the host's keys (`_STREAM_DEFAULTS`: chunking, sink, window, schedule, video
size, ...) and the serving family's own keys, declared by its registration's config record
(``StageRegistration(config=...)``, e.g. LongLive 2.0's ``rope_offset_frames_per_shot``);
each is validated by its declaration and lands in ``ModelConfig.options``.

Everything here reads JSON only: `load_model_info` runs before any weights load, so bad
input is refused in milliseconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from causalkv.config import ModelConfig, ModelRef
from causalkv.errors import CausalKVError, ConfigError, int_requirement, is_int, is_number
from causalkv.memory.geometry import decoded_frames, pixel_frame_tokens
from causalkv.options import Options
from causalkv.plugin import Registry, ResolutionError, collect, get_plugin_manager
from causalkv.runtime.model_io.preset_configs import TINY_VAE, PresetSpec, preset_dir

__all__ = [
    "CAUSALKV_FILE",
    "REQUIRED_FILES",
    "ModelFolderError",
    "RuntimeModelInfo",
    "is_loadable_model",
    "load_model_info",
    "model_head_dim",
    "model_info_from_dicts",
    "model_ref",
    "preset_choices",
    "preset_info",
    "read_json",
    "resolve_preset",
]

#: the causalkv settings file inside a model folder
CAUSALKV_FILE = "causalkv.json"

#: files a model folder must have (weights are checked by from_pretrained itself)
REQUIRED_FILES = (
    "model_index.json",
    "transformer/config.json",
    "vae/config.json",
    "text_encoder/config.json",
    "tokenizer",
)

#: the host's causalkv.json keys (every family has them) and their defaults when a key is absent
_STREAM_DEFAULTS: dict[str, Any] = {
    "frames_per_chunk": 3,
    "sink_frames": 0,
    "global_sink_frames": None,
    "window_frames": 21,
    "cache_frames": None,
    "recent_window_frames": None,
    "timesteps": [1000.0, 750.0, 500.0, 250.0],
    "shift": 5.0,
    "context_noise": 0.0,
    "height": 480,
    "width": 832,
    "text_max_length": 512,
    "default_frames": 21,
    "fps": 16,
    "guidance_scale": 1.0,
    "negative_prompt": "",
    # sglang's names (its pipeline-config / request overrides), in frames; they win when set
    "realtime_causal_sink_size": None,
    "realtime_causal_kv_cache_num_frames": None,
}

#: sglang override key -> the causalkv.json key it sets (the KV-cache frames are the window)
SGLANG_KEYS = {
    "realtime_causal_sink_size": "sink_frames",
    "realtime_causal_kv_cache_num_frames": "window_frames",
}

#: int keys and their minimum (those whose default is None may be null)
_INT_KEYS = {
    "frames_per_chunk": 1, "sink_frames": 0, "window_frames": 1, "height": 1, "width": 1,
    "text_max_length": 1, "default_frames": 1, "fps": 1, "global_sink_frames": 0,
    "cache_frames": 1, "recent_window_frames": 0, "realtime_causal_sink_size": 0,
    "realtime_causal_kv_cache_num_frames": 1,
}
#: number keys: (lowest, highest, lowest excluded)
_NUMBER_KEYS = {
    "shift": (0.0, math.inf, True),
    "context_noise": (0.0, 1000.0, False),
    "guidance_scale": (0.0, math.inf, False),
}
#: the flow-matching timesteps are sigmas x 1000
MAX_TIMESTEP = 1000.0
#: the fix a broken model config file names
_RESTORE = "restore the file (re-download or re-convert the model)"


def _value_problem(key: str, v: Any) -> str | None:
    """What is wrong with ``causalkv.json``'s ``key = v`` (None: nothing)."""
    if key in _INT_KEYS:
        lo, optional = _INT_KEYS[key], _STREAM_DEFAULTS[key] is None
        if not (optional and v is None) and not is_int(v, lo):
            return int_requirement(lo, optional=optional)
    elif key in _NUMBER_KEYS:
        lo, hi, open_lo = _NUMBER_KEYS[key]
        if not is_number(v) or v < lo or (open_lo and v == lo) or v > hi:
            bound = f"> {lo:g}" if open_lo else f">= {lo:g}"
            return f"must be a finite number {bound}" + (f" and <= {hi:g}" if math.isfinite(hi) else "")
    elif key == "timesteps":
        if not (isinstance(v, list) and v and all(is_number(t) and 0 < t <= MAX_TIMESTEP for t in v)):
            return f"must be a non-empty list of numbers in (0, {MAX_TIMESTEP:g}]"
        if any(b >= a for a, b in zip(v, v[1:])):
            return "must be strictly decreasing (the noise level falls at every step)"
    elif key == "negative_prompt":
        if not isinstance(v, str):
            return "must be text"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return "must be valid UTF-8 text"
    return None


def _check_model_json(where: str, transformer: Mapping[str, Any], vae: Mapping[str, Any]) -> None:
    """The transformer and VAE config fields causalkv reads, by type and range."""
    for key in ("num_layers", "num_attention_heads", "attention_head_dim"):
        if key not in transformer:
            raise ModelFolderError(f"{where}: transformer/config.json lacks a field: {key!r}; {_RESTORE}")

    def refuse(file: str, key: str, must: str, v: Any) -> NoReturn:
        raise ModelFolderError(f"{where}/{file}/config.json: {key} must be {must}, got {v!r}; {_RESTORE}")

    patch = transformer.get("patch_size", [1, 2, 2])
    if not (isinstance(patch, (list, tuple)) and len(patch) == 3 and all(map(is_int, patch))):
        refuse("transformer", "patch_size", "3 positive ints", patch)
    for key in ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "rope_max_seq_len"):
        if not is_int(transformer.get(key, 1)):
            refuse("transformer", key, "a positive int", transformer[key])
    for key in ("scale_factor_spatial", "scale_factor_temporal"):
        if vae.get(key) is not None and not is_int(vae[key]):
            refuse("vae", key, "a positive int", vae[key])
    for key in ("dim_mult", "temperal_downsample"):
        if not isinstance(vae.get(key, []), list):
            refuse("vae", key, "a list", vae[key])


def preset_choices(presets: Iterable[str]) -> str:
    """``"choose one of: a, b"``, or why there is nothing to choose."""
    names = list(presets)
    if names:
        return f"choose one of: {', '.join(names)}"
    return (
        "no preset is registered: the plugins that declare presets are blocked or not "
        "installed (the built-in one is causalkv.builtin; causalkv plugins lists what loaded)"
    )


class ModelFolderError(CausalKVError, ValueError):
    """A model name that is neither a preset nor a usable model folder."""


@dataclass(frozen=True)
class RuntimeModelInfo:
    """A model's `ModelConfig` plus what the runtime needs to load and run it.

    Attributes:
        config: the shared `causalkv.config.ModelConfig` (resolution reads it).
        path: the model folder (for a preset: its cache folder, maybe not created yet).
        preset: the preset name, or None for a user folder.
        height, width: video size in pixels; latent size = pixels / ``vae_scale_spatial``.
        latent_channels: C of the latents (transformer ``in_channels``).
        vae_scale_spatial, vae_scale_temporal: VAE compression factors.
        text_max_length: prompt tokens (Wan: 512).
        default_frames: latent frames generated when ``--frames`` is not given.
        fps: frame rate of the written video.
        guidance_scale: default classifier-free guidance (LongLive 2.0; 1 = off).
        negative_prompt: text of the negative CFG branch.
        transformer: the ``transformer/config.json`` it was read from (patch size, RoPE limit).
    """

    config: ModelConfig
    path: Path | None
    preset: str | None
    height: int
    width: int
    latent_channels: int
    vae_scale_spatial: int
    vae_scale_temporal: int
    text_max_length: int
    default_frames: int
    fps: int
    guidance_scale: float
    negative_prompt: str
    transformer: Mapping[str, Any] = field(compare=False, repr=False)

    @property
    def latent_height(self) -> int:
        return self.height // self.vae_scale_spatial

    @property
    def latent_width(self) -> int:
        return self.width // self.vae_scale_spatial

    def video_frames(self, latent_frames: int) -> int:
        """Decoded frames for ``latent_frames`` latents (Wan's causal VAE: 1 + s*(F-1))."""
        return decoded_frames(latent_frames, self.vae_scale_temporal)


def read_json(path: Path, fix: str = _RESTORE, *, any_value: bool = False) -> Any:
    """The JSON object in ``path`` (a model folder's file; with ``any_value``, whatever JSON
    value it holds); `ModelFolderError` naming the file and ``fix`` for anything else."""
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path} is not valid JSON: {exc}; {fix}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFolderError(f"cannot read {path} ({type(exc).__name__}: {exc}); {fix}") from None
    if not (any_value or isinstance(obj, dict)):
        raise ModelFolderError(f"{path} must hold a JSON object ({{...}}), it holds a "
                               f"{type(obj).__name__}; {fix}")
    return obj


def model_info_from_dicts(
    name: str,
    model_index: Mapping[str, Any],
    transformer: Mapping[str, Any],
    vae: Mapping[str, Any],
    causalkv: Mapping[str, Any] | None,
    *,
    path: Path | None = None,
    preset: str | None = None,
    registration: Any = None,
    registry: Registry | None = None,
) -> RuntimeModelInfo:
    """Build a `RuntimeModelInfo` from the parsed config files (see the module docstring).

    ``registration`` is the model family's stage registration: its ``defaults`` apply under
    ``causalkv.json``, its ``config`` record declares the family's own keys; None: the one
    serving the pipeline class among ``registry``'s registrations (default: the process-wide
    plugin manager's), if any.

    Raises ModelFolderError for an unknown key in ``causalkv.json`` (naming the family a key
    of another family belongs to), a value of the wrong type or range, a missing
    ``_class_name``, or a resolution the VAE and patch size cannot divide.
    """
    where = str(path) if path is not None else name
    model_class = model_index.get("_class_name")
    if not isinstance(model_class, str) or not model_class:
        raise ModelFolderError(f"{where}: model_index.json has no _class_name")
    if registration is None:
        serving = _registry(None, registry).serving(model_class)
        registration = serving[0].registration if serving else None
    defaults = getattr(registration, "defaults", None)
    family: type[Options] | None = getattr(registration, "config", None)
    family_keys = (family or Options).keys()
    user = dict(causalkv or {})
    valid = sorted({*_STREAM_DEFAULTS, *family_keys})
    unknown = sorted(set(user) - set(valid))
    if unknown:
        raise ModelFolderError(
            f"{where}: unknown key(s) {unknown} in {CAUSALKV_FILE}; valid keys: {valid}"
            + _other_family(registry, unknown, model_class)
        )
    if causalkv is None and defaults is None:
        raise ModelFolderError(
            f"{where}: no {CAUSALKV_FILE} and no registered stage serves pipeline "
            f"{model_class!r} (causalkv plugins lists the served models); write {CAUSALKV_FILE} "
            "with frames_per_chunk, sink_frames and window_frames"
        )
    s = {**_STREAM_DEFAULTS, **(defaults or {}), **user}
    for key, value in s.items():  # each value by its declaration: the host's or the family's
        problem = (family.field_problem(family_keys[key], value) if key in family_keys  # type: ignore[union-attr]
                   else _value_problem(key, value))
        if problem is None:
            continue
        if key not in user:
            at = f"the defaults of the stage serving {model_class!r}"
            fix = f"set {key} in {CAUSALKV_FILE}, or fix the plugin that declares the defaults"
        elif preset is not None:
            at, fix = f"preset {preset!r}", "fix the preset's settings in the plugin that declares it"
        else:
            at = f"{where}/{CAUSALKV_FILE}" if path is not None else CAUSALKV_FILE
            fix = f"fix it in {at}"
        raise ModelFolderError(f"{at}: {key} {problem}, got {value!r}; {fix}")
    try:
        given = {name: s[key] for key, name in family_keys.items() if key in s}
        records = (family(**given),) if family is not None else ()
    except ConfigError as exc:
        raise ModelFolderError(f"{where}: {exc}; fix {CAUSALKV_FILE}") from None
    _check_model_json(where, transformer, vae)
    for key, target in SGLANG_KEYS.items():
        if s[key] is not None:
            s[target] = s[key]
    patch = tuple(transformer.get("patch_size", (1, 2, 2)))  # each checked by _check_model_json
    dim_mult = vae.get("dim_mult", [1, 2, 4, 4])
    temporal = vae.get("temperal_downsample", [False, True, True])
    spatial_scale = int(vae.get("scale_factor_spatial") or 2 ** (len(dim_mult) - 1))
    temporal_scale = int(vae.get("scale_factor_temporal") or 2 ** sum(bool(t) for t in temporal))
    try:
        tpf = pixel_frame_tokens(s["height"], s["width"], spatial_scale, patch[1:], name, flags=False)
    except ConfigError as exc:
        raise ModelFolderError(f"{where}: {exc} in {CAUSALKV_FILE}") from None
    config = ModelConfig(
        name=name,
        model_class=model_class,
        num_layers=transformer["num_layers"],
        num_heads=transformer["num_attention_heads"],
        head_dim=transformer["attention_head_dim"],
        tokens_per_frame=tpf,
        # the stream values are ints (or None) by now: the checks above refused anything else
        **{k: s[k] for k in ("frames_per_chunk", "sink_frames", "global_sink_frames", "window_frames",
                             "cache_frames", "recent_window_frames")},
        timesteps=tuple(float(t) for t in s["timesteps"]),
        shift=float(s["shift"]),
        context_noise=float(s["context_noise"]),
        path=str(path) if path is not None else None,
        options=records,
    )
    return RuntimeModelInfo(
        config=config,
        path=path,
        preset=preset,
        latent_channels=transformer.get("in_channels", 16),
        vae_scale_spatial=spatial_scale,
        vae_scale_temporal=temporal_scale,
        **{k: s[k] for k in ("height", "width", "text_max_length", "default_frames", "fps")},
        guidance_scale=float(s["guidance_scale"]),
        negative_prompt=str(s["negative_prompt"]),
        transformer=dict(transformer),
    )


def _other_family(registry: Registry | None, keys: list[str], model_class: str) -> str:
    """``"; 'k' is a key of stage 's' (...)"`` for unknown keys another family declares."""
    try:
        stages = _registry(None, registry).stages
    except CausalKVError:  # a plugin conflict: the run reports it
        return ""
    notes = ""
    for key in keys:
        owner = next((e for e in stages if key in (e.registration.config or Options).keys()), None)
        if owner is not None:
            notes += (f"; {key!r} is a key of stage {owner.name!r} "
                      f"({owner.registration.config.title}), which does not serve {model_class!r}")
    return notes


def _registry(pm: Any, registry: Registry | None = None) -> Registry:
    """``registry``, else the one collected from ``pm`` (default: the process-wide manager)."""
    return registry if registry is not None else collect(pm if pm is not None else get_plugin_manager())


def resolve_preset(name: str, *, pm: Any = None, registry: Registry | None = None) -> PresetSpec:
    """The preset ``name`` of ``registry`` (default: collected from ``pm``) with its family;
    `ModelFolderError` naming the presets when no plugin declares it."""
    presets = _registry(pm, registry).presets()
    if name not in presets:
        raise ModelFolderError(f"unknown preset {name!r}; {preset_choices(presets)}")
    entry, preset = presets[name]
    return PresetSpec(preset, entry.registration)


def preset_info(name: str, *, pm: Any = None, registry: Registry | None = None) -> RuntimeModelInfo:
    """The preset's `RuntimeModelInfo`, from its declaration (no files needed)."""
    r = resolve_preset(name, pm=pm, registry=registry)
    return model_info_from_dicts(
        name, {"_class_name": r.model_class}, r.transformer, TINY_VAE, r.settings,
        path=preset_dir(name), preset=name, registration=r.registration,
    )


def read_model_folder(path: str | Path, *, pm: Any = None, registry: Registry | None = None) -> RuntimeModelInfo:
    """`RuntimeModelInfo` of a diffusers-format model folder (JSON only, no weights).

    Defaults for keys ``causalkv.json`` omits come from the stage registration serving the
    folder's pipeline class (``registry``, else collected from ``pm``, default the
    process-wide manager).
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {str(folder)!r} does not exist")
    missing = [f for f in REQUIRED_FILES if not (folder / f).exists()]
    if missing:
        raise ModelFolderError(
            f"model folder {str(folder)!r} is missing {', '.join(missing)}; a model folder is a "
            "diffusers Wan pipeline folder (model_index.json, transformer/, vae/, text_encoder/, "
            f"tokenizer/) plus an optional {CAUSALKV_FILE} (see docs/usage.md)"
        )
    causalkv_path = folder / CAUSALKV_FILE
    return model_info_from_dicts(
        str(folder),
        read_json(folder / "model_index.json"),
        read_json(folder / "transformer" / "config.json"),
        read_json(folder / "vae" / "config.json"),
        read_json(causalkv_path) if causalkv_path.exists() else None,
        path=folder,
        registry=_registry(pm, registry),
    )


def _index_folder(path: Path) -> Path:
    """``path``, or the folder of the ``model_index.json`` it names."""
    return path.parent if path.is_file() and path.name == "model_index.json" else path


def model_ref(model: str | Path) -> ModelRef:
    """What `causalkv.runtime.resolve` matches for a model name or a diffusers-format folder
    (or its ``model_index.json``): reads at most that file, no weights.

    Raises:
        ResolutionError: a folder without ``model_index.json``, an index that is not JSON or
            has no ``_class_name``, or a path that does not exist (each names the fix).
    """
    path = _index_folder(Path(model))
    if path.is_dir():
        index = path / "model_index.json"
        if not index.is_file():
            raise ResolutionError(
                f"{path} is a folder without model_index.json: pass a diffusers-format "
                f"model folder, or a served model name (causalkv plugins lists them)"
            )
        try:
            class_name = read_json(index).get("_class_name")
        except ModelFolderError as exc:
            raise ResolutionError(str(exc)) from exc
        if not isinstance(class_name, str) or not class_name:
            raise ResolutionError(
                f"{index} has no '_class_name': it is not a diffusers pipeline index"
            )
        return ModelRef(str(path), class_name, (class_name,), None, f"{index} _class_name")
    if isinstance(model, Path) or path.exists() or "/" in str(model):
        raise ResolutionError(
            f"model folder {str(model)!r} does not exist (or is not a folder); pass a "
            f"diffusers-format folder with model_index.json, or a served model name"
        )
    return ModelRef.of(str(model))


def model_head_dim(model: str | Path, *, pm: Any = None, registry: Registry | None = None) -> int | None:
    """The attention ``head_dim`` of a preset or a model folder (its transformer config, JSON
    only); None for a bare model name or a folder without a readable transformer config."""
    name = str(model)
    registry = _registry(pm, registry)
    if name in registry.presets():
        value = resolve_preset(name, registry=registry).transformer.get("attention_head_dim")
    else:
        cfg = _index_folder(Path(name).expanduser()) / "transformer" / "config.json"
        if not cfg.is_file():
            return None
        value = read_json(cfg).get("attention_head_dim")
    return value if is_int(value) else None


def is_loadable_model(model: str | Path, *, pm: Any = None, registry: Registry | None = None) -> bool:
    """True for a preset name or an existing path (what ``causalkv generate --model`` loads)."""
    return str(model) in _registry(pm, registry).presets() or Path(str(model)).expanduser().exists()


def load_model_info(model: str | Path, *, pm: Any = None, registry: Registry | None = None) -> RuntimeModelInfo:
    """`RuntimeModelInfo` for a preset name (no files needed yet) or a model folder path.

    Presets are those the stage registrations of ``registry`` declare (default: collected
    from ``pm``'s plugins). Raises ModelFolderError naming the presets when ``model`` is neither.
    """
    name = str(model)
    registry = _registry(pm, registry)
    presets = registry.presets()
    if name in presets:
        return preset_info(name, registry=registry)
    folder = Path(name).expanduser()
    if folder.exists():
        return read_model_folder(folder, registry=registry)
    serving = registry.serving(name)
    if serving:  # a name resolution matches (causalkv resolve accepts it) but nothing to load
        raise ModelFolderError(
            f"model {name!r} is a name stage {serving[0].name!r} (plugin {serving[0].plugin!r}) "
            "serves, but no plugin declares a preset of that name and there is no such folder, "
            f"so there are no weights to load; pass --model a model folder whose "
            f"model_index.json _class_name stage {serving[0].name!r} serves, or a preset "
            f"({preset_choices(presets)})"
        )
    raise ModelFolderError(
        f"unknown model {name!r}: not a preset ({preset_choices(presets)}) and not a "
        "model folder; pass --model PRESET or --model /path/to/diffusers-wan-folder"
    )
