"""The stage hooks: what a served stage carries through a request, and its context pass.

- The request's settings: every forward (offline and realtime) passes through
  ``_prepare_causal_dmd_forward_context`` before a cache exists (`prepare_forward_context`);
  it carries sglang's settings as ``_kv_quant_args`` (sglang's LingBot convention) and starts
  the request, so `request_args` converts them to causalkv's once (`bridge_args`) at the
  request's first allocation and every later allocation of the request (the CFG set, a
  realtime session's) reuses them, packing with the codec the stage's registration names
  when ``CAUSALKV_SGLANG_CODEC`` is unset. Which stages are served is the plugin registry's
  answer (`causalkv.sglang.targets.served_stage`); a stage that is not served keeps sglang's
  behaviour, and one warning says so when ``--kv-cache-quant`` is on and sglang's stage does
  not support QVG.
- Probe and commit: with quantization on, the blocks of a served stage share one
  `causalkv.caches.passes.PassMarker` (`stage_marker`; its CFG sets too). The denoising
  passes (``_denoise_causal_dmd_chunk``, LongLive 2.0's CFG variant, the realtime chunk) run
  inside ``marker.probing()`` (`denoise_chunk`): sglang's attention consumes the view of each
  write inside the same call (``causal_wanvideo.py``, ``lingbot_world.py``) and nothing else
  reads a denoising pass's K/V, so they store nothing. The context-update pass
  (``_update_causal_context_cache``, every served class's own) runs inside
  ``marker.committing`` (`context_update`), so each block stores the chunk straight in its
  tier; LongLive 2.0's ``_is_scene_cut`` (`scene_cut`) announces the pin made after that
  pass (docs/sglang.md).

- The allocation (`allocate`, around ``_allocate_causal_kv_cache``: sglang's base stage's and
  LingBot-World's own; a served subclass runs one of those): causalkv's cache for a served
  stage's blocks when QVG is on. Every allocation is logged once per stage and settings
  (stage, cache class, QVG settings, keep-recent, recency tier, sink handling, which codec,
  where the chunk being generated lives; `describe`) and noted for the request's summary line.
- The summary: a served stage's ``forward`` (`forward`) notes every cache set the request
  allocates (`track`; a realtime session's caches through `prepare_realtime_caches`) and
  logs, after the request, one ``causalkv kv-cache summary:`` line (`summary_line`): the peak
  bytes of the stage's whole cache set over the request (all blocks and the largest one-call
  buffer included), the bytes held at the end, what sglang's dense cache allocates for the
  same request, packed chunks, pinned shot sink.

Each hook receives sglang's original method first (sglang's AROUND convention). This module
imports no sglang and no torch at import time: the bridge's cache module is imported inside
the allocation hook.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from causalkv import env
from causalkv.caches.ledger import peak_nbytes
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuantArgs
from causalkv.errors import ConfigError
from causalkv.sglang import ENV_LINGBOT_QVG, ENV_SWITCH
from causalkv.sglang.settings import bridge_args, lingbot_codec, normalize, sglang_quant_args
from causalkv.sglang.targets import log_once, qualname, served_stage, served_stages

__all__ = [
    "allocate",
    "apply_overrides",
    "context_update",
    "denoise_chunk",
    "describe",
    "forward",
    "off_prepare_forward_context",
    "prepare_forward_context",
    "prepare_realtime_caches",
    "request_args",
    "scene_cut",
    "stage_marker",
    "summary_line",
    "supports_qvg",
    "track",
]

logger = logging.getLogger(__name__)

#: the request's causalkv settings on the stage: (sglang's args they came from, causalkv's)
_ARGS = "_causalkv_quant_args"
_MARKER = "_causalkv_pass_marker"
_SCENE_CUT = "_causalkv_scene_cut"
#: the cache sets the stage's request allocated (`track`), for its summary line
_TRACK = "_causalkv_request_caches"


# ---- the request's settings ------------------------------------------------------------------
def request_args(stage: Any, quant: Any) -> CausalKVQuantArgs:
    """causalkv's settings for the stage's request: `bridge_args` of sglang's ``quant`` at the
    request's first need, then the same object for the rest of the request (sglang's
    ``quant`` unchanged), with the codec the stage's registration names (`served_stage`) when
    ``CAUSALKV_SGLANG_CODEC`` is unset. An allocation outside a request converts once for
    itself."""
    held = stage.__dict__.get(_ARGS)
    if held is not None and held[0] is quant:
        return held[1]
    entry = served_stage(stage)
    args = bridge_args(quant, codec=entry.registration.codec if entry is not None else None)
    stage.__dict__[_ARGS] = (quant, args)
    return args


def supports_qvg(original: Callable[..., bool], self: Any) -> bool:
    """``_supports_qvg_kv_cache_quantization``: True for the served stages."""
    return served_stage(self) is not None or original(self)


def _warn_unserved(self: Any, server_args: Any, why: str, how: str) -> None:
    try:
        quant = sglang_quant_args(getattr(server_args, "kv_cache_quant_config", None))
    except ConfigError:
        return  # a bad setting on a stage the bridge does not serve: sglang's to judge
    if quant.enabled and not type(self)._supports_qvg_kv_cache_quantization(self):
        log_once(
            logger, ("unserved", qualname(self)), logging.WARNING,
            "causalkv sglang bridge: --kv-cache-quant int%s is not applied to %s: %s, so sglang "
            "keeps its dense bf16 KV cache; %s", quant.bits, type(self).__name__, why, how,
        )


def prepare_forward_context(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """``_prepare_causal_dmd_forward_context``: every forward (offline and realtime) passes
    here before a cache exists; start the request (carry its quant settings as
    ``_kv_quant_args``), or warn once when the stage is not served and sglang would drop the
    request's QVG."""
    # the causalkv settings are converted when first needed (`request_args`)
    if served_stage(self) is not None:
        self.__dict__.pop(_ARGS, None)
        self._kv_quant_args = normalize(server_args)
    else:
        stages = served_stages()
        _warn_unserved(
            self, server_args, "the bridge serves only the stages causalkv's plugins register: "
            + (", ".join(sorted({s.cls.__name__ for s in stages.values()})) or "none"),
            f"use one of those pipelines ({', '.join(stages)}) for a QVG cache, or register the "
            "stage (docs/plugins.md, \"Serving a host's class\")",
        )
    return original(self, batch, server_args)


def apply_overrides(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """``_apply_causal_cache_overrides`` (the realtime path and sglang's QVG guard): sglang's
    settings converted before sglang's guard reads them, and carried after its overrides."""
    if served_stage(self) is None:
        return original(self, batch, server_args)
    quant = normalize(server_args)
    out = original(self, batch, server_args)
    self._kv_quant_args = quant
    return out


def off_prepare_forward_context(
    original: Callable[..., Any], self: Any, batch: Any, server_args: Any
):
    """With the bridge off: warn once when sglang silently drops the request's QVG."""
    _warn_unserved(
        self, server_args,
        f"the causalkv sglang bridge is off ({ENV_SWITCH}={env.text(ENV_SWITCH)})",
        f"unset {ENV_SWITCH} to serve it with causalkv's QVG cache",
    )
    return original(self, batch, server_args)


# ---- probe and commit ------------------------------------------------------------------------
def stage_marker(stage: Any) -> Any:
    """The stage's one `causalkv.caches.passes.PassMarker` (its blocks and CFG sets run one
    after another, and share it). Outside the hooked passes it marks nothing: code of
    sglang's that drives the caches directly gets sglang's dense semantics."""
    if _MARKER not in stage.__dict__:
        # lazy: this module imports no torch until sglang calls a hook
        from causalkv.caches.passes import PassMarker

        stage.__dict__[_MARKER] = PassMarker()
    return stage.__dict__[_MARKER]


def scene_cut(original: Callable[..., bool], self: Any, batch: Any, block_index: int) -> bool:
    """LongLive 2.0's ``_is_scene_cut`` (asked once per block, before it is denoised): noted,
    so the block's context pass announces the pin sglang makes right after it."""
    out = original(self, batch, block_index)
    if served_stage(self) is not None:
        self.__dict__[_SCENE_CUT] = bool(out)
    return out


def _marker_of(stage: Any, kw: dict[str, Any]) -> Any:
    """The stage's marker when the pass's caches (``kv_cache``, or a realtime ``cache_ctx``'s)
    use it, else None."""
    marker = stage.__dict__.get(_MARKER) if served_stage(stage) is not None else None
    caches = kw.get("kv_cache") or getattr(kw.get("cache_ctx"), "kv_cache", None)
    used = marker is not None and any(getattr(c, "marker", None) is marker for c in caches or ())
    return marker if used else None


def denoise_chunk(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """A chunk's denoising passes (offline, LongLive 2.0's CFG, realtime): run inside the
    stage marker's ``probing``, so every block serves its view and stores nothing (a context
    update inside commits: the inner mark wins)."""
    marker = _marker_of(self, kw)
    if marker is None:
        return original(self, *args, **kw)
    with marker.probing():
        return original(self, *args, **kw)


def context_update(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``_update_causal_context_cache`` (the chunk's context-update pass, offline, realtime and
    warm-up alike): run inside the stage marker's ``committing``, so every block stores the
    chunk in its tier in this pass (announcing LongLive 2.0's pin)."""
    marker = _marker_of(self, kw)
    if marker is None or marker.commit is not None:
        return original(self, *args, **kw)
    with marker.committing(pin=bool(self.__dict__.get(_SCENE_CUT, False))):
        return original(self, *args, **kw)


# ---- the allocation --------------------------------------------------------------------------
def describe(caches: list, quant: Any, stage: Any, codec: str, note: str = "",
             args: CausalKVQuantArgs | None = None) -> str:
    """The allocation's log line. ``quant``: sglang's settings; ``codec``: whose cache serves
    (``causalkv``, ``sglang`` or ``none``); ``args``: causalkv's settings when its cache serves."""
    name = qualname(caches[0]) if caches else "none"
    if not getattr(quant, "enabled", False):
        return (f"causalkv sglang bridge: {type(stage).__name__} keeps sglang's dense KV cache "
                f"{name} x {len(caches)} blocks (kv-cache-quant off)")
    settings = args.describe() if args is not None else (
        f"int{quant.bits}, centroids={quant.centroids}, block={quant.block_size}")
    tier = args.recent_tier if args is not None else "bf16"
    sink = "sink chunks (stream-start and pinned shot sinks) " + ("packed" if quant.sink else f"kept {tier}")
    where = ("denoising passes stored nothing (probes), the context pass stored each chunk "
             "in its tier" if codec == "causalkv"
             else "the chunk being generated held in every block")
    return (f"causalkv sglang bridge: {type(stage).__name__} KV cache {name} x {len(caches)} "
            f"blocks, served by {codec}, {settings}, keep-recent {quant.keep_recent_chunks} "
            f"({tier}), {sink}, sink-keep {quant.sink_keep_chunks}, {where}"
            + (f" ({note})" if note else ""))


def allocate(original: Callable[..., Any], self: Any, **kw: Any) -> list:
    """``_allocate_causal_kv_cache``: causalkv's cache when quantization is on.

    Quantization off: sglang's own dense cache (the bridge's cache would be equal to it bit
    for bit, so sglang's stays). On: one cache per block built by the stage's registered cache
    factory (`causalkv.sglang.targets.ServedStage.cache`: `SGLangQVGKVCache` or a subclass), global sinks, pins and
    growth included, with the request's causalkv settings (`request_args`: converted once per
    request, shared by its allocations); LingBot-World keeps sglang's own QVG cache when
    ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` or when causalkv's codec cannot lay out its head_dim
    (`can_serve`: PRQ's block size of partial bytes, or one that does not divide it). Every
    allocation is logged once per stage and settings, and tracked for the request's summary
    line.
    """
    entry = served_stage(self)
    if entry is None:
        return original(self, **kw)
    quant = getattr(self, "_kv_quant_args", None)

    def sglangs(codec: str, note: str = "") -> list:  # sglang's own cache serves the stage
        caches = original(self, **kw)
        return track(self, caches, describe(caches, quant, self, codec, note))

    if not getattr(quant, "enabled", False):
        return sglangs("none")
    # lazy: cache imports sglang (module docstring)
    from causalkv.sglang.cache import can_serve

    if entry.lingbot and lingbot_codec() == "sglang":
        return sglangs("sglang", f"{ENV_LINGBOT_QVG}=sglang")
    args = request_args(self, quant)  # the cache, the check and the log line share it
    reason = can_serve(args, kw["attention_head_dim"], kw["dtype"])
    if reason is not None:
        if entry.lingbot:
            return sglangs("sglang", reason)
        raise ConfigError(f"causalkv sglang bridge, {type(self).__name__}: causalkv cannot pack "
                          f"this KV cache: {reason}")
    # lazy: this module imports no torch until sglang calls a hook
    import torch

    device, marker = kw["device"], stage_marker(self)
    caches = [
        entry.cache(  # the registration's cache factory: SGLangQVGKVCache or a subclass
            batch_size=kw["batch_size"], cache_size=kw["kv_cache_size"],
            num_heads=kw["num_attention_heads"], head_dim=kw["attention_head_dim"],
            dtype=kw["dtype"], device=device,
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device),
            use_int_indices=kw.get("use_int_indices", False), sink_tokens=kw.get("sink_tokens", 0),
            attention_window_size=kw.get("attention_window_size") or kw["kv_cache_size"],
            quant_args=args, global_sink_tokens=kw.get("global_sink_tokens", 0),
            allow_growth=kw.get("allow_growth", False), marker=marker,
        )
        for _ in range(self.num_transformer_blocks)
    ]
    return track(self, caches, describe(caches, quant, self, "causalkv", args=args))


# ---- the request's summary line --------------------------------------------------------------
def track(stage: Any, caches: list, line: str) -> list:
    """Log an allocation's line (once per stage and line) and note its caches for the request's
    summary; returns ``caches``."""
    log_once(logger, ("alloc", qualname(stage), line), logging.INFO, "%s", line)
    _note(stage, caches)
    return caches


def _note(stage: Any, caches: Iterable | None) -> None:
    """Note a cache set for the summary of the stage's request (outside one: nothing)."""
    tracked = stage.__dict__.get(_TRACK)
    if tracked is not None and caches:
        tracked.append(list(caches))


def _nbytes(cache: Any) -> tuple[int | None, int]:
    """(resident, dense) K/V bytes of one sglang cache block."""
    k, v = getattr(cache, "k", None), getattr(cache, "v", None)
    if k is not None and v is not None and hasattr(k, "nbytes"):  # sglang's dense buffers
        return int(k.nbytes + v.nbytes), int(k.nbytes + v.nbytes)
    dense = 2 * cache.batch_size * cache.cache_size * cache.num_heads * cache.head_dim * cache.dtype.itemsize
    resident = cache.resident_nbytes() if hasattr(cache, "resident_nbytes") else None
    return (int(resident) if resident is not None else None), int(dense)


def summary_line(stage: Any, cache_sets: Iterable[list]) -> str | None:
    """One ``causalkv kv-cache summary:`` line over the stage's cache sets (positive, CFG).

    ``peak_bytes``: the most the sets held at once over the request: every block's storage
    and the largest one-call buffer (a view gathered for attention or a probe); for sglang's
    own caches, their preallocated buffers. ``resident_bytes``: what they hold now. ``dense_bytes``: what sglang's dense cache allocates for the
    same request. ``ratio``: ``dense_bytes / peak_bytes``, so a request that never packed
    reads 1.00 or less, not a compression. ``codec``: the codec setting of causalkv's cache
    (``int2``, ``fp8``, ...; ``off`` for sglang's own caches), ``recent_tier`` its recency tier.
    """
    sets = [s for s in cache_sets if s]
    if not sets:
        return None
    first = sets[0][0]
    caches = [c for blocks in sets for c in blocks]
    sizes = [_nbytes(c) for c in caches]
    known = all(r is not None for r, _ in sizes)
    resident, dense = sum(r or 0 for r, _ in sizes), sum(d for _, d in sizes)
    markers = {id(m): m for c in caches if (m := getattr(c, "marker", None)) is not None}
    # the ledger of the stage: every block that shares the marker reports to it
    peak = peak_nbytes([m.ledger for m in markers.values()], resident)
    packed = first.packed_chunks() if hasattr(first, "packed_chunks") else 0
    pinned = int(getattr(first, "pinned_len", 0) or 0)
    ratio = f"{dense / peak:.2f}" if known and peak else "n/a"
    quant = getattr(first, "quant", None)
    codec = getattr(quant, "codec", None) or "off"
    tier = getattr(quant, "recent_tier", "bf16") if codec != "off" else "bf16"
    return (
        f"causalkv kv-cache summary: stage={type(stage).__name__} cache={type(first).__name__} "
        f"codec={codec} recent_tier={tier} "
        f"sets={len(sets)} layers={len(sets[0])} peak_bytes={peak if known else 'n/a'} "
        f"resident_bytes={resident if known else 'n/a'} dense_bytes={dense} ratio={ratio} "
        f"packed_chunks={packed} pinned_tokens={pinned}"
    )


def forward(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """A served stage's ``forward``: after the request, log the caches it used."""
    if served_stage(self) is None:
        return original(self, batch, server_args)
    self.__dict__[_TRACK] = tracked = []
    self.__dict__.pop(_SCENE_CUT, None)  # the request starts: no scene cut noted yet, peaks reset
    stage_marker(self).ledger.reset_peaks()
    try:
        out = original(self, batch, server_args)
        held = [*tracked, getattr(self, "causal_kv_cache", None), getattr(self, "causal_kv_cache_neg", None)]
        sets = {id(caches[0]): list(caches) for caches in held if caches}  # each set once, in order
        line = summary_line(self, sets.values())
        if line is not None:
            logger.info("%s", line)
        return out
    finally:
        self.__dict__.pop(_TRACK, None)


def prepare_realtime_caches(original: Callable[..., Any], self: Any, batch: Any,
                            server_args: Any, ctx: Any):
    """``_prepare_realtime_causal_caches``: a realtime session allocates its caches on chunk 0
    and keeps them in the session, not on the stage; note them so each chunk's summary line
    covers the caches the chunk used (packing shows from chunk 1 on)."""
    cache_ctx = original(self, batch, server_args, ctx)
    _note(self, getattr(cache_ctx, "kv_cache", None))
    return cache_ctx
