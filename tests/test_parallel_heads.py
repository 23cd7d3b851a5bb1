"""A head-sharded packed cache stores exactly what one cache stores for the same global heads.

Oracle: one `QVGPackedCausalKVCache` holding all H heads. Two caches holding heads ``[0, H/2)``
and ``[H/2, H)`` (``CausalCacheSpec.head_offset`` = their first global head) are fed the matching
slices of the same chunks; every visible K/V (packed chunks included) must equal the whole
cache's view of those heads bit for bit, and the two halves' bytes must add up to the whole's.
(``min_tokens_per_centroid=1``: 8 centroids for 24 tokens, so the k-means seeding matters.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from causalkv.caches import CausalCacheSpec
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.errors import ConfigError

N, H, D = 24, 4, 32


def _spec(heads: int, offset: int = 0) -> CausalCacheSpec:
    return CausalCacheSpec(batch_size=1, num_heads=heads, head_dim=D, cache_size=5 * N, sink_tokens=N,
                       global_sink_tokens=N, dtype=torch.float32, head_offset=offset)


def _visible(cache: QVGPackedCausalKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    view = cache.get_attention_kv()
    segs = list(view.iter_segments())
    return torch.cat([s[0] for s in segs], dim=1), torch.cat([s[1] for s in segs], dim=1)


@pytest.mark.parametrize("bits", [2, 4])
def test_head_slices_pack_like_the_whole(bits: int) -> None:
    q = QVGKVQuantArgs(codec=f"int{bits}", centroids=8, block_size=16).validate()
    whole = QVGPackedCausalKVCache(_spec(H), q, min_tokens_per_centroid=1)
    halves = [QVGPackedCausalKVCache(_spec(H // 2, r * H // 2), q, min_tokens_per_centroid=1) for r in range(2)]
    assert [c.head_offset for c in halves] == [0, H // 2]
    g = torch.Generator().manual_seed(0)
    packed_any = False
    for i in range(7):  # more chunks than the window: sink and older chunks are packed
        k = torch.randn(1, N, H, D, generator=g)
        v = torch.randn(1, N, H, D, generator=g)
        whole.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
        for r, c in enumerate(halves):
            sl = slice(r * H // 2, (r + 1) * H // 2)
            c.update_and_get_attention_kv(key=k[:, :, sl].contiguous(), value=v[:, :, sl].contiguous(),
                                          current_chunk_start=i * N)
        wk, wv = _visible(whole)
        for r, c in enumerate(halves):
            hk, hv = _visible(c)
            sl = slice(r * H // 2, (r + 1) * H // 2)
            assert torch.equal(hk, wk[:, :, sl]) and torch.equal(hv, wv[:, :, sl])
        packed_any = packed_any or whole.quantize_calls > 0
        assert sum(c.resident_nbytes() for c in halves) == whole.resident_nbytes()
    assert packed_any


def test_head_offset_is_what_makes_slices_agree() -> None:
    # both halves keyed as head 0: the second half's packed values differ from the whole's
    q = QVGKVQuantArgs(codec="int2", centroids=8, block_size=16).validate()
    whole = QVGPackedCausalKVCache(_spec(H), q, min_tokens_per_centroid=1)
    wrong = QVGPackedCausalKVCache(_spec(H // 2, 0), q, min_tokens_per_centroid=1)
    assert wrong.head_offset == 0
    right = QVGPackedCausalKVCache(_spec(H // 2, 0), q, head_offset=H // 2, min_tokens_per_centroid=1)  # the kwarg wins
    g = torch.Generator().manual_seed(1)
    for i in range(7):
        k = torch.randn(1, N, H, D, generator=g)
        v = torch.randn(1, N, H, D, generator=g)
        whole.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * N)
        for c in (wrong, right):
            c.update_and_get_attention_kv(key=k[:, :, H // 2:].contiguous(),
                                          value=v[:, :, H // 2:].contiguous(), current_chunk_start=i * N)
    wk, _ = _visible(whole)
    assert torch.equal(_visible(right)[0], wk[:, :, H // 2:])
    assert not torch.equal(_visible(wrong)[0], wk[:, :, H // 2:])


def test_spec_head_offset_is_checked() -> None:
    with pytest.raises(ConfigError, match="head_offset"):
        replace(_spec(2), head_offset=-1)
