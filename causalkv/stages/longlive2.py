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

from collections.abc import Sequence
from typing import Any

import torch

from causalkv.config import ServerArgs, check_prompts
from causalkv.hooks import Preset, StageRegistration
from causalkv.stages.base import CacheSet, CausalDenoisingStage, even_split

__all__ = ["REGISTRATION", "SCENE_CUT_PREFIX", "LongLive2Stage", "is_scene_cut"]

#: a chunk prompt starting with this text opens a new shot (and is pinned as its sink)
SCENE_CUT_PREFIX = "The scene transitions. "


def is_scene_cut(prompt: str) -> bool:
    """True when ``prompt`` marks a scene cut (starts with `SCENE_CUT_PREFIX`)."""
    return prompt.startswith(SCENE_CUT_PREFIX)


class LongLive2Stage(CausalDenoisingStage):
    """LongLive 2.0: global sink + pinned shot sink, per-shot RoPE offset, CFG."""

    @classmethod
    def _supports_qvg_kv_cache_quantization(cls) -> bool:
        return True

    @classmethod
    def supports_multi_shot(cls) -> bool:
        return True

    @classmethod
    def plan_chunks(
        cls, prompts: Sequence[str], num_chunks: int, server_args: ServerArgs
    ) -> list[str]:
        """The base split; with multi-shot, each shot after the first opens with a scene cut
        (its first chunk's prompt starts with `SCENE_CUT_PREFIX`, added when missing)."""
        prompts = check_prompts(prompts)
        chunks: list[str] = []
        for k, (prompt, n) in enumerate(zip(prompts, even_split(num_chunks, len(prompts)))):
            cut = server_args.multi_shot and k > 0 and not is_scene_cut(prompt)
            chunks += [SCENE_CUT_PREFIX + prompt if cut else prompt] + [prompt] * (n - 1)
        return chunks

    @property
    def guidance_scale(self) -> float:
        return float(self.server_args.guidance_scale)

    def num_branches(self) -> int:
        """2 with classifier-free guidance (``guidance_scale > 1``): its own negative caches."""
        return 2 if self.guidance_scale > 1.0 else 1

    @property
    def negative_caches(self) -> CacheSet | None:
        sets = self.cache_sets()
        return sets[1] if len(sets) > 1 else None

    def report(self) -> dict[str, Any]:
        return {"pinned_chunks": list(self.pinned_chunks)}

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


#: LongLive 2.0 (Wan 2.2 TI2V 5B class): 8-frame chunks, 8 global + 8 pinned shot-sink frames
REGISTRATION = StageRegistration(
    "longlive2",
    LongLive2Stage,
    models=("LongLive2Pipeline",),
    defaults={
        "frames_per_chunk": 8,
        "sink_frames": 8,
        "global_sink_frames": 8,
        "window_frames": 32,
        "rope_offset_frames_per_shot": 8,
        "height": 704,
        "width": 1280,
        "default_frames": 32,
    },
    presets=(
        Preset(
            "tiny-longlive2",
            {"frames_per_chunk": 2, "sink_frames": 2, "global_sink_frames": 2, "window_frames": 8,
             "rope_offset_frames_per_shot": 2, "guidance_scale": 3.0, "default_frames": 8},
            seed=103,
            description="LongLive 2.0-style: 2-frame global + pinned shot sink, 8-frame window, "
            "CFG 3.0, RoPE +2 frames per shot",
        ),
        Preset(
            "tiny-longlive2-1k",
            {"height": 128, "width": 128, "frames_per_chunk": 4, "sink_frames": 4,
             "global_sink_frames": 4, "window_frames": 24, "rope_offset_frames_per_shot": 4,
             "guidance_scale": 3.0, "default_frames": 24},
            seed=105,
            description="LongLive 2.0-style at a chunk size where compression shows: 128x128 "
            "with 1x1 patches (1,024 tokens per 4-frame chunk), 4-frame global + pinned shot "
            "sink, 24-frame window, CFG 3.0, RoPE +4 frames per shot",
            transformer={"patch_size": [1, 1, 1], "num_attention_heads": 2, "num_layers": 2},
        ),
    ),
)
