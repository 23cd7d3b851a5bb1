"""QVGPackedCausalKVCache: packing policy, codec oracle, pins on packed chunks, streaming attention.

Oracles used here:
- positions: the dense cache (itself proven against the token-position oracle);
- packed values: the codec's own round trip ``dequantize(quantize(chunk))`` of exactly the
  chunk that was written (the cache must add no error of its own and pack each chunk once);
- bytes: the sum of what each segment stores, and the bits-per-element formula of docs/design.md.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from causalkv.caches import CacheWriteError, CausalCacheSpec, DenseCausalKVCache
from causalkv.caches import attention as attn
from causalkv.caches.codecs.prq import format as prq_format
from causalkv.caches.codecs.prq import quantizer
from causalkv.caches.codecs.prq.centroids import centroids_for
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.segments import PackedKV, PackingReport

N = 16  # tokens per chunk
D = 32
H = 2


def spec(**kw) -> CausalCacheSpec:
    base = dict(batch_size=1, num_heads=H, head_dim=D, cache_size=6 * N, sink_tokens=N,
                global_sink_tokens=N, dtype=torch.bfloat16)
    base.update(kw)
    return CausalCacheSpec(**base)


def quant(**kw) -> QVGKVQuantArgs:
    base = dict(codec="int2", centroids=8, block_size=16)
    base.update(kw)
    return QVGKVQuantArgs(**base).validate()


def chunk(i: int, n: int = N, heads: int = H, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    k = torch.randn(1, n, heads, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, n, heads, D, generator=g).to(torch.bfloat16)
    return k, v


def roundtrip(x: torch.Tensor, q: QVGKVQuantArgs) -> torch.Tensor:
    """The codec oracle for a chunk ``[B, n, H, D]`` packed alone, with the centroids the
    cache's rule gives its ``n`` tokens (`test_centroid_rule` pins the rule's values)."""
    q = replace(q, centroids=centroids_for(x.shape[1], q.centroids))
    return quantizer.dequantize(quantizer.quantize(x.permute(0, 2, 1, 3), q, seed=1234)).permute(0, 2, 1, 3)


def write(cache, i: int, n: int = N, **kw):
    k, v = chunk(i, n)
    return cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n, **kw)


def test_bad_quant_settings_fail_at_construction():
    with pytest.raises(ValueError, match=r"block-size 48 does not divide head_dim=32; choose one of"):
        QVGPackedCausalKVCache(spec(), quant(block_size=48))
    with pytest.raises(ValueError, match="256"):
        QVGPackedCausalKVCache(spec(), QVGKVQuantArgs(codec="int2", centroids=300))
    with pytest.raises(ValueError, match="unknown KV codec 'int3'"):
        QVGPackedCausalKVCache(spec(), QVGKVQuantArgs(codec="int3"))


def test_capabilities_cover_the_dense_features_and_qvg():
    caps = QVGPackedCausalKVCache.capabilities
    assert caps.covers(DenseCausalKVCache.capabilities.features)
    assert "quant:qvg" in caps and "quant:qvg" not in DenseCausalKVCache.capabilities


def test_packing_policy_and_codec_oracle(monkeypatch):
    calls = []
    real = quantizer.quantize
    q = quant(keep_recent_chunks=1)
    cache = QVGPackedCausalKVCache(spec(), q)  # first, its codec's conformance probe uncounted
    monkeypatch.setattr(quantizer, "quantize", lambda x, a, **kw: calls.append(x.shape) or real(x, a, **kw))
    dense = DenseCausalKVCache(spec())
    for i in range(10):
        view = write(cache, i)
        ref = write(dense, i)
        assert view.position_ranges == ref.position_ranges
    # window of 6 chunks: the sink chunk 0 and chunks 5..7 packed (sink=True quantizes the sink
    # too, as the reference does), 8 (recent) and 9 (current) dense
    layout = [(s.start // N, s.packed) for s in cache.segments]
    assert layout == [(0, True), (5, True), (6, True), (7, True), (8, False), (9, False)]
    # chunks 0..7 were each packed exactly once (K and V per call); 1..4 rolled out since
    assert cache.quantize_calls == 8
    assert len(calls) == 16
    # packed values are the codec's round trip of exactly what was written; dense ones exact
    k_view = view.k
    for idx, (a, b) in enumerate([(0, N), (5 * N, 6 * N), (8 * N, 9 * N), (9 * N, 10 * N)]):
        sl = slice(*[view.positions.tolist().index(p) for p in (a, b - 1)])
        got = k_view[:, sl.start : sl.stop + 1]
        want = chunk(a // N)[0]
        if idx <= 1:
            want = roundtrip(want, q)
        assert torch.equal(got, want), (a, b)


def test_resident_bytes_exact_and_flat():
    q = quant()
    cache = QVGPackedCausalKVCache(spec(), q)
    sizes = []
    for i in range(14):
        write(cache, i)
        expect = 0
        for s in cache.segments:
            if isinstance(s.storage, PackedKV):
                expect += s.storage.k.nbytes + s.storage.v.nbytes
            else:
                expect += 2 * (s.end - s.start) * H * D * 2
        assert cache.resident_nbytes() == expect
        sizes.append(cache.resident_nbytes())
    assert len(set(sizes[6:])) == 1  # window full: constant from then on
    dense_bytes = DenseCausalKVCache(spec()).resident_nbytes()
    assert sizes[-1] < dense_bytes


def test_pin_on_packed_chunk_stays_packed_and_is_retained():
    q = quant(keep_recent_chunks=0)
    s = spec(sink_tokens=N, global_sink_tokens=N // 2, cache_size=5 * N)
    cache = QVGPackedCausalKVCache(s, q)
    dense = DenseCausalKVCache(s)
    for i in range(3):
        write(cache, i)
        write(dense, i)
    assert cache.segments[1].packed  # chunk 1 is cold and keep_recent=0
    calls = cache.quantize_calls
    # pin the start of the previous (packed) chunk: the last 2N tokens begin at chunk 1
    cache.pin_current_chunk(2 * N)
    dense.pin_current_chunk(2 * N)
    for i in range(3, 12):
        view = write(cache, i)
        ref = write(dense, i)
        assert view.position_ranges == ref.position_ranges
    assert (N, 2 * N) in [r for r in view.position_ranges] or any(
        a <= N and b >= 2 * N for a, b in view.position_ranges
    )
    pinned = [seg for seg in cache.segments if seg.start == N]
    assert len(pinned) == 1 and pinned[0].packed
    assert cache.quantize_calls == calls + 9  # chunks 2..10 packed once each, chunk 1 never again
    # the pinned packed values are still the codec round trip of chunk 1
    pos = view.positions.tolist()
    got = view.k[:, pos.index(N) : pos.index(N) + N]
    assert torch.equal(got, roundtrip(chunk(1)[0], q))


@pytest.mark.parametrize("sink", [False, True])
def test_pin_shorter_than_chunk(sink):
    """sink=False: the pinned chunk stays bf16 while pinned; sink=True: it is packed when cold.

    Either way only the pinned half chunk is retained once the window moved on, and a later
    pin releases it so it rolls out.
    """
    q = quant(keep_recent_chunks=0, sink=sink)
    s = spec(sink_tokens=N // 2, global_sink_tokens=N // 4, cache_size=4 * N)
    cache = QVGPackedCausalKVCache(s, q)
    dense = DenseCausalKVCache(s)
    for i in range(2):
        write(cache, i)
        write(dense, i)
    cache.pin_current_chunk(N)
    dense.pin_current_chunk(N)
    for i in range(2, 9):
        view = write(cache, i)
        assert view.position_ranges == write(dense, i).position_ranges
    assert (N, N + N // 2) in view.position_ranges
    held = [(seg.start, seg.end, seg.packed) for seg in cache.segments if seg.start < 2 * N]
    pos = view.positions.tolist()
    got = view.k[:, pos.index(N) : pos.index(N) + N // 2]
    if sink:
        assert (N, 2 * N, True) in held  # packed whole, kept until all of it rolled out
        assert torch.equal(got, roundtrip(chunk(1)[0], q)[:, : N // 2])
    else:
        assert (N, N + N // 2, False) in held  # dense, trimmed to the pinned tokens
        assert torch.equal(got, chunk(1)[0][:, : N // 2])
    cache.pin_current_chunk(N)  # pin chunk 8: chunk 1's half is released and rolls out
    dense.pin_current_chunk(N)
    view = write(cache, 9)
    assert view.position_ranges == write(dense, 9).position_ranges
    assert all(seg.end <= N or seg.start >= 2 * N for seg in cache.segments)  # chunk 1 freed


def test_sink_span_full_and_sink_keep_chunks():
    s = spec(sink_tokens=2 * N, global_sink_tokens=2 * N, cache_size=8 * N)
    full = QVGPackedCausalKVCache(s, quant(keep_recent_chunks=0, sink_span="full"))
    keep = QVGPackedCausalKVCache(s, quant(keep_recent_chunks=0, sink_keep_chunks=1))
    write(full, 0)
    write(full, 1)
    assert full.quantize_calls == 0  # chunk 0 waits for the rest of the sink
    write(full, 2)
    assert [(g.start, g.end) for g in full.packed_segments()] == [(0, 2 * N)]
    assert full.quantize_calls == 1
    for i in range(6):
        write(keep, i)
    layout = [(g.start // N, g.packed) for g in keep.segments]
    assert layout == [(0, False), (1, True), (2, True), (3, True), (4, True), (5, False)]


def test_head_slice_ranks_on_packed_cache():
    q = quant()
    full = QVGPackedCausalKVCache(spec(), q)
    split = QVGPackedCausalKVCache(spec(), q)
    for i in range(9):
        k, v = chunk(i)
        full.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
        va = split.update_and_get_attention_kv(
            key=k[:, :, :1], value=v[:, :, :1], current_chunk_start=i * N, cache_head_start=0)
        vb = split.update_and_get_attention_kv(
            key=k[:, :, 1:], value=v[:, :, 1:], current_chunk_start=i * N, cache_head_start=1)
    ref = full.get_attention_kv()
    assert va.k.shape[2] == 1 and vb.k.shape[2] == 1
    assert torch.equal(torch.cat([va.k, vb.k], dim=2), ref.k)
    assert torch.equal(torch.cat([va.v, vb.v], dim=2), ref.v)


def test_streaming_attention_matches_dense_and_holds_one_segment():
    q = quant(codec="int4")
    cache = QVGPackedCausalKVCache(spec(), q)
    for i in range(9):
        view = write(cache, i)
    assert not view.is_materialized
    query = torch.randn(1, N, H, D).to(torch.bfloat16)
    cache.peak_transient_nbytes = 0
    out = attn.attend(query, view)
    assert not view.is_materialized
    one_segment = 2 * N * H * D * 2
    assert cache.peak_transient_nbytes == one_segment
    ref = attn.attend_dense(query.float(), view.k.float(), view.v.float())
    assert view.is_materialized
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_streaming_attention_stats_bound_the_transient_memory():
    cache = QVGPackedCausalKVCache(spec(), quant(codec="int4"))
    for i in range(9):
        view = write(cache, i)
    stats = attn.AttendStats()
    query = torch.randn(1, 2, H, D).to(torch.bfloat16)  # few queries: the decode-like case
    out = attn.attend(query, view, stats=stats)
    one_segment = 2 * N * H * D * 2
    assert stats.segments == len(cache.segments) == 6
    assert stats.peak_segment_nbytes == one_segment
    # segment K+V, plus the block's output in bf16 and fp32 (2 x 2 x H x D x 6 B) and its
    # log-sum-exp and merge weights (5 x 2 x H x 4 B)
    assert stats.peak_transient_nbytes == one_segment + 2 * H * D * 6 + 5 * 2 * H * 4
    assert stats.peak_transient_nbytes <= 1.25 * one_segment
    ref = attn.attend_dense(query.float(), view.k.float(), view.v.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_offload_roundtrip_equal():
    q = quant()
    a = QVGPackedCausalKVCache(spec(), q)
    b = QVGPackedCausalKVCache(spec(), q, offload=True)
    for i in range(8):
        va, vb = write(a, i), write(b, i)
    assert torch.equal(va.k, vb.k) and torch.equal(va.v, vb.v)
    assert all(seg.storage.device.type == "cpu" for seg in b.packed_segments())


def test_a_non_finite_chunk_stays_dense_and_a_refused_write_changes_nothing():
    q = quant(keep_recent_chunks=0)
    cache = QVGPackedCausalKVCache(spec(), q)
    write(cache, 0)
    k, v = chunk(1)
    k[0, 3, 0, 5] = float("nan")
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=N)
    k2, v2 = chunk(2)
    view = cache.update_and_get_attention_kv(key=k2, value=v2, current_chunk_start=2 * N)
    assert cache.packing_report().chunks_dense.get("non-finite") == 1
    at = int((view.positions == N).nonzero())
    torch.testing.assert_close(view.k[:, at : at + N], k, equal_nan=True, rtol=0, atol=0)
    before = (cache.state, list(cache.segments), cache.quantize_calls)
    with pytest.raises(CacheWriteError):
        cache.update_and_get_attention_kv(key=k2, value=v2, current_chunk_start=5 * N)
    assert (cache.state, cache.segments, cache.quantize_calls) == before


def test_codebook_chunks_share_centroids_and_count_them_once():
    q = quant(keep_recent_chunks=0, codebook_chunks=3)
    s = spec(sink_tokens=0, global_sink_tokens=0, cache_size=8 * N)
    cache = QVGPackedCausalKVCache(s, q)
    for i in range(7):
        view = write(cache, i)
    packed = cache.packed_segments()
    assert [g.start // N for g in packed] == [0, 1, 2, 3, 4, 5]
    books = [g.storage.k.centroids[0] for g in packed]
    assert books[0] is books[1] is books[2] and books[3] is books[4] is books[5]
    assert books[2] is not books[3]
    # oracle: chunk 1 is the codec's round trip with chunk 0's codebook, stored once
    want = quantizer.dequantize(quantizer.quantize(
        chunk(1)[0].permute(0, 2, 1, 3), q, codebooks=packed[0].storage.k.centroids)).permute(0, 2, 1, 3)
    pos = view.positions.tolist()
    assert torch.equal(view.k[:, pos.index(N) : pos.index(N) + N], want)
    per_book = sum(c.nbytes for c in packed[0].storage.k.centroids + packed[0].storage.v.centroids)
    dense_bytes = 2 * N * H * D * 2
    stored = sum(g.storage.nbytes for g in packed)
    assert cache.resident_nbytes() == dense_bytes + stored - 4 * per_book  # 2 books, 6 users


def test_codebooks_argument_validated():
    q = quant()
    x = chunk(0)[0].permute(0, 2, 1, 3)
    with pytest.raises(ValueError, match="codebooks must be 1 bf16"):
        quantizer.quantize(x, q, codebooks=[torch.zeros(1, H, 4, D)])


@pytest.mark.parametrize("fused", [True, False])
def test_partial_attention_paths_return_output_and_logsumexp(fused):
    """Both per-segment paths (CPU flash kernel, fp32 fallback used off the CPU) against fp64."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, H, n, D, generator=g).to(torch.bfloat16) for n in (8, 40, 40))
    out, lse, _ = attn._step(q, k, v, D**-0.5, kind="cpu" if fused else "fallback")
    s = (q.double() @ k.double().transpose(-1, -2)) * D**-0.5
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-2, rtol=1e-3)
    ref = torch.softmax(s, -1) @ v.double()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


# ---- never worse than bf16, the centroid rule and the packing report --------------------------
def test_centroid_rule_values_and_half_bit_budget():
    # largest power of two <= tokens // 32, capped by the setting, at least 1
    assert centroids_for(4680, 128) == 128  # LingBot-World chunk: the reference value
    assert centroids_for(7040, 128) == 128  # LongLive 2.0 chunk (880 x 8)
    assert centroids_for(4096, 128) == 128 and centroids_for(4095, 128) == 64
    assert centroids_for(880, 128) == 16
    assert centroids_for(48, 128) == 1 and centroids_for(1, 128) == 1
    assert centroids_for(4680, 96) == 96  # an explicit smaller setting is kept
    assert centroids_for(48, 128, min_tokens_per_centroid=1) == 32
    for s in range(32, 10_000, 7):  # the centroids never cost more than 0.5 bit per element
        assert 16 * centroids_for(s, 256) / s <= 0.5


# The tiny presets' geometries (2 heads x 64, 16 tokens per frame): frames per chunk, sink and
# global sink frames, window frames, pin every N chunks (LongLive 2.0 multi-shot).
PRESET_GEOMETRIES = {
    "tiny-wan": (3, 0, 0, 9, 0),
    "tiny-longlive": (3, 3, 3, 9, 0),
    "tiny-longlive2": (2, 2, 2, 8, 2),
    "tiny-lingbot": (3, 3, 3, 12, 0),
}


def _preset_stream(name: str, make, chunks: int = 6) -> tuple[int, object]:
    fpc, sink, gsink, window, pin_every = PRESET_GEOMETRIES[name]
    tpf, n = 16, 16 * fpc
    s = CausalCacheSpec(batch_size=1, num_heads=2, head_dim=64, cache_size=window * tpf,
                    sink_tokens=sink * tpf, global_sink_tokens=gsink * tpf,
                    attention_window_size=window * tpf, dtype=torch.bfloat16)
    cache = make(s)
    peak = 0
    g = torch.Generator().manual_seed(3)
    for i in range(chunks):
        k, v = (torch.randn(1, n, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
        if pin_every and i % pin_every == 0 and i > 0:
            cache.pin_current_chunk(n)
        peak = max(peak, cache.resident_nbytes())
    return peak, cache


@pytest.mark.parametrize("name", sorted(PRESET_GEOMETRIES))
def test_preset_geometries_int2_below_int4_below_bf16(name):
    off, _ = _preset_stream(name, DenseCausalKVCache)
    int4, c4 = _preset_stream(name, lambda s: QVGPackedCausalKVCache(s, QVGKVQuantArgs(codec="int4")))
    int2, c2 = _preset_stream(name, lambda s: QVGPackedCausalKVCache(s, QVGKVQuantArgs(codec="int2")))
    assert int2 < int4 < off, (int2, int4, off)
    for cache in (c2, c4):
        report = cache.packing_report()
        assert report.chunks_packed >= 1
        assert report.chunks_packed + report.chunks_kept_dense == 5  # every completed chunk
        assert "not smaller than dense" not in report.chunks_dense
        assert set(report.centroids) == {1}  # 32 or 48 tokens: one centroid per head


def test_chunk_whose_packed_form_is_not_smaller_stays_dense(monkeypatch):
    calls = []
    real = quantizer.quantize
    q = quant(keep_recent_chunks=0)
    # one-token chunks: the centroid alone is 16 bits per element, so packed > bf16 ...
    assert prq_format.packed_nbytes_formula((1, H, 1, D), q) >= 1 * H * 1 * D * 2
    cache = QVGPackedCausalKVCache(spec(), q)  # first, its codec's conformance probe uncounted
    monkeypatch.setattr(quantizer, "quantize", lambda x, a, **kw: calls.append(1) or real(x, a, **kw))
    dense = DenseCausalKVCache(spec())
    for i in range(8):
        view = write(cache, i, n=1)
        assert torch.equal(view.k, write(dense, i, n=1).k)  # stored exactly
    assert calls == [] and cache.quantize_calls == 0  # decided by formula, no quantize wasted
    assert not cache.packed_segments()
    report = cache.packing_report()
    assert report.chunks_packed == 0 and report.chunks_dense == {"not smaller than dense": 7}
    # ... but smaller than float32 (32 bits per element): packed there
    f32 = QVGPackedCausalKVCache(spec(dtype=torch.float32), q)
    for i in range(3):
        k, v = chunk(i, 1)
        f32.update_and_get_attention_kv(key=k.float(), value=v.float(), current_chunk_start=i)
    assert f32.packing_report().chunks_packed == 2


def test_reference_centroids_on_tiny_chunks_would_cost_more_than_bf16():
    """Without the rule (as many centroids as the 32-token chunk has tokens, as the seed runtime
    did with 128 centroids) packing would store more than bf16: such chunks stay dense, so the
    cache is never worse than bf16."""
    def make(s):
        return QVGPackedCausalKVCache(s, QVGKVQuantArgs(codec="int2"), min_tokens_per_centroid=1)

    assert prq_format.packed_nbytes_formula((1, 2, 32, 64), QVGKVQuantArgs(codec="int2")) > 32 * 2 * 64 * 2
    peak, cache = _preset_stream("tiny-longlive2", make)
    off, _ = _preset_stream("tiny-longlive2", DenseCausalKVCache)
    assert cache.quantize_calls == 0
    assert cache.packing_report().chunks_dense == {"not smaller than dense": 4, "recent": 1}
    assert peak <= off
    with pytest.raises(ValueError, match="min_tokens_per_centroid"):
        QVGPackedCausalKVCache(spec(), quant(), min_tokens_per_centroid=0)


def test_packing_report_counts_every_chunk_with_its_reason():
    cache = QVGPackedCausalKVCache(spec(), quant(keep_recent_chunks=1, sink_keep_chunks=1))
    for i in range(10):
        write(cache, i)
    # window of 6 chunks: 0 sink_keep, 5..7 packed, 8 recent, 9 current; 1..4 were packed
    # and rolled out
    report = cache.packing_report()
    assert report.chunks_packed == 7 and report.quantize_calls == 7
    assert report.chunks_dense == {"recent": 1, "sink_keep": 1}
    assert report.centroids == {1: 7}  # 16 tokens: one centroid
    off = QVGPackedCausalKVCache(spec())
    nosink = QVGPackedCausalKVCache(spec(), quant(keep_recent_chunks=0, sink=False))
    span = QVGPackedCausalKVCache(spec(sink_tokens=0, global_sink_tokens=0),
                                  quant(keep_recent_chunks=0, span_chunks=2))
    for i in range(5):
        for c in (off, nosink, span):
            write(c, i)
    assert off.packing_report().chunks_dense == {"quant off": 4}
    assert nosink.packing_report().chunks_dense == {"sink": 1}
    assert span.packing_report().chunks_packed == 4
    write(span, 5)
    assert span.packing_report().chunks_dense == {"waiting for span": 1}
    merged = PackingReport.merge([cache.packing_report(), off.packing_report()])
    assert merged.chunks_packed == 7 and merged.chunks_dense == {
        "quant off": 4, "recent": 1, "sink_keep": 1}
    assert merged.to_dict()["chunks_kept_dense"] == 6
    cache.reset_indices()  # counts survive a reset: the dropped chunks keep their last storage
    assert cache.packing_report() == report
