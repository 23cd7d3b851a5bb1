"""causalkv's own packed cache with probes and commits marked, as its stages mark them.

The oracle is the same cache with no marks (itself held bit for bit to the dense cache with
quantization off, `test_packed_parity`): the same K/V stream through several layers, the
denoising passes probes and the context pass a commit (one `PassMarker` for the layers),
gives every view bit for bit, for quant off, int2 at keep-recent 1 and 0, sink bf16, the
recency tier, spans, shared codebooks and a pinned shot sink; the marked layout holds less,
and in steady state exactly the context the next chunk keeps, by the byte formula. The dense
cache given the same marks answers every call the same way (a commit's rule is the cursor's).
"""

from __future__ import annotations

import pytest
import torch

from causalkv.caches import CausalCacheSpec, CommitPass, DenseCausalKVCache, PassMarker
from causalkv.caches.codecs.prq.centroids import centroids_for
from causalkv.caches.codecs.prq.format import packed_nbytes_formula
from causalkv.caches.qvg import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.errors import UsageError

H, D, N, SLOTS, LAYERS, PASSES, PIN_AFTER = 2, 32, 64, 4, 3, 3, 3
SPEC = CausalCacheSpec(1, H, D, SLOTS * N, sink_tokens=N, global_sink_tokens=N, dtype=torch.bfloat16)


def _kv(chunk, layer, step, n=N):
    g = torch.Generator().manual_seed(1000 * chunk + 10 * layer + step)
    return tuple(torch.randn(1, n, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _stream(caches, marker, chunks=8):
    """Every view and the layers' resident bytes after every call."""
    views, held = [], []
    for c in range(chunks):
        for step in range(PASSES):
            if marker is None:
                scope = torch.no_grad()
            elif step < PASSES - 1:
                scope = marker.probing()
            else:
                scope = marker.committing(pin=c == PIN_AFTER)
            with scope:
                for layer, cache in enumerate(caches):
                    k, v = _kv(c, layer, step)
                    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    views.append((view.k.clone(), view.v.clone(), view.position_ranges))
                    held.append(sum(x.resident_nbytes() for x in caches))
        if c == PIN_AFTER:
            for cache in caches:
                cache.pin_current_chunk(N)
    return views, held


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
def test_marked_views_are_the_unmarked_ones_and_the_layers_hold_less(name):
    quant = SETTINGS[name]
    before, held_before = _stream([QVGPackedCausalKVCache(SPEC, quant) for _ in range(LAYERS)], None)
    marker = PassMarker()
    after, held_after = _stream(
        [QVGPackedCausalKVCache(SPEC, quant, marker=marker) for _ in range(LAYERS)], marker)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a[2] == b[2] and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"view {i}"
    assert max(held_after) < max(held_before)
    assert marker.ledger.peak_resident_nbytes == max(held_after)


def test_keep_recent_0_holds_the_next_chunks_context_packed():
    marker = PassMarker()
    caches = [QVGPackedCausalKVCache(SPEC, SETTINGS["int2-recent0"], marker=marker)
              for _ in range(LAYERS)]
    _, held = _stream(caches, marker)
    q = QVGKVQuantArgs(codec="int2", block_size=16, centroids=centroids_for(N, 128))
    packed = 2 * packed_nbytes_formula((1, H, N, D), q)
    assert held[-1] == LAYERS * 3 * packed  # the sink, the pinned shot sink, the newest chunk


def test_probes_store_nothing():
    marker = PassMarker()
    cache = QVGPackedCausalKVCache(SPEC, SETTINGS["int2-default"], marker=marker)
    _stream([cache], marker, chunks=3)
    state, segments, resident = cache.state, list(cache.store.segments), cache.resident_nbytes()
    for step in range(3):
        k, v = _kv(3, 0, step)
        with marker.probing():
            view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N)
        assert view.position_ranges[-1][1] == 4 * N  # the probed chunk is the view's newest
        assert cache.state is state and cache.store.segments == segments
        assert cache.resident_nbytes() == resident


def test_a_commit_in_head_slices_drops_once_every_head_is_written():
    """Two ranks' halves of one context pass: the first half's view sees what the write saw,
    the second's too (nothing dropped in between), and the drop comes with the second."""
    dense, packed = DenseCausalKVCache(SPEC), QVGPackedCausalKVCache(SPEC, SETTINGS["off"])
    for c in range(5):
        for cache in (dense, packed):
            views = []
            for h0 in range(H):
                k, v = _kv(c, h0, 0)
                views.append(cache.update_and_get_attention_kv(
                    key=k[:, :, h0:h0 + 1], value=v[:, :, h0:h0 + 1], current_chunk_start=c * N,
                    cache_head_start=h0, commit=CommitPass()))
            assert views[0].position_ranges == views[1].position_ranges
        assert packed.state.retained == dense.state.retained
        for a, b in zip((dense.get_attention_kv(),), (packed.get_attention_kv(),)):
            assert a.position_ranges == b.position_ranges and torch.equal(a.k, b.k)
    # after chunk 4 the commit kept what chunk 5 reads: sink [0, 64) and the newest two chunks
    assert dense.state.retained == ((0, N), (3 * N, 5 * N))


def test_a_commit_told_a_smaller_next_chunk_keeps_what_it_reads():
    marker = PassMarker()
    cache, dense = QVGPackedCausalKVCache(SPEC, SETTINGS["off"], marker=marker), DenseCausalKVCache(SPEC)
    small = N // 2
    for c in range(5):
        k, v = _kv(c, 0, 0)
        with marker.committing(next_tokens=small if c == 4 else None):
            cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        dense.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    k, v = _kv(5, 0, 0, small)
    with marker.probing():
        got = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=5 * N)
    want = dense.update_and_get_attention_kv(key=k, value=v, current_chunk_start=5 * N)
    assert got.position_ranges == want.position_ranges
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_a_non_finite_chunk_is_kept_as_written_and_the_stream_goes_on():
    """NaN/inf K/V in a commit: the chunk stays dense (what the dense cache holds), the report
    says so, the next commits pack the other chunks, and the views show it as written."""
    marker = PassMarker()
    cache = QVGPackedCausalKVCache(SPEC, SETTINGS["int2-recent0"], marker=marker)
    bad = _kv(1, 0, 0)
    bad[0][0, 2, 1, 3] = float("nan")
    bad[1][0, 5, 0, 0] = float("inf")
    for c in range(6):
        k, v = bad if c == 1 else _kv(c, 0, 0)
        for step in range(2):
            with marker.committing() if step else marker.probing():
                view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
            if any(a <= N and 2 * N <= b for a, b in view.position_ranges):
                at = int((view.positions == N).nonzero())
                torch.testing.assert_close(view.k[:, at : at + N], bad[0], equal_nan=True, rtol=0, atol=0)
                torch.testing.assert_close(view.v[:, at : at + N], bad[1], equal_nan=True, rtol=0, atol=0)
    report = cache.packing_report()
    assert report.chunks_dense.get("non-finite") == 1 and report.chunks_packed >= 3


def test_a_probe_and_a_commit_together_are_refused_before_anything_changes():
    cache = QVGPackedCausalKVCache(SPEC, SETTINGS["int2-default"])
    k, v = _kv(0, 0, 0)
    with pytest.raises(UsageError, match="a probe or a commit, not both"):
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0, probe=True,
                                          commit=CommitPass())
    assert cache.global_end == 0 and not cache.store.segments
    with pytest.raises(UsageError, match="next_tokens must be a positive int"):
        CommitPass(next_tokens=0)
