"""LingBot-World's self-attention K/V in causalkv's cache, with vLLM-Omni's semantics.

vLLM-Omni keeps one ``LingBotAttentionCache`` per layer (``[B, max_tokens, H, D]`` buffers and
the cursors ``end``, ``absolute_end``, ``last_start``, ``sink_end``) and updates it in
``LingBotSelfAttention._update_cache``. `LingBotLayerKV` is the same contract over a causalkv
cache, `QVGPackedCausalKVCache` or what the served pipeline's cache factory builds (spec:
``cache_size = max_tokens``, ``sink_tokens`` = sink frames x tokens per frame), so the pipeline's calls keep their meaning:

- a chunk at a new ``current_start`` (contiguous) advances: the sink, the newest local tokens
  that fit beside the chunk, and the chunk are visible; older chunks roll out and, with QVG on,
  cold chunks are packed;
- the same ``current_start`` again rewrites the current chunk;
- ``update_cache=False`` (LingBot's noisy DMD probes) is the core's probe
  (``update_and_get_attention_kv(..., probe=True)``): the K/V the write would make visible,
  nothing stored; one ``[B, visible, H, D]`` K and V buffer, the held positions the write
  would keep read (packed ones decoded) straight into it and the probe's K/V copied after
  them; nothing else is built, so the ledger's count of that buffer is the probe's whole
  transient;
- the errors vLLM-Omni raises for an overlapping, non-contiguous or resized chunk are raised
  here, with the same messages, before the cache is touched.

`KVLedger` adds the request's bytes up over every layer: peak (everything held at once plus the
visible K/V one call built, a probe's included), resident now, and vLLM-Omni's dense cache for
the same request. Imports torch and causalkv's caches only; never vLLM or vLLM-Omni.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from causalkv.caches.ledger import ByteLedger
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.spec import CausalCacheSpec

__all__ = ["KVLedger", "LingBotLayerKV", "allocate_layers"]


class KVLedger(ByteLedger):
    """Bytes of one request's self-attention caches, all layers (a `ByteLedger` whose holders
    are the layer indices), beside vLLM-Omni's dense cache for the same request.

    Attributes:
        dense_bytes: what vLLM-Omni's dense cache allocates for the request
            (``2 * B * max_tokens * H * D * itemsize`` per layer).
        num_layers: the layers reporting.

    ``peak_nbytes`` is the most held at once: the sum over layers of what they hold plus the
    visible K/V one call built (a materialized ``[B, visible, H, D]`` pair);
    ``peak_transient_nbytes`` the largest such pair. vLLM-Omni's dense path builds the same pair
    (its ``torch.cat`` of history and chunk), so its own peak is ``dense_peak_bytes``.
    """

    def __init__(self, *, dense_bytes: int, num_layers: int) -> None:
        super().__init__()
        self.dense_bytes = dense_bytes
        self.num_layers = num_layers

    @property
    def dense_peak_bytes(self) -> int:
        """vLLM-Omni's dense cache at its peak: its buffers plus the largest visible K/V."""
        return self.dense_bytes + self.peak_transient_nbytes


class LingBotLayerKV:
    """One layer's self-attention K/V of one request: vLLM-Omni's cursors over a causalkv cache.

    Args:
        spec: the layer's `CausalCacheSpec` (``cache_size`` = vLLM-Omni's ``max_tokens``,
            ``sink_tokens`` = its sink, ``head_offset`` = the global index of the first head this
            rank holds, for Ulysses/TP shards).
        quant: QVG settings (``bits=None``: every chunk dense, bit for bit vLLM-Omni's cache).
        ledger, layer: the request's `KVLedger` and this layer's index in it.
        build: what builds the cache, ``build(spec, quant)`` (the served pipeline's cache
            factory's ``build``: a cache honouring causalkv's contract, probes included).

    Attributes:
        cache: the cache holding the K/V (a `QVGPackedCausalKVCache` unless ``build`` says).
        end, absolute_end, last_start, sink_end: vLLM-Omni's ``LingBotAttentionCache`` cursors
            (tokens held, next global position, start of the current chunk, sink tokens held).
    """

    def __init__(
        self, spec: CausalCacheSpec, quant: QVGKVQuantArgs, *, ledger: KVLedger, layer: int,
        build: Callable[[CausalCacheSpec, QVGKVQuantArgs], Any] = QVGPackedCausalKVCache,
    ) -> None:
        self.spec = spec
        self.cache = build(spec, quant)
        self.ledger = ledger
        self.layer = layer
        self.end = 0
        self.absolute_end = 0
        self.last_start: int | None = None
        self.sink_end = 0

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        current_start: int,
        *,
        sink_tokens: int,
        update_cache: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM-Omni's ``_update_cache`` on this store: the visible K/V ``[B, visible, H, D]``.

        ``key``/``value``: the chunk ``[B, n, H, D]`` (post-RoPE keys). ``update_cache=False``
        stores nothing. ValueError (vLLM-Omni's messages) for a write it refuses; the cache is
        left as it was.
        """
        n = key.shape[1]
        capacity = self.spec.cache_size
        if sink_tokens != self.spec.sink_tokens:
            raise ValueError(
                f"sink_tokens={sink_tokens} differs from the cache's {self.spec.sink_tokens}; "
                "the layer's cache was allocated for another sink"
            )
        incoming_sink = max(0, min(n, sink_tokens - current_start))
        next_sink_end = self.sink_end + incoming_sink  # a first or new chunk (a rewrite keeps it)
        if self.last_start is None:
            if n > capacity:
                raise ValueError(
                    f"Current chunk has {n} tokens but the cache can hold only {capacity}; "
                    "the full current chunk must remain visible."
                )
        elif current_start == self.last_start:
            if current_start + n != self.absolute_end:
                raise ValueError("A repeated current_start must overwrite the same-size current chunk.")
            if n > self.end:
                raise ValueError("The current chunk is no longer fully retained in the cache.")
            next_sink_end = self.sink_end
        else:
            if current_start < self.last_start:
                raise ValueError(
                    f"current_start={current_start} precedes the latest chunk start {self.last_start}."
                )
            if current_start < self.absolute_end:
                raise ValueError(
                    f"current_start={current_start} overlaps cached tokens ending at {self.absolute_end}."
                )
            if current_start > self.absolute_end:
                raise ValueError(
                    f"New chunks must be contiguous: current_start={current_start}, expected {self.absolute_end}."
                )
            if n - incoming_sink > capacity - next_sink_end:  # the new local tokens do not fit
                raise ValueError("The configured cache cannot retain all sink tokens and the full current chunk.")
        if not update_cache and self.last_start is None:  # a probe of the first chunk sees the chunk only
            k, v = key, value
        else:  # a write, or a probe: the view the write would return, nothing stored (the core's probe)
            view = self.cache.update_and_get_attention_kv(
                key=key, value=value, current_chunk_start=current_start, probe=not update_cache,
                debug_name=f"lingbot.self_attn[{self.layer}]",
            )
            k, v = view.k, view.v
        if update_cache:
            self.end = k.shape[1]
            self.absolute_end = current_start + n
            self.last_start = current_start
            self.sink_end = next_sink_end
        self.ledger.hold(self.layer, self.cache.resident_nbytes())
        self.ledger.transient(k.nbytes + v.nbytes)
        return k, v


def allocate_layers(
    spec: CausalCacheSpec, quant: QVGKVQuantArgs, *, num_layers: int,
    build: Callable[[CausalCacheSpec, QVGKVQuantArgs], Any] = QVGPackedCausalKVCache,
) -> tuple[list[LingBotLayerKV], KVLedger]:
    """One request's self-attention stores (one per layer, each cache ``build(spec, quant)``)
    and their shared `KVLedger`.

    ``spec`` is vLLM-Omni's ``allocate_lingbot_cache`` geometry: ``[B, max_tokens, H, D]`` per
    layer (``cache_size`` = ``max_tokens``), ``H`` the heads this rank holds, starting at
    global head ``head_offset``.
    """
    ledger = KVLedger(dense_bytes=num_layers * spec.dense_nbytes(), num_layers=num_layers)
    return [LingBotLayerKV(spec, quant, ledger=ledger, layer=i, build=build) for i in range(num_layers)], ledger
