"""The bridge's AROUND hooks on sglang (dotted targets; sglang is imported only inside hooks).

sglang imports this module while it loads its plugins, so it imports no sglang module (nor
`causalkv.sglang.cache` / `.attention`, which do) at import time: those imports are made
inside the hooks, when sglang calls them.

Each hook receives sglang's original method first (sglang's AROUND convention).

- Stages served: `SERVED` (exact classes: LongLive 2.0, the Wan causal DMD / Self-Forcing base
  stage, LingBot-World); any other subclass keeps sglang's behaviour, and one warning says so
  when ``--kv-cache-quant`` is on and sglang's stage does not support QVG itself.
- Settings are checked where they enter: ``ServerArgs.__post_init__`` (start-up in the user's
  process, when the model folder is local) and the pipeline's ``_load_config`` (in the worker,
  before any weight loads) convert a dict ``kv_cache_quant_config`` to sglang's
  ``QVGKVQuantArgs`` and refuse, with one `ConfigError` naming the flag and the fix, settings
  causalkv's codec cannot pack for that model (centroids, block size x bits, head_dim).
- What the worker's log shows (it is configured by then): one line when a cache set is
  allocated (stage, cache class, QVG settings, keep-recent, recency tier, sink handling, which
  codec, where the chunk being generated lives), and one ``causalkv kv-cache summary:`` line
  per request: the peak bytes of the stage's whole cache set over the request (all blocks,
  the shared chunk scratch and the largest one-call buffer included), the bytes held at the
  end, what sglang's dense cache allocates for the same request, packed chunks, pinned shot
  sink.
- The chunk being generated: with quantization on, the blocks of a served stage share one
  `causalkv.caches.qvg.ChunkScratch` (its CFG sets too), and the context-update pass
  (``_update_causal_context_cache``, every served class's own) runs inside
  ``scratch.context_pass``, so each block moves the chunk straight to its tier; LongLive 2.0's
  ``_is_scene_cut`` announces the pin made after that pass. sglang's attention consumes the
  view of each write inside the same call (``causal_wanvideo.py``, ``lingbot_world.py``), and
  nothing else reads a denoising pass's K/V (docs/sglang.md).
- ``CAUSALKV_SGLANG_RECENT_TIER`` (`recent_tier`, ``bf16`` or a codec setting) sets
  causalkv's recency tier, and ``CAUSALKV_SGLANG_CODEC`` (`codec_override`, unset or a codec
  setting: ``fp8``, ``nvfp4``, ...) the codec the bridge packs with while sglang's
  ``--kv-cache-quant`` (its choices unchanged: int4, int2) turns QVG on; both checked at
  start-up with the other settings. `bridge_args` turns sglang's settings into causalkv's
  with both applied, once per request (the stage carries the result).

- With ``CAUSALKV_SGLANG_FUSED_ATTENTION=1`` (`fused_attention`; default off) `register` also
  registers `FUSED_ATTENTION_HOOKS`: sglang's causal self-attention over a bridge cache on CUDA
  goes through ``causalkv.caches.attend`` and never materializes the window
  (`causalkv.sglang.attention`). Registered only when on, so with the setting off sglang's
  attention code is not even wrapped. A bad value is refused at start-up (``ServerArgs``).

`OFF_HOOKS` are what `causalkv.sglang.register` registers when ``CAUSALKV_SGLANG_BRIDGE=0``:
one observer that changes nothing and warns when ``--kv-cache-quant`` asks for QVG on a stage
that stock sglang then silently serves with its dense cache.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from causalkv.caches.codecs import codec_names
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuantArgs
from causalkv.caches.qvg.options import recent_tiers
from causalkv.errors import ConfigError
from causalkv.sglang import (
    ENV_CODEC,
    ENV_FUSED_ATTENTION,
    ENV_LINGBOT_QVG,
    ENV_RECENT_TIER,
    ENV_SWITCH,
)

__all__ = [
    "ENV_FUSED_ATTENTION",
    "ENV_LINGBOT_QVG",
    "FUSED_ATTENTION_HOOKS",
    "HOOKS",
    "OFF_HOOKS",
    "SERVED",
    "SERVED_PIPELINES",
    "check_settings",
    "fused_attention",
    "served",
    "sglang_quant_args",
]

logger = logging.getLogger(__name__)

_STAGES = "sglang.multimodal_gen.runtime.pipelines_core.stages"
_BASE = f"{_STAGES}.causal_denoising.CausalDMDDenoisingStage"
_LONGLIVE2 = f"{_STAGES}.model_specific_stages.longlive2.LongLive2CausalDenoisingStage"
_LINGBOT = (
    f"{_STAGES}.model_specific_stages.lingbot_world.lingbot_world_causal_denoising."
    "LingBotWorldCausalDMDDenoisingStage"
)
_SERVER_ARGS = "sglang.multimodal_gen.runtime.server_args.server_args.ServerArgs"
_PIPELINE_BASE = (
    "sglang.multimodal_gen.runtime.pipelines_core.composed_pipeline_base.ComposedPipelineBase"
)
_SGLANG_ARGS = "sglang.multimodal_gen.configs.quantization.qvg_kv"

#: fully qualified names of the stage classes the bridge serves
SERVED = frozenset({_BASE, _LONGLIVE2, _LINGBOT})
#: sglang pipeline name -> the served stage its denoising runs in
SERVED_PIPELINES: Mapping[str, str] = {
    "LongLive2Pipeline": _LONGLIVE2,
    "WanCausalDMDPipeline": _BASE,
    "LingBotWorldCausalDMDPipeline": _LINGBOT,
}

_CODECS = ("causalkv", "sglang")

_warned: set[tuple[str, ...]] = set()


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def served(stage: object) -> bool:
    return _qualname(stage) in SERVED


def _once(key: tuple[str, ...], level: int, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.log(level, msg, *args)


def lingbot_codec() -> str:
    """``CAUSALKV_SGLANG_LINGBOT_QVG`` (default ``causalkv``); ConfigError for another value."""
    value = os.environ.get(ENV_LINGBOT_QVG, "causalkv").strip().lower() or "causalkv"
    if value not in _CODECS:
        raise ConfigError(
            f"{ENV_LINGBOT_QVG}={value!r}: choose one of {list(_CODECS)} (causalkv: the bridge's "
            "QVG cache; sglang: sglang's own QVGPackedCausalKVCache with quant-videogen)"
        )
    return value


_ON, _OFF = ("1", "true", "on", "yes"), ("", "0", "false", "off", "no")


def recent_tier() -> str:
    """``CAUSALKV_SGLANG_RECENT_TIER``: ``bf16`` (default, sglang's layout) or a codec setting
    (``int4``, ``fp8``, ...); ConfigError for another value."""
    raw = os.environ.get(ENV_RECENT_TIER, "")
    value = raw.strip().lower() or "bf16"
    if value not in recent_tiers():
        raise ConfigError(
            f"{ENV_RECENT_TIER}={raw!r}: choose one of {list(recent_tiers())} (a codec: the "
            "bridge packs the keep-recent chunks, and bf16 sink chunks, with it until they are "
            "packed with the cache's codec)"
        )
    return value


def codec_override() -> str | None:
    """``CAUSALKV_SGLANG_CODEC``: None (unset: sglang's ``--kv-cache-quant`` int4/int2) or a
    causalkv codec setting; ConfigError for another value."""
    raw = os.environ.get(ENV_CODEC, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in codec_names():
        raise ConfigError(
            f"{ENV_CODEC}={raw!r}: choose one of {list(codec_names())} (the codec the bridge "
            "packs with while --kv-cache-quant int4/int2 turns QVG on), or unset it"
        )
    return value


def bridge_args(quant: Any) -> CausalKVQuantArgs:
    """causalkv's settings for sglang's ``quant`` (its ``QVGKVQuantArgs``): the shared fields,
    the recency tier (`recent_tier`) and the codec (`codec_override`, else sglang's bits).

    Raises:
        ConfigError: a bad environment setting, or settings causalkv refuses.
    """
    # lazy: cache imports sglang (module docstring)
    from causalkv.sglang.cache import causalkv_quant_args

    args = causalkv_quant_args(quant, recent_tier())
    codec = codec_override()
    if codec is not None and args.enabled and codec != args.codec:
        args = replace(args, codec=codec).validate()
    return args


def fused_attention() -> bool:
    """``CAUSALKV_SGLANG_FUSED_ATTENTION``: True for 1/true/on/yes, False when unset or
    0/false/off/no; ConfigError for another value."""
    value = os.environ.get(ENV_FUSED_ATTENTION, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ConfigError(
        f"{ENV_FUSED_ATTENTION}={os.environ[ENV_FUSED_ATTENTION]!r}: set 1 to route sglang's "
        "causal self-attention over causalkv's cache through causalkv.caches.attend on CUDA, "
        "or 0 (the default) for sglang's attention over the materialized window"
    )


# ---- settings -------------------------------------------------------------------------------
def sglang_quant_args(value: Any) -> Any:
    """sglang's ``QVGKVQuantArgs`` for a ``kv_cache_quant_config`` value (converted if a dict).

    A dict takes sglang's field names (``bits`` also as ``"int2"``/``"int4"``/``"off"``) or its
    flag names (``kv_cache_quant``, ``kv_cache_quant_<field>``). Raises ConfigError for anything
    else, an unknown key, or a value sglang refuses.
    """
    # lazy: no sglang import at this module's import (module docstring)
    from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

    if isinstance(value, QVGKVQuantArgs):
        return value
    if value is None:
        return QVGKVQuantArgs()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"kv_cache_quant_config must be sglang's QVGKVQuantArgs or a dict, got "
            f"{type(value).__name__}; e.g. kv_cache_quant_config={{'bits': 2}}"
        )
    names = [f.name for f in fields(QVGKVQuantArgs)]
    try:
        if any(str(k).startswith("kv_cache_quant") for k in value):
            flat = {k: v for k, v in value.items() if str(k).startswith("kv_cache_quant")}
            if len(flat) != len(value):
                raise ConfigError("mixes flag names (kv_cache_quant*) and field names")
            return QVGKVQuantArgs.from_dict(flat)
        unknown = sorted(set(map(str, value)) - set(names))
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown}; valid keys: {names}")
        kw = dict(value)
        bits = kw.get("bits")
        if isinstance(bits, str):
            kw["bits"] = CausalKVQuantArgs.from_codec_name(bits).bits
            if kw["bits"] is None and bits.lower() not in ("off", "none"):
                raise ConfigError(
                    f"sglang's bits take off, int4 or int2, got {bits!r}; causalkv's other "
                    f"codecs come through {ENV_CODEC}={bits} (with bits int4 or int2)"
                )
        return QVGKVQuantArgs(**kw).validate()
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"kv_cache_quant_config={dict(value)!r}: {exc}") from None


def _normalize(server_args: Any) -> Any:
    """Replace a dict ``server_args.kv_cache_quant_config`` by sglang's args; return them."""
    quant = getattr(server_args, "kv_cache_quant_config", None)
    args = sglang_quant_args(quant)
    if args is not quant:
        server_args.kv_cache_quant_config = args
    return args


def _head_dim(model_dir: str | os.PathLike | None) -> int | None:
    """``attention_head_dim`` of the folder's ``transformer/config.json`` (no weights read)."""
    if not model_dir:
        return None
    path = Path(model_dir) / "transformer" / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    head_dim = config.get("attention_head_dim")
    return head_dim if isinstance(head_dim, int) else None


def check_settings(pipeline_name: str | None, quant: Any, head_dim: int | None) -> None:
    """Refuse QVG settings the bridge's codec cannot pack for this pipeline (ConfigError).

    ``quant`` is sglang's ``QVGKVQuantArgs``; pipelines the bridge does not serve, quant off,
    and LingBot-World with ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` are not checked (sglang's own
    code decides there). A ``head_dim`` the block size does not divide is refused except for
    LingBot-World, where sglang's own QVG cache takes over (said in the log).
    """
    if pipeline_name not in SERVED_PIPELINES or quant is None or not quant.enabled:
        return
    lingbot = SERVED_PIPELINES[pipeline_name] == _LINGBOT
    if lingbot and lingbot_codec() == "sglang":
        return
    try:
        args = bridge_args(quant)
        args.check_used()
        if head_dim is not None and not lingbot:
            args.check_layout(head_dim)
    except ConfigError as exc:
        raise ConfigError(f"causalkv sglang bridge, {pipeline_name}: {exc}") from None


def post_init(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``ServerArgs.__post_init__``: a dict ``kv_cache_quant_config`` becomes sglang's args, and
    the settings are checked at start-up when the pipeline and a local model folder are known
    (``CAUSALKV_SGLANG_FUSED_ATTENTION`` always)."""
    fused_attention()
    recent_tier()
    codec_override()
    quant = _normalize(self)
    out = original(self, *args, **kw)
    if quant.enabled and os.path.isdir(str(getattr(self, "model_path", "") or "")):
        name = getattr(self, "pipeline_class_name", None) or _pipeline_name_of(self)
        check_settings(name, quant, _head_dim(self.model_path))
    return out


def _pipeline_name_of(server_args: Any) -> str | None:
    try:
        # lazy: no sglang import at this module's import (module docstring)
        from sglang.multimodal_gen.registry import get_model_info

        info = get_model_info(server_args.model_path, server_args.backend, server_args.model_id)
    except Exception:  # noqa: BLE001 - resolution errors are sglang's to report, later
        return None
    return getattr(getattr(info, "pipeline_cls", None), "pipeline_name", None)


def load_config(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``ComposedPipelineBase._load_config`` (the pipeline's first step, before any weights):
    convert and check the QVG settings against the model's ``head_dim``."""
    out = original(self, *args, **kw)
    server_args = getattr(self, "server_args", None)
    if server_args is not None:
        quant = _normalize(server_args)
        check_settings(getattr(self, "pipeline_name", None), quant, _head_dim(self.model_path))
    return out


# ---- stages ---------------------------------------------------------------------------------
def supports_qvg(original: Callable[..., bool], self: Any) -> bool:
    """``_supports_qvg_kv_cache_quantization``: True for the served stages."""
    return True if served(self) else original(self)


def _carry_quant(self: Any, server_args: Any) -> None:
    if served(self):
        quant = _normalize(server_args)
        self._kv_quant_args = quant


def _warn_unserved(self: Any, server_args: Any, why: str, how: str) -> None:
    try:
        quant = sglang_quant_args(getattr(server_args, "kv_cache_quant_config", None))
    except ConfigError:
        return  # a bad setting on a stage the bridge does not serve: sglang's to judge
    if not quant.enabled or type(self)._supports_qvg_kv_cache_quantization(self):
        return
    _once(
        ("unserved", _qualname(self)), logging.WARNING,
        "causalkv sglang bridge: --kv-cache-quant int%s is not applied to %s: %s, so sglang "
        "keeps its dense bf16 KV cache; %s", quant.bits, type(self).__name__, why, how,
    )


def prepare_forward_context(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """``_prepare_causal_dmd_forward_context``: every forward (offline and realtime) passes
    here before a cache exists; carry the request's quant settings as ``_kv_quant_args``, or
    warn once when the stage is not served and sglang would drop the request's QVG."""
    if served(self):
        _carry_quant(self, server_args)
    else:
        _warn_unserved(
            self, server_args, "the bridge serves only " + ", ".join(
                sorted(n.rsplit(".", 1)[1] for n in SERVED)),
            "use one of those pipelines (LongLive2Pipeline, WanCausalDMDPipeline, "
            "LingBotWorldCausalDMDPipeline) for a QVG cache",
        )
    return original(self, batch, server_args)


def apply_overrides(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """``_apply_causal_cache_overrides`` (the realtime path and sglang's QVG guard)."""
    if served(self):
        _normalize(server_args)
    out = original(self, batch, server_args)
    _carry_quant(self, server_args)
    return out


def _describe(caches: list, quant: Any, stage: Any, codec: str, note: str = "",
              args: CausalKVQuantArgs | None = None) -> str:
    """The allocation line; ``args``: causalkv's settings when its cache serves (`bridge_args`)."""
    cls = type(caches[0]) if caches else None
    name = f"{cls.__module__}.{cls.__qualname__}" if cls else "none"
    if quant is None or not quant.enabled:
        return (f"causalkv sglang bridge: {type(stage).__name__} keeps sglang's dense KV cache "
                f"{name} x {len(caches)} blocks (kv-cache-quant off)")
    settings = args.describe() if args is not None else (
        f"int{quant.bits}, centroids={quant.centroids}, block={quant.block_size}")
    tier = args.recent_tier if args is not None else "bf16"
    sink = (f"sink chunks (stream-start and pinned shot sinks) kept {tier}" if not quant.sink
            else "sink chunks (stream-start and pinned shot sinks) packed")
    where = ("the chunk being generated held once for the stage (shared scratch), completed "
             "chunks moved to their tier by the context pass" if codec == "causalkv"
             else "the chunk being generated held in every block")
    return (f"causalkv sglang bridge: {type(stage).__name__} KV cache {name} x {len(caches)} "
            f"blocks, codec {codec}, {settings}, keep-recent {quant.keep_recent_chunks} "
            f"({tier}), {sink}, sink-keep {quant.sink_keep_chunks}, {where}"
            + (f" ({note})" if note else ""))


def allocate(original: Callable[..., Any], self: Any, **kw: Any) -> list:
    """``_allocate_causal_kv_cache``: causalkv's cache when quantization is on.

    Quantization off: sglang's own dense cache (the bridge's cache would be equal to it bit
    for bit, so sglang's stays). On: one `SGLangQVGKVCache` per block, global sinks, pins and
    growth included; LingBot-World keeps sglang's own QVG cache when
    ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` or when the block size does not divide its
    head_dim. Every allocation is logged once per stage and settings, and tracked for the
    request's summary line.
    """
    if not served(self):
        return original(self, **kw)
    quant = getattr(self, "_kv_quant_args", None)
    lingbot = _qualname(self) == _LINGBOT
    if quant is None or not getattr(quant, "enabled", False):
        caches = original(self, **kw)
        return _track(self, caches, _describe(caches, None, self, "none"))
    # lazy: cache imports sglang (module docstring)
    from causalkv.sglang.cache import SGLangQVGKVCache, can_serve

    if lingbot and lingbot_codec() == "sglang":
        caches = original(self, **kw)
        return _track(self, caches, _describe(caches, quant, self, "sglang",
                                              f"{ENV_LINGBOT_QVG}=sglang"))
    args = bridge_args(quant)  # once per allocation: the cache, the check and the log line
    reason = can_serve(args, kw["attention_head_dim"], kw["dtype"])
    if reason is not None:
        if lingbot:
            caches = original(self, **kw)
            return _track(self, caches, _describe(caches, quant, self, "sglang", reason))
        raise ConfigError(
            f"causalkv sglang bridge, {type(self).__name__}: causalkv cannot pack this KV cache "
            f"({reason}); set --kv-cache-quant-block-size to a divisor of the head_dim"
        )
    # lazy: this module imports no torch until sglang calls a hook
    import torch

    device = kw["device"]
    scratch = _stage_scratch(self)
    caches = [
        SGLangQVGKVCache(
            batch_size=kw["batch_size"], cache_size=kw["kv_cache_size"],
            num_heads=kw["num_attention_heads"], head_dim=kw["attention_head_dim"],
            dtype=kw["dtype"], device=device,
            global_end_index=torch.zeros(1, dtype=torch.long, device=device),
            local_end_index=torch.zeros(1, dtype=torch.long, device=device),
            use_int_indices=kw.get("use_int_indices", False), sink_tokens=kw.get("sink_tokens", 0),
            attention_window_size=kw.get("attention_window_size") or kw["kv_cache_size"],
            quant_args=args, global_sink_tokens=kw.get("global_sink_tokens", 0),
            allow_growth=kw.get("allow_growth", False), scratch=scratch,
        )
        for _ in range(self.num_transformer_blocks)
    ]
    return _track(self, caches, _describe(caches, quant, self, "causalkv", args=args))


# ---- the context pass -------------------------------------------------------------------------
_SCRATCH = "_causalkv_chunk_scratch"
_SCENE_CUT = "_causalkv_scene_cut"


def _stage_scratch(stage: Any) -> Any:
    """The stage's one `causalkv.caches.qvg.ChunkScratch` (its blocks and CFG sets run one
    after another). Unshared until the stage's own request loop runs (`forward`, which ends
    every chunk with the hooked context pass): code of sglang's that drives the caches
    directly gets every block's chunk in its own cache, as sglang's dense cache holds it."""
    scratch = stage.__dict__.get(_SCRATCH)
    if scratch is None:
        # lazy: this module imports no torch until sglang calls a hook
        from causalkv.caches.qvg.chunk_scratch import ChunkScratch

        scratch = stage.__dict__[_SCRATCH] = ChunkScratch()
    return scratch


def scene_cut(original: Callable[..., bool], self: Any, batch: Any, block_index: int) -> bool:
    """LongLive 2.0's ``_is_scene_cut`` (asked once per block, before it is denoised): noted,
    so the block's context pass announces the pin sglang makes right after it."""
    out = original(self, batch, block_index)
    if served(self):
        self.__dict__[_SCENE_CUT] = bool(out)
    return out


def context_update(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``_update_causal_context_cache`` (the chunk's context-update pass, offline, realtime and
    warm-up alike): run inside the stage scratch's ``context_pass``, so every block that shares
    it moves the chunk to its tier in this pass."""
    scratch = self.__dict__.get(_SCRATCH) if served(self) else None
    caches = kw.get("kv_cache") or ()
    if (scratch is None or scratch.committing
            or not any(getattr(c, "scratch", None) is scratch for c in caches)):
        return original(self, *args, **kw)
    with scratch.context_pass(pin=bool(self.__dict__.get(_SCENE_CUT, False))):
        return original(self, *args, **kw)


# ---- what the log shows per request ---------------------------------------------------------
_TRACK = "_causalkv_request_caches"


def _track(stage: Any, caches: list, line: str) -> list:
    _once(("alloc", _qualname(stage), line), logging.INFO, "%s", line)
    tracked = stage.__dict__.get(_TRACK)
    if tracked is not None:
        tracked.append(caches)
    return caches


def _nbytes(cache: Any) -> tuple[int | None, int]:
    """(resident, dense) K/V bytes of one sglang cache block."""
    k = getattr(cache, "k", None)
    v = getattr(cache, "v", None)
    if k is not None and v is not None and hasattr(k, "nbytes"):  # sglang's dense buffers
        return int(k.nbytes + v.nbytes), int(k.nbytes + v.nbytes)
    # lazy: this module imports no torch until sglang calls a hook
    import torch

    itemsize = torch.empty((), dtype=cache.dtype).element_size()
    dense = 2 * cache.batch_size * cache.cache_size * cache.num_heads * cache.head_dim * itemsize
    resident = cache.resident_nbytes() if hasattr(cache, "resident_nbytes") else None
    return (int(resident) if resident is not None else None), int(dense)


def summary_line(stage: Any, cache_sets: Iterable[list]) -> str | None:
    """One ``causalkv kv-cache summary:`` line over the stage's cache sets (positive, CFG).

    ``peak_bytes``: the most the sets held at once over the request: every block's storage,
    the shared chunk scratch and the largest one-call buffer (a view gathered for attention);
    for sglang's own caches, their preallocated buffers. ``resident_bytes``: what they hold
    now (the scratch included). ``dense_bytes``: what sglang's dense cache allocates for the
    same request. ``ratio``: ``dense_bytes / peak_bytes``, so a request that never packed
    reads 1.00 or less, not a compression. ``codec``: the codec setting of causalkv's cache
    (``int2``, ``fp8``, ...; ``off`` for sglang's own caches), ``recent_tier`` its recency tier.
    """
    sets = [s for s in cache_sets if s]
    if not sets:
        return None
    cls = type(sets[0][0])
    resident = dense = 0
    known = True
    scratches: dict[int, Any] = {}
    for caches in sets:
        for cache in caches:
            r, d = _nbytes(cache)
            dense += d
            if r is None:
                known = False
            else:
                resident += r
            scratch = getattr(cache, "scratch", None)
            if scratch is not None:
                scratches[id(scratch)] = scratch
    resident += sum(s.nbytes for s in scratches.values())
    if scratches:  # the ledger of the stage: every block that shares the scratch reports to it
        peak = max(max(s.peak_nbytes for s in scratches.values()), resident)
    else:
        peak = resident
    first = sets[0][0]
    packed = first.packed_chunks() if hasattr(first, "packed_chunks") else 0
    pinned = int(getattr(first, "pinned_len", 0) or 0)
    ratio = f"{dense / peak:.2f}" if known and peak else "n/a"
    quant = getattr(first, "quant", None)
    codec = getattr(quant, "codec", None) or "off"
    tier = getattr(quant, "recent_tier", "bf16") if codec != "off" else "bf16"
    return (
        f"causalkv kv-cache summary: stage={type(stage).__name__} cache={cls.__name__} "
        f"codec={codec} recent_tier={tier} "
        f"sets={len(sets)} layers={len(sets[0])} peak_bytes={peak if known else 'n/a'} "
        f"resident_bytes={resident if known else 'n/a'} dense_bytes={dense} ratio={ratio} "
        f"packed_chunks={packed} pinned_tokens={pinned}"
    )


def forward(original: Callable[..., Any], self: Any, batch: Any, server_args: Any):
    """A served stage's ``forward``: after the request, log the caches it used."""
    if not served(self):
        return original(self, batch, server_args)
    self.__dict__[_TRACK] = tracked = []
    self.__dict__.pop(_SCENE_CUT, None)
    scratch = _stage_scratch(self)
    scratch.share()  # the stage's loop ends every chunk with its (hooked) context pass
    scratch.reset_peaks()
    try:
        out = original(self, batch, server_args)
        sets: list[list] = []
        seen: set[int] = set()
        for caches in [*tracked, getattr(self, "causal_kv_cache", None),
                       getattr(self, "causal_kv_cache_neg", None)]:
            if caches and id(caches[0]) not in seen:
                seen.add(id(caches[0]))
                sets.append(list(caches))
        line = summary_line(self, sets)
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
    tracked = self.__dict__.get(_TRACK)
    caches = getattr(cache_ctx, "kv_cache", None)
    if tracked is not None and caches:
        tracked.append(list(caches))
    return cache_ctx


def off_prepare_forward_context(
    original: Callable[..., Any], self: Any, batch: Any, server_args: Any
):
    """With the bridge off: warn once when sglang silently drops the request's QVG."""
    _warn_unserved(
        self, server_args,
        f"the causalkv sglang bridge is off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)})",
        f"unset {ENV_SWITCH} to serve it with causalkv's QVG cache",
    )
    return original(self, batch, server_args)


#: (dotted target, AROUND hook) pairs registered by `causalkv.sglang.register`
HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{_SERVER_ARGS}.__post_init__", post_init),
    (f"{_PIPELINE_BASE}._load_config", load_config),
    (f"{_BASE}._supports_qvg_kv_cache_quantization", supports_qvg),
    (f"{_BASE}._prepare_causal_dmd_forward_context", prepare_forward_context),
    (f"{_BASE}._apply_causal_cache_overrides", apply_overrides),
    (f"{_BASE}._allocate_causal_kv_cache", allocate),
    (f"{_LINGBOT}._allocate_causal_kv_cache", allocate),
    (f"{_BASE}.forward", forward),
    (f"{_BASE}._prepare_realtime_causal_caches", prepare_realtime_caches),
    (f"{_LONGLIVE2}.forward", forward),
    (f"{_LINGBOT}.forward", forward),
    (f"{_BASE}._update_causal_context_cache", context_update),
    (f"{_LONGLIVE2}._update_causal_context_cache", context_update),
    (f"{_LINGBOT}._update_causal_context_cache", context_update),
    (f"{_LONGLIVE2}._is_scene_cut", scene_cut),
)

# ---- the fused-attention route (causalkv.sglang.attention; imports sglang, on first use) ------
_ATTN_DITS = "sglang.multimodal_gen.runtime.models.dits"
_WAN_ATTN = f"{_ATTN_DITS}.causal_wanvideo.CausalWanSelfAttention"
_LINGBOT_ATTN = f"{_ATTN_DITS}.lingbot_world.LingBotWorldCausalSelfAttention"
_LOCAL_ATTN = "sglang.multimodal_gen.runtime.layers.attention.layer.LocalAttention"
_route: Any = None


def _route_module() -> Any:
    global _route
    if _route is None:
        # lazy: the route imports sglang and torch; loaded only when the setting is on
        from causalkv.sglang import attention

        _route = attention
    return _route


def wan_self_attention(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``CausalWanSelfAttention.forward`` (LongLive 2.0, Wan causal DMD / Self-Forcing):
    `causalkv.sglang.attention.wan_self_attention`."""
    return _route_module().wan_self_attention(original, self, *args, **kw)


def lingbot_self_attention(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``LingBotWorldCausalSelfAttention.forward``: `causalkv.sglang.attention.lingbot_self_attention`."""
    return _route_module().lingbot_self_attention(original, self, *args, **kw)


def local_attention(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """``LocalAttention.forward``: `causalkv.sglang.attention.local_attention` (sglang's own
    code for every call whose K/V are not a routed call's deferred view)."""
    return _route_module().local_attention(original, self, *args, **kw)


#: what `causalkv.sglang.register` adds to `HOOKS` with ``CAUSALKV_SGLANG_FUSED_ATTENTION=1``
FUSED_ATTENTION_HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{_WAN_ATTN}.forward", wan_self_attention),
    (f"{_LINGBOT_ATTN}.forward", lingbot_self_attention),
    (f"{_LOCAL_ATTN}.forward", local_attention),
)

#: what `causalkv.sglang.register` registers with the bridge off: a warning, no behaviour
OFF_HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{_BASE}._prepare_causal_dmd_forward_context", off_prepare_forward_context),
)
