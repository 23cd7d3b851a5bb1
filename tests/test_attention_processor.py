"""The causal attention processor and RoPE offsets against full-sequence oracles.

Oracle: chunked causal generation over the caches must equal ONE forward of diffusers' own
``WanTransformer3DModel`` (stock ``WanAttnProcessor``, stock RoPE for frames ``[0, F)``)
over the whole sequence under a block-causal mask with the same sink / window / recent
window visibility, with per-token timesteps: the clean frames of earlier chunks at the
context-pass timestep, the current chunk at its denoising timestep.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from runtime_helpers import make_options, plan_and_run

from causalkv.caches import CausalCacheSpec, DenseCausalKVCache
from causalkv.caches.cross import CrossAttentionKVCache
from causalkv.runtime.model_io.causal_wan import CausalWanTransformer, rope_at_frame_offset
from causalkv.runtime.model_io.components import load_wan_transformer
from causalkv.runtime.model_io.presets import materialize_preset
from causalkv.stages.records import ForwardRecord


class MaskedWanAttnProcessor(WanAttnProcessor):
    """diffusers' own processor with a fixed boolean attention mask ``[S, S]``."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def visible_mask(num_tokens: int, chunk: int, sink: int, window: int, recent: int | None) -> torch.Tensor:
    """Boolean ``[S, S]``: query token q (in chunk k) sees key p iff p < end_k and p is in the
    sink ``[0, sink)`` or in the tail ``[max(sink, end_k - (window - sink), start_k - recent), end_k)``."""
    mask = torch.zeros(num_tokens, num_tokens, dtype=torch.bool)
    for k in range(num_tokens // chunk):
        start, end = k * chunk, (k + 1) * chunk
        s = min(sink, end)
        lo = max(s, end - (window - s))
        if recent is not None:
            lo = max(lo, start - recent)
        rows = slice(start, end)
        mask[rows, :s] = True
        mask[rows, lo:end] = True
    return mask


def test_rope_at_offset_equals_rows_of_the_full_table(causalkv_home: str) -> None:
    model = load_wan_transformer(materialize_preset("tiny-wan") / "transformer")
    hw = 4 * 4  # 8x8 latents, patch 2x2
    full_cos, full_sin = model.rope(torch.zeros(1, 4, 9, 8, 8))
    for f0, nf in ((0, 3), (3, 3), (6, 3), (2, 5)):
        cos, sin = rope_at_frame_offset(model.rope, nf, 8, 8, f0)
        assert torch.equal(cos, full_cos[:, f0 * hw : (f0 + nf) * hw])
        assert torch.equal(sin, full_sin[:, f0 * hw : (f0 + nf) * hw])
    with pytest.raises(ValueError, match="exceed the model's rope_max_seq_len=1024"):
        rope_at_frame_offset(model.rope, 3, 8, 8, 1023)


@pytest.mark.parametrize(
    ("preset", "frames", "overrides"),
    [
        ("tiny-wan", 12, {}),  # window 9 frames: chunk 3 no longer sees chunk 0
        ("tiny-longlive", 15, {}),  # sink 3 + window 9: chunk 4 sees chunk 0 and chunks 3-4
        ("tiny-lingbot", 12, {}),  # sink 3, recent window 3 frames
        ("tiny-lingbot", 12, {"recent_window_frames": 6}),
    ],
)
def test_chunked_generation_equals_block_causal_full_forward(
    causalkv_home: str, pm, preset: str, frames: int, overrides: dict
) -> None:
    records: list[ForwardRecord] = []
    plan, run = plan_and_run(
        make_options(preset, frames=frames, **overrides), pm, on_forward=records.append
    )
    st = plan.settings
    tpf, tpc = st.tokens_per_frame, st.tokens_per_chunk
    mask = visible_mask(
        frames * tpf, tpc, st.sink_frames * tpf, st.window_frames * tpf, st.recent_window_tokens
    )
    oracle = load_wan_transformer(materialize_preset(preset) / "transformer").eval()
    procs = {}
    for name in oracle.attn_processors:
        procs[name] = MaskedWanAttnProcessor(mask) if ".attn1." in name else WanAttnProcessor()
    oracle.set_attn_processor(procs)
    prompt = run.stage.encode_prompt(plan.chunk_prompts[0])
    last_step = len(run.stage.timesteps) - 1
    finals = {r.chunk_index: r for r in records if r.step == last_step}
    assert sorted(finals) == list(range(plan.num_chunks))
    clean = run.latents
    fpc = st.frames_per_chunk
    for i, rec in finals.items():
        n_frames = (i + 1) * fpc
        x = clean[:, :, :n_frames].clone()
        x[:, :, i * fpc :] = rec.latents
        t = torch.full((1, n_frames * tpf), run.stage.context_noise)
        t[:, i * tpc :] = rec.timestep
        sub = mask[: n_frames * tpf, : n_frames * tpf]
        for proc in oracle.attn_processors.values():
            if isinstance(proc, MaskedWanAttnProcessor):
                proc.mask = sub
        with torch.no_grad():
            full = oracle(x, t, prompt, return_dict=False)[0]
        got = rec.prediction
        want = full[:, :, i * fpc :]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"chunk {i}")


def test_oracle_mask_actually_evicts(causalkv_home: str) -> None:
    # the mask of tiny-wan (no sink, window 9 frames = 144 tokens, chunk 48 tokens):
    # chunk 3 [144, 192) sees [48, 192) and not chunk 0
    mask = visible_mask(192, 48, 0, 144, None)
    assert not mask[150, :48].any() and mask[150, 48:192].all()
    lingbot = visible_mask(192, 48, 48, 192, 48)  # sink 48, recent 48: chunk 3 sees [0,48) + [96,192)
    assert lingbot[150, :48].all() and not lingbot[150, 48:96].any() and lingbot[150, 96:192].all()


def test_processor_writes_advance_then_rewrite(causalkv_home: str) -> None:
    model = load_wan_transformer(materialize_preset("tiny-wan") / "transformer")
    tr = CausalWanTransformer(model)
    spec = CausalCacheSpec(batch_size=1, num_heads=2, head_dim=64, cache_size=144, dtype=torch.float32)
    kv = [DenseCausalKVCache(spec) for _ in range(tr.num_layers)]
    cross = [CrossAttentionKVCache() for _ in range(tr.num_layers)]
    text = torch.randn(1, 8, 32)
    x = torch.randn(1, 4, 3, 8, 8)
    a = tr(x, 500.0, text, kv_caches=kv, cross_caches=cross, token_start=0, rope_frame_start=0)
    b = tr(x, 500.0, text, kv_caches=kv, cross_caches=cross, token_start=0, rope_frame_start=0)
    assert torch.equal(a, b), "a rewrite of the same chunk must give the same output"
    assert all(c.global_end == 48 for c in kv) and all(c.is_initialized for c in cross)
    tr(x, 0.0, text, kv_caches=kv, cross_caches=cross, token_start=48, rope_frame_start=3)
    assert all(c.global_end == 96 for c in kv)
    assert tr.state.last_positions[1] == ((0, 96),)
    with pytest.raises(ValueError, match="non-sequential write current_start=0 global_end=96"):
        tr(x, 0.0, text, kv_caches=kv, cross_caches=cross, token_start=0, rope_frame_start=0)
    with pytest.raises(RuntimeError, match="outside CausalWanTransformer"):
        model(x, torch.tensor([1.0]), text)
