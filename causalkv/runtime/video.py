"""Decoding latents with the Wan VAE and writing the video (mp4 via imageio-ffmpeg, else GIF)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["decode_latents", "write_video"]


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


def write_video(frames: np.ndarray, path: str | Path, *, fps: int = 16) -> Path:
    """Write uint8 frames ``[T, H, W, 3]``; returns the path written.

    ``.mp4`` (or any other suffix but ``.gif``) is encoded with imageio + imageio-ffmpeg's
    bundled ffmpeg (libx264, yuv420p; frames are padded to even sizes). If that encoder is
    unavailable or fails, a GIF is written next to it (same name, ``.gif``) with Pillow.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() != ".gif":
        try:
            _write_mp4(frames, path, fps)
            return path
        except Exception as exc:  # noqa: BLE001 - any encoder failure falls back to GIF
            gif = path.with_suffix(".gif")
            print(f"mp4 encoding failed ({type(exc).__name__}: {exc}); writing {gif} instead")
            path = gif
    _write_gif(frames, path, fps)
    return path


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
        path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0
    )
