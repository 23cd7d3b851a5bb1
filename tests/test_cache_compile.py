"""torch.compile over the caches: a layer step that writes the cache and attends, compiled with
the default backend (inductor) on the CPU, runs a whole stream with the eager step's output.

The stream: 10 chunks of 16 tokens, 4 calls per chunk (the first advances the stream, three
more rewrite the chunk, as denoising steps do), a 4-chunk cache with a one-chunk sink, so
chunks roll out and, on the packed cache, cold chunks are packed from chunk 2 on.

Oracles: the same step run eagerly on a fresh cache (the compiled output must equal it: the
cache's bookkeeping and the packed segments' decode run eagerly in both, and the dense view's
attention is the same SDPA call), the dense cache's positions (the token-position oracle of
the packed cache), and the eager codec's bytes for packing under torch.compile. The graph
breaks per call are counted with dynamo's own counters (docs/caches.md, "torch.compile").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache, QVGPackedCausalKVCache, attend
from causalkv.caches.codecs.prq import quantizer
from causalkv.caches.qvg.options import QVGKVQuantArgs

B, H, D, N = 1, 2, 64, 16
CHUNKS, CALLS = 10, 4
SPEC = CausalCacheSpec(batch_size=B, num_heads=H, head_dim=D, cache_size=4 * N, sink_tokens=N,
                   global_sink_tokens=N, dtype=torch.bfloat16)
KINDS = ("dense", "int4", "int2")


def make(kind: str):
    if kind == "dense":
        return DenseCausalKVCache(SPEC)
    quant = QVGKVQuantArgs(codec=kind, block_size=16, centroids=8, keep_recent_chunks=0)
    return QVGPackedCausalKVCache(SPEC, quant)


def step(cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """One layer's attention over the cache: write this call's K/V, attend the view."""
    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
    return attend(q, view)


def step_sdpa(cache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """The same with torch's SDPA over the view's materialized ``k``/``v``."""
    view = cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2),
                                         view.v.transpose(1, 2))
    return out.transpose(1, 2)


@pytest.fixture(scope="module")
def qkv() -> torch.Tensor:
    """``[CHUNKS, CALLS, 3, B, N, H, D]`` bf16: each call's query, key and value."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(CHUNKS, CALLS, 3, B, N, H, D, generator=g).to(torch.bfloat16)


def stream(fn, cache, qkv: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple]]:
    """Every call's output and the positions the cache shows after it."""
    outs, positions = [], []
    for c in range(CHUNKS):
        for i in range(CALLS):
            q, k, v = qkv[c, i]
            outs.append(fn(cache, q, k, v, c * N))
            positions.append(cache.get_attention_kv().position_ranges)
    return outs, positions


@pytest.fixture(scope="module")
def compiled():
    """One compiled function per step, shared by every cache kind (compiling is the slow part)."""
    torch._dynamo.reset()
    yield {"attend": torch.compile(step), "sdpa": torch.compile(step_sdpa)}
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def dense_positions(qkv):
    return stream(step, make("dense"), qkv)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_step_runs_the_whole_stream_with_the_eager_output(kind, compiled, qkv,
                                                                     dense_positions):
    eager, eager_pos = stream(step, make(kind), qkv)
    cache = make(kind)
    out, pos = stream(compiled["attend"], cache, qkv)
    assert len(out) == CHUNKS * CALLS
    for i, (a, b) in enumerate(zip(out, eager)):
        assert torch.equal(a, b), f"call {i}: compiled differs from eager by {(a - b).abs().max()}"
    assert pos == eager_pos == dense_positions
    assert pos[-1] == ((0, N), ((CHUNKS - 3) * N, CHUNKS * N))  # the stream rolled
    if kind != "dense":
        assert len(cache.packed_segments()) >= 2  # the compiled stream packed chunks


def test_a_compiled_step_over_the_views_k_and_v_gives_the_eager_output(compiled, qkv):
    """SDPA over ``view.k``/``view.v`` of the int2 cache: filling them decodes packed chunks."""
    eager, _ = stream(step_sdpa, make("int2"), qkv)
    cache = make("int2")
    out, _ = stream(compiled["sdpa"], cache, qkv)
    assert len(cache.packed_segments()) >= 2
    for i, (a, b) in enumerate(zip(out, eager)):
        assert torch.equal(a, b), f"call {i}: compiled differs from eager by {(a - b).abs().max()}"


def graph_breaks(fn, cache, q, k, v, start) -> int:
    torch._dynamo.reset()
    counters.clear()
    torch.compile(fn, backend="eager")(cache, q, k, v, start)
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return breaks


@pytest.mark.parametrize(("kind", "expected"), [("dense", (1, 1)), ("int2", (3, 3))])
def test_graph_breaks_per_call(kind, expected, qkv):
    """One break at the cache's write (it runs eagerly); a packed view adds attend's segment
    loop (eager too). The figures of docs/caches.md, at an advance and at a rewrite with
    packed chunks in view."""
    cache = make(kind)
    for c in range(5):
        q, k, v = qkv[c, 0]
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    if kind != "dense":
        assert len(cache.packed_segments()) >= 1
    q, k, v = qkv[5, 0]
    advance = graph_breaks(step, cache, q, k, v, 5 * N)
    q, k, v = qkv[5, 1]
    rewrite = graph_breaks(step, cache, q, k, v, 5 * N)
    assert (advance, rewrite) == expected, counters["graph_break"]


def _packed_bytes(seg) -> dict:
    out = {}
    for f in dataclasses.fields(seg):
        val = getattr(seg, f.name)
        if isinstance(val, torch.Tensor):
            out[f.name] = val.view(torch.uint8) if val.dtype == torch.float8_e4m3fn else val
        elif isinstance(val, list):
            out[f.name] = list(val)
        else:
            out[f.name] = val
    return out


def _assert_same_codes(a, b) -> None:
    da, db = _packed_bytes(a), _packed_bytes(b)
    assert da.keys() == db.keys()
    for name in da:
        x, y = da[name], db[name]
        if isinstance(x, list):
            assert len(x) == len(y) and all(torch.equal(p, r) for p, r in zip(x, y)), name
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert x == y, name


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_under_torch_compile_gives_the_eager_codes(bits):
    """PRQ quantize runs eagerly under torch.compile: a compiled caller that packs, and the
    codec entry compiled itself, store the eager codec's bytes."""
    x = torch.randn(1, H, 2 * N, D, generator=torch.Generator().manual_seed(bits))
    x = x.to(torch.bfloat16)
    args = QVGKVQuantArgs(codec=f"int{bits}", block_size=16, centroids=8).validate()
    eager = quantizer.quantize(x, args, seed=1234)

    def host(t: torch.Tensor):
        return quantizer.quantize(t * 1, args, seed=1234)

    torch._dynamo.reset()
    try:
        _assert_same_codes(torch.compile(host)(x), eager)
        _assert_same_codes(torch.compile(quantizer.quantize)(x, args, seed=1234), eager)
    finally:
        torch._dynamo.reset()
