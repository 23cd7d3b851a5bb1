"""`LongLive2Stage`: LongLive 2.0 multi-shot generation with a pinned shot sink and CFG.

- Sinks: the caches keep a global sink (``global_sink_frames`` at the stream start) and a
  shot sink of ``sink_frames``. A chunk whose prompt starts with ``SCENE_CUT_PREFIX``
  ("The scene transitions. ") opens a new shot: after its context pass every cache (both
  CFG branches) pins the chunk's first ``sink_frames`` frames (``pin_current_chunk``), so
  the shot keeps attending to its own opening while the previous shot's sink rolls out.
  Pinning happens only for multi-shot requests (``ServerArgs.multi_shot``), which the
  resolver serves with a cache that has the ``pinned_sink`` capability.
- RoPE: shot ``k`` (the number of scene cuts so far) shifts its frames' RoPE positions by
  ``k * rope_offset_frames_per_shot`` (8 frames in LongLive 2.0).
- Classifier-free guidance: with ``guidance_scale > 1`` a negative branch runs on its own
  caches (same spec, same factory) with the negative prompt;
  ``pred = neg + guidance_scale * (pos - neg)``. Both branches get the context pass.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from causalkv.stages.base import CacheSet, CausalDenoisingStage

__all__ = ["SCENE_CUT_PREFIX", "LongLive2Stage", "is_scene_cut"]

#: a chunk prompt starting with this text opens a new shot (and is pinned as its sink)
SCENE_CUT_PREFIX = "The scene transitions. "


def is_scene_cut(prompt: str) -> bool:
    """True when ``prompt`` marks a scene cut (starts with `SCENE_CUT_PREFIX`)."""
    return prompt.startswith(SCENE_CUT_PREFIX)


class LongLive2Stage(CausalDenoisingStage):
    """LongLive 2.0: global sink + pinned shot sink, per-shot RoPE offset, CFG."""

    stage_name: ClassVar[str] = "longlive2"

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As `CausalDenoisingStage`; with ``guidance_scale > 1`` also the negative caches."""
        super().__init__(*args, **kwargs)
        self.guidance_scale = float(self.server_args.guidance_scale)
        self.negative_caches: CacheSet | None = (
            self._new_cache_set() if self.guidance_scale > 1.0 else None
        )

    def cache_sets(self) -> list[CacheSet]:
        sets = [self.caches]
        if getattr(self, "negative_caches", None) is not None:
            sets.append(self.negative_caches)  # type: ignore[arg-type]
        return sets

    def _reset_stream(self) -> None:
        super()._reset_stream()
        self.shot_index = 0
        #: chunk indices pinned as shot sinks
        self.pinned_chunks: list[int] = []

    def rope_frame_offset(self, chunk_index: int, prompt: str) -> int:
        return self.shot_index * self.model.rope_offset_frames_per_shot

    def begin_chunk(self, chunk_index: int, prompt: str, latents: torch.Tensor) -> None:
        if chunk_index > 0 and is_scene_cut(prompt):
            self.shot_index += 1

    def end_chunk(self, chunk_index: int, prompt: str) -> None:
        if not (self.server_args.multi_shot and chunk_index > 0 and is_scene_cut(prompt)):
            return
        n = self.settings.tokens_per_chunk
        for cs in self.cache_sets():
            for cache in cs.kv:
                cache.pin_current_chunk(n)
        self.pinned_chunks.append(chunk_index)

    def predict(
        self, prompt: str, latents: torch.Tensor, timestep: float, token_start: int, rope_frame_start: int
    ) -> torch.Tensor:
        pos = self._forward(self.caches, prompt, latents, timestep, token_start, rope_frame_start)
        if self.negative_caches is None:
            return pos
        neg = self._forward(
            self.negative_caches, self.negative_prompt, latents, timestep, token_start, rope_frame_start
        )
        return neg + self.guidance_scale * (pos - neg)

    def context_pass(
        self, prompt: str, latents: torch.Tensor, token_start: int, rope_frame_start: int
    ) -> torch.Tensor:
        pred = super().context_pass(prompt, latents, token_start, rope_frame_start)
        if self.negative_caches is not None:
            self._forward(
                self.negative_caches, self.negative_prompt, latents, self.context_noise,
                token_start, rope_frame_start,
            )
        return pred
