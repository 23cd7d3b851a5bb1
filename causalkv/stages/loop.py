"""`ChunkLoop`: the chunk loop of one stage (docs/design.md, "Flow") and the stream it owns.

A stage builds one (``stage.loop``); the host runs a request with `ChunkLoop.run`: for each
chunk of ``frames_per_chunk`` latent frames, ``stage.begin_chunk``, ``stage.denoise_chunk``
(the stage's sampler; its writes are probes, inside ``stage.probe_scope()``), the finiteness
check, the context pass at ``context_noise`` that commits the chunk's clean K/V
(``stage.context_pass``), ``stage.end_chunk``, and one
`ChunkStats`. The loop is the one writer of the stream's state: the next token start in the
caches' positions (`token_end`) and the ``(frame, rope frame)`` of every latent frame the
caches hold (`cache_frames`). A stage reads them there and writes them only through
`restart` and `extend` (LongLive's re-cache rewrites the stream that way). Latent layout
throughout: ``[B, C, F, h, w]``, float32 outside the transformer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from causalkv.errors import ConfigError, NonFiniteLatentsError
from causalkv.stages.records import ChunkStats, DenoisingResult, ForwardRecord

if TYPE_CHECKING:
    from causalkv.stages.base import CausalDenoisingStage

__all__ = ["ChunkLoop", "renoise"]


def renoise(x0: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``x0`` noised to ``sigma``: ``(1 - sigma) * x0 + sigma * noise``, the standard normal
    noise shaped like ``x0`` (float32, drawn on the generator's device)."""
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32, device=generator.device)
    return (1.0 - sigma) * x0 + sigma * noise.to(x0.device)


class ChunkLoop:
    """The chunk loop over one stage's hooks, and the stream state it alone writes."""

    def __init__(self, stage: CausalDenoisingStage) -> None:
        self.stage = stage
        self.restart()

    # ---- the stream --------------------------------------------------------------------------
    @property
    def token_end(self) -> int:
        """The next token start in the caches' positions (== every cache's ``global_end``)."""
        return self._token_end

    @property
    def cache_frames(self) -> tuple[tuple[int, int], ...]:
        """``(frame, rope frame)`` of each latent frame the caches hold, in cache-position order."""
        return tuple(self._cache_frames)

    def restart(self) -> None:
        """An empty stream: token start 0, no frame held (the caches are reset by their owner)."""
        self._token_end = 0
        self._cache_frames: list[tuple[int, int]] = []

    def extend(self, frames: Sequence[tuple[int, int]]) -> None:
        """Record ``frames`` (``(frame, rope frame)`` each) as written at `token_end`: the
        stream advances by their tokens."""
        self._token_end += len(frames) * self.stage.settings.tokens_per_frame
        self._cache_frames.extend(frames)

    # ---- the loop ----------------------------------------------------------------------------
    def check_finite(self, x0: torch.Tensor, chunk_index: int, num_chunks: int) -> None:
        """`NonFiniteLatentsError` when chunk ``chunk_index``'s clean latents hold NaN or inf
        (one host sync per chunk): the run stops there instead of writing a black video."""
        bad = int((~torch.isfinite(x0)).sum())
        if not bad:
            return
        stage = self.stage
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
    def run(
        self,
        noise: torch.Tensor,
        chunk_prompts: Sequence[str],
        *,
        generator: torch.Generator,
        on_chunk_done: Callable[[int, ChunkStats], None] | None = None,
        on_forward: Callable[[ForwardRecord], None] | None = None,
    ) -> DenoisingResult:
        """Generate every chunk of ``noise`` ``[B, C, F, h, w]`` (one prompt per chunk).

        ``stage.begin_request(chunk_prompts)``, the request check, a reset of the stage's
        caches and of the stream; then each chunk: ``len(timesteps)`` denoising calls (the
        first advances the caches, the rest rewrite), then the context pass. ``generator``
        draws the re-noising noise, so a seed fixes the whole run. ``on_chunk_done(i,
        stats)`` runs after each chunk with its `ChunkStats`; ``on_forward`` sees every
        transformer call (`ForwardRecord`).
        """
        stage = self.stage
        stage.begin_request(chunk_prompts)
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
            token_start = self._token_end
            rope_f0 = f0 + stage.rope_frame_offset(i, prompt)
            x = noise[:, :, f0 : f0 + fpc].float()
            with stage.probe_scope():  # the denoising passes store nothing
                x0 = stage.denoise_chunk(i, prompt, x, token_start, rope_f0, generator=generator,
                                         on_forward=on_forward)
            self.check_finite(x0, i, len(chunk_prompts))
            out[:, :, f0 : f0 + fpc] = x0
            ctx_in = renoise(x0, stage.context_noise / 1000.0, generator) if stage.context_noise > 0 else x0
            ctx_pred = stage.context_pass(prompt, ctx_in, token_start, rope_f0)
            if on_forward is not None:
                on_forward(ForwardRecord(i, -1, stage.context_noise, ctx_in, ctx_pred, token_start, rope_f0))
            self.extend([(f, f + rope_f0 - f0) for f in range(f0, f0 + fpc)])
            stage.end_chunk(i, prompt)
            visible = stage.caches.kv[0].visible_positions(
                recent_window_tokens=stage.recent_window_tokens())
            stats = ChunkStats(
                chunk=i,
                frames=(f0, f0 + fpc),
                token_start=token_start,
                rope_frame_start=rope_f0,
                prompt=prompt,
                seconds=time.perf_counter() - t0,
                kv_resident_bytes=stage.kv_resident_nbytes(),
                visible_tokens=sum(b - a for a, b in visible),
            )
            stats_all.append(stats)
            if on_chunk_done is not None:
                on_chunk_done(i, stats)
        return DenoisingResult(latents=out, chunk_stats=stats_all)
