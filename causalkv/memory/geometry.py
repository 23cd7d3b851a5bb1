"""Model geometry for the planner: what it needs of a model (`ModelGeometry`), the built-in
models (`BUILTIN_MODELS`), and the latent arithmetic every layer shares: tokens per latent frame
(`frame_tokens`, from pixels `pixel_frame_tokens`) and the frames Wan's causal VAE decodes (`decoded_frames`). A causalkv preset or a local diffusers / sglang folder is read into a
`ModelGeometry` by the runtime (`causalkv.runtime.model_io.geometry`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from causalkv.errors import ConfigError, alternatives, check_int, is_int, multiples_around


@dataclass(frozen=True)
class ModelGeometry:
    """What the planner needs of a model (all frame counts are latent frames).

    Attributes:
        name: shown in the header.
        num_layers, num_heads, head_dim: the self-attention caches' geometry.
        vae_scale_spatial, vae_scale_temporal: the VAE's compression.
        patch: the transformer's spatial patch ``(ph, pw)``.
        frames_per_chunk: latent frames per chunk.
        sink_frames: the sink (LongLive 2.0: also the most a pinned shot sink keeps).
        global_sink_frames: the stream-start sink kept while a shot sink is pinned.
        window_frames: the frames attention sees, = the frames each cache holds (sglang's
            ``local_attn_size`` or ``sliding_window_num_frames``).
        height, width: the default video size in pixels.
        fps: frames per second of the video (for ``--seconds``).
        default_frames: video frames of a request that gives none (sglang's ``num_frames``).
        shot_sinks: a scene cut pins a shot sink (LongLive 2.0); other models take one shot.
        window_is_video: the cache holds the whole video (Self-Forcing's global attention
            over a 21-frame video): the budget answer is the longest video, not a window.
    """

    name: str
    num_layers: int
    num_heads: int
    head_dim: int
    vae_scale_spatial: int
    vae_scale_temporal: int
    patch: tuple[int, int]
    frames_per_chunk: int
    sink_frames: int
    global_sink_frames: int
    window_frames: int
    height: int
    width: int
    fps: int = 16
    default_frames: int = 81
    shot_sinks: bool = False
    window_is_video: bool = False

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self) if f.type == "int"):  # the sinks may be 0
            check_int(f"{self.name}: {name}", getattr(self, name), minimum=0 if "sink" in name else 1,
                      hint="fix the model's config")
        if len(self.patch) != 2 or not all(is_int(p) for p in self.patch):
            raise ConfigError(f"{self.name}: patch must be 2 positive ints, got {self.patch!r}")
        if self.global_sink_frames > self.sink_frames:
            raise ConfigError(
                f"{self.name}: global_sink_frames={self.global_sink_frames} exceeds "
                f"sink_frames={self.sink_frames}; fix the model's config"
            )

    def tokens_per_frame(self, height: int, width: int) -> int:
        """Latent tokens per latent frame at ``height x width`` pixels (`pixel_frame_tokens`)."""
        return pixel_frame_tokens(height, width, self.vae_scale_spatial, self.patch, self.name)

    def latent_frames(self, video_frames: int) -> int:
        """Latent frames of a ``video_frames`` video (Wan's causal VAE: ``(F - 1) // s + 1``)."""
        return (video_frames - 1) // self.vae_scale_temporal + 1

    def video_frames(self, latent_frames: int) -> int:
        return decoded_frames(latent_frames, self.vae_scale_temporal)

    def describe(self) -> str:
        return f"{self.name} ({self.num_layers} layers x {self.num_heads} heads x {self.head_dim})"


def decoded_frames(latent_frames: int, temporal_scale: int) -> int:
    """Video frames Wan's causal VAE decodes from ``latent_frames`` latent frames: the first
    latent frame one, each later one ``temporal_scale``, ``1 + s x (F - 1)``."""
    return 1 + temporal_scale * (latent_frames - 1)


def frame_tokens(latent_height: int, latent_width: int, patch: Sequence[int]) -> int:
    """Tokens of one ``latent_height x latent_width`` latent frame patchified by ``patch``
    (height, width): one per whole patch, ``(h // p_h) * (w // p_w)``."""
    return (latent_height // patch[0]) * (latent_width // patch[1])


def pixel_frame_tokens(height: int, width: int, scale: int, patch: Sequence[int], model: str,
                       flags: bool = True) -> int:
    """Tokens of one latent frame of a ``height x width``-pixel video: the one rule that the
    VAE's spatial ``scale`` times the ``patch`` (height, width) divides each side. A side it
    does not divide is a `ConfigError` naming ``model`` and offering the nearest sizes, as a
    flag (``--height``) or, with ``flags=False``, as a setting (``height``)."""
    for label, px, p in (("height", height, patch[0]), ("width", width, patch[1])):
        label, unit = f"--{label}" if flags else label, scale * p
        check_int(label, px, minimum=1, hint=f"pass a multiple of {unit}")
        if px % unit:
            near = alternatives(multiples_around(px, unit))
            raise ConfigError(f"{label} {px} is not a multiple of {unit} (VAE scale {scale} x patch "
                              f"{p} of {model}); {'pass' if flags else 'set'} {label} {near}")
    return frame_tokens(height // scale, width // scale, patch)


#: the built-in models (published geometry; docs/design.md, "Models"), by ``causalkv memory`` name
BUILTIN_MODELS: Mapping[str, ModelGeometry] = {
    "longlive2": ModelGeometry(
        "LongLive 2.0 5B", 30, 24, 128, vae_scale_spatial=16, vae_scale_temporal=4,
        patch=(2, 2), frames_per_chunk=8, sink_frames=8, global_sink_frames=8,
        window_frames=32, height=704, width=1280, fps=24, default_frames=61, shot_sinks=True,
    ),
    "lingbot": ModelGeometry(
        "LingBot-World", 40, 40, 128, vae_scale_spatial=8, vae_scale_temporal=4,
        patch=(2, 2), frames_per_chunk=3, sink_frames=3, global_sink_frames=3,
        window_frames=45, height=480, width=832, fps=16, default_frames=117,
    ),
    "self-forcing": ModelGeometry(
        "Self-Forcing Wan 1.3B", 30, 12, 128, vae_scale_spatial=8, vae_scale_temporal=4,
        patch=(2, 2), frames_per_chunk=3, sink_frames=0, global_sink_frames=0,
        window_frames=21, height=480, width=832, fps=16, default_frames=81,
        window_is_video=True,
    ),
}
