"""Realtime sessions on vLLM-Omni's paged AR-diffusion engine, on a CPU, through vLLM-Omni's own
entry point: ``Omni(..., engine_backend=ARDiffusionEngine)`` on the tiny LingBot-World checkpoint
(``causalkv vllm-omni-checkpoint``, RANDOM weights), one typed tick per request
(``extra_args["ar_diffusion_tick"]``: session id, chunk index, a camera-action control).

Used by ``paged_demo.py`` (``make run-vllm-omni``'s sessions table) and
``tests/vllm_omni_bridge/test_paged_engine.py``. Needs the CPU stand-ins of ``cpu_stand_ins/``
(on ``PYTHONPATH``) and the demo's ``tiny_pipeline`` (causalkv's pipeline with its DiT built at
the checkpoint's geometry). What runs is vLLM-Omni's: its engine, the ``ARDiffusionModelRunner``
(sessions, LRU eviction), LingBot's pipeline and DMD block runner; causalkv's pages when the
stage's ``model_config`` has ``causalkv_kv_cache``. The worker runs in this process (inline
client, uniproc executor), so the session caches can be read here
(`causalkv.vllm_omni.paged_cache.live_caches`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: vLLM-Omni's AR-diffusion engine, as a stage names it
ENGINE = "vllm_omni.experimental.ar_diffusion.engine.ARDiffusionEngine"
#: the tiny checkpoint's frame (64x64 pixels: 8x8 latents, 16 tokens per latent frame)
SIZE = 64
#: video frames of one tick (3 latent frames: the Wan VAE's 4x temporal compression)
TICK_FRAMES = 9
PROMPT = "a fox trots through fresh snow"
#: named settings beyond a bare ``kv_cache_quant`` value (the engine tests' wider cases)
NAMED: dict[str, dict[str, Any]] = {
    # no keep-recent, ticks packed two at a time: a span outlives its older tick
    "int2-span2": {"kv_cache_quant": "int2", "kv_cache_quant_keep_recent": 0,
                   "kv_cache_quant_span_chunks": 2},
    # the newest tick packed at fp8 (the recency tier), re-packed at int2 once older
    "int2-fp8": {"kv_cache_quant": "int2", "kv_cache_quant_recent_tier": "fp8"},
}
SEED = 7


def image() -> Any:
    """The session's source image (seeded noise)."""
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray((np.random.default_rng(0).random((SIZE, SIZE, 3)) * 255).astype("uint8"))


@contextmanager
def engine(folder: Path, work: Path, setting: str, *, free_memory: int = 1 << 30,
           fraction: float = 1.0) -> Any:
    """One ``Omni`` on ``engine_backend: ARDiffusionEngine`` for ``setting`` (``stock``: no
    ``causalkv_kv_cache``; a `NAMED` setting; else its ``kv_cache_quant``), shut down on exit. ``free_memory``:
    what the CPU platform reports to the runner's admission (``CAUSALKV_CPU_FREE_MEMORY``);
    ``fraction``: ``ar_diffusion_kv_config.gpu_memory_fraction``."""
    import tiny_pipeline
    from vllm_omni.entrypoints.omni import Omni

    from causalkv.vllm_omni.paged_cache import install_engine_seams

    tiny_pipeline.register()
    # causalkv's pipeline installs the engine seams itself; here they are installed for the stock
    # run too, so its cache is recorded for the measurement (vLLM-Omni's own, built unchanged)
    install_engine_seams()
    model_config: dict[str, Any] = {
        "ar_diffusion_height": SIZE, "ar_diffusion_width": SIZE, "lingbot_action_root": str(work),
        "ar_diffusion_kv_config": {"gpu_memory_fraction": fraction},
    }
    if setting != "stock":
        model_config["causalkv_kv_cache"] = dict(NAMED.get(setting, {"kv_cache_quant": setting}))
    old = os.environ.get("CAUSALKV_CPU_FREE_MEMORY")
    os.environ["CAUSALKV_CPU_FREE_MEMORY"] = str(free_memory)
    try:
        omni = Omni(model=str(folder), model_class_name=tiny_pipeline.ARCH, dtype="float32",
                    enforce_eager=True, stage_init_timeout=600, engine_backend=ENGINE,
                    model_config=model_config)
    finally:
        if old is None:
            os.environ.pop("CAUSALKV_CPU_FREE_MEMORY", None)
        else:
            os.environ["CAUSALKV_CPU_FREE_MEMORY"] = old
    try:
        yield omni
    finally:
        omni.shutdown()
        _undecorate()


def tick(omni: Any, src: Any, session: str, index: int, *, close: bool = False,
         reset: bool = False, actions: tuple[tuple[str, ...], ...] = (("w",), ("w",), ("w",))) -> Any:
    """One realtime tick of ``session`` (chunk ``index``): the block's latents
    ``[1, 16, 3, 8, 8]``. Raises what the engine reports for a refused tick."""
    from vllm_omni.experimental.ar_diffusion.tick_protocol import (
        ARDiffusionControlInput,
        ARDiffusionTickRequest,
    )
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    t = ARDiffusionTickRequest(
        session_id=session, request_id=f"{session}-{index}-{os.urandom(4).hex()}", chunk_index=index,
        prompt=PROMPT, reset=reset, close_session=close,
        controls=(ARDiffusionControlInput("camera", "lingbot.camera_actions.v1",
                                          {"mode": "frames", "frames": [list(a) for a in actions]}),))
    params = OmniDiffusionSamplingParams(height=SIZE, width=SIZE, num_frames=TICK_FRAMES, seed=SEED,
                                         num_inference_steps=4, output_type="latent",
                                         extra_args=t.to_extra_args())
    (out,) = omni.generate([{"prompt": PROMPT, "multi_modal_data": {"image": src}}], [params],
                           use_tqdm=False)
    if getattr(out, "error", None):
        raise RuntimeError(out.error)
    return out.images[0].detach().cpu().clone()


def interleave(omni: Any, src: Any, sessions: Iterable[str], ticks: int) -> dict[tuple[str, int], Any]:
    """``ticks`` ticks of each of ``sessions``, interleaved (a0 b0 a1 b1 ...): latents by
    ``(session, index)``."""
    names = list(sessions)
    return {(s, i): tick(omni, src, s, i) for i in range(ticks) for s in names}


def newest_cache(stock: bool = False) -> Any:
    """The session cache the last engine's runner built (this process's worker)."""
    from causalkv.vllm_omni.paged_cache import live_caches

    caches = live_caches(stock=stock)
    if not caches:
        raise RuntimeError("no session cache was built in this process")
    return caches[-1]


def pool_pages(cache: Any, session: str) -> int:
    """Pool pages (latent frames) ``session``'s branch holds in ``cache`` (any engine cache)."""
    for request_id, adapter in cache._adapters.items():
        if request_id == f"ar::{session}::main":
            return len(cache.window_block_ids(adapter))
    raise KeyError(session)


def held(cache: Any, session: str) -> dict[str, int]:
    """What ``session``'s branch holds in ``cache`` now, read from the pool (any engine cache):
    its pages, their bytes in every layer, and (causalkv's cache) its packed records' bytes,
    packed groups and the layer calls that decoded one."""
    from causalkv.vllm_omni.paged_cache import CausalKVPagedKVCache

    pages = pool_pages(cache, session)
    out = {"pages": pages, "pool_bytes": pages * cache.spec.page_size_bytes * cache.num_layers,
           "packed_bytes": 0, "packed_groups": 0, "packed_reads": 0}
    if isinstance(cache, CausalKVPagedKVCache):
        rep = cache.report(f"ar::{session}::main")
        out.update(packed_bytes=rep.packed_bytes, packed_groups=len(rep.packed_groups),
                   packed_reads=rep.packed_reads)
    return out


def wanted() -> tuple[int, int]:
    """``(stock, int2)``: the sessions vLLM-Omni's engine admits at LingBot-World's geometry at
    80 GiB (`causalkv.vllm_omni.admission.plan_admission`, the formula ``causalkv memory lingbot
    --host vllm-omni --budget 80GiB`` prints and the engine admits by)."""
    from causalkv.vllm_omni.admission import plan_admission

    stock, int2 = plan_admission(80 << 30, rows=("stock", "int2"))
    return stock.capacity, int2.capacity


def admission(cache: Any) -> Any:
    """What ``cache``'s own bytes admit, no declared cap (`causalkv.vllm_omni.admission.admit`
    on the geometry it was built with): causalkv's cache's own `Admission` (its pipeline
    declares what fits), or for vLLM-Omni's cache the formula on its constructor arguments
    (`causalkv.vllm_omni.paged_cache.engine_geometry`), which is its own admission without
    LingBot's cap (tests/vllm_omni_bridge/test_paged_admission.py)."""
    from causalkv.vllm_omni.admission import admit, stock_layout
    from causalkv.vllm_omni.paged_cache import CausalKVPagedKVCache, engine_geometry

    if isinstance(cache, CausalKVPagedKVCache):
        return cache.admission
    eng = engine_geometry(
        cache.config, num_layers=cache.num_layers, num_kv_heads=cache.num_kv_heads,
        head_size=cache.head_size, dtype=cache.dtype, block_size=cache.block_size,
        kv_branches=cache.kv_branches, cross_attention_lengths=cache.cross_attention_lengths,
        cross_attention_kv_heads=cache.cross_attention_kv_heads,
        frames_per_block=cache.frames_per_block,
        model_owned_state_bytes_per_session=cache.model_owned_state_bytes_per_session)
    return admit(eng, stock_layout(eng), available_bytes=cache.available_memory_bytes,
                 gpu_memory_fraction=cache.config.gpu_memory_fraction)


def _undecorate() -> None:
    """Takes back the ``(DiffusionWorker pid=...)`` prefix vLLM put on this process's streams."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        if "_original_write" in vars(stream):
            del stream.write, stream._original_write
