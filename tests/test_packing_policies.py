"""`QVGPackedCausalKVCache(policy=RECENT_NON_SINK)`: keep-recent over non-sink chunks in causalkv's own cache.

Runs in the main environment (no sglang needed); the bridge's cache uses the same policy
object (`causalkv.caches.qvg.policy.RECENT_NON_SINK`) over
the same segment store and is tested against sglang itself in tests/sglang_bridge.
"""

from __future__ import annotations

import pytest
import torch

from causalkv.caches import CausalCacheSpec
from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.caches.qvg.packed import QVGPackedCausalKVCache
from causalkv.caches.qvg.policy import RECENT_CHUNKS, RECENT_NON_SINK, ChunkInfo

CHUNK = 8
SPEC = CausalCacheSpec(batch_size=1, num_heads=2, head_dim=32, cache_size=8 * CHUNK,
                   sink_tokens=CHUNK, dtype=torch.bfloat16)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \['recent-chunks', 'recent-non-sink'\], got 'qvg'"):
        QVGPackedCausalKVCache(SPEC, policy="qvg")


@pytest.mark.parametrize(
    ("completed", "keep_recent", "pack_sink", "dense"),
    [
        ([(0, True, False), (1, False, False), (2, False, False)], 1, True, {2}),
        ([(0, True, False), (1, False, False), (2, False, False)], 1, False, {0, 2}),
        ([(0, True, True), (1, True, False), (2, False, False)], 1, True, {0, 2}),
        ([(0, True, False), (1, False, False)], 5, True, {1}),
        ([(0, False, False), (1, False, False)], 0, True, set()),
    ],
)
def test_rule_counts_only_non_sink_chunks_as_recent(completed, keep_recent, pack_sink, dense):
    """``completed``: (chunk, holds sink, among the leading ``sink_keep_chunks``) per chunk."""
    q = QVGKVQuantArgs(codec="int2", keep_recent_chunks=keep_recent, sink=pack_sink,
                       sink_keep_chunks=int(any(kept for *_, kept in completed)))
    chunks = tuple(ChunkInfo(c, c * CHUNK, (c + 1) * CHUNK, sink=s) for c, s, _ in completed)
    got = RECENT_NON_SINK.decide(q, chunks, len(chunks), sink_open=False, chunk_tokens=CHUNK)
    assert set(got.dense) == dense


def _packed_flags(policy, chunks: int) -> list[list[bool]]:
    cache = QVGPackedCausalKVCache(
        SPEC, QVGKVQuantArgs(codec="int2", block_size=16, centroids=8, keep_recent_chunks=1),
        policy=policy)
    gen = torch.Generator().manual_seed(0)
    flags = []
    for c in range(chunks):
        kv = torch.randn(2, 1, CHUNK, 2, 32, generator=gen).to(torch.bfloat16)
        cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=c * CHUNK)
        flags.append([s.packed for s in cache.segments])
    return flags


def test_recent_non_sink_packs_the_sink_chunk_at_once():
    # chunk 0 is the sink chunk; keep_recent=1 keeps one completed non-sink chunk dense
    assert _packed_flags("recent-non-sink", 4) == [
        [False], [True, False], [True, False, False], [True, True, False, False]]
    # causalkv's rule counts the sink chunk as the recent one
    assert _packed_flags("recent-chunks", 4)[1] == [False, False]


def test_policy_names_are_spellings_of_the_objects():
    assert _packed_flags(RECENT_NON_SINK, 4) == _packed_flags("recent-non-sink", 4)
    assert _packed_flags(RECENT_CHUNKS, 4) == _packed_flags("recent-chunks", 4)
    assert QVGPackedCausalKVCache(SPEC, policy="recent-non-sink").policy is RECENT_NON_SINK
