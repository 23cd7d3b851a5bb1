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

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache, attend
from causalkv.caches.codecs.prq.format import packed_nbytes_formula
from causalkv.caches.qvg import ChunkScratch, QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.policy import centroids_for
from causalkv.caches.spec import CacheProtocolError

H, D, N, SLOTS, LAYERS, PASSES, PIN_AFTER = 2, 32, 64, 4, 3, 3, 3
SPEC = CausalCacheSpec(1, H, D, SLOTS * N, sink_tokens=N, global_sink_tokens=N, dtype=torch.bfloat16)


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
    scratch = ChunkScratch(shared=True)
    after, held_after = _stream(
        [QVGPackedCausalKVCache(SPEC, quant, scratch=scratch) for _ in range(LAYERS)], scratch)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a[2] == b[2] and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"view {i}"
    assert max(held_after) < max(held_before)
    assert scratch.ledger.peak_resident_nbytes == max(held_after)


def test_keep_recent_0_holds_the_next_chunks_context_packed_and_one_scratch_chunk():
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch(shared=True)
    caches = [QVGPackedCausalKVCache(SPEC, quant, scratch=scratch) for _ in range(LAYERS)]
    _, held = _stream(caches, scratch)
    q = QVGKVQuantArgs(codec="int2", block_size=16, centroids=centroids_for(N, 128))
    packed = 2 * packed_nbytes_formula((1, H, N, D), q)
    chunk = 2 * N * H * D * 2
    assert held[-1] == LAYERS * 3 * packed + chunk  # sink, pinned shot sink, newest; 1 scratch


def _dense_layers(n):
    return [DenseCausalKVCache(SPEC) for _ in range(n)]


def _same_view(a, b):
    assert a.position_ranges == b.position_ranges
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_an_undeclared_scratch_never_refuses_and_answers_as_the_dense_cache():
    """Layers given one scratch but no declaration (no share(), no context pass) keep their
    own chunk: lock-step chunks, reads between chunks, a second request, all as dense."""
    scratch = ChunkScratch()
    caches = [QVGPackedCausalKVCache(SPEC, QVGKVQuantArgs(), scratch=scratch) for _ in range(LAYERS)]
    dense = _dense_layers(LAYERS)
    for request in range(2):
        for c in range(6):
            for step in range(PASSES):
                for layer in range(LAYERS):
                    k, v = _kv(c, layer, step + 10 * request)
                    got = caches[layer].update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    want = dense[layer].update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    _same_view(got, want)
            for layer in range(LAYERS):  # a read between chunks
                _same_view(caches[layer].get_attention_kv(), dense[layer].get_attention_kv())
        for cache in (*caches, *dense):
            cache.reset_indices()
    assert not scratch.shared and scratch.nbytes == 0


def test_a_declared_chunk_ended_without_its_pass_is_refused_when_lost_and_nothing_changes():
    scratch = ChunkScratch(shared=True)
    a, b = (QVGPackedCausalKVCache(SPEC, SETTINGS["int2-default"], scratch=scratch) for _ in range(2))
    for cache in (a, b):
        k, v = _kv(0, 0, 0)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    k, v = _kv(1, 0, 0)
    state, segments = a.state, list(a.store.segments)
    with pytest.raises(CacheProtocolError, match=r"chunk \[0, 64\) .* never committed by a context pass"):
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=N)
    with pytest.raises(CacheProtocolError, match="another layer has written"):
        a.get_attention_kv()
    assert a.state is state and a.store.segments == segments
    # b wrote the scratch last: its chunk is intact, so it is answered (its own copy)
    want = DenseCausalKVCache(SPEC)
    want.update_and_get_attention_kv(key=_kv(0, 0, 0)[0], value=_kv(0, 0, 0)[1], current_chunk_start=0)
    _same_view(b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=N),
               want.update_and_get_attention_kv(key=k, value=v, current_chunk_start=N))


def test_reads_between_chunks_of_dropped_positions_are_refused_never_answered_over_fewer():
    """Three layers, a declared scratch, every chunk ended in its context pass: a read between
    chunks of positions the pass already dropped is refused; attend never computes over
    fewer tokens than the view reports."""
    scratch = ChunkScratch()
    caches = [QVGPackedCausalKVCache(SPEC, QVGKVQuantArgs(), scratch=scratch) for _ in range(LAYERS)]
    _stream(caches, scratch, chunks=6)
    for cache in caches:
        with pytest.raises(CacheProtocolError, match="dropped at the last context pass"):
            cache.get_attention_kv()
    # a recent-window read that needs only what is held is answered
    view = caches[0].get_attention_kv(recent_window_tokens=0)
    q = torch.randn(1, 4, H, D).to(torch.bfloat16)
    out = attend(q, view)
    assert out.shape == (1, 4, H, D) and view.k.shape[1] == view.num_visible


def test_head_slice_halves_inside_one_context_pass_answer_as_the_dense_cache():
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch(shared=True)
    caches = [QVGPackedCausalKVCache(SPEC, quant, scratch=scratch) for _ in range(LAYERS)]
    plain = [QVGPackedCausalKVCache(SPEC, quant) for _ in range(LAYERS)]
    half = H // 2
    for c in range(6):
        for step in range(PASSES):
            context = step == PASSES - 1
            with scratch.context_pass() if context else _null():
                for layer in range(LAYERS):
                    k, v = _kv(c, layer, step)
                    parts = ((0, k[:, :, :half], v[:, :, :half]), (half, k[:, :, half:], v[:, :, half:])) \
                        if context else ((None, k, v),)
                    for h0, kk, vv in parts:
                        got = caches[layer].update_and_get_attention_kv(
                            key=kk.contiguous(), value=vv.contiguous(), current_chunk_start=c * N,
                            cache_head_start=h0)
                        want = plain[layer].update_and_get_attention_kv(
                            key=kk.contiguous(), value=vv.contiguous(), current_chunk_start=c * N,
                            cache_head_start=h0)
                        _same_view(got, want)
    assert sum(x.resident_nbytes() for x in caches) < sum(x.resident_nbytes() for x in plain)


def test_a_refused_context_write_leaves_everything_as_it_was_the_scratch_included():
    scratch = ChunkScratch(shared=True)
    a, b = (QVGPackedCausalKVCache(SPEC, SETTINGS["int2-recent0"], scratch=scratch) for _ in range(2))
    for c in range(2):
        for cache in (a, b):
            k, v = _kv(c, 0, 0)
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        with scratch.context_pass():
            for cache in (a, b):
                cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    for cache in (a, b):  # chunk 2: b writes the scratch last
        k, v = _kv(2, 0, 0)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=2 * N)
    held_k = scratch._k.clone()
    state, segments = a.state, list(a.store.segments)
    with pytest.raises(CacheProtocolError, match=r"chunk \[128, 192\) .* never committed"):
        # a's chunk was overwritten by b, and is not committed: the advance would lose it
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N)
    with scratch.context_pass():
        # a context write of head 0 alone: head 1 is lost until rewritten, and never read
        a.update_and_get_attention_kv(key=k[:, :, :1].contiguous(), value=v[:, :, :1].contiguous(),
                                      current_chunk_start=2 * N, cache_head_start=0)
        state, segments, held_k = a.state, list(a.store.segments), scratch._k.clone()
        with pytest.raises(CacheProtocolError, match=r"heads \[1\]"):
            a.get_attention_kv()
    with pytest.raises(CacheProtocolError, match=r"heads \[1\]"):
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N)
    assert a.state is state and a.store.segments == segments
    assert torch.equal(scratch._k, held_k) and scratch.writer is b.store


def test_a_non_finite_chunk_is_kept_as_written_and_the_stream_goes_on():
    """NaN/inf K/V: the chunk stays dense (what the dense cache holds), the report says so,
    the next advances pack the other chunks, and the views show the chunk as written."""
    scratch = ChunkScratch(shared=True)
    cache = QVGPackedCausalKVCache(SPEC, SETTINGS["int2-recent0"], scratch=scratch)
    bad = _kv(1, 0, 0)
    bad[0][0, 2, 1, 3] = float("nan")
    bad[1][0, 5, 0, 0] = float("inf")
    for c in range(6):
        k, v = bad if c == 1 else _kv(c, 0, 0)
        for step in range(2):
            with scratch.context_pass() if step else _null():
                view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
            if c >= 1 and (N, 2 * N) in view.position_ranges or (
                    c >= 1 and any(a <= N and 2 * N <= b for a, b in view.position_ranges)):
                at = int((view.positions == N).nonzero())
                torch.testing.assert_close(view.k[:, at : at + N], bad[0], equal_nan=True, rtol=0, atol=0)
                torch.testing.assert_close(view.v[:, at : at + N], bad[1], equal_nan=True, rtol=0, atol=0)
    report = cache.packing_report()
    assert report.chunks_dense.get("non-finite") == 1 and report.chunks_packed >= 3


def test_the_stage_and_the_sglang_bridge_declare_the_scratch_a_library_user_by_its_first_pass():
    scratch = ChunkScratch()
    assert not scratch.shared
    with scratch.context_pass():
        pass
    assert scratch.shared and scratch.passes == 1
    assert ChunkScratch(shared=True).shared


def test_a_partial_rewrite_of_a_chunk_another_layer_overwrote_in_the_scratch_is_refused():
    """Part of a chunk whose rows another layer has overwritten in the shared scratch: the
    rest of its rows are that layer's, so the write is refused with nothing changed (before,
    it took the scratch and the rest of the chunk read as the other layer's K/V)."""
    from causalkv.caches.qvg import KVWrite, SegmentStore

    scratch = ChunkScratch(shared=True)
    stores = [SegmentStore(batch_size=1, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                           device="cpu", quant=QVGKVQuantArgs(), scratch=scratch)
              for _ in range(2)]
    for i, store in enumerate(stores):
        k, v = _kv(0, i, 0)
        store.commit(store.plan(held=((0, N),), advance=True, write=KVWrite(0, N, (0, H), k, v)))
    k, v = _kv(0, 0, 1)
    segments = list(stores[0].segments)
    with pytest.raises(CacheProtocolError, match=r"rewrites part of chunk \[0, 64\)"):
        stores[0].plan_write(KVWrite(0, N // 2, (0, H), k[:, : N // 2], v[:, : N // 2]))
    assert stores[0].segments == segments and scratch.writer is stores[1]
    stores[0].write(KVWrite(0, N, (0, H), k, v))  # the whole chunk: its own again
    assert scratch.writer is stores[0]
    got, _ = stores[0].gather([(0, N)], 0, H)
    assert torch.equal(got, k)
