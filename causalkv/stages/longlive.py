"""`LongLiveStage`: LongLive 1.0, a frame sink and interactive prompt switches.

LongLive keeps a frame sink (3 frames) and a short window (12 frames incl. the sink). When
the prompt changes between chunks it re-caches: the cross-attention K/V are reset and the
frames the next chunk would attend to (the sink and the newest frames in the window) are
run again at ``context_noise`` with the new prompt, so their cached K/V follow the new
text. In cache terms: every layer's cache is reset and those frames are written again in
ascending order, one piece per original chunk (so the sink is written first and stays the
sink); their RoPE positions stay those of the original frames.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any

import torch

from causalkv.errors import UsageError
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.loop import renoise

__all__ = ["LongLiveStage"]


class LongLiveStage(CausalDenoisingStage):
    """LongLive 1.0: the base loop plus re-caching the visible frames on a prompt switch."""

    has_qvg = True

    def _reset_stream(self) -> None:
        super()._reset_stream()
        self._last_prompt: str | None = None
        #: chunk indices at which a prompt switch re-cached the stream
        self.recache_events: list[int] = []

    def report(self) -> dict[str, Any]:
        return {"recache_chunks": list(self.recache_events)}

    def begin_chunk(self, chunk_index: int, prompt: str, latents: torch.Tensor) -> None:
        previous, self._last_prompt = self._last_prompt, prompt
        if previous is None or previous == prompt or not self.loop.cache_frames:
            return
        self.recache(prompt, latents)
        self.recache_events.append(chunk_index)

    @torch.no_grad()
    def recache(self, prompt: str, latents: torch.Tensor) -> None:
        """Re-write the visible frames' K/V with ``prompt`` (``latents``: clean ``[B, C, F, h, w]``).

        The frames are those the caches show now (``(frame, rope_frame)`` each, ascending).
        Every re-cache write is context: each group of frames (one per original chunk)
        commits, told the next group's size (the next chunk's after the last)."""
        fpc, tpf = self.settings.frames_per_chunk, self.settings.tokens_per_frame
        view = self.caches.kv[0].get_attention_kv(recent_window_tokens=self.settings.recent_window_tokens)
        slots = {f for a, b in view.position_ranges for f in range(a // tpf, (b - 1) // tpf + 1)}
        frames = [fr for s, fr in enumerate(self.loop.cache_frames) if s in slots]
        for cs in self.cache_sets():
            cs.reset()
        self.loop.restart()
        groups = [list(g) for _, g in groupby(frames, key=lambda fr: fr[0] // fpc)]
        for i, piece in enumerate(groups):
            idx = [f for f, _ in piece]
            x = latents[:, :, idx[0] : idx[-1] + 1]
            if x.shape[2] != len(idx):
                raise UsageError(f"re-cache piece {idx} is not contiguous")
            if self.context_noise > 0:
                gen = torch.Generator(device="cpu").manual_seed(self.server_args.seed + idx[0])
                x = renoise(x, self.context_noise / 1000.0, gen)
            nxt = len(groups[i + 1]) if i + 1 < len(groups) else fpc
            with self.context_scope(next_tokens=nxt * tpf):
                self._forward(self.caches, prompt, x, self.context_noise, self.loop.token_end, piece[0][1])
            self.loop.extend(piece)
