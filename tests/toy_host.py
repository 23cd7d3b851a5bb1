"""A toy host: the smallest host adapter, written from docs/hosts.md alone.

It generates "video" chunk by chunk with a stack of layers whose attention reads causalkv's
caches, the way a real host does: every denoising pass of a chunk is a probe (its K/V are read
inside the call and never again), the context pass commits the chunk (the caches' shared
``PassMarker``: ``probing()`` around the denoising passes, ``committing(pin=...)`` around the
context pass, announcing a pin when the chunk is a scene cut), a scene-cut
chunk is then pinned as the shot sink, and a new request resets every cache. The heads are
written as two head slices (a head-parallel host's two ranks, one after the other).

Only the contract's names are used: `CausalCacheSpec`, `QVGPackedCausalKVCache`,
`DenseCausalKVCache`, `QVGKVQuantArgs`, `PassMarker` (its ``ledger``) and the
cache calls (``use_marker``, ``update_and_get_attention_kv``, ``pin_current_chunk``,
``reset_indices``, ``resident_nbytes``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache, PassMarker
from causalkv.caches.qvg import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache

H, D, N = 4, 32, 48  # heads, head dim, tokens per chunk
SPEC = CausalCacheSpec(batch_size=1, num_heads=H, head_dim=D, cache_size=4 * N, sink_tokens=N,
                   global_sink_tokens=N, dtype=torch.bfloat16)


def kv(request: int, chunk: int, layer: int, step: int, h0: int, h1: int):
    """The K/V a layer writes ``[1, N, h1 - h0, D]``: seeded by where it is written."""
    g = torch.Generator().manual_seed(((request * 100 + chunk) * 10 + layer) * 10 + step)
    full = [torch.randn(1, N, H, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    return full[0][:, :, h0:h1], full[1][:, :, h0:h1]


@dataclass
class Request:
    chunks: int
    steps: int = 3  # denoising passes (probes) before the context pass
    cuts: tuple[int, ...] = ()  # scene-cut chunks, pinned after their context pass


@dataclass
class Trace:
    """Every view a host's attention read: (request, chunk, layer, step, heads) -> (k, v, positions)."""

    views: dict = field(default_factory=dict)
    #: the most the caches held at once (the dense cache: its preallocated buffers)
    peak_resident_bytes: int = 0


def run(requests: list[Request], *, layers: int, quant: QVGKVQuantArgs | None,
        marked: bool = True) -> Trace:
    """Generate ``requests`` one after another; ``quant=None``: the dense cache, unmarked
    writes (the reference host); else the packed cache, probes and commits marked."""
    marker = PassMarker() if quant is not None and marked else None
    if quant is None:
        caches = [DenseCausalKVCache(SPEC) for _ in range(layers)]
    else:
        caches = [QVGPackedCausalKVCache(SPEC, quant, marker=marker) for _ in range(layers)]
    trace = Trace()
    for r, req in enumerate(requests):
        if r:
            for cache in caches:
                cache.reset_indices()
        for c in range(req.chunks):
            for step in range(req.steps + 1):
                context = step == req.steps
                scope = (contextlib.nullcontext() if marker is None else
                         marker.committing(pin=c in req.cuts) if context else marker.probing())
                with scope:
                    for layer, cache in enumerate(caches):
                        for h0, h1 in ((0, H // 2), (H // 2, H)):
                            k, v = kv(r, c, layer, step, h0, h1)
                            view = cache.update_and_get_attention_kv(
                                key=k, value=v, current_chunk_start=c * N, cache_head_start=h0)
                            trace.views[(r, c, layer, step, h0)] = (
                                view.k.clone(), view.v.clone(), view.position_ranges)
            if c in req.cuts:
                for cache in caches:
                    cache.pin_current_chunk(N)
        resident = sum(cache.resident_nbytes() for cache in caches)
        most = marker.ledger.peak_resident_nbytes if marker is not None else resident
        trace.peak_resident_bytes = max(trace.peak_resident_bytes, most, resident)
    return trace
