"""`LingBotWorldStage`: LingBot-World's interactive world model with recent-window sampling.

Sink and window come from the model config (LingBot-World fast: sink 3, window 45 frames;
other configs sink 9 / window 18 or 3 / 12), each overridable per request
(``ServerArgs.sink_frames`` / ``window_frames``). A denoising call with a recent window of
``r`` frames passes ``recent_window_tokens = r * tokens_per_frame``: the chunk sees the sink
plus only the ``r`` frames before it (and itself), not the whole window.

Which ``r`` (the seed runtime's interactive KV window, sglang 0.5.23 LingBot-World):

- With a per-chunk motion signal (the family's request record `MotionOptions`, flag
  ``--motion``: ``"m"`` the camera moves, ``"s"`` it stands still; `window_per_chunk`): a
  "moving" window of ``moving_window_frames`` (a key of the family's ``causalkv.json``
  record `LingBotConfig`, like ``still_window_frames`` and ``still_chunks``), and
  a smaller "still" one of ``still_window_frames`` once the count of consecutive still
  chunks, the current one included, reaches ``still_chunks`` (N, default 2). A moving chunk
  resets the count and the window; a still chunk below N keeps the window the previous
  chunk had. Chunk 0 starts from a zero count and the moving window.
- Without one: the static ``recent_window_frames`` of the config or the request.

The context pass that writes a chunk's clean K/V never samples: it attends over the whole
window (the seed runtime's cache-update call passes no sample size).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from causalkv.config import ModelConfig, ServerArgs
from causalkv.errors import ConfigError, check_int
from causalkv.stages.base import CausalDenoisingStage
from causalkv.stages.families import LingBotConfig, MotionOptions
from causalkv.stages.settings import StreamSettings

__all__ = ["LingBotWorldStage", "window_per_chunk"]


def window_per_chunk(
    motion: Sequence[str], *, moving_frames: int, still_frames: int | None, still_chunks: int = 2
) -> list[dict[str, Any]]:
    """The seed runtime's per-chunk window: ``[{"mode": "moving"|"still", "frames": r}, ...]``.

    ``motion[i]`` is ``"m"`` or ``"s"``. A moving chunk: count 0, moving window. A still
    chunk: count + 1; at ``count >= max(1, still_chunks)`` (and a still window configured)
    the still window, otherwise the previous chunk's window (the moving one at chunk 0).
    The mode is "still" exactly when the still window applies by that rule.
    """
    check_int("moving window frames", moving_frames, hint="fix moving_window_frames")
    n = max(1, int(still_chunks))
    count, frames = 0, moving_frames
    out: list[dict[str, Any]] = []
    for m in motion:
        count = 0 if m == "m" else count + 1
        still = still_frames is not None and count >= n  # a moving chunk's count is 0
        frames = moving_frames if m == "m" else still_frames if still else frames
        out.append({"mode": "still" if still else "moving", "frames": int(frames)})
    return out


class LingBotWorldStage(CausalDenoisingStage):
    """LingBot-World: the base loop with a recent window per chunk (motion-driven) or static."""

    options: MotionOptions  # the request's record (the registration declares it)

    has_qvg = True

    @classmethod
    def check_request_fields(cls, server_args: ServerArgs, num_chunks: int) -> None:
        """The base checks; a motion signal needs one letter per chunk."""
        super().check_request_fields(server_args, num_chunks)
        motion = server_args.option(MotionOptions).motion
        if motion is not None and len(motion) != num_chunks:
            raise ConfigError(
                f"--motion has {len(motion)} letters for {num_chunks} chunks; give one letter "
                f"(m or s) per chunk, e.g. --motion {','.join(['m'] * num_chunks)}"
            )

    @classmethod
    def check_request(
        cls,
        model: ModelConfig,
        server_args: ServerArgs,
        num_frames: int,
        chunk_prompts: Sequence[str] | None = None,
    ) -> StreamSettings:
        """The base checks; with a motion signal, one letter per chunk, the model must
        configure the interactive window and its moving/still windows must fit the window."""
        settings = super().check_request(model, server_args, num_frames, chunk_prompts)
        if server_args.option(MotionOptions).motion is None:
            return settings
        cls.check_request_fields(server_args, num_frames // settings.frames_per_chunk)
        window = model.option(LingBotConfig)  # its bounds were checked when it was read
        if window.moving_window_frames is None:
            raise ConfigError(
                f"--motion needs an interactive window, but {model.name} sets no "
                "moving_window_frames; add moving_window_frames / still_window_frames to causalkv.json"
            )
        widest = max(window.moving_window_frames, window.still_window_frames or 0)
        need = settings.sink_frames + widest + settings.frames_per_chunk
        if settings.window_frames < need:
            raise ConfigError(
                f"window of {settings.window_frames} frames cannot hold the sink "
                f"({settings.sink_frames}) plus a {widest}-frame recent window plus a chunk of "
                f"{settings.frames_per_chunk} frames; pass --window-frames >= {need}"
            )
        return settings

    # ---- the per-chunk window ---------------------------------------------------------------
    @property
    def interactive(self) -> bool:
        """True when the request carries a motion signal (the interactive window is on)."""
        return self.options.motion is not None

    def _reset_stream(self) -> None:
        super()._reset_stream()
        self._in_context_pass = False
        #: the window each chunk sampled with (interactive requests; the last is the current one)
        self.kv_window_per_chunk: list[dict[str, Any]] = []

    def begin_chunk(self, chunk_index: int, prompt: str, latents: torch.Tensor) -> None:
        if not self.interactive:
            return
        m = self.model.option(LingBotConfig)
        # the rule is a prefix scan: the window of chunk i depends on motion[: i + 1] only
        self.kv_window_per_chunk.append(window_per_chunk(
            self.options.motion[: chunk_index + 1], moving_frames=m.moving_window_frames or 0,
            still_frames=m.still_window_frames, still_chunks=m.still_chunks,
        )[-1])

    def recent_window_tokens(self) -> int | None:
        if self._in_context_pass:
            return None
        if self.kv_window_per_chunk:
            return self.kv_window_per_chunk[-1]["frames"] * self.settings.tokens_per_frame
        return super().recent_window_tokens()

    def context_pass(
        self, prompt: str, latents: torch.Tensor, token_start: int, rope_frame_start: float
    ) -> torch.Tensor:
        self._in_context_pass = True
        try:
            return super().context_pass(prompt, latents, token_start, rope_frame_start)
        finally:
            self._in_context_pass = False

    def report(self) -> dict[str, Any]:
        return {
            "interactive_kv_window": self.interactive,
            "kv_window_per_chunk": [dict(w) for w in self.kv_window_per_chunk],
        }
