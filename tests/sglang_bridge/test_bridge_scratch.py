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

Also: a chunk never committed by a context pass is refused at the next advance (its K/V were
another block's by then), a read of the scratch by a block that did not write it last is
refused, and a failed context commit (non-finite K/V the codec refuses) leaves the block as
it was.
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

from causalkv.caches.qvg import ChunkScratch
from causalkv.caches.qvg.format import packed_nbytes_formula
from causalkv.caches.qvg.options import QVGKVQuantArgs as CausalKVQuant
from causalkv.errors import UsageError
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
    scratch = ChunkScratch()
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
    assert scratch.peak_resident_nbytes == max(held_after)


def test_keep_recent_0_holds_three_packed_chunks_per_block_and_one_scratch():
    """Steady state (after a context pass, before the next advance), by the byte formula."""
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch()
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
    scratch = ChunkScratch()
    blocks = [_block(quant, scratch) for _ in range(LAYERS)]
    _, held = _stream(blocks, scratch)
    q2 = CausalKVQuant(codec="int2", centroids=8, block_size=16)
    q4 = CausalKVQuant(codec="int4", centroids=8, block_size=16)
    p2, p4 = (2 * packed_nbytes_formula((1, H, N, D), q) for q in (q2, q4))
    assert held[-1] == LAYERS * (2 * p2 + p4) + 2 * N * H * D * 2
    tiers = [s.storage.recent for s in blocks[0].store.segments if s.packed]
    assert tiers.count(True) == 1  # the newest completed chunk


def test_a_chunk_without_a_context_pass_is_refused_at_the_next_advance():
    scratch = ChunkScratch()
    blocks = [_block(SETTINGS["int2-default"], scratch) for _ in range(2)]
    for block in blocks:
        k, v = _kv(0, 0, 0)
        block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=0)
    k, v = _kv(1, 0, 0)
    with pytest.raises(UsageError, match="never committed by a context pass"):
        blocks[0].update_and_get_attention_kv(key=k, value=v, current_chunk_start=N)


def test_a_failed_context_commit_leaves_the_block_as_it_was():
    quant = SETTINGS["int2-recent0"]
    scratch = ChunkScratch()
    block = _block(quant, scratch)
    for c in range(2):
        for step in range(PASSES):
            k, v = _kv(c, 0, step)
            if step == PASSES - 1:
                with scratch.context_pass():
                    block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
            else:
                block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=c * N)
    k, v = _kv(2, 0, 0)
    block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=2 * N)
    segments, held = list(block.store.segments), block.resident_nbytes()
    calls = block.quantize_calls
    k[0, 3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"), scratch.context_pass():
        block.update_and_get_attention_kv(key=k, value=v, current_chunk_start=2 * N)
    assert [s is t for s, t in zip(block.store.segments, segments, strict=True)] == [True] * len(segments)
    assert (block.resident_nbytes(), block.quantize_calls) == (held, calls)
