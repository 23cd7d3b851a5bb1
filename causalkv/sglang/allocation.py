"""The cache allocation hook: causalkv's cache for a served stage's blocks when QVG is on.

`allocate` wraps ``_allocate_causal_kv_cache`` (sglang's base stage and LingBot-World's own;
a served subclass runs one of those). Served: a class the plugin registry names
(`causalkv.sglang.targets.served_stage`).
Every allocation is logged once per stage and settings (stage, cache class, QVG settings,
keep-recent, recency tier, sink handling, which codec, where the chunk being generated lives;
`describe`) and noted for the request's summary line (`causalkv.sglang.summary`).

This module imports no sglang and no torch at import time (sglang imports the hooks while it
loads its plugins): the bridge's cache module is imported inside the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuantArgs
from causalkv.errors import ConfigError
from causalkv.sglang import ENV_LINGBOT_QVG
from causalkv.sglang.settings import lingbot_codec
from causalkv.sglang.stages import request_args, stage_marker
from causalkv.sglang.summary import track
from causalkv.sglang.targets import qualname, served_stage

__all__ = ["allocate", "describe"]


def describe(caches: list, quant: Any, stage: Any, codec: str, note: str = "",
             args: CausalKVQuantArgs | None = None) -> str:
    """The allocation's log line. ``quant``: sglang's settings; ``codec``: whose cache serves
    (``causalkv``, ``sglang`` or ``none``); ``args``: causalkv's settings when its cache serves."""
    name = qualname(caches[0]) if caches else "none"
    if quant is None or not quant.enabled:
        return (f"causalkv sglang bridge: {type(stage).__name__} keeps sglang's dense KV cache "
                f"{name} x {len(caches)} blocks (kv-cache-quant off)")
    settings = args.describe() if args is not None else (
        f"int{quant.bits}, centroids={quant.centroids}, block={quant.block_size}")
    tier = args.recent_tier if args is not None else "bf16"
    sink = (f"sink chunks (stream-start and pinned shot sinks) kept {tier}" if not quant.sink
            else "sink chunks (stream-start and pinned shot sinks) packed")
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
    ``CAUSALKV_SGLANG_LINGBOT_QVG=sglang`` or when the block size does not divide its
    head_dim. Every allocation is logged once per stage and settings, and tracked for the
    request's summary line.
    """
    entry = served_stage(self)
    if entry is None:
        return original(self, **kw)
    quant = getattr(self, "_kv_quant_args", None)
    lingbot = entry.lingbot
    if quant is None or not getattr(quant, "enabled", False):
        caches = original(self, **kw)
        return track(self, caches, describe(caches, None, self, "none"))
    # lazy: cache imports sglang (module docstring)
    from causalkv.sglang.cache import can_serve

    if lingbot and lingbot_codec() == "sglang":
        caches = original(self, **kw)
        return track(self, caches, describe(caches, quant, self, "sglang",
                                            f"{ENV_LINGBOT_QVG}=sglang"))
    args = request_args(self, quant)  # the cache, the check and the log line share it
    reason = can_serve(args, kw["attention_head_dim"], kw["dtype"])
    if reason is not None:
        if lingbot:
            caches = original(self, **kw)
            return track(self, caches, describe(caches, quant, self, "sglang", reason))
        raise ConfigError(
            f"causalkv sglang bridge, {type(self).__name__}: causalkv cannot pack this KV cache: "
            f"{reason}"
        )
    # lazy: this module imports no torch until sglang calls a hook
    import torch

    device = kw["device"]
    marker = stage_marker(self)
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
