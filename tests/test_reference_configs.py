"""The reference configurations of docs/design.md ("Models") at reduced token counts.

Each stream runs the way a causal stage drives a layer's cache: per chunk, 4 denoising steps
(the first advances, the others rewrite) and a context pass that rewrites the clean K/V, so
5 writes per chunk. The visible positions after each chunk are checked against tables
derived by hand from the model's sink / window numbers, and the whole stream (values
included) against the oracle with `run_sequence`.
"""

from __future__ import annotations

import torch
from oracle import Pin, Write, encode_kv, run_sequence, runs_of

from causalkv.caches import CausalCacheSpec, CrossAttentionKVCache, DenseCausalKVCache

FORWARDS_PER_CHUNK = 5  # 4 denoising steps + context pass


def chunk_ops(chunk_tokens: int, *, recent=None, h0=None, h=None, pin=False) -> list:
    ops = [Write("advance", n=chunk_tokens, h0=h0, h=h, recent=recent)]
    ops += [Write("rewrite", h0=h0, h=h, recent=recent)] * (FORWARDS_PER_CHUNK - 1)
    return ops + ([Pin(chunk_tokens)] if pin else [])


def drive(cache, spec, chunks, chunk_tokens, *, recent=None, pins=(), h0=None, h=None, wid0=0):
    """Write ``chunks`` chunks; return the ranges the context pass saw, per chunk."""
    seen = []
    wid = wid0
    heads = spec.num_heads if h is None else h
    for c in range(chunks):
        start = c * chunk_tokens
        r = recent(c) if callable(recent) else recent
        for _ in range(FORWARDS_PER_CHUNK):
            wid += 1
            k, v = encode_kv(spec, start, chunk_tokens, h0 or 0, heads, wid)
            view = cache.update_and_get_attention_kv(
                key=k, value=v, current_chunk_start=start, cache_head_start=h0,
                recent_window_tokens=r,
            )
        seen.append(runs_of(view.positions.tolist()))
        if c in pins:
            cache.pin_current_chunk(chunk_tokens)
    return seen


# ---- Self-Forcing / CausVid: no sink, global window of 21 frames -----------------------


def test_self_forcing_global_window():
    tpf, chunk = 4, 3 * 4  # 4 tokens per frame (1560 in the model), 3 frames per chunk
    window = 21 * tpf
    spec = CausalCacheSpec(batch_size=1, num_heads=12, head_dim=4, cache_size=window)
    cache = DenseCausalKVCache(spec)
    assert cache.can_direct_current_attention(chunk)  # first chunk sees only itself
    seen = drive(cache, spec, 10, chunk)
    for c, ranges in enumerate(seen):
        end = (c + 1) * chunk
        assert ranges == [(max(0, end - window), end)], c
    assert not cache.can_direct_current_attention(chunk)
    assert cache.resident_nbytes() == 2 * 1 * window * 12 * 4 * 2  # bf16, preallocated
    run_sequence(DenseCausalKVCache, spec, [op for _ in range(10) for op in chunk_ops(chunk)])


# ---- LongLive 1.0: 3-frame sink, 12-frame window including the sink ----------------------


def test_longlive_frame_sink():
    tpf = 4
    chunk, sink, window = 3 * tpf, 3 * tpf, 12 * tpf
    spec = CausalCacheSpec(1, 12, 4, cache_size=window, sink_tokens=sink)
    cache = DenseCausalKVCache(spec)
    seen = drive(cache, spec, 10, chunk)
    for c, ranges in enumerate(seen):
        end = (c + 1) * chunk
        tail_start = max(sink, end - (window - sink))
        assert ranges == runs_of([*range(sink), *range(tail_start, end)]), c
    assert seen[9] == [(0, 12), (84, 120)]
    run_sequence(DenseCausalKVCache, spec, [op for _ in range(10) for op in chunk_ops(chunk)])


def test_longlive_prompt_switch_resets_cross_attention_only():
    spec = CausalCacheSpec(1, 2, 4, cache_size=16, sink_tokens=4)
    cache, cross = DenseCausalKVCache(spec), CrossAttentionKVCache()
    text = torch.randn(1, 5, 2, 4, requires_grad=True)
    cross.store(text * 2, text * 3)
    assert not cross.k.requires_grad and cross.resident_nbytes() == 2 * 5 * 2 * 4 * 4
    drive(cache, spec, 3, 4)
    cross.reset()  # the new prompt's text K/V will be stored next
    assert not cross.is_initialized and cross.resident_nbytes() == 0
    assert cache.global_end == 12 and cache.get_attention_kv().positions.tolist() == list(range(12))


# ---- LongLive 2.0: 8-frame global sink + 8-frame pinned shot sink, scene cuts -------------


def test_longlive2_global_sink_and_pinned_shot_sink():
    tpf = 2
    chunk = 8 * tpf  # 8 frames per chunk
    sink = 8 * tpf  # 8-frame global sink, 8-frame shot sink
    window = 32 * tpf
    spec = CausalCacheSpec(1, 24, 4, cache_size=window, sink_tokens=sink, global_sink_tokens=sink)
    cache = DenseCausalKVCache(spec)
    cuts = {3, 6}  # "The scene transitions. " chunks: pinned after their context pass
    seen = drive(cache, spec, 9, chunk, pins=cuts)
    # By hand: the global sink [0, 16) always; while a shot sink is pinned it takes 16 more
    # slots, leaving 32 for the newest ordinary tokens; the cut at chunk 6 releases [48, 64).
    assert seen == [
        [(0, 16)],
        [(0, 32)],
        [(0, 48)],
        [(0, 64)],  # chunk 3: the cut chunk itself; pinned [48, 64) afterwards
        [(0, 16), (32, 80)],  # sink, [32, 48) newest ordinary, [48, 64) pinned, chunk 4
        [(0, 16), (48, 96)],  # pinned [48, 64) kept although older than [64, 96)
        [(0, 16), (48, 64), (80, 112)],  # chunk 6, the second cut; pins [96, 112)
        [(0, 16), (80, 128)],  # the released [48, 64) rolled out
        [(0, 16), (96, 144)],
    ]
    assert cache.state.pinned == (96, 112)
    ops = [op for c in range(9) for op in chunk_ops(chunk, pin=c in cuts)]
    run_sequence(DenseCausalKVCache, spec, ops)


def test_longlive2_shot_sink_replaces_part_of_a_larger_first_sink():
    """global_sink 4 < sink 8: the first shot keeps [0, 8); after a cut only [0, 4) stays."""
    spec = CausalCacheSpec(1, 2, 4, cache_size=24, sink_tokens=8, global_sink_tokens=4)
    cache = DenseCausalKVCache(spec)
    seen = drive(cache, spec, 7, 8, pins={2})
    assert seen[1] == [(0, 16)]
    assert seen[2] == [(0, 24)]  # the cut chunk [16, 24); pinned [16, 24) afterwards
    assert seen[3] == [(0, 4), (12, 32)]  # [4, 12) lost its sink status and rolled out first
    assert seen[6] == [(0, 4), (16, 24), (44, 56)]
    ops = [op for c in range(7) for op in chunk_ops(8, pin=c == 2)]
    run_sequence(DenseCausalKVCache, spec, ops)


# ---- LingBot-World: sink 3, window 45, recent-window sampling, two head-parallel ranks ----


def lingbot_recent(c: int) -> int | None:
    """Interactive sampling: moving (12 frames) for chunks 4-9, still (3 frames) for 10-13."""
    if 4 <= c < 10:
        return 12
    if 10 <= c < 14:
        return 3
    return None


def lingbot_expected(c: int, chunk: int, sink: int, window: int) -> list[tuple[int, int]]:
    start, end = c * chunk, (c + 1) * chunk
    r = lingbot_recent(c)
    tail_start = max(sink, end - (window - sink))
    if r is not None:
        tail_start = max(tail_start, start - r)
    return runs_of([*range(sink), *range(tail_start, end)])


def test_lingbot_world_recent_window_sampling():
    tpf = 1
    chunk, sink, window = 3 * tpf, 3 * tpf, 45 * tpf
    spec = CausalCacheSpec(1, 8, 4, cache_size=window, sink_tokens=sink)
    cache = DenseCausalKVCache(spec)
    seen = drive(cache, spec, 24, chunk, recent=lingbot_recent)
    for c, ranges in enumerate(seen):
        assert ranges == lingbot_expected(c, chunk, sink, window), c
    assert seen[9] == [(0, 3), (15, 30)]  # moving: 12 frames before the chunk
    assert seen[12] == [(0, 3), (33, 39)]  # still: 3 frames before the chunk
    assert seen[23] == [(0, 3), (30, 72)]  # full window again
    ops = [op for c in range(24) for op in chunk_ops(chunk, recent=lingbot_recent(c))]
    run_sequence(DenseCausalKVCache, spec, ops)


def test_lingbot_world_two_ranks_with_half_the_heads_each():
    """Head parallel: rank r writes heads [4r, 4r + 4) of 8. Two layouts, same answer:
    (a) each rank's cache is full-sized and is written through ``cache_head_start``;
    (b) each rank's cache holds its 4 heads only. The union equals a full-head cache."""
    chunk, sink, window, H = 3, 3, 18, 8
    full_spec = CausalCacheSpec(1, H, 4, cache_size=window, sink_tokens=sink)
    shard_spec = CausalCacheSpec(1, H // 2, 4, cache_size=window, sink_tokens=sink)
    full = DenseCausalKVCache(full_spec)
    sliced = [DenseCausalKVCache(full_spec) for _ in range(2)]
    sharded = [DenseCausalKVCache(shard_spec) for _ in range(2)]
    for c in range(12):
        start, r = c * chunk, lingbot_recent(c)
        for step in range(FORWARDS_PER_CHUNK):
            wid = c * FORWARDS_PER_CHUNK + step + 1
            k, v = encode_kv(full_spec, start, chunk, 0, H, wid)
            want = full.update_and_get_attention_kv(
                key=k, value=v, current_chunk_start=start, recent_window_tokens=r
            )
            got_sliced, got_sharded = [], []
            for rank in range(2):
                hs = slice(4 * rank, 4 * rank + 4)
                got_sliced.append(sliced[rank].update_and_get_attention_kv(
                    key=k[:, :, hs], value=v[:, :, hs], current_chunk_start=start,
                    cache_head_start=4 * rank, recent_window_tokens=r,
                ))
                got_sharded.append(sharded[rank].update_and_get_attention_kv(
                    key=k[:, :, hs], value=v[:, :, hs], current_chunk_start=start,
                    recent_window_tokens=r,
                ))
            for views in (got_sliced, got_sharded):
                for view in views:
                    assert torch.equal(view.positions, want.positions)
                    assert view.k.shape[2] == 4
                assert torch.equal(torch.cat([x.k for x in views], dim=2), want.k)
                assert torch.equal(torch.cat([x.v for x in views], dim=2), want.v)
        assert runs_of(want.positions.tolist()) == lingbot_expected(c, chunk, sink, window)
    # the head-sliced caches hold the other rank's heads as zeros (never written there)
    assert not sliced[0].k_cache[:, :, 4:].any() and not sliced[1].k_cache[:, :, :4].any()
    assert sharded[0].resident_nbytes() * 2 == full.resident_nbytes()
    # and the oracle agrees with a rank's stream, values included
    ops = [op for c in range(12) for op in chunk_ops(chunk, recent=lingbot_recent(c), h0=4, h=4)]
    run_sequence(DenseCausalKVCache, full_spec, ops)
