"""The bridge's AROUND hooks on sglang: which hook wraps which sglang method (dotted targets).

sglang imports this module while it loads its plugins, so it (and every module it imports)
imports no sglang module, nor `causalkv.sglang.cache` / `.attention` (which do), at import
time: those imports are made inside the hooks, when sglang calls them. Each hook receives
sglang's original method first (sglang's AROUND convention). The hooks live by job:

- `causalkv.sglang.targets`: the dotted names of the classes the hooks wrap (sglang's causal
  DMD base stage, LongLive 2.0's, LingBot-World's), and the stages served: the exact classes
  causalkv's plugin registry names for host ``sglang`` (`served_stages`; the built-in plugin
  registers those three, a plugin may add a subclass: the hooks on a base's methods run for
  it, since a subclass calls the wrapped methods).
- `causalkv.sglang.settings`: sglang's QVG settings and causalkv's environment settings, the
  one conversion to causalkv's (`bridge_args`), the start-up checks (``ServerArgs`` and the
  pipeline's ``_load_config``).
- `causalkv.sglang.stages`: what a served stage carries through a request (its settings,
  converted once per request), its denoising passes marked as probes and its context-update
  pass as the commit, the cache allocation hook and its log line, and the per-request
  ``causalkv kv-cache summary:`` line.
- `causalkv.sglang.attention`: the fused-attention route (registered only with
  ``CAUSALKV_SGLANG_FUSED_ATTENTION=1``; `FUSED_ATTENTION_HOOKS` import it at the first
  hooked call, since it imports sglang and torch).

`causalkv.sglang.register` registers `HOOKS` (plus `FUSED_ATTENTION_HOOKS` when the route is
on), or only `OFF_HOOKS` when ``CAUSALKV_SGLANG_BRIDGE=0``: one observer that changes nothing
and warns when ``--kv-cache-quant`` asks for QVG on a stage that stock sglang then silently
serves with its dense cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from causalkv.sglang import settings, stages
from causalkv.sglang.targets import (
    BASE,
    LINGBOT,
    LINGBOT_ATTN,
    LOCAL_ATTN,
    LONGLIVE2,
    PIPELINE_BASE,
    SERVER_ARGS,
    WAN_ATTN,
)

__all__ = ["FUSED_ATTENTION_HOOKS", "HOOKS", "OFF_HOOKS"]

#: (dotted target, AROUND hook) pairs registered by `causalkv.sglang.register`
HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{SERVER_ARGS}.__post_init__", settings.post_init),
    (f"{PIPELINE_BASE}._load_config", settings.load_config),
    (f"{BASE}._supports_qvg_kv_cache_quantization", stages.supports_qvg),
    (f"{BASE}._prepare_causal_dmd_forward_context", stages.prepare_forward_context),
    (f"{BASE}._apply_causal_cache_overrides", stages.apply_overrides),
    (f"{BASE}._prepare_realtime_causal_caches", stages.prepare_realtime_caches),
    (f"{LONGLIVE2}._is_scene_cut", stages.scene_cut),
    (f"{LONGLIVE2}._denoise_causal_dmd_chunk_cfg", stages.denoise_chunk),
    *((f"{cls}.forward", stages.forward) for cls in (BASE, LONGLIVE2, LINGBOT)),
    *((f"{cls}._update_causal_context_cache", stages.context_update) for cls in (BASE, LONGLIVE2, LINGBOT)),
    *((f"{cls}._allocate_causal_kv_cache", stages.allocate) for cls in (BASE, LINGBOT)),
    *((f"{cls}._denoise_causal_dmd_chunk", stages.denoise_chunk) for cls in (BASE, LONGLIVE2)),
    *((f"{cls}._denoise_realtime_causal_chunk", stages.denoise_chunk) for cls in (BASE, LINGBOT)),
)


def _route(name: str, **fixed: Any) -> Callable[..., Any]:
    """The AROUND hook that calls `causalkv.sglang.attention`'s ``name`` (with the keywords
    ``fixed``), imported at the first call (the route imports sglang and torch: loaded only
    when the setting is on)."""

    def hook(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
        from causalkv.sglang import attention  # lazy: see the docstring

        return getattr(attention, name)(original, self, *args, **kw, **fixed)

    hook.__name__ = hook.__qualname__ = name
    return hook


#: what `causalkv.sglang.register` adds to `HOOKS` with ``CAUSALKV_SGLANG_FUSED_ATTENTION=1``:
#: sglang's causal self-attention over a bridge cache on CUDA goes through
#: ``causalkv.caches.attend`` and never materializes the window (`causalkv.sglang.attention`)
FUSED_ATTENTION_HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{WAN_ATTN}.forward", _route("self_attention")),
    (f"{LINGBOT_ATTN}.forward", _route("self_attention", lingbot=True)),
    (f"{LOCAL_ATTN}.forward", _route("local_attention")),
)

#: what `causalkv.sglang.register` registers with the bridge off: a warning, no behaviour
OFF_HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    (f"{BASE}._prepare_causal_dmd_forward_context", stages.off_prepare_forward_context),
)
