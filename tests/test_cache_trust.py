"""Bad input is answered at the call that brings it, the same way at every position.

- a float32 query over a bf16 cache: the same float32 answer at every chunk of the stream,
  whether the view is one dense buffer or packed segments (the oracle: float64 softmax
  attention over the view's own K/V);
- ``attend`` on a view with no visible token: `AttendError`, dense and packed alike;
- a write with fewer heads than the cache and no ``cache_head_start``: `CacheWriteError`
  naming the fix, the cache unchanged.
"""

from __future__ import annotations

import pytest
import torch

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache, attend
from causalkv.caches.attention import AttendError
from causalkv.caches.qvg import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.spec import CacheWriteError

H, D, N = 2, 32, 32
SPEC = CausalCacheSpec(1, H, D, 4 * N, sink_tokens=N, dtype=torch.bfloat16)
CACHES = {
    "dense": lambda: DenseCausalKVCache(SPEC),
    "packed-int2": lambda: QVGPackedCausalKVCache(
        SPEC, QVGKVQuantArgs(codec="int2", block_size=16, keep_recent_chunks=0)),
}


def _kv(c):
    g = torch.Generator().manual_seed(c)
    return tuple(torch.randn(1, N, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _reference(q, k, v):
    """float64 softmax attention of ``q [B, n, h, D]`` over ``k``/``v`` ``[B, s, h, D]``."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
    return (p @ v).transpose(1, 2)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_a_float32_query_gets_a_float32_answer_at_every_position(name):
    cache = CACHES[name]()
    q = torch.randn(1, 8, H, D)
    for c in range(6):
        k, v = _kv(c)
        view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        out = attend(q, view)
        assert out.dtype == torch.float32
        want = _reference(q, view.k, view.v)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_attend_on_an_empty_view_is_an_attend_error(name):
    view = CACHES[name]().get_attention_kv()
    assert view.num_visible == 0
    with pytest.raises(AttendError, match="no visible tokens"):
        attend(torch.randn(1, 4, H, D).to(torch.bfloat16), view)


@pytest.mark.parametrize("name", sorted(CACHES))
def test_fewer_heads_without_a_head_start_is_refused_and_nothing_changes(name):
    cache = CACHES[name]()
    k, v = _kv(0)
    cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    before = cache.get_attention_kv()
    k1, v1 = _kv(1)
    with pytest.raises(CacheWriteError, match=r"the write has 1 heads, the cache 2; pass cache_head_start"):
        cache.update_and_get_attention_kv(key=k1[:, :, :1], value=v1[:, :, :1], current_chunk_start=N)
    after = cache.get_attention_kv()
    assert after.position_ranges == before.position_ranges == ((0, N),)
    assert torch.equal(after.k, before.k) and torch.equal(after.v, before.v)
    # the head slice, named, is a write
    view = cache.update_and_get_attention_kv(key=k1[:, :, :1], value=v1[:, :, :1],
                                             current_chunk_start=N, cache_head_start=1)
    assert view.k.shape == (1, 2 * N, 1, D)
