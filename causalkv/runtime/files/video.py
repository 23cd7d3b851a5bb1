"""Decoding latents with the Wan VAE and writing the video (``.mp4`` or ``.gif``).

The container is chosen by the output's suffix among the formats an installed encoder can
write (`video_formats`): ``.mp4`` (H.264 through imageio-ffmpeg's ffmpeg) and ``.gif``
(Pillow). Any other suffix is refused before generation (`check_video_suffix`); nothing falls
back to a file the user did not name. Files are written atomically
(`causalkv.runtime.files.outputs.atomic_write`) and read back before the rename: a file that does
not decode to every frame is never renamed into place (`EncoderError`).
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from causalkv.errors import ConfigError, EncoderError
from causalkv.runtime.files.outputs import atomic_write
from causalkv.runtime.processes.launch import describe_exit

if TYPE_CHECKING:  # numpy and torch load with a run; `video_formats` (--help) needs neither
    import numpy as np
    import torch

__all__ = ["check_video_suffix", "decode_latents", "video_formats", "write_video"]


def decode_latents(vae: Any, latents: torch.Tensor) -> np.ndarray:
    """Decode latents ``[B, C, F, h, w]`` with diffusers' ``AutoencoderKLWan``.

    Latents are de-normalized with the VAE's ``latents_mean``/``latents_std`` as in
    diffusers' Wan pipeline. Returns uint8 frames ``[T, H, W, 3]`` of the first batch item
    (``T = 1 + scale_factor_temporal * (F - 1)``).
    """
    import torch

    with torch.no_grad():
        cfg = vae.config
        z = latents.to(device=vae.device, dtype=vae.dtype)
        c = z.shape[1]
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, c, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, c, 1, 1, 1)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        frames = ((video[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return frames.permute(1, 2, 3, 0).cpu().numpy()


#: libx264 constant rate factor: imageio's default quality 5 of 10 ((1 - 5/10) * 51)
MP4_CRF = 25.5


def _ffmpeg_error(stderr: str, rc: int | None = None) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    status = f"ffmpeg {describe_exit(rc)}" if rc else "ffmpeg reported an error"
    return f"{status}: {lines[-1]}" if lines else status


def _write_mp4(frames: np.ndarray, path: Path, fps: int) -> None:
    """H.264 in an mp4 container through imageio-ffmpeg's ffmpeg (``IMAGEIO_FFMPEG_EXE`` or
    the bundled one), then read back: any error ffmpeg reports (its exit status, or an error
    line such as "Error writing trailer", which older ffmpeg versions report with status 0)
    or a file that does not decode to every frame raises `EncoderError`."""
    # lazy: ffmpeg is looked up only when a video is written
    import imageio_ffmpeg
    import numpy as np

    t, h, w, _ = frames.shape
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
        t, h, w, _ = frames.shape
    cmd = [
        imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-f", "rawvideo", "-vcodec", "rawvideo",
        "-s", f"{w}x{h}", "-pix_fmt", "rgb24", "-r", f"{fps:.02f}", "-i", "-",
        "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", str(MP4_CRF),
        "-v", "error", "-xerror", "-f", "mp4", str(path),
    ]
    # its own session: a Ctrl-C reaches this process, whose `subprocess.run` kills ffmpeg; a
    # ffmpeg that dies while it reads (a broken pipe) is judged by its status and its log
    proc = subprocess.run(cmd, input=np.ascontiguousarray(frames, dtype=np.uint8).tobytes(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    rc, stderr = proc.returncode, proc.stderr.decode("utf-8", "replace")
    if rc != 0 or stderr.strip():
        raise EncoderError(_ffmpeg_error(stderr, rc))
    try:
        decoded, _secs = imageio_ffmpeg.count_frames_and_secs(str(path))
    except RuntimeError as exc:
        raise EncoderError(f"the file ffmpeg wrote does not decode ({_ffmpeg_error(str(exc))})") from None
    if decoded != t:
        raise EncoderError(f"the file ffmpeg wrote decodes to {decoded} of its {t} frames")


def _write_gif(frames: np.ndarray, path: Path, fps: int) -> None:
    """An animated GIF through Pillow, then read back (every frame must decode)."""
    # lazy: Pillow loads only for a .gif output
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    images[0].save(
        path, format="GIF", save_all=True, append_images=images[1:],
        duration=max(1, round(1000 / fps)), loop=0,
    )
    try:
        with Image.open(path) as im:
            decoded = im.n_frames
    except (OSError, ValueError) as exc:
        raise EncoderError(f"the GIF Pillow wrote does not decode ({type(exc).__name__}: {exc})") from None
    if decoded != len(images):
        raise EncoderError(f"the GIF Pillow wrote decodes to {decoded} of its {len(images)} frames")


def _ffmpeg_ready() -> bool:
    """True when imageio-ffmpeg finds an ffmpeg executable (bundled, ``IMAGEIO_FFMPEG_EXE`` or
    on ``PATH``)."""
    try:
        # lazy: ffmpeg is looked up only when a video format is asked for
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return False
    return True


#: suffix -> (what encodes it, is it installed, writer)
_FORMATS: dict[str, tuple[str, Callable[[], bool], Callable[[np.ndarray, Path, int], None]]] = {
    ".mp4": ("H.264 via imageio-ffmpeg", _ffmpeg_ready, lambda f, p, fps: _write_mp4(f, p, fps)),
    ".gif": ("Pillow", lambda: importlib.util.find_spec("PIL") is not None, lambda f, p, fps: _write_gif(f, p, fps)),
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
    choices = " or ".join(formats) or "video (install imageio-ffmpeg or Pillow first)"
    what = "has no file extension" if not suffix else f"has extension {suffix!r}, which no installed encoder writes"
    raise ConfigError(f"{flag} {str(path)!r} {what}; name a {choices} file")


def write_video(frames: np.ndarray, path: str | Path, *, fps: int = 16) -> Path:
    """Write uint8 frames ``[T, H, W, 3]`` to ``path`` atomically; returns ``path``.

    The suffix picks the encoder (`video_formats`; ``.mp4`` frames are padded to even
    sizes). An unsupported suffix raises `ConfigError` before anything is written. The file
    is read back before it is renamed into place: an encoder failure, or a file that does not
    decode to every frame, raises `EncoderError` and leaves no file behind (an existing
    ``path`` is kept as it was).
    """
    path = Path(path)
    writer = _FORMATS[check_video_suffix(path)][2]
    return atomic_write(path, lambda tmp: writer(frames, tmp, fps))
