"""The bridge's cache over causalkv's one segment store: plan-then-commit, sink handling, views.

- The bridge stores K/V in `causalkv.caches.qvg.store.SegmentStore` with the `RECENT_NON_SINK` policy
  object, the very class causalkv's own `QVGPackedCausalKVCache` uses.
- A write whose pack fails (NaN/inf in a cold chunk) raises and leaves everything as it was:
  sglang's cursors and their int twins, the slots, the pin, the stored segments.
- ``--kv-cache-quant-sink 0`` keeps LongLive 2.0's pinned shot sink bf16 while it is pinned,
  as causalkv's own cache does (the oracle: causalkv's cache on the same stream); with
  ``sink=1`` the pinned chunk is packed.
- A view is one buffer: packed ranges decoded into it, no ``torch.cat``.
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

from causalkv.caches import CausalCacheSpec
from causalkv.caches.codecs.prq import quantizer
from causalkv.caches.qvg import RECENT_NON_SINK, SegmentStore
from causalkv.caches.qvg import QVGKVQuantArgs as CausalKVQuant
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.spec import CacheWriteError
from causalkv.sglang.cache import SGLangQVGKVCache

H, D, N = 2, 32, 64  # 64-token chunks: one centroid per 32 tokens pays at int2


def _cache(quant, *, chunks=4, sink=N, global_sink=N):
    return SGLangQVGKVCache(
        batch_size=1, cache_size=chunks * N, num_heads=H, head_dim=D, dtype=torch.bfloat16,
        device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=True,
        sink_tokens=sink, attention_window_size=chunks * N, quant_args=quant,
        global_sink_tokens=global_sink,
    )


def _kv(i):
    g = torch.Generator().manual_seed(i)
    return tuple(torch.randn(1, N, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _chunk(cache, i, passes=2, kv=None):
    k, v = kv or _kv(i)
    for _ in range(passes):  # denoise steps, then the context update
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
    return view


def _snapshot(cache):
    return (int(cache.global_end_index.item()), int(cache.local_end_index.item()),
            cache.global_end_index_int, cache.local_end_index_int, cache.cache_size,
            cache.pinned_start, cache.pinned_len, list(cache._slots.runs), cache._heads,
            list(cache.store.segments), cache.store.current, cache.quantize_calls,
            cache.resident_nbytes())


def test_the_bridge_stores_in_causalkvs_segment_store_with_sglangs_policy():
    cache = _cache(QVGKVQuantArgs(bits=2, centroids=8, block_size=16))
    assert type(cache.store) is SegmentStore and cache.store.policy is RECENT_NON_SINK
    own = QVGPackedCausalKVCache(CausalCacheSpec(1, H, D, 4 * N), CausalKVQuant(codec="int2", block_size=16))
    assert type(own.store) is type(cache.store)


def test_a_non_finite_chunk_stays_dense_and_a_refused_write_changes_nothing():
    cache = _cache(QVGKVQuantArgs(bits=2, centroids=8, block_size=16, keep_recent_chunks=0))
    _chunk(cache, 0)
    k, v = _kv(1)
    k[0, 5, 1, 3] = float("nan")
    _chunk(cache, 1, kv=(k, v))
    cache.pin_current_chunk(N)
    k2, v2 = _kv(2)
    view = cache.update_and_get_attention_kv(key=k2, value=v2, current_chunk_start=2 * N)
    assert view.k.shape[1] == 3 * N and torch.isnan(view.k).sum() == 1  # as sglang's dense cache
    assert cache.store.packing_report().chunks_dense.get("non-finite") == 1
    before = _snapshot(cache)
    with pytest.raises(CacheWriteError, match="heads"):  # another head range than written
        cache.update_and_get_attention_kv(key=k2[:, :, :1].contiguous(), value=v2[:, :, :1].contiguous(),
                                          current_chunk_start=2 * N, cache_head_start=1)
    after = _snapshot(cache)
    assert after == before
    assert all(a is b for a, b in zip(after[9], before[9], strict=True))


def _pinned_chunk_storage(sink: int) -> tuple[list[bool], list[bool]]:
    """LongLive 2.0's layout (sink = global sink = one chunk, a 4-chunk window): chunk 2 is a
    scene cut, pinned after its passes; 6 more chunks. Per later chunk: is the segment
    holding chunk 2 packed, in the bridge and in causalkv's own cache?"""
    bridge = _cache(QVGKVQuantArgs(bits=2, centroids=8, block_size=16, sink=bool(sink)))
    own = QVGPackedCausalKVCache(
        CausalCacheSpec(1, H, D, 4 * N, sink_tokens=N, global_sink_tokens=N),
        CausalKVQuant(codec="int2", centroids=8, block_size=16, sink=bool(sink)))
    flags = ([], [])
    for i in range(9):
        k, v = _kv(i)
        for cache in (bridge, own):
            for _ in range(2):
                cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
            if i == 2:
                cache.pin_current_chunk(N)
        if i > 3:
            for j, segs in enumerate((bridge.store.segments, own.segments)):
                held = [s for s in segs if s.start <= 2 * N < s.end]
                assert len(held) == 1, f"chunk 2 not held after chunk {i}"
                flags[j].append(held[0].packed)
    return flags


def test_sink_0_keeps_the_pinned_shot_sink_bf16_as_causalkvs_cache_does():
    bridge, own = _pinned_chunk_storage(sink=0)
    assert own == [False] * 5  # the oracle: causalkv's own cache keeps it bf16
    assert bridge == own
    bridge, own = _pinned_chunk_storage(sink=1)
    assert all(bridge) and all(own)  # sink=1: the pinned chunk is packed like any sink chunk


def test_a_view_is_one_buffer_packed_ranges_decoded_into_it(monkeypatch):
    cache = _cache(QVGKVQuantArgs(bits=2, centroids=8, block_size=16, keep_recent_chunks=0))
    for i in range(4):
        _chunk(cache, i)
    assert cache.packed_chunks() == 3
    outs = []
    real = quantizer.dequantize

    def recording(packed, **kw):
        assert kw.get("out") is not None, "decoded into a temporary"
        outs.append(kw["out"])
        return real(packed, **kw)

    def no_cat(*a, **kw):
        raise AssertionError("torch.cat in a view")

    expected = _chunk(cache, 3, passes=1)
    monkeypatch.setattr(quantizer, "dequantize", recording)
    monkeypatch.setattr(torch, "cat", no_cat)
    view = _chunk(cache, 3, passes=1)
    monkeypatch.undo()
    assert torch.equal(view.k, expected.k) and torch.equal(view.v, expected.v)
    base = {view.k.untyped_storage().data_ptr(), view.v.untyped_storage().data_ptr()}
    assert len(outs) == 6 and {o.untyped_storage().data_ptr() for o in outs} == base


# ---- sglang's call patterns with packing on ------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from oracle import examples  # noqa: E402
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (  # noqa: E402
    CausalSelfAttentionKVCache,
)
from test_bridge_parity import _cursors, _state, streams  # noqa: E402

PACKING = QVGKVQuantArgs(bits=2, centroids=1, block_size=4, keep_recent_chunks=0)
PACKED = {"examples": 0, "quantize_calls": 0, "writes_into_packed": 0}


@settings(max_examples=examples(200))
@given(streams())
def test_packing_on_keeps_sglangs_positions_cursors_and_refusals(stream):
    """The parity streams (tests/sglang_bridge/test_bridge_parity.py) with int2 packing every
    cold chunk: cursors, index tensors, pins and every refusal still equal sglang's dense
    cache; views keep its shapes and stay finite; a failed write changes nothing."""
    cfg, ops, rnd = stream
    dt, d = torch.bfloat16, 4
    shape = (1, cfg["cache"], cfg["heads"], d)
    i0 = 0 if cfg["int_indices"] else None
    ref = CausalSelfAttentionKVCache(
        k=torch.zeros(shape, dtype=dt), v=torch.zeros(shape, dtype=dt),
        global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), global_end_index_int=i0,
        local_end_index_int=i0, cache_size=cfg["cache"], sink_tokens=cfg["sink"],
        attention_window_size=cfg["window"], allow_growth=cfg["growth"],
        global_sink_tokens=cfg["global_sink"])
    ours = SGLangQVGKVCache(
        batch_size=1, cache_size=cfg["cache"], num_heads=cfg["heads"], head_dim=d, dtype=dt,
        device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=cfg["int_indices"],
        sink_tokens=cfg["sink"], attention_window_size=cfg["window"], quant_args=PACKING,
        global_sink_tokens=cfg["global_sink"], allow_growth=cfg["growth"])
    gen = torch.Generator().manual_seed(rnd.randrange(2**31))
    heads = cfg["heads"] if cfg["slice"] is None else cfg["slice"][1] - cfg["slice"][0]
    head_start = cfg["head_start"] if cfg["slice"] is None else cfg["slice"][0]

    def write(start, n):
        key, value = (torch.randn(1, n, heads, d, generator=gen).to(dt) for _ in range(2))
        kw = dict(key=key, value=value, current_chunk_start=start, cache_head_start=head_start)
        try:
            expected = ref.update_and_get_attention_kv(**kw)
        except (RuntimeError, ValueError) as exc:
            before = _state(ours), list(ours.store.segments)
            with pytest.raises(type(exc)):
                ours.update_and_get_attention_kv(**kw)
            assert (_state(ours), list(ours.store.segments)) == before
            return False
        before = _state(ours), list(ours.store.segments), ours.quantize_calls
        PACKED["writes_into_packed"] += any(
            s.packed and s.start < start + n and start < s.end for s in ours.store.segments)
        try:
            got = ours.update_and_get_attention_kv(**kw)
        except CacheWriteError:
            assert (_state(ours), list(ours.store.segments), ours.quantize_calls) == before
            return False
        assert got.k.shape == expected.k.shape and _cursors(got) == _cursors(expected)
        assert torch.isfinite(got.k).all() and torch.isfinite(got.v).all()
        assert _state(ours) == _state(ref)
        return True

    PACKED["examples"] += 1
    try:
        _run_ops(ref, ours, ops, cfg, rnd, write)
    finally:
        PACKED["quantize_calls"] += ours.quantize_calls


def _run_ops(ref, ours, ops, cfg, rnd, write):
    for op in ops:
        g = ref.global_end_index_int
        g = int(ref.global_end_index.item()) if g is None else g
        n = cfg["n"]
        if op == "chunk":
            for _ in range(1 + rnd.randrange(3)):
                if not write(g, n):
                    return
        elif op == "pin":
            m = rnd.choice([n, 0, 1])
            ref.pin_current_chunk(m)
            ours.pin_current_chunk(m)
        elif op == "rewrite_old" and g > 0:
            length = rnd.randint(1, min(n, g))
            if not write(rnd.randint(max(0, g - cfg["cache"]), g - length), length):
                return
        elif op == "overlap" and g > 1 and n > 1:
            if not write(g - rnd.randint(1, min(n - 1, g)), n):
                return
        elif op == "reset":
            ref.reset_indices()
            ours.reset_indices()
        assert _state(ours) == _state(ref)


def test_the_packing_streams_packed_and_wrote_into_packed_chunks():
    """Runs after the property (file order): the streams did pack, and rewrote packed chunks."""
    assert PACKED["examples"] >= examples(200)
    assert PACKED["quantize_calls"] >= PACKED["examples"] // 2
    assert PACKED["writes_into_packed"] > 0
    print(f"packing streams: {PACKED}")
