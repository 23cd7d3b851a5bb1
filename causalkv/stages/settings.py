"""`StreamSettings`: the streaming policy of one request (model config + request overrides),
validated where it is derived, and `even_split`, the base stage's prompts-to-chunks rule.

Part of the stage's planning (`causalkv.stages.planning`): everything here is known before
any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from causalkv.caches.spec import CausalCacheSpec
from causalkv.errors import ConfigError, check_int

__all__ = ["StreamSettings", "even_split"]


@dataclass(frozen=True)
class StreamSettings:
    """The effective streaming policy of one request, in latent frames (model + overrides).

    Validated on construction (`ConfigError`, a ValueError naming the value and the flag);
    `StagePlanning.stream_settings`, its one maker, keeps the global sink within the sink and
    the cache at least the window.

    Attributes:
        frames_per_chunk, tokens_per_frame: chunk geometry.
        sink_frames: the sink (LongLive 2.0: the pinned shot sink's size).
        global_sink_frames: the stream-start sink kept while a shot sink is pinned.
        window_frames: frames attention sees at most (sink and current chunk included).
        cache_frames: frames each cache retains.
        recent_window_frames: LingBot-World recent-window sampling, or None.
        multi_shot: shot sinks are pinned: the window must hold both sinks plus a chunk.
    """

    frames_per_chunk: int
    tokens_per_frame: int
    sink_frames: int
    global_sink_frames: int
    window_frames: int
    cache_frames: int
    recent_window_frames: int | None
    multi_shot: bool = False

    def __post_init__(self) -> None:
        fpc = check_int("frames_per_chunk", self.frames_per_chunk, minimum=1,
                        hint="fix frames_per_chunk in causalkv.json")
        check_int("tokens_per_frame", self.tokens_per_frame, minimum=1,
                  hint="check the model's resolution and patch size")
        sink = check_int("sink frames", self.sink_frames, hint="fix --sink-frames")
        window = check_int("window frames", self.window_frames, minimum=1, hint="fix --window-frames")
        if self.recent_window_frames is not None:
            check_int("recent window frames", self.recent_window_frames,
                      hint="fix --recent-window-frames")
        if window < fpc:
            raise ConfigError(
                f"window of {window} frames is smaller than a chunk of {fpc} frames; "
                f"pass --window-frames >= {fpc}"
            )
        max_sink = self.global_sink_frames + sink if self.multi_shot else sink
        if window < max_sink + fpc:
            what = (f"the global sink ({self.global_sink_frames}) plus a pinned shot sink ({sink})"
                    if self.multi_shot else f"the sink ({sink})")
            raise ConfigError(
                f"window of {window} frames cannot hold {what} plus a chunk of {fpc} frames; "
                f"pass --window-frames >= {max_sink + fpc} or a smaller --sink-frames"
            )

    @property
    def tokens_per_chunk(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def recent_window_tokens(self) -> int | None:
        recent = self.recent_window_frames
        return None if recent is None else recent * self.tokens_per_frame

    def kv_spec(self, **layer: Any) -> CausalCacheSpec:
        """One layer's `CausalCacheSpec`: these settings in tokens (frames x
        ``tokens_per_frame``) plus ``layer``, the layer's other spec fields (``batch_size``,
        ``num_heads`` starting at global head ``head_offset``, ``head_dim``, ``dtype``,
        ``device``)."""
        tpf = self.tokens_per_frame
        return CausalCacheSpec(
            cache_size=self.cache_frames * tpf,
            sink_tokens=self.sink_frames * tpf,
            global_sink_tokens=self.global_sink_frames * tpf,
            attention_window_size=self.window_frames * tpf,
            **layer,
        )


def even_split(num_chunks: int, num_shots: int) -> list[int]:
    """Chunks per shot: ``num_chunks // num_shots`` each, the first shots one more while
    chunks remain (with fewer chunks than shots, the last shots get none)."""
    base, extra = divmod(num_chunks, num_shots)
    return [base + (k < extra) for k in range(num_shots)]
