"""LingBot-World's causal pipeline with causalkv's self-attention cache (imports vLLM-Omni).

Loaded only by vLLM-Omni itself: `causalkv.vllm_omni.register` registers
`CausalKVLingBotWorldPipeline` under ``LingBotWorldCausalDMDPipeline`` with
``register_diffusion_model``, and vLLM-Omni imports this module when it builds that pipeline.

- `CausalKVLingBotWorldPipeline` (and a plugin's subclass registered under a name of its own,
  `causalkv.vllm_omni.served_pipelines`) reads the setting (``model_config.causalkv_kv_cache``,
  `causalkv.vllm_omni.settings`, with the codec the served name's registration gives) before
  anything loads, refuses a bad one (on the paged AR-diffusion engine also what
  `causalkv.vllm_omni.paged_pipeline.check_paged` refuses), then builds the stock pipeline and
  gives its transformer and self-attention layers the subclasses below; on the paged engine
  `causalkv.vllm_omni.paged_pipeline.install_paged` puts causalkv's pages under its realtime
  sessions. No setting: nothing changes.
- `CausalKVLingBotTransformer.allocate_cache` (the direct path's per-request cache) returns
  vLLM-Omni's ``LingBotTransformerCache`` whose self-attention entries are
  `causalkv.vllm_omni.lingbot_cache.LingBotLayerKV` (each a cache the served name's cache factory
  builds, `causalkv.vllm_omni.cache_factory`: ``qvg``'s `QVGPackedCausalKVCache` by default); cross-attention
  stays vLLM-Omni's. A new cache per request, so requests never share K/V.
- `CausalKVLingBotSelfAttention._update_cache` sends those entries to the store and anything
  else (vLLM-Omni's own ``LingBotAttentionCache``) to the stock code.

After each request one INFO line gives the cache class, bits and the request's peak,
resident and dense KV bytes (all layers).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm_omni.diffusion.models.lingbot_world.pipeline import (
    LingBotWorldCausalDMDPipeline,
    get_lingbot_world_post_process_func,
    get_lingbot_world_pre_process_func,
)
from vllm_omni.diffusion.models.lingbot_world.transformer import (
    CausalLingBotWorldTransformer3DModel,
    LingBotSelfAttention,
    LingBotTransformerCache,
)

from causalkv.caches.ledger import peak_nbytes
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.spec import CausalCacheSpec
from causalkv.capabilities import QUANT_QVG
from causalkv.errors import ConfigError
from causalkv.hooks import CacheFactory
from causalkv.memory.geometry import frame_tokens
from causalkv.vllm_omni import DEFAULT_CACHE, cache_factory, served_pipelines
from causalkv.vllm_omni.lingbot_cache import KVLedger, LingBotLayerKV, allocate_layers
from causalkv.vllm_omni.settings import CONFIG_KEY, read_settings

__all__ = [
    "PAGED_ENGINE",
    "CausalKVLingBotSelfAttention",
    "CausalKVLingBotTransformer",
    "CausalKVLingBotWorldPipeline",
    "check_engine_mode",
    "get_lingbot_world_post_process_func",
    "get_lingbot_world_pre_process_func",
    "install",
]

logger = logging.getLogger(__name__)

#: vLLM-Omni's paged AR-diffusion engine, as ``engine_backend`` names it: its realtime sessions
#: hold causalkv's pages
PAGED_ENGINE = "ARDiffusionEngine"
#: LingBot-World v2's head dim: ``CausalLingBotWorldTransformer3DModel.from_config`` refuses any
#: other (its checkpoint contract), so a block layout can be checked before the folder is read
_HEAD_DIM = 128


class CausalKVLingBotSelfAttention(LingBotSelfAttention):
    """vLLM-Omni's LingBot self-attention; a `LingBotLayerKV` cache entry is causalkv's store."""

    def _update_cache(self, cache: Any, key: torch.Tensor, value: torch.Tensor, current_start: int,
                      *, sink_tokens: int, update_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(cache, LingBotLayerKV):
            return cache.update(key, value, current_start, sink_tokens=sink_tokens,
                                update_cache=update_cache)
        return super()._update_cache(cache, key, value, current_start, sink_tokens=sink_tokens,
                                     update_cache=update_cache)


class CausalKVLingBotTransformer(CausalLingBotWorldTransformer3DModel):
    """vLLM-Omni's causal LingBot-World DiT whose per-request self-attention cache is causalkv's.

    Attributes (set by `install`):
        causalkv_quant: the QVG settings of the stores it allocates.
        causalkv_cache: the cache factory building each layer's cache.
        causalkv_ledger: the `KVLedger` of the last cache it allocated (the request's bytes).
    """

    causalkv_quant: QVGKVQuantArgs
    causalkv_cache: CacheFactory
    causalkv_ledger: KVLedger | None = None

    def head_offset(self) -> int:
        """Global index of the first self-attention head this rank caches (TP x Ulysses)."""
        attn = self.blocks[0].self_attn
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() * attn.num_local_heads + attn.ulysses_rank * attn.num_sp_heads

    def allocate_cache(self, *, batch_size: int, latent_height: int, latent_width: int,
                       device: torch.device, dtype: torch.dtype) -> LingBotTransformerCache:
        """vLLM-Omni's ``allocate_cache`` (same checks and geometry), causalkv's stores.

        The stock call validates the arguments and sizes ``max_tokens``; its zero buffers are
        dropped at once (the stores allocate as chunks arrive).
        """
        stock = super().allocate_cache(batch_size=batch_size, latent_height=latent_height,
                                       latent_width=latent_width, device=device, dtype=dtype)
        _, max_tokens, heads, head_dim = stock.self_attention[0].key.shape
        del stock
        tokens_per_frame = frame_tokens(latent_height, latent_width, self.config.patch_size[1:])
        spec = CausalCacheSpec(
            batch_size=batch_size, num_heads=heads, head_dim=head_dim, cache_size=max_tokens,
            sink_tokens=self.config.sink_size * tokens_per_frame, dtype=dtype, device=device,
            head_offset=self.head_offset())
        layers, self.causalkv_ledger = allocate_layers(
            spec, self.causalkv_quant, num_layers=self.config.num_layers,
            build=self.causalkv_cache.build)
        return LingBotTransformerCache(self_attention=list(layers),
                                       cross_attention=[None] * self.config.num_layers)


def install(transformer: CausalLingBotWorldTransformer3DModel, quant: QVGKVQuantArgs,
            cache: CacheFactory | None = None) -> CausalKVLingBotTransformer:
    """Give a built LingBot-World transformer causalkv's self-attention cache, in place.

    Swaps the instance's class to `CausalKVLingBotTransformer` and each block's self-attention
    to `CausalKVLingBotSelfAttention` (subclasses adding no state: parameters, buffers and
    forward stay vLLM-Omni's). ``cache``: the factory building each layer's cache (default:
    the registry's `causalkv.vllm_omni.DEFAULT_CACHE`); it must cover ``quant:qvg`` when
    ``quant`` packs, and its kind's ``check_request`` runs here. Returns the same object.
    """
    if not isinstance(transformer, CausalLingBotWorldTransformer3DModel):
        raise ConfigError(f"install takes vLLM-Omni's CausalLingBotWorldTransformer3DModel, got {type(transformer).__name__}")
    cache = cache if cache is not None else cache_factory(None)[0]
    if lacks := sorted(cache.features().missing({QUANT_QVG} if quant.enabled else ())):
        raise ConfigError(f"causalkv vllm-omni bridge: cache {cache.name!r} lacks {', '.join(lacks)}, which "
                          f"kv_cache_quant {quant.codec} needs; name a cache that covers it, or turn quantization off")
    cache.check_request(quant, head_dim=int(transformer.config.attention_head_dim),
                        device=str(next(transformer.parameters()).device))
    for block in transformer.blocks:
        if type(block.self_attn) is LingBotSelfAttention:
            block.self_attn.__class__ = CausalKVLingBotSelfAttention
    if type(transformer) is CausalLingBotWorldTransformer3DModel:
        transformer.__class__ = CausalKVLingBotTransformer
    transformer.causalkv_quant = quant
    transformer.causalkv_cache = cache
    transformer.causalkv_ledger = None
    return transformer  # type: ignore[return-value]


def check_engine_mode(od_config: Any, quant: QVGKVQuantArgs) -> bool:
    """True when the stage runs on vLLM-Omni's paged AR-diffusion engine (``engine_backend``
    names `PAGED_ENGINE` or a subclass of it, by class or import path) or with step execution:
    where LingBot's K/V live in the engine's paged pool, held by causalkv's pages
    (`causalkv.vllm_omni.paged_pipeline`: its seams and mode are checked here, a ConfigError
    before anything loads); False in request (direct) mode."""
    from causalkv.vllm_omni.paged_pipeline import check_paged

    backend = getattr(od_config, "engine_backend", "default")
    names = [c.__name__ for c in backend.__mro__] if isinstance(backend, type) else [str(backend)]
    if not any(PAGED_ENGINE in n for n in names) and not getattr(od_config, "step_execution", False):
        return False
    check_paged(od_config, quant)
    return True


class CausalKVLingBotWorldPipeline(LingBotWorldCausalDMDPipeline):
    """vLLM-Omni's ``LingBotWorldCausalDMDPipeline`` with causalkv's self-attention cache.

    Registered under ``LingBotWorldCausalDMDPipeline`` by the built-in plugin (a plugin's
    subclass under its own name). Without ``model_config.causalkv_kv_cache`` it is the stock
    pipeline. With it: the setting is checked first (a bad value, or on the paged engine what
    `causalkv.vllm_omni.paged_pipeline.check_paged` refuses, raises before any component or
    weight loads; the codec the served name's registration gives fills a ``kv_cache_quant``
    left out), then the stock pipeline is built, `install` puts causalkv's store on its
    transformer and, on the paged engine, `install_paged` causalkv's pages under its sessions.

    Attributes:
        causalkv_name: the ``model_class_name`` it was built as (the summary's ``pipeline=``).
        causalkv_quant: the QVG settings, or None (vLLM-Omni's own cache).
        causalkv_cache_class: the class name of the layers' caches (the summary's ``cache=``),
            or None.
    """

    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        name = getattr(od_config, "model_class_name", None) or LingBotWorldCausalDMDPipeline.__name__
        served = served_pipelines().get(name)
        quant = read_settings(getattr(od_config, "model_config", None) or {},
                              codec=served[0].codec if served else None)
        paged, cache = False, None
        if quant is not None:
            quant.check_layout(_HEAD_DIM)
            cache, plugin = cache_factory(name)
            paged = check_engine_mode(od_config, quant)
            if paged and cache.name != DEFAULT_CACHE:  # the engine's sessions live in causalkv's pages
                raise ConfigError(f"causalkv vllm-omni bridge, {name}: cache {cache.name!r} serves request "
                                  f"mode only; on the paged AR-diffusion engine the sessions hold causalkv's pages")
        super().__init__(od_config=od_config, prefix=prefix)
        self.causalkv_name = name
        self.causalkv_quant = quant
        self.causalkv_cache_class = getattr(cache.load(), "__name__", cache.name) if cache else None
        if quant is None:
            logger.info("causalkv: LingBotWorldCausalDMDPipeline keeps vLLM-Omni's KV cache "
                        "(no model_config.%s)", CONFIG_KEY)
            return
        install(self.transformer, quant, cache)
        if paged:  # the AR-diffusion engine's sessions: causalkv's pages (paged_pipeline)
            from causalkv.vllm_omni.paged_pipeline import install_paged

            install_paged(self, quant)
        logger.info("causalkv: LingBotWorldCausalDMDPipeline self-attention cache %s %s (cache %s, plugin %s)%s",
                    self.causalkv_cache_class, quant.describe(), cache.name, plugin,
                    f" (served as {name}, plugin {served[1]})" if served else "")

    def forward(self, req: Any) -> Any:
        out = super().forward(req)
        ledger = getattr(self.transformer, "causalkv_ledger", None)
        quant = self.causalkv_quant
        if quant is None or ledger is None:
            return out
        # the request's line (all layers): ``peak_bytes`` the most its stores held at once plus
        # the largest visible K/V one call built; ``resident_bytes`` what they hold at the end;
        # ``dense_bytes`` vLLM-Omni's dense cache for the same request (its preallocated
        # buffers); ``dense_peak_bytes`` that plus the same largest visible K/V (vLLM-Omni builds
        # it too); ``ratio`` dense_peak / peak; ``cache`` the class of the layers' caches
        peak = peak_nbytes([ledger], ledger.resident_nbytes)
        logger.info(
            "causalkv kv-cache summary: pipeline=%s cache=%s codec=%s layers=%d peak_bytes=%d "
            "resident_bytes=%d dense_bytes=%d dense_peak_bytes=%d ratio=%s", self.causalkv_name,
            self.causalkv_cache_class, quant.codec if quant.enabled else "off", ledger.num_layers,
            peak, ledger.resident_nbytes, ledger.dense_bytes, ledger.dense_peak_bytes,
            f"{ledger.dense_peak_bytes / peak:.2f}" if peak else "n/a")
        return out
