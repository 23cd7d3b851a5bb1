"""Decoding latents with the Wan VAE and writing the video (``.mp4`` or ``.gif``).

The container is chosen by the output's suffix among the formats an installed encoder can
write (`video_formats`): ``.mp4`` (H.264 through imageio + imageio-ffmpeg's bundled ffmpeg)
and ``.gif`` (Pillow). Any other suffix is refused before generation (`check_video_suffix`);
nothing falls back to a file the user did not name. Files are written atomically
(`causalkv.runtime.outputs.atomic_write`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from causalkv.errors import ConfigError
from causalkv.runtime.outputs import atomic_write

__all__ = ["check_video_suffix", "decode_latents", "video_formats", "write_video"]


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor) -> np.ndarray:
    """Decode latents ``[B, C, F, h, w]`` with diffusers' ``AutoencoderKLWan``.

    Latents are de-normalized with the VAE's ``latents_mean``/``latents_std`` as in
    diffusers' Wan pipeline. Returns uint8 frames ``[T, H, W, 3]`` of the first batch item
    (``T = 1 + scale_factor_temporal * (F - 1)``).
    """
    cfg = vae.config
    z = latents.to(device=vae.device, dtype=vae.dtype)
    c = z.shape[1]
    mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, c, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, c, 1, 1, 1)
    video = vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
    frames = ((video[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return frames.permute(1, 2, 3, 0).cpu().numpy()


def _write_mp4(frames: np.ndarray, path: Path, fps: int) -> None:
    import imageio.v2 as imageio

    t, h, w, _ = frames.shape
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with imageio.get_writer(
        str(path), format="FFMPEG", mode="I", fps=fps, codec="libx264",
        pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error",
    ) as writer:
        for frame in frames:
            writer.append_data(frame)


def _write_gif(frames: np.ndarray, path: Path, fps: int) -> None:
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    images[0].save(
        path, format="GIF", save_all=True, append_images=images[1:],
        duration=max(1, round(1000 / fps)), loop=0,
    )


def _has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _ffmpeg_ready() -> bool:
    """True when imageio-ffmpeg finds an ffmpeg executable (bundled, ``IMAGEIO_FFMPEG_EXE`` or
    on ``PATH``)."""
    if not _has("imageio", "imageio_ffmpeg"):
        return False
    import imageio_ffmpeg

    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        return False
    return True


#: suffix -> (what encodes it, is it installed, writer)
_FORMATS: dict[str, tuple[str, Callable[[], bool], Callable[[np.ndarray, Path, int], None]]] = {
    ".mp4": ("H.264 via imageio-ffmpeg", _ffmpeg_ready, lambda f, p, fps: _write_mp4(f, p, fps)),
    ".gif": ("Pillow", lambda: _has("PIL"), lambda f, p, fps: _write_gif(f, p, fps)),
}


def video_formats() -> dict[str, str]:
    """The video suffixes the installed encoders can write, each with its encoder."""
    return {suffix: what for suffix, (what, ready, _w) in _FORMATS.items() if ready()}


def check_video_suffix(path: str | Path, *, flag: str = "--output") -> str:
    """The lower-case suffix of ``path`` if an installed encoder writes it; else `ConfigError`
    naming the path and the suffixes that work."""
    suffix = Path(path).suffix.lower()
    formats = video_formats()
    if suffix in formats:
        return suffix
    names = list(formats)
    choices = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    choices = choices or "video (install imageio-ffmpeg or Pillow first)"
    what = "has no file extension" if not suffix else f"has extension {suffix!r}, which no installed encoder writes"
    raise ConfigError(f"{flag} {str(path)!r} {what}; name a {choices} file")


def write_video(frames: np.ndarray, path: str | Path, *, fps: int = 16) -> Path:
    """Write uint8 frames ``[T, H, W, 3]`` to ``path`` atomically; returns ``path``.

    The suffix picks the encoder (`video_formats`; ``.mp4`` frames are padded to even
    sizes). An unsupported suffix raises `ConfigError` before anything is written; an
    encoder failure leaves no file behind (an existing ``path`` is kept as it was).
    """
    path = Path(path)
    writer = _FORMATS[check_video_suffix(path)][2]
    return atomic_write(path, lambda tmp: writer(frames, tmp, fps))
