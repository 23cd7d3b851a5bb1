"""The chunk loop (docs/design.md, "Flow"), driven over a stage's hooks.

`run_chunks` is what `CausalDenoisingStage.generate` runs: for each chunk of
``frames_per_chunk`` latent frames, ``stage.begin_chunk``, ``stage.denoise_chunk`` (the
sampler; `denoise_dmd` is the base stage's), the finiteness check, the context pass at
``context_noise`` that writes the chunk's clean K/V, ``stage.end_chunk``, and one
`ChunkStats`. Latent layout throughout: ``[B, C, F, h, w]``, float32 outside the transformer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from causalkv.errors import ConfigError, NonFiniteLatentsError
from causalkv.stages.records import ChunkStats, ForwardRecord, GenerationResult

if TYPE_CHECKING:
    from causalkv.stages.base import CausalDenoisingStage

__all__ = ["check_finite", "denoise_dmd", "noise_like", "run_chunks"]


def noise_like(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Standard normal noise shaped like ``x`` (float32, drawn on the generator's device)."""
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=generator.device)
    return noise.to(x.device)


def denoise_dmd(
    stage: CausalDenoisingStage,
    chunk_index: int,
    prompt: str,
    x: torch.Tensor,
    token_start: int,
    rope_frame_start: float,
    *,
    generator: torch.Generator,
    on_forward: Callable[[ForwardRecord], None] | None = None,
) -> torch.Tensor:
    """The DMD sampler over one chunk's noise ``x`` ``[B, C, F, h, w]``: each step predicts
    ``x0 = x - sigma * pred`` and re-noises it to the next sigma with ``generator``; the
    clean latents (float32)."""
    x0 = x
    steps = len(stage.timesteps)
    for j in range(steps):
        t, sigma = stage.timesteps[j], stage.sigmas[j]
        pred = stage.predict(prompt, x, t, token_start, rope_frame_start)
        x0 = x - sigma * pred
        if on_forward is not None:
            on_forward(ForwardRecord(chunk_index, j, t, x, pred, token_start, rope_frame_start))
        if j + 1 < steps:
            s_next = stage.sigmas[j + 1]
            x = (1.0 - s_next) * x0 + s_next * noise_like(x0, generator)
    return x0


def check_finite(stage: CausalDenoisingStage, x0: torch.Tensor, chunk_index: int, num_chunks: int) -> None:
    """`NonFiniteLatentsError` when chunk ``chunk_index``'s clean latents hold NaN or inf
    (one host sync per chunk): the run stops there instead of writing a black video."""
    if bool(torch.isfinite(x0).all()):
        return
    bad = int((~torch.isfinite(x0)).sum())
    hint = (
        f"lower --guidance-scale (it is {stage.server_args.guidance_scale:g})"
        if stage.num_branches() > 1
        else "check the model's timesteps, shift and weights"
    )
    raise NonFiniteLatentsError(
        f"the latents of chunk {chunk_index} (0-based, of {num_chunks}) are not finite ({bad:,} of "
        f"{x0.numel():,} values are NaN or inf); the run stops and nothing is written; {hint}"
        + (", or compute in --dtype float32" if stage.denoiser.dtype != torch.float32 else ""),
        chunk=chunk_index, num_chunks=num_chunks,
    )


@torch.no_grad()
def run_chunks(
    stage: CausalDenoisingStage,
    noise: torch.Tensor,
    chunk_prompts: Sequence[str],
    *,
    generator: torch.Generator,
    on_chunk_done: Callable[[int, ChunkStats], None] | None = None,
    on_forward: Callable[[ForwardRecord], None] | None = None,
) -> GenerationResult:
    """Generate every chunk of ``noise`` ``[B, C, F, h, w]`` (one prompt per chunk) with
    ``stage``; see `CausalDenoisingStage.generate`."""
    b, _c, num_frames, _h, _w = noise.shape
    if b != stage.batch_size:
        raise ConfigError(f"noise batch {b} does not match the stage's batch_size={stage.batch_size}")
    stage.check_request(stage.model, stage.server_args, num_frames, list(chunk_prompts))
    stage.reset()
    fpc = stage.settings.frames_per_chunk
    out = torch.zeros(noise.shape, dtype=torch.float32, device=noise.device)
    stats_all: list[ChunkStats] = []
    for i, prompt in enumerate(chunk_prompts):
        t0 = time.perf_counter()
        f0 = i * fpc
        stage.begin_chunk(i, prompt, out)
        token_start = stage._token_end
        rope_f0 = f0 + stage.rope_frame_offset(i, prompt)
        x = noise[:, :, f0 : f0 + fpc].float()
        x0 = stage.denoise_chunk(i, prompt, x, token_start, rope_f0, generator=generator, on_forward=on_forward)
        stage.check_finite(x0, i, len(chunk_prompts))
        out[:, :, f0 : f0 + fpc] = x0
        ctx_in = x0
        if stage.context_noise > 0:
            s_ctx = stage.context_noise / 1000.0
            ctx_in = (1.0 - s_ctx) * x0 + s_ctx * noise_like(x0, generator)
        ctx_pred = stage.context_pass(prompt, ctx_in, token_start, rope_f0)
        if on_forward is not None:
            on_forward(ForwardRecord(i, -1, stage.context_noise, ctx_in, ctx_pred, token_start, rope_f0))
        stage._token_end = token_start + fpc * stage.settings.tokens_per_frame
        stage._cache_frames.extend((f, f + rope_f0 - f0) for f in range(f0, f0 + fpc))
        stage.end_chunk(i, prompt)
        view = stage.caches.kv[0].get_attention_kv(recent_window_tokens=stage.recent_window_tokens())
        stats = ChunkStats(
            chunk=i,
            frames=(f0, f0 + fpc),
            token_start=token_start,
            rope_frame_start=rope_f0,
            prompt=prompt,
            seconds=time.perf_counter() - t0,
            kv_resident_bytes=stage.kv_resident_nbytes(),
            visible_tokens=view.num_visible,
        )
        stats_all.append(stats)
        if on_chunk_done is not None:
            on_chunk_done(i, stats)
    return GenerationResult(latents=out, chunk_stats=stats_all)
