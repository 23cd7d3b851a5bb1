"""Probe and commit on the bridge's cache: the denoising passes store nothing, the context
update stores the chunk in its tier and drops what the next chunk drops.

The oracle is the bridge's cache with no marks (sglang's dense semantics, itself held to
sglang's dense cache by `test_bridge_parity`): the same K/V stream through a stage of several
blocks, marked (the stage's `PassMarker`: probes, then the commit) and unmarked, must give
every view bit for bit, for every policy setting (quant off, int4, int2 at sglang's defaults,
keep-recent 0, sink bf16) and with a LongLive 2.0 shot pinned after a chunk; only the bytes
held differ, by the arithmetic: unmarked, every block holds the chunk being generated and,
between a context update and the next advance, the chunk that advance evicts; marked, each
block holds context only, trimmed at the commit to what the next chunk keeps.

Also: a probe moves no cursor and stores nothing; a commit is a promise (the next chunk's
size, the pin) and a view that needs what it dropped is refused with nothing changed, while
a commit told the truth keeps it; a commit of an older chunk is a plain write; sglang's own
call order on the hooked allocation (no marks) is served as before; non-finite K/V stay
dense as written.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2CausalDenoisingStage,
)

from causalkv.caches.codecs.prq.format import packed_nbytes_formula
from causalkv.caches.passes import PassMarker
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuant
from causalkv.caches.spec import CacheProtocolError
from causalkv.sglang.cache import SGLangQVGKVCache

H, D, N, SLOTS, LAYERS, PASSES = 2, 32, 64, 4, 3, 3
PIN_AFTER = 3  # chunk 3 opens a new shot: pinned after its context update


def _block(quant, marker=None):
    return SGLangQVGKVCache(
        batch_size=1, cache_size=SLOTS * N, num_heads=H, head_dim=D, dtype=torch.bfloat16,
        device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=True,
        sink_tokens=N, attention_window_size=SLOTS * N, quant_args=quant,
        global_sink_tokens=N, marker=marker,
    )


def _kv(chunk, layer, step, n=N):
    g = torch.Generator().manual_seed(1000 * chunk + 10 * layer + step)
    return tuple(torch.randn(1, n, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _stream(blocks, marker, chunks=8):
    """Every view of every call; resident bytes of the stage after every call."""
    views, held = [], []
    for c in range(chunks):
        for step in range(PASSES):  # denoising passes, then the context update
            if marker is None:
                scope = torch.no_grad()
            elif step < PASSES - 1:
                scope = marker.probing()
            else:
                scope = marker.committing(pin=c == PIN_AFTER)
            with scope:
                for layer, block in enumerate(blocks):
                    k, v = _kv(c, layer, step)
                    view = block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    views.append((view.k.clone(), view.v.clone(), view.local_start_index,
                                  view.local_end_index, view.visible_local_end))
                    held.append(sum(b.resident_nbytes() for b in blocks))
        if c == PIN_AFTER:
            for block in blocks:
                block.pin_current_chunk(N)
    return views, held


SETTINGS = {
    "off": QVGKVQuantArgs(),
    "int4-default": QVGKVQuantArgs(bits=4, centroids=8, block_size=16),
    "int2-default": QVGKVQuantArgs(bits=2, centroids=8, block_size=16),
    "int2-recent0": QVGKVQuantArgs(bits=2, centroids=8, block_size=16, keep_recent_chunks=0),
    "int2-sink0": QVGKVQuantArgs(bits=2, centroids=8, block_size=16, sink=False),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_marks_change_no_view_and_hold_less(name):
    quant = SETTINGS[name]
    before, held_before = _stream([_block(quant) for _ in range(LAYERS)], None)
    marker = PassMarker()
    after, held_after = _stream([_block(quant, marker) for _ in range(LAYERS)], marker)
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a[2:] == b[2:], i
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"view {i} differs"
    # in steady state every block holds at least one chunk less (at its tier) than the
    # layout that keeps the chunk being generated in every block
    chunk = 2 * N * H * D * 2
    assert max(held_after) <= max(held_before) - LAYERS * chunk // (8 if quant.bits else 1)
    assert marker.ledger.peak_resident_nbytes == max(held_after)


def test_keep_recent_0_holds_three_packed_chunks_per_block():
    """Steady state (after a commit, before the next chunk), by the byte formula."""
    marker = PassMarker()
    blocks = [_block(SETTINGS["int2-recent0"], marker) for _ in range(LAYERS)]
    _, held = _stream(blocks, marker)
    q = CausalKVQuant(codec="int2", centroids=8, block_size=16, keep_recent_chunks=0)
    packed = 2 * packed_nbytes_formula((1, H, N, D), q)
    # 4 slots: 3 hold context (the sink chunk, the pinned chunk or older context, the newest)
    assert held[-1] == LAYERS * 3 * packed


def test_the_recency_tier_packs_the_recent_chunk_at_4_bits():
    quant = CausalKVQuant(codec="int2", centroids=8, block_size=16, recent_tier="int4")
    marker = PassMarker()
    blocks = [_block(quant, marker) for _ in range(LAYERS)]
    _, held = _stream(blocks, marker)
    q2 = CausalKVQuant(codec="int2", centroids=8, block_size=16)
    q4 = CausalKVQuant(codec="int4", centroids=8, block_size=16)
    p2, p4 = (2 * packed_nbytes_formula((1, H, N, D), q) for q in (q2, q4))
    assert held[-1] == LAYERS * (2 * p2 + p4)
    tiers = [s.storage.recent for s in blocks[0].store.segments if s.packed]
    assert tiers.count(True) == 1  # the newest completed chunk


def test_a_probe_moves_no_cursor_and_stores_nothing():
    marker = PassMarker()
    block = _block(SETTINGS["int2-default"], marker)
    plain = _block(SETTINGS["int2-default"])
    for c in range(3):
        k, v = _kv(c, 0, 9)
        with marker.committing():
            block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    segments, cursors = list(block.store.segments), (block.global_end_index_int,
                                                     block.local_end_index_int)
    resident = block.resident_nbytes()
    for step in range(3):
        k, v = _kv(3, 0, step)
        with marker.probing():
            got = block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N)
        want = plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=3 * N)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        assert (got.local_start_index, got.local_end_index, got.visible_local_end) == (
            want.local_start_index, want.local_end_index, want.visible_local_end)
        assert block.store.segments == segments and block.resident_nbytes() == resident
        assert (block.global_end_index_int, block.local_end_index_int) == cursors
        assert int(block.global_end_index.item()) == cursors[0]


def test_a_probe_grows_the_size_as_sglang_s_buffer_grows_for_it():
    """With ``allow_growth``, sglang's cache grows for every write it serves, a probe's too
    (it hears no marks), and keeps that size through ``reset_indices``. A request abandoned
    after a probe of a 24-token chunk in 16 slots leaves sglang's buffer and window at 32 (it
    grows to twice the size, or to fit) for the next request, where a 16-token chunk can no
    longer attend to itself directly (sglang's stage then skips the cache). The bridge, which
    stores nothing for the probe, takes the same size: the next request gets sglang's answers
    (the oracle: sglang's own cache, given every write)."""
    from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
        CausalSelfAttentionKVCache,
    )

    idx = lambda: dict(global_end_index=torch.zeros(1, dtype=torch.long),  # noqa: E731
                       local_end_index=torch.zeros(1, dtype=torch.long))
    ref = CausalSelfAttentionKVCache(
        k=torch.zeros(1, 16, H, D, dtype=torch.bfloat16),
        v=torch.zeros(1, 16, H, D, dtype=torch.bfloat16), **idx(), global_end_index_int=0,
        local_end_index_int=0, cache_size=16, allow_growth=True)
    marker = PassMarker()
    block = SGLangQVGKVCache(
        batch_size=1, cache_size=16, num_heads=H, head_dim=D, dtype=torch.bfloat16,
        device="cpu", **idx(), use_int_indices=True, allow_growth=True,
        quant_args=CausalKVQuant(), marker=marker)
    sizes = lambda c: (c.cache_size, c.attention_window_size, c.can_direct_current_attention(16))  # noqa: E731
    k, v = _kv(0, 0, 0, n=24)
    ref.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    with marker.probing():
        block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert block.resident_nbytes() == 0  # the probe stored nothing
    ref.reset_indices()
    block.reset_indices()
    assert sizes(block) == sizes(ref) == (32, 32, False)
    for c in range(5):  # the next request: 8-token chunks
        k, v = _kv(c, 0, 1, n=8)
        want = ref.update_and_get_attention_kv(key=k, value=v, current_chunk_start=8 * c)
        with marker.committing():
            got = block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=8 * c)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v), c
        assert sizes(block) == sizes(ref), c


def test_a_commit_is_a_promise_and_a_broken_one_is_refused_with_nothing_changed():
    """A commit keeps what the next chunk it was told of keeps (default: one of its own size).
    A smaller next chunk would see a position it dropped: refused (sglang's dense cache would
    show it), nothing changed; a commit told the smaller size keeps it and serves it."""
    quant = SETTINGS["off"]
    small = N // 2
    for told in (None, small):
        marker = PassMarker()
        block, plain = _block(quant, marker), _block(quant)
        for c in range(4):
            k, v = _kv(c, 0, 0)
            with marker.committing(next_tokens=told if c == 3 else None):
                block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
            plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        k, v = _kv(4, 0, 0, small)
        want = plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4 * N)
        if told is None:
            held = (list(block.store.segments), block.global_end_index_int)
            with marker.probing(), pytest.raises(CacheProtocolError, match="the last commit dropped"):
                block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4 * N)
            assert (list(block.store.segments), block.global_end_index_int) == held
        else:
            with marker.probing():
                got = block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=4 * N)
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_a_commit_of_an_older_chunk_is_a_plain_write():
    marker = PassMarker()
    block, plain = _block(SETTINGS["int2-default"], marker), _block(SETTINGS["int2-default"])
    for c in range(2):
        k, v = _kv(c, 0, 0)
        with marker.committing():
            block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
        plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    k, v = _kv(5, 0, 0)
    with marker.committing():
        got = block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    want = plain.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_sglang_s_own_call_order_on_the_hooked_allocation_is_served_as_before():
    """sglang's LongLive 2.0 stage allocates the bridge's caches through the hooked
    ``_allocate_causal_kv_cache`` (one marker for the stage); driven as sglang drives its
    dense cache with no hooked pass marking them (blocks in lock step, the context write a
    plain ``update_and_get_attention_kv``, a second request after ``reset_indices``), every
    view equals the one of unmarked blocks."""
    stage = LongLive2CausalDenoisingStage.__new__(LongLive2CausalDenoisingStage)
    stage.sink_size, stage.sliding_window_num_frames, stage.num_transformer_blocks = 1, 4, LAYERS
    stage._apply_causal_cache_overrides(
        SimpleNamespace(), SimpleNamespace(pipeline_config=SimpleNamespace(),
                                           kv_cache_quant_config=SETTINGS["int2-default"]))
    caches = stage._allocate_causal_kv_cache(
        batch_size=1, kv_cache_size=SLOTS * N, num_attention_heads=H, attention_head_dim=D,
        dtype=torch.bfloat16, device=torch.device("cpu"), sink_tokens=N, global_sink_tokens=N)
    assert all(type(c) is SGLangQVGKVCache and c.marker is caches[0].marker for c in caches)
    assert caches[0].marker is not None
    plain = [_block(caches[0].quant) for _ in range(LAYERS)]
    for request in range(2):
        for c in range(6):
            for step in range(PASSES + 1):  # denoising passes, then the context write
                for layer in range(LAYERS):
                    k, v = _kv(c, layer, step + 10 * request)
                    got = caches[layer].update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    want = plain[layer].update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        for block in (*caches, *plain):
            block.reset_indices()


def test_a_non_finite_chunk_is_kept_dense_and_the_block_goes_on():
    """NaN K/V in a commit: the chunk stays dense as written (sglang's dense cache holds it
    so), the next chunks pack, the report says why."""
    marker = PassMarker()
    block = _block(SETTINGS["int2-recent0"], marker)
    for c in range(3):  # chunk 1 (the NaN) is still held after chunk 2
        for step in range(PASSES):
            k, v = _kv(c, 0, step)
            if c == 1 and step == PASSES - 1:
                k[0, 3, 1, 2] = float("nan")
            with marker.committing() if step == PASSES - 1 else marker.probing():
                block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    report = block.store.packing_report()
    assert report.chunks_dense.get("non-finite") == 1 and report.chunks_packed >= 1
    nan_chunk = next(s for s in block.store.segments if s.start == N)
    assert not nan_chunk.packed and torch.isnan(nan_chunk.storage.k).sum() == 1
