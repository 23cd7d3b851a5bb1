"""Graph breaks under torch.compile: the bridge's cache against sglang's dense cache.

`torch._dynamo.explain` (eager backend) over a LongLive 2.0 chunk loop through sglang's own
attention call site (`CausalWanSelfAttention.forward`: rotary embedding,
``can_direct_current_attention``, ``update_and_get_attention_kv``, torch SDPA over the view):
7 chunks x 5 passes (4 denoising steps and the context update), a global sink and two
scene-cut pins, with the int2 bridge packing as it goes. The oracle is sglang's dense
``CausalSelfAttentionKVCache`` on the same loop in the same process: the bridge may add at
most 2 graph breaks and 2 graphs to its counts.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalSelfAttentionKVCache,
)
from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context

from causalkv.sglang.cache import SGLangQVGKVCache

H, D, N = 2, 32, 16
CACHE = 4 * N  # LongLive 2.0: a 4-chunk window, sink = global sink = one chunk
CHUNKS, PASSES, PINS = 7, 5, (2, 5)


def _dense():
    z = torch.zeros(1, CACHE, H, D, dtype=torch.bfloat16)
    return CausalSelfAttentionKVCache(
        k=z.clone(), v=z.clone(), global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), cache_size=CACHE, sink_tokens=N,
        attention_window_size=CACHE, global_sink_tokens=N)


def _bridge():
    return SGLangQVGKVCache(
        batch_size=1, cache_size=CACHE, num_heads=H, head_dim=D, dtype=torch.bfloat16,
        device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), sink_tokens=N,
        attention_window_size=CACHE, global_sink_tokens=N,
        quant_args=QVGKVQuantArgs(bits=2, block_size=16, centroids=8, keep_recent_chunks=0))


def _explain(cache, monkeypatch):
    from sglang.multimodal_gen.runtime.models.dits.causal_wanvideo import CausalWanSelfAttention
    from sglang.multimodal_gen.runtime.server_args import server_args as sgl_server_args

    monkeypatch.setattr(sgl_server_args, "_global_server_args", SimpleNamespace(
        attention_backend="torch_sdpa", is_arg_explicitly_set=lambda name: True))
    attn = CausalWanSelfAttention(dim=H * D, num_heads=H)
    qkv = torch.randn(CHUNKS, 3, 1, N, H, D, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(torch.bfloat16)

    def loop(cache):
        outs = []
        for c in range(CHUNKS):
            pos = torch.arange(c * N, (c + 1) * N, dtype=torch.float32)
            freqs = pos[:, None] / 10000 ** (torch.arange(D // 2) / (D // 2))
            for _ in range(PASSES):
                y = attn(qkv[c, 0], qkv[c, 1], qkv[c, 2], (freqs.cos(), freqs.sin()), None,
                         kv_cache=cache, current_start=c * N)
            outs.append(y)
            if c in PINS:
                cache.pin_current_chunk(N)
        return outs

    torch._dynamo.reset()
    try:
        with set_forward_context(current_timestep=0, attn_metadata=None):
            out = torch._dynamo.explain(loop)(cache)
    finally:
        torch._dynamo.reset()
    return out


def test_the_bridge_adds_at_most_two_graph_breaks_to_sglangs_dense_cache(monkeypatch):
    dense = _explain(_dense(), monkeypatch)
    bridge_cache = _bridge()
    bridge = _explain(bridge_cache, monkeypatch)
    assert bridge_cache.packed_chunks() >= 2 and bridge_cache.has_pinned()  # it packed and pinned
    counts = {
        "dense": (len(dense.break_reasons), dense.graph_count),
        "bridge": (len(bridge.break_reasons), bridge.graph_count),
    }
    print(f"graph breaks / graphs: {counts}")
    assert len(bridge.break_reasons) <= len(dense.break_reasons) + 2, bridge.break_reasons
    assert bridge.graph_count <= dense.graph_count + 2, counts
