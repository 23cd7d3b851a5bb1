"""causalkv's own packed cache with the chunk being generated held once per stage.

The oracle is the same cache without a scratch (itself held bit for bit to the dense cache
with quantization off, `test_packed_parity`): the same K/V stream through several layers with
and without one shared `ChunkScratch` gives every view bit for bit, for quant off, int2 at
keep-recent 1 and 0, sink bf16 and a pinned shot sink; the scratch layout holds less, and in
steady state exactly the context the next chunk keeps, by the byte formula.
"""

from __future__ import annotations

import pytest
import torch

from causalkv.caches import KVCacheSpec
from causalkv.caches.qvg import ChunkScratch, QVGKVQuantArgs
from causalkv.caches.qvg.format import packed_nbytes_formula
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.policy import centroids_for
from causalkv.errors import UsageError

H, D, N, SLOTS, LAYERS, PASSES, PIN_AFTER = 2, 32, 64, 4, 3, 3, 3
SPEC = KVCacheSpec(1, H, D, SLOTS * N, sink_tokens=N, global_sink_tokens=N, dtype=torch.bfloat16)


def _kv(chunk, layer, step):
    g = torch.Generator().manual_seed(1000 * chunk + 10 * layer + step)
    return tuple(torch.randn(1, N, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _stream(caches, scratch, chunks=8):
    views, held = [], []
    for c in range(chunks):
        for step in range(PASSES):
            context = step == PASSES - 1 and scratch is not None
            with scratch.context_pass(pin=c == PIN_AFTER) if context else _null():
                for layer, cache in enumerate(caches):
                    k, v = _kv(c, layer, step)
                    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    views.append((view.k.clone(), view.v.clone(), view.position_ranges))
                    held.append(sum(x.resident_nbytes() for x in caches) + (scratch.nbytes if scratch else 0))
        if c == PIN_AFTER:
            for cache in caches:
                cache.pin_current_chunk(N)
    return views, held


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SETTINGS = {
    "off": QVGKVQuantArgs(),
    "int2-default": QVGKVQuantArgs(codec="int2", block_size=16),
    "int2-recent0": QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=0),
    "int2-sink0": QVGKVQuantArgs(codec="int2", block_size=16, sink=False),
    "int2-recent-int4": QVGKVQuantArgs(codec="int2", block_size=16, recent_tier="int4"),
    "int2-sink-full": QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=0, sink_span="full"),
    "int2-span2": QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=0, span_chunks=2),
    "int2-codebook2": QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=0, codebook_chunks=2),
    "int4-sink0-recent-int4": QVGKVQuantArgs(codec="int4", block_size=16, sink=False, recent_tier="int4"),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_views_are_those_without_the_scratch_and_the_stage_holds_less(name):
    quant = SETTINGS[name]
    before, held_before = _stream([QVGPackedCausalKVCache(SPEC, quant) for _ in range(LAYERS)], None)
    scratch = ChunkScratch()
    after, held_after = _stream(
        [QVGPackedCausalKVCache(SPEC, quant, scratch=scratch) for _ in range(LAYERS)], scratch)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a[2] == b[2] and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"view {i}"
    assert max(held_after) < max(held_before)
    assert scratch.peak_resident_nbytes == max(held_after)


def test_keep_recent_0_holds_the_next_chunks_context_packed_and_one_scratch_chunk():
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch()
    caches = [QVGPackedCausalKVCache(SPEC, quant, scratch=scratch) for _ in range(LAYERS)]
    _, held = _stream(caches, scratch)
    q = QVGKVQuantArgs(codec="int2", block_size=16, centroids=centroids_for(N, 128))
    packed = 2 * packed_nbytes_formula((1, H, N, D), q)
    chunk = 2 * N * H * D * 2
    assert held[-1] == LAYERS * 3 * packed + chunk  # sink, pinned shot sink, newest; 1 scratch


def test_a_chunk_whose_scratch_another_layer_wrote_is_refused_without_a_context_pass():
    scratch = ChunkScratch()
    a, b = (QVGPackedCausalKVCache(SPEC, SETTINGS["int2-default"], scratch=scratch) for _ in range(2))
    for cache in (a, b):
        k, v = _kv(0, 0, 0)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    k, v = _kv(1, 0, 0)
    with pytest.raises(UsageError, match="never committed by a context pass"):
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=N)
    with pytest.raises(UsageError, match="another layer has written"):
        a.get_attention_kv().k  # noqa: B018 - reading is the point


def test_a_failed_context_commit_leaves_the_cache_as_it_was():
    scratch = ChunkScratch()
    cache = QVGPackedCausalKVCache(SPEC, SETTINGS["int2-recent0"], scratch=scratch)
    for c in range(2):
        k, v = _kv(c, 0, 0)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        with scratch.context_pass():
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    k, v = _kv(2, 0, 0)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=2 * N)
    state, segments, calls = cache.state, list(cache.store.segments), cache.quantize_calls
    k[0, 1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"), scratch.context_pass():
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=2 * N)
    assert cache.state is state and cache.quantize_calls == calls
    assert all(s is t for s, t in zip(cache.store.segments, segments, strict=True))
