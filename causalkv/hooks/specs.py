"""The hook specifications: what a causalkv plugin may implement.

Implement any of these in a module or class, mark each with ``@causalkv.hooks.hookimpl``,
and expose the module under the ``causalkv`` entry-point group (docs/plugins.md). Every
argument is optional in an implementation: pluggy passes only the ones you name.

Load time (before any weights load): ``causalkv_register_stages``,
``causalkv_register_cache_factories``, ``causalkv_register_codecs`` and
``causalkv_register_host_classes`` fill the registries; ``resolve()`` then calls
``causalkv_select_cache_factory``. Run time: the host calls ``causalkv_configure_stage``
once per built stage, before its caches are allocated, and ``causalkv_chunk_done`` after
each generated chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from causalkv.config import ModelConfig, ServerArgs
from causalkv.hooks.markers import hookspec
from causalkv.hooks.records import (
    CacheFactory,
    CodecRegistration,
    HostClassRegistration,
    Stage,
    StageRegistration,
)

__all__ = [
    "causalkv_chunk_done", "causalkv_configure_stage", "causalkv_register_cache_factories",
    "causalkv_register_codecs", "causalkv_register_host_classes", "causalkv_register_stages",
    "causalkv_select_cache_factory",
]


@hookspec
def causalkv_register_stages() -> Iterable[StageRegistration] | None:
    """Register denoising stages and the models they serve.

    Called: once each time the registries are collected (``resolve()``,
    ``causalkv plugins``), before any model weights load. Every implementation runs.

    Returns:
        An iterable of `StageRegistration` (or None). Stage classes given as
        ``"module:Class"`` strings are imported only when a stage is chosen or listed.
        Two stages with the same name, or two stages serving the same model at the same
        priority, raise ``PluginConflictError`` naming both plugins.
    """


@hookspec
def causalkv_register_cache_factories() -> Iterable[CacheFactory] | None:
    """Register KV-cache implementations and their capabilities.

    Called: once each time the registries are collected, before any weights load. Every
    implementation runs.

    Returns:
        An iterable of `CacheFactory` (or None). A cache given as ``"module:Class"`` is
        imported only when it is built. Two caches with the same name raise
        ``PluginConflictError`` naming both plugins.
    """


@hookspec
def causalkv_register_codecs() -> Iterable[CodecRegistration] | None:
    """Register KV codec settings (``--kv-cache-quant NAME``, the recency tier).

    Called: once each time the registries are collected, before any weights load. Every
    implementation runs.

    Returns:
        An iterable of `CodecRegistration` (or None). The codec class is imported only when
        a cache packs with it. A name taken by another codec setting sets the plugin aside
        (the message names both).
    """


@hookspec
def causalkv_register_host_classes() -> Iterable[HostClassRegistration] | None:
    """Register the host classes causalkv serves (a stage of sglang, a pipeline of vLLM-Omni,
    a stage of causalkv's own runtime) and the cache factory and codec each is served with.

    Called: once each time the registries are collected; the bridge of each host collects
    once per process, before any weights load, and serves exactly the classes registered for
    it (the highest priority per model). Every implementation runs.

    Returns:
        An iterable of `HostClassRegistration` (or None). The class is imported only by its host's
        bridge. Two registrations serving one model of one host at the same priority, or one
        naming a codec or a cache factory no plugin registers, set the later plugin aside
        (the message names both, or the codec or cache).
    """


@hookspec(firstresult=True)
def causalkv_select_cache_factory(
    stage: type[Stage],
    requirements: frozenset[str],
    candidates: tuple[CacheFactory, ...],
) -> CacheFactory | str | None:
    """Choose the cache for a stage among the factories that qualify. First result wins.

    Called: by ``resolve()`` once the stage is chosen and at least one cache covers the
    requirements, unless the user forced a cache (``ServerArgs.cache`` / ``--cache``).

    Args:
        stage: the chosen `CausalDenoisingStage` subclass.
        requirements: the cache features the stage needs under the server args, e.g.
            ``frozenset({"quant:qvg", "pinned_sink"})``.
        candidates: the qualifying factories, highest priority first (the default pick is
            ``candidates[0]``).

    Returns:
        One of ``candidates`` (or its name) to choose it; None to leave the choice to the
        next implementation and finally to priority order. Returning anything else makes
        ``resolve()`` fail naming the candidates.
    """


@hookspec
def causalkv_configure_stage(
    stage: Stage, model: ModelConfig, server_args: ServerArgs
) -> Mapping[str, Any] | None:
    """Per-model overrides for a freshly built stage (sink, window, and so on).

    Called: by the host right after it builds ``stage`` for ``model``, before the stage
    allocates its KV caches and before the first chunk. Every implementation runs; an
    implementation may set attributes on ``stage`` and may return overrides: both take
    effect on that one stage (`causalkv.runtime.host.hook_calls.configure_stage`), whose caches are then
    allocated once with the overridden settings.

    Returns:
        None, or a mapping of `ModelConfig` field overrides such as
        ``{"sink_frames": 3, "window_frames": 12}``. The mappings are merged (an
        implementation called earlier, i.e. ``tryfirst`` or registered later, wins a key)
        and unknown field names are refused.
    """


@hookspec
def causalkv_chunk_done(stage: Stage, chunk_index: int, stats: Mapping[str, Any]) -> None:
    """Event: a chunk finished denoising (for metrics and progress).

    Called: by the runtime after each chunk's context pass, with the 0-based
    ``chunk_index`` and ``stats``, a `causalkv.stages.records.ChunkStats` (a read-only
    mapping too: ``chunk``, ``frames``, ``token_start``, ``rope_frame_start``, ``prompt``,
    ``seconds``, ``kv_resident_bytes``, ``visible_tokens``).
    Every implementation runs; return values are ignored. An
    implementation that raises is reported once (naming its plugin) and skipped for the rest
    of the run, which completes; the host's ``--strict-plugins`` makes it fatal instead.
    """
