"""The QVG segment store both hosts use, and its packing policy objects.

Oracles: the codec's own round trip of exactly the tensor a segment was packed from (the
store must add no error of its own); positions by construction (what each test wrote where);
peak memory from torch's profiler (every allocation and free the store makes while it runs).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from causalkv.caches import CausalCacheSpec
from causalkv.caches.codecs.prq import quantizer
from causalkv.caches.codecs.prq.centroids import centroids_for
from causalkv.caches.positions import HeldPositions
from causalkv.caches.qvg import (
    RECENT_CHUNKS,
    RECENT_NON_SINK,
    ChunkInfo,
    KVWrite,
    PackingDecision,
    PackingPolicy,
    QVGKVQuantArgs,
    SegmentStore,
)
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.policy import resolve_policy
from causalkv.errors import ConfigError

H, D, N = 2, 64, 256


def _held(held) -> HeldPositions:
    return HeldPositions(held, 0, ())
Q = QVGKVQuantArgs(codec="int2", centroids=8, block_size=16, keep_recent_chunks=0)


def _kv(i: int, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return tuple(torch.randn(1, n, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _store(q: QVGKVQuantArgs = Q, **kw) -> SegmentStore:
    return SegmentStore(batch_size=1, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                        device="cpu", quant=q, **kw)


def _stream(store: SegmentStore, chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    written = []
    for c in range(chunks):
        k, v = _kv(c)
        plan = store.plan(KVWrite(c * N, (c + 1) * N, (0, H), k, v), _held(((0, (c + 1) * N),)),
                          advance=True)
        store.commit(plan)
        written.append((k, v))
    return written


def _roundtrip(x: torch.Tensor, q: QVGKVQuantArgs) -> torch.Tensor:
    """The codec oracle: ``x [B, n, H, D]`` packed alone with the store's centroid rule."""
    q = replace(q, centroids=centroids_for(x.shape[1], q.centroids))
    return quantizer.dequantize(quantizer.quantize(x.permute(0, 2, 1, 3), q)).permute(0, 2, 1, 3)


def _peak(fn):
    """(peak bytes allocated above the start while ``fn`` ran, its result)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                    key=lambda e: e.time_range.start)
    run = top = 0
    for e in events:
        run += e.self_cpu_memory_usage
        top = max(top, run)
    return top, out


def test_both_hosts_hold_their_kv_in_the_one_store():
    cache = QVGPackedCausalKVCache(CausalCacheSpec(1, H, D, 4 * N), Q)
    assert type(cache.store) is SegmentStore and cache.store.policy is RECENT_CHUNKS
    assert QVGPackedCausalKVCache(CausalCacheSpec(1, H, D, 4 * N), Q, policy=RECENT_NON_SINK).store.policy is RECENT_NON_SINK


def test_gather_decodes_into_one_buffer_with_no_temporary_and_no_cat(monkeypatch):
    store = _store()
    written = _stream(store, 4)
    assert [(s.start // N, s.packed) for s in store.segments] == [
        (0, True), (1, True), (2, True), (3, False)]
    # a packed chunk from its middle, a zero run, all of two packed chunks and the dense one
    pieces = [(N + 7, 100), (None, 5), (0, 2 * N), (3 * N, N)]
    want_k = torch.cat([
        _roundtrip(written[1][0], Q)[:, 7:107], torch.zeros(1, 5, H, D, dtype=torch.bfloat16),
        _roundtrip(written[0][0], Q), _roundtrip(written[1][0], Q), written[3][0]], dim=1)
    store.gather(pieces, 0, H)  # the codec's reusable CPU workspace is sized once
    outs = []
    real = quantizer.dequantize

    def recording(packed, **kw):
        assert kw.get("out") is not None, "decoded into a temporary"
        outs.append(kw["out"])
        return real(packed, **kw)

    def no_cat(*a, **kw):
        raise AssertionError("torch.cat in a view")

    monkeypatch.setattr(quantizer, "dequantize", recording)
    monkeypatch.setattr(torch, "cat", no_cat)
    peak, (k, v) = _peak(lambda: store.gather(pieces, 0, H))
    monkeypatch.undo()
    assert torch.equal(k, want_k)
    base = k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()
    assert len(outs) == 6 and all(o.untyped_storage().data_ptr() in base for o in outs)
    # the buffer itself plus the codec's small per-call tables; one chunk decoded into a
    # temporary would add 2 * N * H * D * 2 = 131,072 bytes
    assert k.nbytes + v.nbytes <= peak <= k.nbytes + v.nbytes + 16_384
    assert store.peak_transient_nbytes == k.nbytes + v.nbytes


def test_decode_of_one_segment_and_head_slices():
    store = _store()
    written = _stream(store, 3)
    seg = store.segments[1]
    k, v = store.gather([(N + 3, 17)], 1, 2, [seg])
    full = _roundtrip(written[1][1], Q)[:, :, 1:2]
    assert torch.equal(v, full[:, 3:20])
    dk, _ = store.gather([(2 * N, N)], 0, H, [store.segments[2]])  # dense: views, no copy
    assert dk.data_ptr() == store.segments[2].storage.k.data_ptr()


def test_a_write_into_a_packed_chunk_unpacks_it_and_a_patched_chunk_packs_as_written():
    """A write into part of a packed chunk decodes it (its other rows carry the codec's error
    once) and keeps it dense from then on: packing it again would add a second error past
    the codec's bound. A chunk written whole packs again, from exactly the new values."""
    store = _store()
    written = _stream(store, 3)  # chunks 0, 1 packed; 2 current
    assert store.segments[1].packed
    k, v = _kv(9, 10)
    # a rewrite inside packed chunk 1 (sglang's dense cache accepts in-window rewrites)
    plan = store.plan(KVWrite(N + 5, N + 15, (0, H), k, v), _held(((0, 3 * N),)),
                      advance=False)
    store.commit(plan)
    seg = store.segments[1]
    assert not seg.packed and store.quantize_calls == 2
    want = _roundtrip(written[1][0], Q).clone()
    want[:, 5:15] = k
    assert torch.equal(seg.storage.k, want)
    # an advance overlapping chunk 2's tail: chunk 2 goes cold with the write applied, and
    # is packed from exactly those values (keep_recent=0); chunk 1 stays dense as it is
    k2, v2 = _kv(10, N)
    plan = store.plan(KVWrite(3 * N - N // 2, 3 * N + N // 2, (0, H), k2, v2), _held(((0, 3 * N + N // 2),)),
                      advance=True)
    before = [s.storage for s in store.segments]
    store.commit(plan)
    patched = written[2][0].clone()
    patched[:, N // 2 :] = k2[:, : N // 2]
    chunk2 = next(s for s in store.segments if s.start == 2 * N)
    assert chunk2.packed
    got = quantizer.dequantize(chunk2.storage.k).permute(0, 2, 1, 3)
    assert torch.equal(got, _roundtrip(patched, Q))
    assert before[2].k.equal(written[2][0])  # the planned-from storage was not written
    current = store.segments[-1]
    assert (current.start, current.end) == (3 * N, 3 * N + N // 2)
    assert torch.equal(current.storage.k, k2[:, N // 2 :])
    chunk1 = next(s for s in store.segments if s.start == N)
    assert not chunk1.packed and torch.equal(chunk1.storage.k, want)
    assert store.packing_report().chunks_dense == {"rewritten in part": 1}
    # chunk 1 written whole (every position and head): nothing decoded, packed as written
    k3, v3 = _kv(11, N)
    store.commit(store.plan(KVWrite(N, 2 * N, (0, H), k3, v3), _held(((0, 3 * N + N // 2),)),
                            advance=False))
    k4, v4 = _kv(12, N // 2)
    store.commit(store.plan(KVWrite(3 * N + N // 2, 4 * N, (0, H), k4, v4), _held(((0, 4 * N),)),
                            advance=True))
    chunk1 = next(s for s in store.segments if s.start == N)
    assert chunk1.packed
    got = quantizer.dequantize(chunk1.storage.k).permute(0, 2, 1, 3)
    assert torch.equal(got, _roundtrip(k3, Q))


def test_a_non_finite_chunk_stays_dense_as_written_and_the_stream_goes_on():
    """The codec cannot pack NaN/inf (on the CPU it refuses them): the chunk is kept dense,
    exactly as written (the dense cache's answer), the report says why, and every later
    advance packs the other chunks as before (the stream is never stuck)."""
    store = _store()
    _stream(store, 2)
    k, v = _kv(5)
    k[0, 3, 1, 7] = float("nan")
    store.commit(store.plan(KVWrite(2 * N, 3 * N, (0, H), k, v), _held(((0, 3 * N),)),
                            advance=True))
    snapshot = (list(store.segments), store.current, store.quantize_calls, store.packing_report())
    for c in (3, 4):
        k2, v2 = _kv(c + 3)
        plan = store.plan(KVWrite(c * N, (c + 1) * N, (0, H), k2, v2), _held(((0, (c + 1) * N),)),
                          advance=True)
        if c == 3:  # planning changed nothing
            assert (list(store.segments), store.current, store.quantize_calls,
                    store.packing_report()) == snapshot
        store.commit(plan)
    chunk2 = next(s for s in store.segments if s.start == 2 * N)
    assert not chunk2.packed
    torch.testing.assert_close(chunk2.storage.k, k, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(chunk2.storage.v, v)
    chunk3 = next(s for s in store.segments if s.start == 3 * N)
    assert chunk3.packed  # packed at the advance to chunk 4, next to the dense NaN chunk
    assert store.packing_report().chunks_dense.get("non-finite") == 1


def test_gather_of_positions_not_held_is_a_bug_not_zeros():
    store = _store()
    _stream(store, 2)
    with pytest.raises(RuntimeError, match=r"positions \[512, 600\) are not held"):
        store.gather([(N, 2 * N - N + 88)], 0, H)


# ---- policy objects ---------------------------------------------------------------------
CHUNKS = (ChunkInfo(0, 0, N, sink=True), ChunkInfo(1, N, 2 * N), ChunkInfo(2, 2 * N, 3 * N, pinned=True),
          ChunkInfo(3, 3 * N, 4 * N))


@pytest.mark.parametrize(
    ("policy", "quant", "dense"),
    [
        (RECENT_CHUNKS, QVGKVQuantArgs(codec="int2", keep_recent_chunks=1), {3: "recent"}),
        (RECENT_CHUNKS, QVGKVQuantArgs(codec="int2", keep_recent_chunks=1, sink=False),
         {0: "sink", 2: "sink", 3: "recent"}),
        (RECENT_CHUNKS, QVGKVQuantArgs(codec="int2", keep_recent_chunks=2, sink_keep_chunks=1),
         {0: "sink_keep", 2: "recent", 3: "recent"}),
        # sglang: sink chunks (the pinned one included) do not count as recent ...
        (RECENT_NON_SINK, QVGKVQuantArgs(codec="int2", keep_recent_chunks=2), {1: "recent", 3: "recent"}),
        # ... and with sink=0 stay bf16: the stream-start sink and the pinned shot sink
        (RECENT_NON_SINK, QVGKVQuantArgs(codec="int2", keep_recent_chunks=1, sink=False),
         {0: "sink", 2: "sink", 3: "recent"}),
        (RECENT_NON_SINK, QVGKVQuantArgs(codec="int2", keep_recent_chunks=0, sink_keep_chunks=1),
         {0: "sink_keep"}),
    ],
)
def test_policy_decisions(policy, quant, dense):
    got = policy.decide(quant, CHUNKS, 4, sink_open=False, chunk_tokens=N)
    assert dict(got.dense) == dense and got.groups == ()


def test_causalkv_full_sink_span_groups_wait_while_the_sink_is_open():
    q = QVGKVQuantArgs(codec="int2", keep_recent_chunks=0, sink_span="full")
    closed = RECENT_CHUNKS.decide(q, CHUNKS, 4, sink_open=False, chunk_tokens=N)
    assert closed.groups == (frozenset({0}), frozenset({2}))
    assert RECENT_CHUNKS.decide(q, CHUNKS, 4, sink_open=True, chunk_tokens=N).groups[0] == {0, 4}


class _KeepEverything(PackingPolicy):
    name = "keep-everything"

    def decide(self, quant, chunks, current, *, sink_open, chunk_tokens):
        return PackingDecision({c.index: "policy" for c in chunks})


def test_a_host_passes_any_policy_object_and_names_are_spellings():
    cache = QVGPackedCausalKVCache(CausalCacheSpec(1, H, D, 4 * N), Q, policy=_KeepEverything())
    for i in range(4):
        k, v = _kv(i)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
    assert cache.quantize_calls == 0 and cache.packing_report().chunks_dense == {"policy": 3}
    assert resolve_policy("recent-non-sink") is RECENT_NON_SINK and resolve_policy("recent-chunks") is RECENT_CHUNKS
    with pytest.raises(ConfigError, match=r"one of \['recent-chunks', 'recent-non-sink'\], got 'qvg'"):
        resolve_policy("qvg")
    with pytest.raises(ConfigError, match="must be a PackingPolicy"):
        _store(policy="recent-non-sink")


def test_a_lazy_view_reads_the_layout_it_was_made_from():
    spec = CausalCacheSpec(1, H, D, 3 * N)
    a, b = QVGPackedCausalKVCache(spec, Q), QVGPackedCausalKVCache(spec, Q)
    for i in range(3):
        k, v = _kv(i)
        a.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
        held = b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
    assert not held.is_materialized  # packed chunks visible: built on first access
    want = a.get_attention_kv().k
    for i in range(3, 6):  # chunks 0..2 roll out of b
        k, v = _kv(i)
        b.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
    assert torch.equal(held.k, want)


def test_a_recency_tier_chunk_the_cache_codec_would_not_shrink_stays_at_its_tier():
    """int2 with 128 centroids as given (the bridge's store) does not shrink a 32-token chunk,
    fp8 does: the newest completed chunk is held at fp8, and once it leaves recency it stays
    at fp8 (decoding it to bf16 would hold more bytes of the same values); the tier policy
    says so without tensors, and nothing is decoded."""
    n = 32
    q = QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=1, recent_tier="fp8")
    store = _store(q, min_tokens_per_centroid=None)
    assert not store.tiering.pays(n, 1, None) and store.tiering.pays(n, 1, None, store.tiering.tier_quant(n))
    for c in range(4):
        k, v = _kv(c, n)
        store.commit(store.plan(KVWrite(c * n, (c + 1) * n, (0, H), k, v), _held(((0, (c + 1) * n),)),
                                advance=True))
    tiers = [seg.storage.codec.name if seg.packed else "bf16" for seg in store.segments]
    assert tiers == ["fp8", "fp8", "fp8", "bf16"]  # two left recency, the recent one, current
    assert store.quantize_calls == 3  # chunks 0 to 2 once each, at the tier, never again
    report = store.packing_report()
    assert report.chunks_packed == 3 and not report.chunks_dense


@pytest.mark.parametrize(("codec", "lines"), [("int2", 1), ("int4", 1), ("fp8", 0), ("nvfp4", 0)])
def test_the_run_header_names_only_the_codecs_own_parameters(codec: str, lines: int):
    """PRQ's centroid line is PRQ's: fp8 and nvfp4 have no k-means, so no centroids line."""
    got = QVGPackedCausalKVCache.describe_request(
        QVGKVQuantArgs(codec=codec), tokens_per_chunk=880, sink_tokens=880)
    assert len(got) == lines
    assert all(line.startswith("centroids: 16 per packed span of 880 tokens") for line in got)


def test_the_block_size_rule_is_the_codecs_own():
    """PRQ's block size must divide head_dim; fp8 and nvfp4 have their own layout rules, so a
    block size PRQ would refuse does not refuse them (`QVGKVQuantArgs.layout_problem`)."""
    def store(codec: str, head_dim: int) -> SegmentStore:
        return SegmentStore(batch_size=1, num_heads=H, head_dim=head_dim, dtype=torch.bfloat16,
                            device="cpu", quant=QVGKVQuantArgs(codec=codec, block_size=64))

    with pytest.raises(ConfigError, match="block-size 64 does not divide head_dim=48; choose"):
        store("int4", 48)
    assert store("fp8", 48).head_dim == 48
    assert store("nvfp4", 48).head_dim == 48
