"""Load-time resolution of causalkv's own host: the stage for a model and a cache that serves it.

The plugin registry (`causalkv.plugin`) collects what every plugin registers; this host picks
from it (the sglang and vLLM-Omni bridges pick their host classes with
`causalkv.plugin.Registry.host_classes`). A ``HostClassRegistration`` of host ``causalkv`` naming the
chosen stage's class for the model names its cache factory (``cache``), as ``--cache`` does
(which wins over it); a factory built with another host's arguments is never chosen here.

Runs before any weights load and reads no file (a model folder is read by the runtime,
`causalkv.runtime.model_io.model_config.model_ref`); it imports the chosen stage's module (never a
cache module). It also routes the request's option records
(`causalkv.options`): the chosen stage gets its family's record, the chosen cache its
settings record (`Resolution.stage_options`, `Resolution.cache_options`), and a record of an
extension that was not chosen is refused with one message naming the option, its owner and
the chosen one (`causalkv.options.foreign_options_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from causalkv.capabilities import QUANT_QVG
from causalkv.config import ModelConfig, ModelRef, ServerArgs
from causalkv.hooks import NAME, CacheFactory, HostClassRegistration, StageRegistration
from causalkv.options import (
    CacheOptions,
    StageOptions,
    cache_record_for,
    foreign_options_error,
)
from causalkv.plugin.errors import ResolutionError, UnsupportedRequestError
from causalkv.plugin.manager import get_plugin_manager
from causalkv.plugin.registry import CacheEntry, Registry, StageEntry, collect

if TYPE_CHECKING:
    import pluggy

    from causalkv.stages.base import CausalDenoisingStage

__all__ = ["Resolution", "resolve"]


@dataclass(frozen=True)
class Resolution:
    """The outcome of `resolve`: what to build, and why.

    Attributes:
        stage: the chosen `CausalDenoisingStage` subclass.
        cache_factory: the chosen cache factory (not built, its module not imported).
        requirements: cache features the stage needs under the server args.
        reasons: human-readable lines explaining each choice.
        model: the model as resolution saw it (its name, ``_class_name`` and `ModelConfig`
            when one was given).
        stage_registration: the registration that won.
        stage_plugin, cache_plugin: the plugins that registered the stage and the cache.
        stage_options: the request's record of the stage family's knobs (its defaults when
            the request gives none), or None when the family declares none.
        cache_options: the settings record the chosen cache is built with, or None.
    """

    stage: type[CausalDenoisingStage]
    cache_factory: CacheFactory
    requirements: frozenset[str]
    reasons: tuple[str, ...]
    model: ModelRef
    stage_registration: StageRegistration
    stage_plugin: str
    cache_plugin: str
    stage_options: StageOptions | None = None
    cache_options: CacheOptions | None = None

    @property
    def stage_name(self) -> str:
        """The stage's registration name (its one name: header, metrics, ``--stage``)."""
        return self.stage_registration.name


def _refuse_foreign_records(registry: Registry, stage: StageEntry, cache: CacheEntry, cls: type, args: ServerArgs) -> None:
    """The one refusal of option records given to an extension that was not chosen
    (`foreign_options_error`, naming the record's owner): a stage record not of the chosen
    stage's ``options`` class, a cache record the chosen cache does not take (not of its
    ``options`` class; a factory without one takes a record asking for a feature it covers)."""
    own_stage, own_cache = stage.registration.options, cache.factory.options
    for record in (r for r in args.options if r.changed()):
        if isinstance(record, StageOptions) and not (own_stage and isinstance(record, own_stage)):
            kind, chosen = "stage", f"{cls.__name__} (stage {stage.name!r})"
            owners = [e for e in registry.stages if e.registration.options and isinstance(record, e.registration.options)]
        elif isinstance(record, CacheOptions) and not (isinstance(record, own_cache) if own_cache else record.requires()):
            kind, chosen = "cache", f"cache {cache.name!r}"
            owners = [e for e in registry.caches if e.factory.options and isinstance(record, e.factory.options)]
        else:
            continue
        owner = f"{kind} {owners[0].name!r}" if owners else None
        fix = (f"a model {owner} serves" if kind == "stage" else f"--cache {owners[0].name}") if owners else None
        raise foreign_options_error(record, chosen=chosen, owner=owner, alternative=fix)


def _stage_list(entries: list[StageEntry]) -> str:
    return "; ".join(e.describe() for e in entries)


def _pick_stage(
    registry: Registry, ref: ModelRef, stage_name: str | None
) -> tuple[StageEntry, list[StageEntry]]:
    """The winning stage entry and every entry serving the model (best first)."""
    serving = list(registry.serving(*ref.keys))  # model_class before name: a class match wins a tie
    if stage_name is not None:
        entry = registry.stage(stage_name)
        if entry not in serving:
            raise ResolutionError(
                f"stage {stage_name!r} does not serve {ref.label} (it serves "
                f"{', '.join(entry.registration.served)}). Stages serving it: "
                f"{', '.join(e.name for e in serving) or '(none)'}"
            )
        return entry, serving
    if not serving:
        served = ", ".join(registry.served_models()) or "(none: no plugin registers a stage)"
        raise ResolutionError(
            f"no registered stage serves model {ref.label}. Served models: {served}. "
            f"Install or enable a plugin that registers a stage for it (causalkv plugins "
            f"lists what is loaded)."
        )
    return serving[0], serving


#: what a request may ask that a stage must declare: (`StageEntry.supports` feature, what it
#: is, the flag that drops it)
_STAGE_FEATURES = (
    ("qvg", "QVG KV-cache quantization", "run with --kv-cache-quant off"),
    ("multi_shot", "multi-shot generation (a pinned shot sink per scene cut)", "drop --multi-shot"),
)


def _check_stage(entry: StageEntry, serving: list[StageEntry], registry: Registry, ref: ModelRef, args: ServerArgs) -> None:
    """Refuse a request asking for a feature the chosen stage does not declare, naming the
    stages that do (those serving the model first) and the flag that drops it."""
    asked = {"qvg": QUANT_QVG in args.requirement_reasons(ref.config), "multi_shot": args.multi_shot}
    for feature, what, drop in _STAGE_FEATURES:
        if not asked[feature] or entry.supports(feature):
            continue
        able = [e for e in registry.stages if e.supports(feature)]
        here = [e for e in able if e in serving]
        fix = (
            f"Stages serving {ref.label} that do: {_stage_list(here)}; pick one with --stage NAME, or {drop}."
            if here
            else f"No registered stage serving {ref.label} does (stages that do: {_stage_list(able) or 'none'}): {drop}."
        )
        raise UnsupportedRequestError(
            f"{entry.load().__name__} does not support {what} (stage {entry.name!r}, plugin {entry.plugin!r}). {fix}"
        )


def _pick_cache(
    pm: pluggy.PluginManager, registry: Registry, stage: StageEntry, requirements: frozenset[str], args: ServerArgs,
    hosted: tuple[HostClassRegistration, str] | None = None,
) -> tuple[CacheEntry, str]:
    """The cache for ``stage`` (forced by ``--cache``, named by the stage's host registration
    ``hosted``, chosen by the hook, or the highest priority among those covering
    ``requirements``) and the reason line. A cache built with another host's arguments
    (`CacheFactory.host`) is never this host's."""
    req = ", ".join(sorted(requirements)) or "none"
    covers = req if requirements else "the requirements (none)"
    caches = [e for e in registry.caches if e.factory.host is None]
    missing = {e.name: ", ".join(sorted(e.factory.features().missing(requirements))) for e in caches}
    qualifying = sorted((e for e in caches if not missing[e.name]), key=lambda e: -e.factory.priority)
    lack = "; ".join(f"{name} lacks {m}" for name, m in missing.items() if m)
    names, tail = ", ".join(f"{e.name} ({e.factory.priority})" for e in qualifying), f"; {lack}" if lack else ""
    label = lambda e: f"cache {e.name} (plugin {e.plugin}, priority {e.factory.priority})"  # noqa: E731
    named, how = (args.cache, "forced by --cache") if args.cache is not None else (
        (hosted[0].cache, f"named by plugin {hosted[1]}'s host registration") if hosted is not None else (None, ""))
    if named is not None:
        entry = registry.cache(named)
        ok = ", ".join(e.name for e in qualifying) or "(none)"
        if entry.factory.host is not None:
            raise ResolutionError(f"cache {named!r} ({how}) builds {entry.factory.host}'s caches, not causalkv's "
                                  f"runtime's. Caches that qualify: {ok}")
        if missing[entry.name]:
            raise ResolutionError(
                f"cache {named!r} ({how}) lacks {missing[entry.name]}, which stage {stage.name} needs "
                f"(requirements: {req}). Caches that qualify: {ok}"
            )
        return entry, f"{label(entry)}: {how}; covers {covers}"
    if not qualifying:
        raise ResolutionError(
            f"no registered cache covers the requirements of stage {stage.name} ({req}): "
            f"{lack or 'no cache is registered'}. Drop the flag that needs the missing feature, "
            f"or install a plugin whose cache provides it."
        )
    chosen = pm.hook.causalkv_select_cache_factory(
        stage=stage.load(), requirements=requirements, candidates=tuple(e.factory for e in qualifying)
    )
    if chosen is None:
        how = f"highest priority among qualifying {names}" if len(qualifying) > 1 else "the only cache that does"
        return qualifying[0], f"{label(qualifying[0])}: covers {covers}; {how}{tail}"
    chosen_name = chosen if isinstance(chosen, str) else getattr(chosen, "name", None)
    entry = next((e for e in qualifying if e.name == chosen_name), None)
    if entry is None:
        raise ResolutionError(
            f"causalkv_select_cache_factory returned {chosen!r}, which is not one of the "
            f"qualifying caches for stage {stage.name}: {', '.join(e.name for e in qualifying)}"
        )
    return entry, f"{label(entry)}: chosen by causalkv_select_cache_factory among qualifying {names}{tail}"


def resolve(
    model: str | ModelConfig | ModelRef,
    server_args: ServerArgs | None = None,
    *,
    pm: pluggy.PluginManager | None = None,
    stage: str | None = None,
    registry: Registry | None = None,
) -> Resolution:
    """Choose the stage for ``model`` and a cache that serves what it needs.

    Args:
        model: a preset or model name (``"tiny-wan"``), a `ModelConfig` (matched on
            ``model_class``, then ``name``), or a `ModelRef` (a diffusers-format folder, read
            by `causalkv.runtime.model_io.model_config.model_ref`: its ``_class_name`` is matched).
        server_args: flags that shape the requirements (default `ServerArgs()`).
        pm: the plugin manager (default: the process-wide one).
        stage: force a stage by registration name (it must serve the model).
        registry: the registrations collected from ``pm`` (default: collected here; a host
            collects once per run and passes it).

    Raises:
        InvalidTypeError: ``model`` of another type.
        ResolutionError: ``model`` is a path (the message names `model_ref`), unknown model
            (lists the served ones), unknown or unqualified
            forced stage/cache, or no cache covering the requirements (names, per cache,
            the capability it lacks).
            QVG requested on a stage without QVG support (the message starts with
            ``"<StageClass> does not support QVG KV-cache quantization"``), or multi-shot
            on a stage without it.
        PluginConflictError: plugins claim the same stage, model priority or cache name.
        ConfigError: an option record whose given values do nothing (`Options.check_used`),
            or one of a stage or cache that was not chosen (naming both).
    """
    pm = pm if pm is not None else get_plugin_manager()
    args = server_args if server_args is not None else ServerArgs()
    for record in args.options:
        record.check_used()
    if isinstance(model, str) and "/" in model:  # resolution reads no folder
        raise ResolutionError(
            f"model {model!r} is a path: resolve a model folder as "
            f"resolve(causalkv.runtime.model_io.model_config.model_ref(path)), or pass a served model name"
        )
    ref = ModelRef.of(model)
    registry = registry if registry is not None else collect(pm)
    entry, serving = _pick_stage(registry, ref, stage)
    cls = entry.load()
    reg = entry.registration
    reasons = [f"model {ref.label}: matched by {ref.source}"]
    matched = next(k for k in ref.keys if k in reg.served)
    how = "forced by --stage" if stage is not None else f"priority {reg.priority}"
    others = [e for e in serving if e is not entry]
    also = f"; also serving: {_stage_list(others)}" if others else ""
    reasons.append(
        f"stage {reg.name} ({cls.__name__}, plugin {entry.plugin}) serves {matched} ({how}){also}"
    )
    _check_stage(entry, serving, registry, ref, args)
    requirements = frozenset(cls.required_cache_features(args, ref.config))
    why = args.requirement_reasons(ref.config)
    described = [f"{f} ({why.get(f) or f'declared by stage {reg.name}'})" for f in sorted(requirements)]
    reasons.append(f"requirements: {', '.join(described) or 'none'}")
    hosts = registry.host_classes(NAME)  # a registration naming this stage's class for the model
    hosted = next((h for k in ref.keys if (h := hosts.get(k)) is not None and h[0].target == reg.target), None)
    cache_entry, why = _pick_cache(pm, registry, entry, requirements, args, hosted)
    reasons.append(why)
    _refuse_foreign_records(registry, entry, cache_entry, cls, args)
    return Resolution(
        stage=cls,
        cache_factory=cache_entry.factory,
        requirements=requirements,
        reasons=tuple(reasons),
        model=ref,
        stage_registration=reg,
        stage_plugin=entry.plugin,
        cache_plugin=cache_entry.plugin,
        stage_options=args.option(reg.options) if reg.options is not None else None,
        cache_options=cache_record_for(cache_entry.factory, args.options),
    )
