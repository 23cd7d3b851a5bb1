"""The fused-attention route: sglang's causal self-attention over a bridge cache through `attend`.

sglang's call sites (``CausalWanSelfAttention.forward``, which LongLive 2.0 and the Wan causal
DMD / Self-Forcing blocks use, and ``LingBotWorldCausalSelfAttention.forward``) write the
chunk with ``kv_cache.update_and_get_attention_kv(...)`` and then call
``self.attn(roped_query, cache_view.k, cache_view.v)``: reading ``cache_view.k`` is what
builds the bf16 window. With ``CAUSALKV_SGLANG_FUSED_ATTENTION=1`` the bridge registers three
AROUND hooks (`causalkv.sglang.hooks.FUSED_ATTENTION_HOOKS`) that change this, copying none of
sglang's logic:

1. around the two ``forward`` methods: when the call's ``kv_cache`` is a bridge
   `SGLangQVGKVCache`, the queries are on CUDA and the request does not shard the sequence
   (LingBot's ``enable_sequence_shard``), sglang's own ``forward`` runs with the cache behind
   a thin proxy whose ``update_and_get_attention_kv`` makes the same write but returns
   sglang's view with `DeferredKV` placeholders as ``k``/``v`` (meta tensors of the window's
   shape: no memory) that carry the bridge's lazy segment view
   (`SGLangQVGKVCache.update_and_get_segment_view`). A view that is one run of one dense
   chunk costs nothing to build and is returned as sglang's ordinary view instead.
2. around ``LocalAttention.forward``: a call whose K/V are such placeholders returns
   ``causalkv.caches.attend(q, segment_view, scale=self.softmax_scale)`` (on CUDA the fused
   path: packed chunks read in place by the Triton kernel; `docs/attention.md`). Every other
   call runs sglang's code untouched.

Anything else that touches a placeholder (an sglang version that reads the view's K/V
elsewhere) raises `FusedAttentionError` naming the setting, instead of computing on garbage.
Everything the route declines (a CPU or other non-CUDA device, a sequence-sharded LingBot
request) runs sglang's original code and is said once in the log. The engaged path runs
outside torch.compile's graphs (``torch.compiler.disable``): the cache write is a graph
break already, and `attend` is a Python loop over segments.

`causalkv.caches.attention.forced_route` engages the route on any device and picks `attend`'s
path, for the tests (the route on CPU tensors: attend's decode path, or the kernel under
``TRITON_INTERPRET=1``) and the benchmark (the decode path on CUDA too); the product never
enters it. Each routed call records ``(segment view, AttendStats)`` in its ``record``.

This module imports sglang; only the bridge's hooks import it, at the first hooked call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
)
from sglang.multimodal_gen.runtime.managers.forward_context import get_forward_context_or_none

from causalkv.caches.attention import AttendStats, attend, route_override
from causalkv.errors import CausalKVError
from causalkv.sglang import ENV_FUSED_ATTENTION
from causalkv.sglang.cache import SegmentView, SGLangQVGKVCache
from causalkv.sglang.targets import log_once

__all__ = [
    "DeferredKV",
    "FusedAttentionError",
    "local_attention",
    "self_attention",
]

logger = logging.getLogger(__name__)


class FusedAttentionError(CausalKVError, RuntimeError):
    """sglang's code used a deferred view's K/V other than by passing them to its attention."""


# ---- the placeholders -----------------------------------------------------------------------
_ALLOWED = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.__repr__,
})


class DeferredKV(torch.Tensor):
    """``cache_view.k`` / ``cache_view.v`` of a routed call: a meta tensor of the window's shape
    ``[B, visible, h, D]`` (no memory) that carries the bridge's lazy segment view.

    Only its shape, dtype, device (``meta``) and repr may be read; any other use raises `FusedAttentionError`.
    """

    segment_view: SegmentView

    @staticmethod
    def __new__(cls, segment_view: SegmentView, shape: tuple[int, ...], dtype: torch.dtype):
        t = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=dtype, device="meta"))
        t.segment_view = segment_view
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise FusedAttentionError(
            f"causalkv sglang bridge: {name} on the K/V of a view the fused-attention route "
            f"deferred; this sglang code path reads the view's K/V other than through its "
            f"attention layer, which the route does not serve. Set {ENV_FUSED_ATTENTION}=0"
        )


class _RoutedCache:
    """The bridge cache as sglang's attention sees it during a routed call: the same object in
    every respect except that ``update_and_get_attention_kv`` returns a deferred view."""

    __slots__ = ("_cache",)

    def __init__(self, cache: SGLangQVGKVCache) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def update_and_get_attention_kv(self, **kw: Any) -> CausalAttentionKVView:
        cache = self._cache
        view = cache.update_and_get_segment_view(**kw)
        if view.is_materialized:  # one dense run: sglang's ordinary view, as views of it
            k, v = view.k, view.v
        else:
            shape = (cache.batch_size, view.rows, kw["key"].shape[2], cache.head_dim)
            k, v = DeferredKV(view, shape, cache.dtype), DeferredKV(view, shape, cache.dtype)
        cursors = ("local_start_index", "local_end_index", "visible_local_end", "visible_global_end")
        return CausalAttentionKVView(k=k, v=v, **{name: getattr(view, name) for name in cursors})


# ---- the hooks ------------------------------------------------------------------------------
def _declined(args: tuple, kw: dict, *, lingbot: bool) -> str | None:
    """Why the route does not serve this call (None: it does)."""
    q = args[0] if args else kw.get("q")
    if not isinstance(q, torch.Tensor):
        return "no query tensor where sglang's forward takes q"
    forced = route_override()
    if forced is not None and not forced.routed:
        return "forced_route(routed=False): sglang's attention reads the materialized window"
    if q.device.type != "cuda" and forced is None:
        return (f"the queries are on {q.device.type}, and the route engages on CUDA only "
                "(sglang's attention then reads the materialized window)")
    if lingbot:
        ctx = get_forward_context_or_none()
        batch = getattr(ctx, "forward_batch", None)
        if getattr(batch, "enable_sequence_shard", False):
            return "the request shards the sequence (LingBot's sequence-parallel strategies)"
    return None


def self_attention(
    original: Callable[..., Any], owner: Any, *args: Any, lingbot: bool = False, **kw: Any
) -> Any:
    """AROUND ``CausalWanSelfAttention.forward`` and (``lingbot``)
    ``LingBotWorldCausalSelfAttention.forward``: sglang's forward with the bridge cache proxied
    (deferred view) when the route serves the call; otherwise sglang's forward (LingBot: always
    for a request that shards the sequence, whose strategies read the view's K/V themselves)."""
    cache = next((a for a in (*args, *kw.values()) if isinstance(a, SGLangQVGKVCache)), None)
    if cache is None:
        return original(owner, *args, **kw)
    why = _declined(args, kw, lingbot=lingbot)
    if why is not None:
        log_once(logger, ("declined", type(owner).__name__, why), logging.INFO,
                 "causalkv sglang bridge: %s=1, but %s keeps sglang's attention over the bridge "
                 "cache: %s", ENV_FUSED_ATTENTION, type(owner).__name__, why)
        return original(owner, *args, **kw)
    return _routed_forward(original, owner, cache, args, kw)


@torch.compiler.disable(reason="the routed attention is a Python loop over stored segments")
def _routed_forward(
    original: Callable[..., Any], owner: Any, cache: SGLangQVGKVCache, args: tuple, kw: dict
) -> Any:
    proxy = _RoutedCache(cache)
    args = tuple(proxy if a is cache else a for a in args)
    kw = {k: (proxy if a is cache else a) for k, a in kw.items()}
    log_once(logger, ("engaged", type(owner).__name__), logging.INFO,
             "causalkv sglang bridge: %s attends the bridge cache through causalkv.caches.attend "
             "(%s=1): the window is never materialized", type(owner).__name__, ENV_FUSED_ATTENTION)
    return original(owner, *args, **kw)


def local_attention(original: Callable[..., Any], owner: Any, *args: Any, **kw: Any) -> Any:
    """AROUND ``LocalAttention.forward``: K/V that are a routed call's placeholders are
    attended with `causalkv.caches.attend` over the segment view; any other call is
    sglang's."""
    if not any(type(a) is DeferredKV for a in (*args, *kw.values())):
        return original(owner, *args, **kw)
    return _attend_deferred(owner, *args, **kw)


@torch.compiler.disable(reason="the routed attention is a Python loop over stored segments")
def _attend_deferred(
    owner: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    if not (type(k) is DeferredKV and type(v) is DeferredKV and k.segment_view is v.segment_view):
        raise FusedAttentionError(
            "causalkv sglang bridge: LocalAttention got K and V that are not one deferred view's "
            f"pair; set {ENV_FUSED_ATTENTION}=0")
    if attn_mask is not None or type(q) is DeferredKV:
        raise FusedAttentionError(
            "causalkv sglang bridge: the fused-attention route serves unmasked attention of "
            f"real queries over a deferred view; set {ENV_FUSED_ATTENTION}=0")
    view = k.segment_view
    if q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise FusedAttentionError(
            f"causalkv sglang bridge: queries {tuple(q.shape)} do not match the view's K/V "
            f"{tuple(k.shape)} ([B, n, h, D] against [B, visible, h, D], the same heads); set "
            f"{ENV_FUSED_ATTENTION}=0")
    forced = route_override()
    stats = AttendStats()
    out = attend(q, view, scale=owner.softmax_scale, stats=stats,
                 fused=None if forced is None else forced.fused)
    for reason in stats.unreported():  # the cache records them; the bridge says each once
        logger.warning("causalkv sglang bridge: attention: %s", reason)
    if forced is not None and forced.record is not None:
        forced.record.append((view, stats))
    return out
