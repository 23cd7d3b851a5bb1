"""A tiny random-weight LingBot-World through vLLM-Omni's own classes: causalkv's store against
vLLM-Omni's dense cache (the oracle: the stock transformer and the stock ``_update_cache``)."""

from __future__ import annotations

import pytest
import tiny_lingbot as tl
import torch

from causalkv.caches.qvg.options import QVGKVQuantArgs

BLOCKS = 6  # two past the 9-frame window (3 chunks): eviction and packing both happen
CPU = torch.device("cpu")


def _run(quant: str | None, dtype=torch.float32, blocks: int = BLOCKS):
    from causalkv.vllm_omni.pipeline import install

    model = tl.build_transformer(dtype=dtype)
    if quant is not None:
        install(model, QVGKVQuantArgs.from_codec_name(quant))
    h, w = tl.LATENT_HW
    cache = model.allocate_cache(batch_size=1, latent_height=h, latent_width=w, device=CPU, dtype=dtype)
    return tl.run_blocks(model, cache, blocks, dtype=dtype), model, cache


@pytest.fixture(scope="module")
def stock(runtime):
    return {dt: _run(None, dt) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_off_is_bit_for_bit_vllm_omnis_dense_cache(stock, dtype):
    """Every probe and committing pass of six blocks (sink, window roll-out) equals stock."""
    ref, _, ref_cache = stock[dtype]
    outs, model, cache = _run("off", dtype)
    assert type(model).__name__ == "CausalKVLingBotTransformer"
    assert type(cache.self_attention[0]).__name__ == "LingBotLayerKV"
    assert len(outs) == len(ref) == BLOCKS * (tl.PROBES + 1)
    for a, b in zip(outs, ref):
        assert torch.equal(a, b)
    for ours, theirs in zip(cache.self_attention, ref_cache.self_attention):  # vLLM-Omni's cursors
        assert (ours.end, ours.absolute_end, ours.last_start, ours.sink_end) == (
            theirs.end, theirs.absolute_end, theirs.last_start, theirs.sink_end)


@pytest.mark.parametrize("quant", ["int4", "int2"])
def test_qvg_holds_fewer_bytes_than_vllm_omnis_dense_cache_all_layers(stock, quant):
    """Resident and peak bytes of every layer's store against vLLM-Omni's preallocated
    ``[B, max_tokens, H, D]`` K and V (all layers), and the outputs stay close to stock."""
    ref, _, ref_cache = stock[torch.float32]
    outs, model, _ = _run(quant)
    ledger = model.causalkv_ledger
    dense = sum(c.key.nbytes + c.value.nbytes for c in ref_cache.self_attention)
    assert ledger.dense_bytes == dense
    assert ledger.num_layers == tl.TINY["num_layers"]
    assert 0 < ledger.resident_nbytes < dense
    assert ledger.peak_nbytes < ledger.dense_peak_bytes
    scale = max(r.abs().max().item() for r in ref)
    diff = max((a - b).abs().max().item() for a, b in zip(outs, ref))
    assert 0 < diff < (0.01 if quant == "int4" else 0.1) * scale, (quant, diff, scale)
