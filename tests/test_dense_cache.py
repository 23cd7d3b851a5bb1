"""Unit tests of `DenseCausalKVCache` beyond the oracle properties: storage, in-place
rewrite, capabilities, cursors on a worked example, no device syncs, bf16, cross cache."""

from __future__ import annotations

import pytest
import torch
from oracle import encode_kv

from causalkv.caches import (
    CausalCacheSpec,
    CausalKVCache,
    CrossAttentionKVCache,
    DenseCausalKVCache,
)
from causalkv.capabilities import (
    GROWTH,
    HEAD_SLICE,
    INT_INDICES,
    PINNED_SINK,
    QUANT_QVG,
    RECENT_WINDOW,
)

SPEC = CausalCacheSpec(batch_size=2, num_heads=3, head_dim=4, cache_size=10, sink_tokens=2,
                   attention_window_size=8)


def write(cache, start, n, *, h0=None, h=None, wid=1, recent=None):
    h = cache.spec.num_heads if h is None else h
    k, v = encode_kv(cache.spec, start, n, h0 or 0, h, wid)
    return cache.update_and_get_attention_kv(
        key=k, value=v, current_chunk_start=start, cache_head_start=h0,
        recent_window_tokens=recent,
    )


def test_preallocated_buffer_and_resident_bytes():
    cache = DenseCausalKVCache(SPEC)
    assert cache.k_cache.shape == (2, 10, 3, 4) and cache.k_cache.dtype == torch.bfloat16
    assert cache.resident_nbytes() == 2 * (2 * 10 * 3 * 4) * 2 == SPEC.dense_nbytes()
    ptr = cache.k_cache.data_ptr()
    for c in range(6):
        for wid in range(3):
            write(cache, 3 * c, 3, wid=wid + 1)
    assert cache.k_cache.data_ptr() == ptr  # rewritten in place, never reallocated
    assert cache.resident_nbytes() == SPEC.dense_nbytes()


def test_contract_properties():
    cache = DenseCausalKVCache(SPEC)
    assert isinstance(cache, CausalKVCache)
    assert cache.num_cache_heads == 3
    caps = cache.capabilities
    for feature in (PINNED_SINK, HEAD_SLICE, RECENT_WINDOW, GROWTH, INT_INDICES):
        assert feature in caps
    assert QUANT_QVG not in caps
    assert caps.missing([PINNED_SINK, QUANT_QVG]) == {QUANT_QVG}


def test_refuses_enabled_quantization():
    class Quant:
        enabled = True

    with pytest.raises(ValueError, match="QVGPackedCausalKVCache"):
        DenseCausalKVCache(SPEC, Quant())
    DenseCausalKVCache(SPEC, None)  # quantization off: fine


def test_worked_example_positions_and_cursors():
    """cache 10, window 8, sink 2, chunks of 3 tokens.

    After 4 chunks (12 tokens) the cache holds the sink [0, 2) and the newest 8 tokens
    [4, 12) in slots 0..9; attention sees the sink and the newest 6: [0, 2) [6, 12).
    The current chunk [9, 12) sits in slots [7, 10).
    """
    cache = DenseCausalKVCache(SPEC)
    for c in range(4):
        view = write(cache, 3 * c, 3, wid=c + 1)
    assert view.position_ranges == ((0, 2), (6, 12))
    assert view.positions.tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    assert view.positions.dtype == torch.int64
    assert (view.local_start_index, view.local_end_index) == (7, 10)
    assert (view.visible_local_end, view.visible_global_end) == (10, 12)
    assert cache.state.retained == ((0, 2), (4, 12))
    # the values: channel 0 holds the position, 2 the write id (chunk c was write c + 1)
    assert view.k[0, :, 0, 0].tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    assert view.k[0, :, 0, 2].tolist() == [1, 1, 3, 3, 3, 4, 4, 4]
    assert torch.equal(view.v, -(view.k + 1))
    # recent window 2: the tail starts at max(2, 9 - 2) = 7
    assert write(cache, 9, 3, wid=5, recent=2).position_ranges == ((0, 2), (7, 12))
    # a read without a write sees the same as the last full write
    assert cache.get_attention_kv().position_ranges == ((0, 2), (6, 12))


def test_cursors_and_indices_are_python_ints_and_writes_never_sync(monkeypatch):
    """The hot path decides everything on Python ints: no .item()/.tolist()/bool(tensor)."""
    cache = DenseCausalKVCache(SPEC)
    inputs = [encode_kv(SPEC, 3 * c, 3, 0, 3, c + 1) for c in range(5)]

    def boom(*a, **k):
        raise AssertionError("device sync on the hot path")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    with pytest.raises(AssertionError, match="device sync"):
        bool(torch.ones(1))  # the trap is armed
    for c, (k, v) in enumerate(inputs):
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * c)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * c)
        if c == 2:
            cache.pin_current_chunk(3)
        assert view.k.shape == view.v.shape  # materialized under the trap
    monkeypatch.undo()
    for attr in ("local_start_index", "local_end_index", "visible_local_end",
                 "visible_global_end"):
        assert type(getattr(view, attr)) is int
    assert type(cache.global_end) is int


def test_empty_cache_view():
    cache = DenseCausalKVCache(SPEC)
    view = cache.get_attention_kv()
    assert view.positions.tolist() == [] and view.k.shape == (2, 0, 3, 4)
    assert (view.local_start_index, view.local_end_index, view.visible_local_end,
            view.visible_global_end) == (0, 0, 0, 0)


def test_head_slice_advance_leaves_other_heads_zero_until_written():
    cache = DenseCausalKVCache(SPEC)
    write(cache, 0, 3, wid=1)
    view = write(cache, 3, 3, h0=1, h=1, wid=2)
    assert view.k.shape == (2, 6, 1, 4)  # the view carries the written head only
    assert view.k[0, :, 0, 2].tolist() == [1, 1, 1, 2, 2, 2]
    full = cache.get_attention_kv()
    assert not full.k[:, 3:, 0].any() and not full.k[:, 3:, 2].any()  # heads 0 and 2 fresh
    assert full.k[0, 3:, 1, 0].tolist() == [3, 4, 5]
    write(cache, 3, 3, h0=0, h=1, wid=3)  # rewrite head 0 only
    full = cache.get_attention_kv()
    assert full.k[0, 3:, 0, 2].tolist() == [3, 3, 3] and not full.k[:, 3:, 2].any()


def test_segments_cover_the_view():
    cache = DenseCausalKVCache(SPEC)
    for c in range(4):
        view = write(cache, 3 * c, 3, wid=c + 1)
    assert view.position_ranges == ((0, 2), (6, 12))  # two runs of the buffer
    segments = list(view.iter_segments())
    assert torch.equal(torch.cat([s[0] for s in segments], dim=1), view.k)
    assert torch.equal(torch.cat([s[1] for s in segments], dim=1), view.v)


def test_bf16_exact_small_values():
    """bf16 has 8 significant bits: integers up to 256 are exact, so the markers survive."""
    spec = CausalCacheSpec(1, 2, 4, cache_size=8, sink_tokens=1, dtype=torch.bfloat16)
    cache = DenseCausalKVCache(spec)
    for c in range(20):
        view = write(cache, 4 * c, 4, wid=200 + c)
    # window 8: the sink token and the newest 7 (chunk 18 is [72, 76), chunk 19 [76, 80))
    assert view.positions.tolist() == [0, *range(73, 80)]
    assert view.k[0, [0, 1, 3, 4, 7], 1].tolist() == [
        [0, 1, 200, 0], [73, 1, 218, 0], [75, 1, 218, 0], [76, 1, 219, 0], [79, 1, 219, 0]
    ]
    assert view.v[0, 0, 0].tolist() == [-1, -1, -201, -1]


def test_can_direct_current_attention():
    spec = CausalCacheSpec(1, 1, 4, cache_size=6, dtype=torch.float32)
    cache = DenseCausalKVCache(spec)
    assert cache.can_direct_current_attention(3)
    assert not cache.can_direct_current_attention(7)  # does not fit
    assert not cache.can_direct_current_attention(0)
    write(cache, 0, 3)
    assert not cache.can_direct_current_attention(3)  # would also see [0, 3)
    assert cache.can_direct_current_attention(6)  # a full-window chunk evicts the rest
    cache.reset_indices()
    assert cache.global_end == 0 and cache.can_direct_current_attention(3)


def test_cross_attention_cache_store_detach_reset():
    cross = CrossAttentionKVCache()
    with pytest.raises(RuntimeError, match="store"):
        cross.get()
    k = torch.ones(1, 7, 2, 4, requires_grad=True)
    cross.store(k * 1, k * 2)
    got_k, got_v = cross.get()
    assert not got_k.requires_grad and torch.equal(got_v, torch.full((1, 7, 2, 4), 2.0))
    with pytest.raises(ValueError, match=r"\(1, 7, 2, 4\) != v shape \(1, 6, 2, 4\)"):
        cross.store(torch.ones(1, 7, 2, 4), torch.ones(1, 6, 2, 4))
    cross.reset()
    assert not cross.is_initialized and cross.resident_nbytes() == 0
