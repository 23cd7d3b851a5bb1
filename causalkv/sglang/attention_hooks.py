"""The fused-attention route's AROUND hooks (``CAUSALKV_SGLANG_FUSED_ATTENTION=1``).

With the setting on (`causalkv.sglang.settings.fused_attention`; default off) `register` also
registers `causalkv.sglang.hooks.FUSED_ATTENTION_HOOKS`, these three: sglang's causal
self-attention over a bridge cache on CUDA goes through ``causalkv.caches.attend`` and never
materializes the window (`causalkv.sglang.attention`). Registered only when on, so with the
setting off sglang's attention code is not even wrapped. A bad value is refused at start-up
(``ServerArgs``, `causalkv.sglang.settings.post_init`).

The route imports sglang and torch; it is loaded at the first hooked call, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["lingbot_self_attention", "local_attention", "wan_self_attention"]

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
