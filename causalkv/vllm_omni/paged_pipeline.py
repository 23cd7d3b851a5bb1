"""causalkv's LingBot-World pipeline on vLLM-Omni's paged AR-diffusion engine (realtime ticks).

With ``model_config.causalkv_kv_cache`` set and ``engine_backend`` naming vLLM-Omni's
``ARDiffusionEngine`` (request mode: one typed tick per request), causalkv's pipeline
(`causalkv.vllm_omni.pipeline.CausalKVLingBotWorldPipeline`) calls `check_paged` before anything
loads (the seams of `causalkv.vllm_omni.paged_seams` and the mode) and `install_paged` once it
is built:

- the engine's two seams point at causalkv (`causalkv.vllm_omni.paged_cache.install_engine_seams`:
  the runner builds `CausalKVPagedKVCache` for this pipeline's spec, LingBot's attention reads
  causalkv's pages);
- the pipeline's class becomes a subclass adding `PagedLingBotMixin`: its
  ``ar_diffusion_kv_cache_spec`` carries the QVG settings in its KV branch
  (`CausalKVBranchSpec`) and declares the sessions causalkv's pages hold at the device's free
  memory (not LingBot's cap of 2); ``bind_ar_diffusion_state`` binds the session to the cache's
  attention; a session the engine evicted (least recently used, to admit another when its
  sessions are full) is told so by name on its next tick, not through LingBot's
  ``chunk_index must be contiguous`` error.

When the engine's sessions are full, a tick for a new session makes vLLM-Omni's runner release
the least recently used one (its pages, its packed records, its model state); that session's
next tick that does not start over (``chunk_index`` 0 or ``reset``) is refused with
`evicted_message`. Its K/V cannot be rebuilt: the client starts it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from vllm_omni.experimental.ar_diffusion.runner import resolve_ar_diffusion_kv_config
from vllm_omni.experimental.ar_diffusion.tick_protocol import ARDiffusionTickRequest

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.errors import ConfigError
from causalkv.vllm_omni.paged_cache import (
    CausalKVBranchSpec,
    CausalKVPagedKVCache,
    check_kv_config,
    declared_capacity,
    install_engine_seams,
)
from causalkv.vllm_omni.paged_seams import check_seams

__all__ = ["PagedLingBotMixin", "check_paged", "evicted_message", "install_paged"]

#: sessions whose eviction is remembered (for the notice on their next tick)
_REMEMBERED = 4096


def check_paged(od_config: Any, quant: QVGKVQuantArgs) -> None:
    """Refuse what causalkv's pages do not serve on the paged path, before anything loads
    (`ConfigError`): a vLLM-Omni lacking a seam (`check_seams`, one line naming it), step
    execution (only request-mode ticks are served and tested), the options `check_kv_config`
    refuses."""
    check_seams()
    if getattr(od_config, "step_execution", False):
        raise ConfigError(
            f"model_config.causalkv_kv_cache ({quant.describe()}) on vLLM-Omni's paged "
            "AR-diffusion engine serves request-mode ticks (one ar_diffusion_tick per request); "
            "step_execution=True is not supported: set step_execution false")
    check_kv_config(resolve_ar_diffusion_kv_config(od_config))


def evicted_message(session_id: str, chunk_index: int, by: str | None, capacity: int | None,
                    quant: QVGKVQuantArgs) -> str:
    """The refusal of an evicted session's next tick."""
    who = f"to admit session {by!r}" if by else "to admit another session"
    held = f"the engine holds {capacity} session(s) at this memory" if capacity else "its sessions were full"
    return (
        f"LingBot session {session_id!r} was evicted from vLLM-Omni's AR-diffusion engine (least "
        f"recently used) {who}: {held} (model_config.causalkv_kv_cache {quant.describe()}); its "
        f"K/V and model state are gone, so chunk_index {chunk_index} cannot continue it. Start it "
        "again at chunk_index 0 (or with reset), or give the engine more memory "
        "(ar_diffusion_kv_config.gpu_memory_fraction)")


class PagedLingBotMixin:
    """The AR-diffusion capability of causalkv's LingBot-World pipeline on the paged engine
    (placed before the pipeline's class by `install_paged`; the module docstring)."""

    causalkv_quant: QVGKVQuantArgs
    _causalkv_cache: CausalKVPagedKVCache | None
    #: evicted sessions (oldest first) -> the session admitted in their place (None until the
    #: next session is bound)
    _causalkv_evicted: OrderedDict[str, str | None]
    #: sessions whose release is no eviction: a close their tick asked for, a failed forward
    _causalkv_ending: set[str]

    def ar_diffusion_kv_cache_spec(self) -> Any:
        """LingBot's spec with causalkv's branch (the settings) and the capacity causalkv's
        pages hold at the device's free memory x the engine's ``gpu_memory_fraction``."""
        spec = super().ar_diffusion_kv_cache_spec()  # type: ignore[misc]
        offset = getattr(self.transformer, "head_offset", None)  # type: ignore[attr-defined]
        branches = tuple(CausalKVBranchSpec(b.name, b.local_index, quant=self.causalkv_quant,
                                            head_offset=int(offset()) if callable(offset) else 0)
                         for b in spec.kv_branches)
        od_config = self.od_config  # type: ignore[attr-defined]
        from vllm_omni.platforms import current_omni_platform

        free = current_omni_platform.get_free_memory(torch.device(self.device))  # type: ignore[attr-defined]
        capacity = declared_capacity(spec, resolve_ar_diffusion_kv_config(od_config),
                                     od_config.dtype, free, self.causalkv_quant)
        return dataclasses.replace(spec, kv_branches=branches, session_capacity=capacity)

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state: Any) -> Iterator[None]:
        cache = state.kv_cache
        if not isinstance(cache, CausalKVPagedKVCache):
            raise RuntimeError(
                f"model_config.causalkv_kv_cache is set but vLLM-Omni's runner built "
                f"{type(cache).__name__}, not causalkv's paged cache: the runner did not use "
                "causalkv's seam (causalkv.vllm_omni.paged_seams); run QVG in request mode")
        self._causalkv_cache = cache
        for evicted, by in self._causalkv_evicted.items():
            if by is None:
                self._causalkv_evicted[evicted] = session_id
        with super().bind_ar_diffusion_state(session_id, state), cache.binding(state):  # type: ignore[misc]
            yield

    def close_ar_diffusion_session(self, session_id: str) -> None:
        """vLLM-Omni's release (close, eviction or a failed forward): one that is neither a
        close the tick asked for nor a failed forward is an eviction, remembered for the
        notice."""
        super().close_ar_diffusion_session(session_id)  # type: ignore[misc]
        self._causalkv_evicted.pop(session_id, None)
        if session_id in self._causalkv_ending:
            self._causalkv_ending.discard(session_id)
            return
        self._causalkv_evicted[session_id] = None
        while len(self._causalkv_evicted) > _REMEMBERED:
            self._causalkv_evicted.popitem(last=False)

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        super().reset_ar_diffusion_session(session_id)  # type: ignore[misc]
        self._causalkv_evicted.pop(session_id, None)
        self._causalkv_ending.discard(session_id)

    def forward(self, req: Any) -> Any:
        tick = ARDiffusionTickRequest.from_extra_args(getattr(req.sampling_params, "extra_args", None))
        if tick is None:
            return super().forward(req)  # type: ignore[misc]
        sid = tick.session_id
        if sid in self._causalkv_evicted:
            if tick.chunk_index != 0 and not tick.reset:
                raise ValueError(evicted_message(
                    sid, tick.chunk_index, self._causalkv_evicted[sid],
                    getattr(self._causalkv_cache, "session_capacity", None), self.causalkv_quant))
            del self._causalkv_evicted[sid]
        if tick.close_session:  # the runner releases it after the forward: no eviction
            self._causalkv_ending.add(sid)
        try:
            return super().forward(req)  # type: ignore[misc]
        except Exception:
            self._causalkv_ending.add(sid)
            raise


@functools.cache
def _paged_class(base: type) -> type:
    """``base`` with `PagedLingBotMixin` first (one class per pipeline class)."""
    return type(f"Paged{base.__name__}", (PagedLingBotMixin, base),
                {"__module__": base.__module__, "__doc__": base.__doc__})


def install_paged(pipeline: Any, quant: QVGKVQuantArgs) -> Any:
    """Put causalkv's pages under a built LingBot-World pipeline on the paged engine, in place:
    the engine seams (`install_engine_seams`), then the pipeline's class swapped to a subclass
    with `PagedLingBotMixin` first (no parameter or buffer changes). Returns the pipeline."""
    from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline

    if not isinstance(pipeline, LingBotWorldCausalDMDPipeline):
        raise ConfigError(f"install_paged takes vLLM-Omni's LingBotWorldCausalDMDPipeline, got "
                          f"{type(pipeline).__name__}")
    install_engine_seams()
    if not isinstance(pipeline, PagedLingBotMixin):
        pipeline.__class__ = _paged_class(type(pipeline))
    pipeline.causalkv_quant = quant
    pipeline._causalkv_cache = None
    pipeline._causalkv_evicted = OrderedDict()
    pipeline._causalkv_ending = set()
    return pipeline
