"""The chunk being generated held once per stage (`ChunkScratch`), not in every block.

The oracle is the bridge's cache without a scratch (today's layout, itself held to sglang's
dense cache by `test_bridge_parity`): the same K/V stream through a stage of several blocks
with and without a shared scratch must give every view bit for bit, for every policy
setting (quant off, int4, int2 at sglang's defaults, keep-recent 0, sink bf16) and with a
LongLive 2.0 shot pinned after a chunk; only the bytes held differ, by the arithmetic:

- without a scratch every block holds its chunk being generated and, between a context pass
  and the next advance, the chunk that advance evicts;
- with it, each block holds context only, trimmed at the context pass to what the next chunk
  keeps, and the stage holds one chunk once.

Also: a scratch nobody declared (sglang's own code driving the caches) refuses nothing and
keeps every block's chunk; once declared, a chunk never committed by a context pass is
refused at the next advance (its K/V were another block's by then); non-finite K/V stay
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
from causalkv.caches.qvg import ChunkScratch
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuant
from causalkv.caches.spec import CacheProtocolError
from causalkv.sglang.cache import SGLangQVGKVCache

H, D, N, SLOTS, LAYERS, PASSES = 2, 32, 64, 4, 3, 3
PIN_AFTER = 3  # chunk 3 opens a new shot: pinned after its context pass


def _block(quant, scratch=None):
    return SGLangQVGKVCache(
        batch_size=1, cache_size=SLOTS * N, num_heads=H, head_dim=D, dtype=torch.bfloat16,
        device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=True,
        sink_tokens=N, attention_window_size=SLOTS * N, quant_args=quant,
        global_sink_tokens=N, scratch=scratch,
    )


def _kv(chunk, layer, step):
    g = torch.Generator().manual_seed(1000 * chunk + 10 * layer + step)
    return tuple(torch.randn(1, N, H, D, generator=g).to(torch.bfloat16) for _ in range(2))


def _stream(blocks, scratch, chunks=8):
    """Every view of every call; resident bytes of the stage after every call."""
    views, held = [], []
    for c in range(chunks):
        for step in range(PASSES):  # denoising passes, then the context update
            context = step == PASSES - 1
            ctx = scratch.context_pass(pin=c == PIN_AFTER) if (context and scratch) else None
            if ctx is not None:
                ctx.__enter__()
            try:
                for layer, block in enumerate(blocks):
                    k, v = _kv(c, layer, step)
                    view = block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    views.append((view.k.clone(), view.v.clone(), view.local_start_index,
                                  view.local_end_index, view.visible_local_end))
                    held.append(sum(b.resident_nbytes() for b in blocks)
                                + (scratch.nbytes if scratch else 0))
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
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
def test_the_scratch_changes_no_view_and_holds_less(name):
    quant = SETTINGS[name]
    before, held_before = _stream([_block(quant) for _ in range(LAYERS)], None)
    scratch = ChunkScratch(shared=True)
    blocks = [_block(quant, scratch) for _ in range(LAYERS)]
    after, held_after = _stream(blocks, scratch)
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a[2:] == b[2:], i
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"view {i} differs"
    # the stage holds at most what it did, and in steady state at least one chunk per block less
    # than the layout that keeps the chunk being generated in every block
    chunk = 2 * N * H * D * 2
    assert max(held_after) <= max(held_before) - (LAYERS - 1) * chunk // (8 if quant.bits else 1)
    assert scratch.ledger.peak_resident_nbytes == max(held_after)


def test_keep_recent_0_holds_three_packed_chunks_per_block_and_one_scratch():
    """Steady state (after a context pass, before the next advance), by the byte formula."""
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch(shared=True)
    blocks = [_block(quant, scratch) for _ in range(LAYERS)]
    _, held = _stream(blocks, scratch)
    q = CausalKVQuant(codec="int2", centroids=8, block_size=16, keep_recent_chunks=0)
    packed = 2 * packed_nbytes_formula((1, H, N, D), q)
    dense_chunk = 2 * N * H * D * 2
    # 4 slots: 3 hold context (the sink chunk, the pinned chunk or older context, the newest)
    assert held[-1] == LAYERS * 3 * packed + dense_chunk
    assert scratch.nbytes == dense_chunk


def test_the_recency_tier_packs_the_recent_chunk_at_4_bits():
    quant = CausalKVQuant(codec="int2", centroids=8, block_size=16, recent_tier="int4")
    scratch = ChunkScratch(shared=True)
    blocks = [_block(quant, scratch) for _ in range(LAYERS)]
    _, held = _stream(blocks, scratch)
    q2 = CausalKVQuant(codec="int2", centroids=8, block_size=16)
    q4 = CausalKVQuant(codec="int4", centroids=8, block_size=16)
    p2, p4 = (2 * packed_nbytes_formula((1, H, N, D), q) for q in (q2, q4))
    assert held[-1] == LAYERS * (2 * p2 + p4) + 2 * N * H * D * 2
    tiers = [s.storage.recent for s in blocks[0].store.segments if s.packed]
    assert tiers.count(True) == 1  # the newest completed chunk


def test_an_undeclared_scratch_keeps_every_block_s_chunk_and_refuses_nothing():
    """A scratch nobody declared (no context pass, no stage loop): each block keeps its own
    chunk, so lock-step blocks, a context write through a plain call and a second request
    give the views of blocks without a scratch."""
    quant = SETTINGS["int2-default"]
    scratch = ChunkScratch()
    blocks = [_block(quant, scratch) for _ in range(LAYERS)]
    plain = [_block(quant) for _ in range(LAYERS)]
    for request in range(2):
        for c in range(6):
            for step in range(PASSES):
                for layer in range(LAYERS):
                    k, v = _kv(c, layer, step + 10 * request)
                    got = blocks[layer].update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    want = plain[layer].update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
                    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        for block in (*blocks, *plain):
            block.reset_indices()
    assert not scratch.shared


def test_sglang_s_own_call_order_on_the_hooked_allocation_refuses_nothing():
    """sglang's LongLive 2.0 stage allocates the bridge's caches through the hooked
    ``_allocate_causal_kv_cache``; driven as sglang drives its dense cache (blocks in lock
    step, the context write a plain ``update_and_get_attention_kv``, a second request after
    ``reset_indices``), every view equals the one of blocks without a scratch."""
    stage = LongLive2CausalDenoisingStage.__new__(LongLive2CausalDenoisingStage)
    stage.sink_size, stage.sliding_window_num_frames, stage.num_transformer_blocks = 1, 4, LAYERS
    stage._apply_causal_cache_overrides(
        SimpleNamespace(), SimpleNamespace(pipeline_config=SimpleNamespace(),
                                           kv_cache_quant_config=SETTINGS["int2-default"]))
    caches = stage._allocate_causal_kv_cache(
        batch_size=1, kv_cache_size=SLOTS * N, num_attention_heads=H, attention_head_dim=D,
        dtype=torch.bfloat16, device=torch.device("cpu"), sink_tokens=N, global_sink_tokens=N)
    assert all(type(c) is SGLangQVGKVCache and c.scratch is caches[0].scratch for c in caches)
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


def test_a_declared_chunk_without_a_context_pass_is_refused_at_the_next_advance():
    scratch = ChunkScratch(shared=True)
    blocks = [_block(SETTINGS["int2-default"], scratch) for _ in range(2)]
    for block in blocks:
        k, v = _kv(0, 0, 0)
        block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    k, v = _kv(1, 0, 0)
    segments = list(blocks[0].store.segments)
    with pytest.raises(CacheProtocolError, match=r"chunk \[0, 64\) .* never committed by a context pass"):
        blocks[0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=N)
    assert blocks[0].store.segments == segments and blocks[0].global_end_index_int == N


def test_a_non_finite_chunk_is_kept_dense_and_the_block_goes_on():
    """NaN K/V in a context write: the chunk stays dense as written (sglang's dense cache
    holds it so), the next chunks pack, the report says why."""
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch()
    block = _block(quant, scratch)
    for c in range(3):  # chunk 1 (the NaN) is still held after chunk 2
        for step in range(PASSES):
            k, v = _kv(c, 0, step)
            if c == 1 and step == PASSES - 1:
                k[0, 3, 1, 2] = float("nan")
            if step == PASSES - 1:
                with scratch.context_pass():
                    block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
            else:
                block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    report = block.store.packing_report()
    assert report.chunks_dense.get("non-finite") == 1 and report.chunks_packed >= 1
    nan_chunk = next(s for s in block.store.segments if s.start == N)
    assert not nan_chunk.packed and torch.isnan(nan_chunk.storage.k).sum() == 1


def _held(block):
    """The block's stored K/V and cursors, as values (to compare before and after a call)."""
    return ([(s.start, s.end, s.storage.k.clone(), s.storage.v.clone())
             for s in block.store.segments if not s.packed],
            block.global_end_index_int, block.local_end_index_int)


def _same(a, b):
    return (a[1:] == b[1:] and len(a[0]) == len(b[0])
            and all(x[:2] == y[:2] and torch.equal(x[2], y[2]) and torch.equal(x[3], y[3])
                    for x, y in zip(a[0], b[0])))


def test_blocks_out_of_lock_step_on_a_declared_scratch_are_refused_before_anything_changes():
    """Two blocks broke the protocol (no context pass) and fell out of lock step: block 0's
    advance was refused, block 1's went on. A later rewrite of block 1 whose view needs its
    chunk in the scratch (block 0 has written the scratch since) is refused with nothing
    changed; before, it was committed first and then refused, and the next view showed the
    refused write's rows. Every accepted view equals sglang's dense cache's."""
    scratch = ChunkScratch(shared=True)
    off = SETTINGS["off"]
    blocks = [_block(off, scratch) for _ in range(2)]
    plain = [_block(off) for _ in range(2)]  # the oracle: the same calls, no scratch

    def call(i, chunk, start):
        k, v = _kv(chunk, i, start)
        view = blocks[i].update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
        want = plain[i].update_and_get_attention_kv(key=k, value=v, current_chunk_start=start)
        assert torch.equal(view.k, want.k) and torch.equal(view.v, want.v)

    for i in range(2):
        call(i, 0, 0)
    with pytest.raises(CacheProtocolError, match="never committed by a context pass"):
        call(0, 1, N)
    call(1, 1, N)  # block 1 wrote the scratch last: its chunk 0 gets its own copy
    call(0, 2, 0)  # block 0 rewrites its chunk 0 whole: the scratch is its own again
    before = _held(blocks[1])
    k, v = _kv(2, 1, 0)
    with pytest.raises(CacheProtocolError, match=r"needs chunk \[64, 128\)"):
        blocks[1].update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert _same(_held(blocks[1]), before)
    call(1, 3, N)  # a rewrite of its whole chunk: accepted, equal to the dense cache


def test_a_context_pass_of_a_chunk_other_than_the_newest_is_refused():
    scratch = ChunkScratch(shared=True)
    block = _block(SETTINGS["int2-default"], scratch)
    for c in range(2):
        k, v = _kv(c, 0, 0)
        with scratch.context_pass():
            block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    before = _held(block)
    k, v = _kv(5, 0, 0)
    with scratch.context_pass(), pytest.raises(CacheProtocolError, match="ends before it"):
        block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    assert _same(_held(block), before)
