"""`ModelConfig`, `ModelRef` and `ServerArgs`: what the resolver and the stages read, before any weights load.

A torch-free leaf module, so hooks, plugins, stages and the runtime share these records without
import cycles and a plugin author imports it without loading torch. It imports only
`causalkv.options` and `causalkv.errors` (a test scans its imports).

Both records hold only what every model and every request has. What one extension adds lives
in that extension's own records (`causalkv.options`), carried generically: a stage family's
request knobs and a cache's settings in ``ServerArgs.options`` (the host gives each to the
stage or cache it chose and refuses the others), a family's ``causalkv.json`` keys in
``ModelConfig.options``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from causalkv.errors import ConfigError, InvalidTypeError, check_int, is_number
from causalkv.options import Options

__all__ = ["DTYPES", "DTYPE_BYTES", "MULTI_SHOT", "ModelConfig", "ModelRef", "ServerArgs", "check_prompts", "check_text"]

R = TypeVar("R", bound=Options)


def _by_class(records: Sequence[Any], owner: str) -> tuple[Options, ...]:
    """``records`` as a tuple in a fixed order, one per record class (`ConfigError` otherwise)."""
    out: dict[type, Options] = {}
    for r in records:
        if not isinstance(r, Options):
            raise ConfigError(f"{owner}.options must hold causalkv.options.Options records, got {r!r}")
        if type(r) in out:
            raise ConfigError(f"{owner}.options holds two {type(r).__name__} records; give one")
        out[type(r)] = r
    return tuple(sorted(out.values(), key=lambda r: (type(r).__module__, type(r).__qualname__)))


def _option(records: Sequence[Options], cls: type[R]) -> R:
    return next((r for r in records if isinstance(r, cls)), None) or cls()


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
        recent_window_frames: recent-window sampling (frames before the chunk; LingBot-World).
        timesteps: denoising timesteps before the shift (Self-Forcing: 1000, 750, 500, 250).
        shift: flow-matching shift.
        context_noise: timestep of the context pass that writes the clean K/V.
        path: the model folder, or None for a preset not yet materialized.
        options: the serving family's own ``causalkv.json`` settings, as the records its
            registration declares (``StageRegistration(config=...)``: LongLive 2.0's RoPE
            offset per shot, LingBot-World's interactive window); `option` reads one.

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
    path: str | None = None
    options: tuple[Options, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _by_class(self.options, "ModelConfig"))

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.frames_per_chunk

    def option(self, cls: type[R]) -> R:
        """The model's ``cls`` record (its family's ``causalkv.json`` settings), else defaults."""
        return _option(self.options, cls)

    def override_keys(self) -> list[str]:
        """What `with_overrides` accepts (a ``causalkv_configure_stage`` hook may return): the
        streaming fields (not the model's identity or its weights' geometry), then the keys of
        the family records it holds."""
        own = [f.name for f in fields(self) if f.name not in _NOT_OVERRIDES]
        return own + [k for r in self.options for k in type(r).specs() if k not in own]

    def with_overrides(self, overrides: Mapping[str, Any]) -> ModelConfig:
        """A copy with ``overrides`` applied (field names to the fields, a family key to its
        record); `ConfigError` for any other key, listing `override_keys`. The one check of
        overrides (``causalkv_configure_stage`` results, `causalkv.runtime.host.hook_calls.configure_stage`)."""
        keys = self.override_keys()
        if unknown := sorted(set(overrides) - set(keys)):
            raise ConfigError(
                f"unknown ModelConfig override(s) {', '.join(unknown)}; the overrides are: {', '.join(keys)}"
            )
        own = {k: v for k, v in overrides.items() if k in {f.name for f in fields(self)}}
        # each family record a changed (validated) copy, with its keys not the fields'
        records = [replace(r, **{k: v for k, v in overrides.items() if k not in own and k in type(r).specs()})
                   for r in self.options]
        return replace(self, **own, options=records)


#: `ModelConfig` fields no override may change: the model's identity and its weights' geometry
_NOT_OVERRIDES = frozenset({"name", "model_class", "path", "options", "num_layers", "num_heads", "head_dim",
                            "tokens_per_frame"})


@dataclass(frozen=True)
class ModelRef:
    """What resolution knows about a model before loading it (no file read to build one).

    Attributes:
        name: the preset or model name, the folder path, or ``ModelConfig.name``.
        model_class: the diffusers ``_class_name`` (None for a bare model name).
        keys: names matched against ``StageRegistration.models``, in preference order.
        config: the `ModelConfig` when one was given, else None.
        source: how the model was read (for the resolution's reasons).
    """

    name: str
    model_class: str | None
    keys: tuple[str, ...]
    config: ModelConfig | None
    source: str

    @classmethod
    def of(cls, model: str | ModelConfig | ModelRef) -> ModelRef:
        """The reference for a model name (matched as is), a `ModelConfig` (matched on
        ``model_class``, then ``name``) or a `ModelRef` (returned as is). A diffusers-format
        folder is read by `causalkv.runtime.model_io.model_config.model_ref`.

        Raises:
            InvalidTypeError: ``model`` of another type.
        """
        if isinstance(model, ModelRef):
            return model
        if isinstance(model, ModelConfig):
            keys = tuple(dict.fromkeys(k for k in (model.model_class, model.name) if k))
            return cls(model.name, model.model_class, keys, model, "model config")
        if not isinstance(model, str):
            raise InvalidTypeError(f"model must be a model name, a ModelConfig or a ModelRef, got {model!r}")
        return cls(model, None, (model,), None, "model name")

    @property
    def label(self) -> str:
        """The name, with the pipeline class when it differs: ``"path (WanPipeline)"``."""
        differs = self.model_class and self.model_class != self.name
        return f"{self.name} ({self.model_class})" if differs else self.name


#: the dtypes a request (its compute, its caches, the planner's count) may name, with their
#: bytes per element
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: their names
DTYPES = tuple(DTYPE_BYTES)
#: what turns ``multi_shot`` on, as generate and resolve take it
MULTI_SHOT = "several --prompt (resolve: --multi-shot)"


@dataclass(frozen=True)
class ServerArgs:
    """Per-request and per-server options that shape resolution and generation.

    Validated on construction (`ConfigError`, a ValueError, naming the value and the flag);
    derive a changed copy with ``dataclasses.replace`` so the copy is validated too.

    Attributes:
        sink_frames, window_frames, recent_window_frames: overrides of the model config.
        multi_shot: scene cuts pin a shot sink (needs ``pinned_sink``; LongLive 2.0).
        heads_sharded: ranks sharing the heads (> 1 needs ``head_slice``).
        cache: force a cache factory by name (None: let resolution choose).
        seed, dtype, device: generation settings.
        kv_cache_dtype: dtype of the KV caches (None: ``dtype``). On CPUs without bf16
            instructions (AVX2) bf16 matmuls run several times slower than fp32: computing in
            float32 with bf16 caches keeps the caches' bytes at bf16 and the speed of fp32.
        guidance_scale: classifier-free guidance (> 1 runs a negative branch with its own cache).
        options: the extensions' own records (`causalkv.options`): a stage family's request
            knobs (LongLive 2.0 shots, LingBot-World motion), a cache's settings (QVG); one per
            record class. `option` reads one (its defaults when the request gives none).

    """

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
    kv_cache_dtype: str | None = None
    options: tuple[Options, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _by_class(self.options, "ServerArgs"))
        for name, minimum in (("sink_frames", 0), ("window_frames", 1),
                              ("recent_window_frames", 0)):
            if getattr(self, name) is not None:  # its flag: --sink-frames, ...
                check_int(f"--{name.replace('_', '-')}", getattr(self, name), minimum=minimum,
                          hint="or leave it unset for the model's value")
        check_int("--heads-sharded", self.heads_sharded, minimum=1)
        check_int("--seed", self.seed)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in (None, *DTYPES):
            raise ConfigError(f"kv cache dtype must be one of {list(DTYPES)} or None (same as "
                              f"--dtype), got {self.kv_cache_dtype!r} (--kv-cache-dtype)")
        g = self.guidance_scale
        if not is_number(g) or g < 0:
            raise ConfigError(f"guidance scale must be a finite number >= 0, got {g!r} (--guidance-scale)")
        if self.cache is not None and (not isinstance(self.cache, str) or not self.cache):
            raise ConfigError(f"cache must be a cache name or None, got {self.cache!r} (--cache)")

    def option(self, cls: type[R]) -> R:
        """The request's ``cls`` record, else ``cls()`` (its defaults)."""
        return _option(self.options, cls)

    def without_options(self, kind: type[Options]) -> ServerArgs:
        """A validated copy without the records of type ``kind`` (e.g. every cache's)."""
        return replace(self, options=tuple(r for r in self.options if not isinstance(r, kind)))

    def requirement_reasons(self, model: ModelConfig | None = None) -> dict[str, str]:
        """Cache features this request needs -> why, as the user wrote it: the host's fields
        (``--multi-shot``, ``--nproc-per-node N`` / ``--heads-sharded N``, a recent window of the request or the
        model) and every record's `Options.requires`."""
        out: dict[str, str] = {}
        if self.multi_shot:  # generate: several prompts of a multi-shot stage; resolve: a flag
            out["pinned_sink"] = MULTI_SHOT
        if self.heads_sharded > 1:  # generate's flag, then resolve's
            out["head_slice"] = f"--nproc-per-node {self.heads_sharded} (resolve: --heads-sharded {self.heads_sharded})"
        if self.recent_window_frames is not None:
            out["recent_window"] = f"--recent-window-frames {self.recent_window_frames}"
        elif model is not None and model.recent_window_frames is not None:
            out["recent_window"] = f"model recent_window_frames={model.recent_window_frames}"
        for record in self.options:
            for feature, why in record.requires().items():
                out.setdefault(feature, why)
        return out


def check_text(text: str, flag: str) -> str:
    """``text`` if it encodes as UTF-8; else `ConfigError` naming ``flag`` and the first bad byte.

    A command-line argument that is not valid UTF-8 reaches Python with its bad bytes as
    lone surrogates (PEP 383); a tokenizer cannot encode them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        try:  # bytes the command line or a file gave (PEP 383): show them as they were given
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate character of the text itself
            shown, where = repr(text), f"character {text[exc.start]!r} at position {exc.start}"
        else:
            at = len(text[: exc.start].encode("utf-8", "surrogateescape"))
            shown, where = repr(raw), f"byte {raw[at:at + 1]!r} at byte {at}"
        raise ConfigError(
            f"{flag} {shown} is not valid UTF-8 text ({where}); pass it as UTF-8 "
            "(e.g. through iconv -t UTF-8) or fix the file it comes from"
        ) from None
    return text


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
