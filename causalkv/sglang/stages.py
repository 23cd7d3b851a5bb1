"""The stage hooks: what a served stage carries through a request, and its context pass.

- The request's settings: every forward (offline and realtime) passes through
  ``_prepare_causal_dmd_forward_context`` before a cache exists (`prepare_forward_context`);
  it carries sglang's settings as ``_kv_quant_args`` (sglang's LingBot convention) and starts
  the request, so `request_args` converts them to causalkv's once (`bridge_args`) at the
  request's first allocation and every later allocation of the request (the CFG set, a
  realtime session's) reuses them, packing with the codec the stage's registration names
  when ``CAUSALKV_SGLANG_CODEC`` is unset. Which stages are served is the plugin registry's
  answer (`causalkv.sglang.targets.served`); a stage that is not served keeps sglang's
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

Each hook receives sglang's original method first (sglang's AROUND convention). This module
imports no sglang and no torch at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from causalkv import env
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuantArgs
from causalkv.errors import ConfigError
from causalkv.sglang import ENV_SWITCH
from causalkv.sglang.settings import bridge_args, normalize, sglang_quant_args
from causalkv.sglang.targets import log_once, qualname, served, served_stage, served_stages

__all__ = [
    "apply_overrides",
    "context_update",
    "denoise_chunk",
    "off_prepare_forward_context",
    "prepare_forward_context",
    "request_args",
    "scene_cut",
    "stage_marker",
    "supports_qvg",
]

logger = logging.getLogger(__name__)

#: the request's causalkv settings on the stage: (sglang's args they came from, causalkv's)
_ARGS = "_causalkv_quant_args"
_MARKER = "_causalkv_pass_marker"
_SCENE_CUT = "_causalkv_scene_cut"


# ---- the request's settings -----------------------------------------------------------------
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


def _start_request(stage: Any, server_args: Any) -> None:
    """Carry the request's sglang settings; the causalkv ones are converted when first needed."""
    stage.__dict__.pop(_ARGS, None)
    stage._kv_quant_args = normalize(server_args)


def supports_qvg(original: Callable[..., bool], self: Any) -> bool:
    """``_supports_qvg_kv_cache_quantization``: True for the served stages."""
    return True if served(self) else original(self)


def _warn_unserved(self: Any, server_args: Any, why: str, how: str) -> None:
    try:
        quant = sglang_quant_args(getattr(server_args, "kv_cache_quant_config", None))
    except ConfigError:
        return  # a bad setting on a stage the bridge does not serve: sglang's to judge
    if not quant.enabled or type(self)._supports_qvg_kv_cache_quantization(self):
        return
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
    if served(self):
        _start_request(self, server_args)
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
    if not served(self):
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
    marker = stage.__dict__.get(_MARKER)
    if marker is None:
        # lazy: this module imports no torch until sglang calls a hook
        from causalkv.caches.passes import PassMarker

        marker = stage.__dict__[_MARKER] = PassMarker()
    return marker


def begin_chunk_loop(stage: Any) -> Any:
    """The stage's own request loop starts (the ``forward`` hook): no scene cut noted yet, the
    marker's peaks reset. Returns the marker."""
    stage.__dict__.pop(_SCENE_CUT, None)
    marker = stage_marker(stage)
    marker.ledger.reset_peaks()
    return marker


def scene_cut(original: Callable[..., bool], self: Any, batch: Any, block_index: int) -> bool:
    """LongLive 2.0's ``_is_scene_cut`` (asked once per block, before it is denoised): noted,
    so the block's context pass announces the pin sglang makes right after it."""
    out = original(self, batch, block_index)
    if served(self):
        self.__dict__[_SCENE_CUT] = bool(out)
    return out


def _marker_of(stage: Any, kw: dict[str, Any]) -> Any:
    """The stage's marker when the pass's caches (``kv_cache``, or a realtime ``cache_ctx``'s)
    use it, else None."""
    marker = stage.__dict__.get(_MARKER) if served(stage) else None
    caches = kw.get("kv_cache") or getattr(kw.get("cache_ctx"), "kv_cache", None)
    if marker is None or not any(getattr(c, "marker", None) is marker for c in caches or ()):
        return None
    return marker


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
