"""Records the registration hooks return: `StageRegistration` (with its `Preset`s), `CacheFactory`,
`CodecRegistration` and `HostClassRegistration`.

Plain frozen dataclasses, torch-free: a ``"module:Class"`` string is imported only by ``load()``.
A `StageRegistration` is the one place that describes a model family to the host: the stage
class, the model names it serves, the model-config defaults of those models, tiny presets, and
the family's own option records (request knobs, ``causalkv.json`` keys). A `CacheFactory`
describes a cache: its class, capabilities and settings record. The host builds the command
line, the config parsing and the validation from those records (`causalkv.options`). A
`HostClassRegistration` names a class of a host (a stage of sglang, a pipeline of vLLM-Omni, a
stage of causalkv's own runtime) that causalkv serves there, and the cache factory and codec
it is served with.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from causalkv.capabilities import CacheCapabilities
from causalkv.config import ModelConfig, ServerArgs
from causalkv.errors import ImportPathError, InvalidTypeError, is_int
from causalkv.options import CacheOptions, Options, StageOptions

__all__ = [
    "CacheFactory", "CacheKind", "CodecRegistration", "HostClassRegistration", "Preset", "Stage",
    "StageRegistration", "import_object",
]


class Stage(Protocol):
    """What a hook sees of a denoising stage (`causalkv.stages.base.CausalDenoisingStage` is
    one): its registration name, its model config, the request, and its family's record."""

    name: str
    model: ModelConfig
    server_args: ServerArgs
    options: StageOptions | None


class CacheKind(Protocol):
    """What a `CacheFactory`'s ``cache`` is once loaded: a cache class (or a callable) that
    builds one layer's cache, and the calls the host makes on it and on what it built. Define
    the ones you need (the two request calls as classmethods; docs/plugins.md, "A cache
    kind"); one left out gets the default written here. The host calls them through the
    factory (`CacheFactory.check_request`, `.describe_request`, `.packing_report`).
    """

    def __call__(self, spec: Any, options: CacheOptions | None) -> CacheReporting:
        """One layer's cache for ``spec`` (a `causalkv.caches.spec.CausalCacheSpec`), honouring
        the cache contract (docs/caches.md) for every capability it declares."""

    def check_request(self, options: CacheOptions | None, *, head_dim: int, device: str) -> None:
        """Before any weights load: refuse ``options`` that cannot run for K/V of ``head_dim``
        channels on ``device`` (`causalkv.errors.ConfigError` naming the flag and the fix).
        Default: nothing to refuse."""

    def describe_request(
        self, options: CacheOptions | None, *, tokens_per_chunk: int, sink_tokens: int
    ) -> list[str]:
        """Lines the run header adds under the cache (after the resolution's reasons).
        Default: none."""


class CacheReporting(Protocol):
    """What the host asks a built cache after the run (every layer's and branch's)."""

    def packing_report(self) -> PackingReport | None:
        """What this cache did, as a report the host merges over all caches of the run into
        the ``kv_packing`` metric. Default (a cache without it): no ``kv_packing``."""


class PackingReport(Protocol):
    """A cache's `CacheReporting.packing_report`: merged over the run's caches, then a dict.

    Keys of `to_dict` the host reads when present: ``chunks_packed`` (int: chunks stored
    packed) and ``chunks_dense`` (reason -> chunks kept dense); with ``chunks_packed`` 0 the
    host warns that the request's cache settings packed nothing, naming those reasons. Every
    other key is the cache's own and goes to the ``kv_packing`` metric as it is.
    """

    @classmethod
    def merge(cls, reports: Sequence[Any]) -> PackingReport: ...

    def to_dict(self) -> dict[str, Any]: ...


def import_object(path: str) -> Any:
    """Import ``"package.module:Attr"`` (``Attr`` may be dotted: ``"mod:Outer.Inner"``), with
    the standard library's `pkgutil.resolve_name`.

    Raises:
        ImportPathError: ``path`` is not of that form, or the attribute is missing (naming it).
        ModuleNotFoundError: the module is missing.
    """
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise ImportPathError(f"{path!r} is not a 'package.module:Attribute' import path")
    try:
        return pkgutil.resolve_name(path)
    except AttributeError as exc:
        raise ImportPathError(f"{path!r}: {exc}") from None


def _target(obj: object) -> str:
    """``"module:Qualname"`` of a class or callable (a string is returned as is)."""
    if isinstance(obj, str):
        return obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(obj)


def _require(ok: bool, owner: str, what: str, expected: str, value: object) -> None:
    """Refuse field ``what`` of ``owner`` unless ``ok`` (InvalidTypeError naming the value)."""
    if not ok:
        raise InvalidTypeError(f"{owner}: {what} must be {expected}, got {value!r}")


def _nonempty(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _names(owner: str, names: object, what: str = "models") -> tuple[str, ...]:
    """``names`` (one string, or an iterable of them) as a tuple of non-empty strings, itself
    non-empty for ``models``."""
    out = (names,) if isinstance(names, str) else tuple(names)  # type: ignore[call-overload]
    _require((bool(out) or what != "models") and all(map(_nonempty, out)), owner, what, "non-empty strings", names)
    return out


def _check_record(owner: str, what: str, record: object, base: type[Options]) -> None:
    _require(record is None or (isinstance(record, type) and issubclass(record, base)), owner, what,
             f"a causalkv.options.{base.__name__} subclass (a frozen dataclass of option(...) "
             "fields) or None", record)


@dataclass(frozen=True)
class Preset:
    """A tiny model of a family, with seeded random weights, that a host can build locally.

    Attributes:
        name: the model name users pass (``"tiny-lingbot"``); the stage serves it.
        settings: the model folder's ``causalkv.json`` (frames per chunk, sink, window, ...;
            the host's docs list the keys).
        seed: the weights' seed.
        description: one line for ``--help`` and the folder's README.
        transformer: overrides of the host's tiny transformer config (e.g. more heads).
    """

    name: str
    settings: Mapping[str, Any]
    seed: int = 0
    description: str = ""
    transformer: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(_nonempty(self.name), "Preset", "name", "a non-empty string", self.name)
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "transformer", MappingProxyType(dict(self.transformer)))


@dataclass(frozen=True)
class StageRegistration:
    """A model family: its denoising stage, the models it serves, their defaults and presets.

    Attributes:
        name: unique stage name, used everywhere (``--stage``, the run header, metrics).
        stage: a `CausalDenoisingStage` subclass, or a ``"module:Class"`` string imported
            only when the stage is chosen or listed.
        models: model names served: diffusers ``_class_name`` values of ``model_index.json``
            (``"WanPipeline"``) and/or plain names. Preset names are served too. A single
            string is stored as a 1-tuple.
        priority: among stages serving the same model, the highest wins; two stages serving
            one model at the same priority are a conflict.
        defaults: model-config defaults (``causalkv.json`` keys) of the served models, used
            where a model folder's ``causalkv.json`` is absent or omits a key.
        presets: tiny models of this family (`Preset`); ``models[0]`` is their pipeline class.
        options: the family's request knobs, a `causalkv.options.StageOptions` subclass (its
            flags join ``causalkv generate``'s, under the record's title; the host gives the
            request's record to this stage, ``stage.options``, and refuses it for any other).
            Declared here only, so ``--help`` reads it without importing the stage.
        config: the family's own ``causalkv.json`` keys, a `causalkv.options.Options` subclass
            (``ModelConfig.option(config)`` reads them).
    """

    name: str
    stage: type | str
    models: tuple[str, ...]
    priority: int = 0
    defaults: Mapping[str, Any] = field(default_factory=dict)
    presets: tuple[Preset, ...] = ()
    options: type[StageOptions] | None = None
    config: type[Options] | None = None

    def __post_init__(self) -> None:
        owner = f"StageRegistration {self.name!r}"
        _require(_nonempty(self.name), owner, "name", "a non-empty string", self.name)
        _require(isinstance(self.stage, (str, type)), owner, "stage",
                 "a class or a 'module:Class' string", self.stage)
        presets = tuple(self.presets)
        _require(all(isinstance(p, Preset) for p in presets), owner, "presets", "Preset records",
                 self.presets)
        object.__setattr__(self, "models", _names(owner, self.models))
        object.__setattr__(self, "presets", presets)
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        _require(is_int(self.priority, None), owner, "priority", "an int", self.priority)
        _check_record(owner, "options", self.options, StageOptions)
        _check_record(owner, "config", self.config, Options)

    @property
    def served(self) -> tuple[str, ...]:
        """Every name this stage serves: ``models`` then the preset names."""
        return self.models + tuple(p.name for p in self.presets)

    @property
    def target(self) -> str:
        """``"module:Class"`` of the stage, without importing it."""
        return _target(self.stage)

    def load(self) -> type:
        """The stage class (imports a ``"module:Class"`` string on first use)."""
        return import_object(self.stage) if isinstance(self.stage, str) else self.stage


@dataclass(frozen=True)
class CodecRegistration:
    """A KV codec setting a plugin adds (``--kv-cache-quant NAME``, the recency tier, the
    planner's rows, ``causalkv plugins``).

    Attributes:
        name: what the user types (``"int8"``); unique among codec settings.
        codec: ``"module:Class"`` of a ``causalkv.caches.codecs.base.KVCodec`` subclass,
            imported only when a cache packs with it.
        params: keyword arguments of the class's ``from_settings``.
        help: one line for ``causalkv plugins``.
    """

    name: str
    codec: str
    params: Mapping[str, Any] = field(default_factory=dict)
    help: str = ""

    def __post_init__(self) -> None:
        owner = f"CodecRegistration {self.name!r}"
        _require(_nonempty(self.name), owner, "name", "a non-empty string", self.name)
        _require(isinstance(self.codec, str) and ":" in self.codec, owner, "codec",
                 "a 'module:Class' string", self.codec)


@dataclass(frozen=True)
class HostClassRegistration:
    """A class of another host that causalkv serves there: a stage of sglang's diffusion
    runtime, a pipeline of vLLM-Omni. That host's bridge reads the registrations naming it,
    once per process before any weights load, and serves exactly the classes they name
    (docs/plugins.md, "Serving a host's class"); causalkv's built-in plugin registers its own
    this way.

    Attributes:
        host: the host's name: ``"sglang"`` or ``"vllm-omni"`` (another host's bridge, or
            causalkv's own runtime, ignores the registration).
        target: ``"module:Class"`` of the class, imported only by that host's bridge.
        models: the host's pipeline names it serves (sglang: the pipelines whose denoising runs
            in the stage; vLLM-Omni: the ``model_class_name`` values it is registered under).
            A single string is stored as a 1-tuple.
        codec: the codec setting it packs with while the host's settings turn QVG on and name
            no codec (None: the host's default); a codec causalkv or a plugin registers.
            A registration of host ``"causalkv"`` names none: the runtime takes the codec from
            ``--kv-cache-quant``.
        priority: among one host's registrations serving one model, the highest wins; two at
            the same priority are a conflict.
        cache: the name of the `CacheFactory` whose kind builds each layer's cache there (None:
            the host's default); a cache causalkv or a plugin registers. What the kind is
            called with is the host's (docs/plugins.md, "Serving a host's class").
    """

    host: str
    target: str
    models: tuple[str, ...]
    codec: str | None = None
    priority: int = 0
    cache: str | None = None

    def __post_init__(self) -> None:
        owner = f"HostClassRegistration {self.target!r}"
        _require(isinstance(self.target, str) and ":" in self.target, "HostClassRegistration", "target",
                 "a 'module:Class' string", self.target)
        _require(_nonempty(self.host), owner, "host", "a host's name such as 'sglang'", self.host)
        for what, value, kind in (("codec", self.codec, "codec setting"), ("cache", self.cache, "cache factory")):
            _require(value is None or _nonempty(value), owner, what, f"a {kind}'s name or None", value)
        if self.host == "causalkv" and self.codec is not None:
            raise InvalidTypeError(f"{owner}: causalkv's runtime takes the codec from --kv-cache-quant, so a "
                                   f"registration of host 'causalkv' cannot name one (got codec={self.codec!r}); "
                                   "leave codec None")
        object.__setattr__(self, "models", _names(owner, self.models))
        _require(is_int(self.priority, None), owner, "priority", "an int", self.priority)

    @property
    def name(self) -> str:
        """``"<host> <target>"``: what messages call the registration."""
        return f"{self.host} {self.target}"


@dataclass(frozen=True)
class CacheFactory:
    """A KV-cache implementation.

    Attributes:
        name: unique cache name (``--cache NAME`` forces it).
        cache: a cache class, a ``"module:Class"`` string imported only when needed, or any
            callable ``(spec: CausalCacheSpec, options) -> cache``; ``options`` is the request's
            record of the ``options`` class (its defaults when the request gives none), or
            None when the factory declares no options record.
        capabilities: what it supports (``host:<name>``: a kind built with another host's
            arguments, `host`). None (the default) reads the cache class's own
            ``capabilities`` attribute (at once for a class, on first `features()` call for a
            ``"module:Class"`` string), so a cache declares them in one place; a
            `CacheCapabilities` or an iterable of feature strings overrides that.
        priority: among the caches that qualify, the highest wins unless a
            ``causalkv_select_cache_factory`` hook chooses.
        options: the cache's settings, a `causalkv.options.CacheOptions` subclass (its flags
            join ``causalkv generate``'s; the host gives the request's record to this cache
            and refuses it for a cache it did not choose). The built-in ``qvg`` declares
            `causalkv.caches.qvg.options.QVGKVQuantArgs`.
    """

    name: str
    cache: type | str | Callable[..., Any]
    capabilities: CacheCapabilities | Iterable[str] | None = None
    priority: int = 0
    options: type[CacheOptions] | None = None

    def __post_init__(self) -> None:
        owner = f"CacheFactory {self.name!r}"
        _require(_nonempty(self.name), owner, "name", "a non-empty string", self.name)
        _require(isinstance(self.cache, str) or callable(self.cache), owner, "cache",
                 "a class, a 'module:Class' string or a callable", self.cache)
        _require(is_int(self.priority, None), owner, "priority", "an int", self.priority)
        _check_record(owner, "options", self.options, CacheOptions)
        caps = self.capabilities
        if caps is None and isinstance(self.cache, type):
            object.__setattr__(self, "capabilities", self.features())  # declared by the class
        elif caps is not None and not isinstance(caps, CacheCapabilities):
            object.__setattr__(self, "capabilities", CacheCapabilities(frozenset(_names(owner, caps, "capabilities"))))

    def features(self) -> CacheCapabilities:
        """The capabilities: given ones, else the loaded class's ``capabilities`` attribute."""
        if isinstance(self.capabilities, CacheCapabilities):
            return self.capabilities
        caps = getattr(self.load(), "capabilities", None)
        if not isinstance(caps, CacheCapabilities):
            raise InvalidTypeError(
                f"CacheFactory {self.name!r}: {self.target} declares no `capabilities` "
                f"(a causalkv.capabilities.CacheCapabilities); pass capabilities=..."
            )
        return caps

    @property
    def target(self) -> str:
        """``"module:Class"`` (or a repr of the callable), without importing it."""
        return _target(self.cache)

    @property
    def host(self) -> str | None:
        """The host whose caches the kind builds, with that host's arguments: ``"sglang"`` for a
        ``host:sglang`` capability; None (no ``host:`` capability): causalkv's cache contract,
        ``kind(spec, options)``, which causalkv's runtime and vLLM-Omni's bridge build."""
        return next((f.partition(":")[2] for f in self.features() if f.startswith("host:")), None)

    def load(self) -> Callable[..., Any]:
        """The cache class or callable (imports a ``"module:Class"`` string on demand)."""
        return import_object(self.cache) if isinstance(self.cache, str) else self.cache

    def build(self, spec: Any, options: CacheOptions | None = None) -> Any:
        """Build one layer's cache: ``load()(spec, options)`` (``options``: the request's
        settings record for this cache, e.g. a ``QVGKVQuantArgs``)."""
        return self.load()(spec, options)

    # ---- the host's calls on the cache kind (`CacheKind`; defaults where the kind has none)
    def check_request(self, options: CacheOptions | None, *, head_dim: int, device: str) -> None:
        """`CacheKind.check_request` of the loaded kind (nothing to refuse without one)."""
        _hook(self.load(), "check_request", None)(options, head_dim=head_dim, device=device)

    def describe_request(self, options: CacheOptions | None, *, tokens_per_chunk: int, sink_tokens: int) -> list[str]:
        """`CacheKind.describe_request` of the loaded kind (no lines without one)."""
        return list(_hook(self.load(), "describe_request", ())(options, tokens_per_chunk=tokens_per_chunk,
                                                               sink_tokens=sink_tokens))

    def packing_report(self, caches: Sequence[Any]) -> dict[str, Any] | None:
        """The ``kv_packing`` metric: the `CacheReporting.packing_report` of ``caches`` (the
        run's, built by this factory) merged (`PackingReport.merge`); None when none reports."""
        reports = [r for c in caches if (r := _hook(c, "packing_report", None)()) is not None]
        return type(reports[0]).merge(reports).to_dict() if reports else None


def _hook(obj: Any, name: str, default: Any) -> Callable[..., Any]:
    """``obj``'s `CacheKind` / `CacheReporting` call ``name``, else one returning ``default``."""
    fn = getattr(obj, name, None)  # a kind defines only the calls it needs
    return fn if callable(fn) else lambda *a, **k: default
