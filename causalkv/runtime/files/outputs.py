"""Atomic output files: a temporary file in the destination folder, renamed into place.

Every file ``causalkv generate`` writes (the video, the metrics JSON, saved latents) goes
through `atomic_write`: the content is written to a hidden temporary file next to the
destination (same folder, so the final ``os.replace`` is a rename on one file system), flushed
to disk, then renamed over the destination. A reader therefore sees either the old file or the
complete new one, never a partial file; a failed or interrupted write removes its temporary
file and leaves an existing destination untouched.

`latents_path_for` names the file a finished generation's latents are kept in when its video
cannot be written (``NAME.latents.safetensors`` next to the requested output).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from causalkv.errors import CausalKVError, describe_exception

if TYPE_CHECKING:
    import torch

__all__ = [
    "LATENTS_KEY",
    "OutputLog",
    "OutputWriteError",
    "atomic_write",
    "keep_latents",
    "latents_path_for",
    "load_latents",
    "save_latents",
    "write_json_atomic",
]

#: the tensor name of the latents inside a ``.latents.safetensors`` file
LATENTS_KEY = "latents"


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Write ``path`` through ``write(tmp)`` and rename the result into place; return ``path``.

    ``write`` receives a temporary path in the destination folder with the destination's
    suffix and must leave the complete content there. Missing parent folders are created.
    The file gets the permissions the umask gives a new file (``0o666`` less the umask),
    whatever mode ``write`` created it with (safetensors writes ``0o600``). On any failure
    (``KeyboardInterrupt`` included) the temporary file is removed, the exception propagates
    and an existing ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a new, empty, hidden file beside ``path`` that keeps its suffix (encoders choose the
    # container from it), created with O_EXCL and mode 0o666 less the umask: its bits are the
    # umask's (read back, not computed: reading the umask means changing it)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(8)}.partial{path.suffix}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # the content reaches the disk before the rename
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """`atomic_write` of ``obj`` as indented UTF-8 JSON (NaN/inf refused before anything is written)."""
    text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def latents_path_for(output: str | Path) -> Path:
    """Where a run's latents are kept when its video cannot be written:
    ``out/clip.mp4`` -> ``out/clip.latents.safetensors``."""
    output = Path(output)
    return output.with_name(f"{output.stem}.latents.safetensors")


def save_latents(path: str | Path, latents: torch.Tensor, metadata: Mapping[str, Any] | None = None) -> Path:
    """Save ``latents`` ``[B, C, F, h, w]`` (float32) to a safetensors file, atomically.

    The tensor is stored under `LATENTS_KEY`; ``metadata`` (model, seed, frames, ...) is
    stored as strings in the file header.
    """
    # lazy: safetensors is needed only with --save-latents
    import torch
    from safetensors.torch import save_file

    tensor = latents.detach().to("cpu", torch.float32).contiguous()
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return atomic_write(path, lambda tmp: save_file({LATENTS_KEY: tensor}, str(tmp), metadata=meta))


class OutputWriteError(CausalKVError, RuntimeError):
    """An output of a finished generation could not be written; the message says where its
    latents are kept. ``exit_code``: 2 when the cause is a causalkv error (e.g. an unreadable
    VAE in the model folder), else 1."""

    def __init__(self, message: str, *, exit_code: int = 1, kept: Path | None = None) -> None:
        super().__init__(message)
        self.exit_code, self.kept = exit_code, kept


class OutputLog:
    """The files one run has written, in order, and the rule when a later one fails.

    The outputs of a finished generation are written one after the other (``causalkv
    generate``: ``--save-latents``, ``--output``, ``--metrics``). The first that fails stops
    the run; every file already written stays (each is complete) and the `OutputWriteError`
    names them, as it names the latents kept for a video that could not be encoded.

    Attributes:
        files: ``(flag, path)`` of each file written so far.
    """

    def __init__(self, on_written: Callable[[Path], None] | None = None) -> None:
        self.files: list[tuple[str, Path]] = []
        self.on_written = on_written

    def kept(self) -> str:
        """What the failure line says about the files already written."""
        if not self.files:
            return "nothing was written"
        names = ", ".join(f"{str(p)!r} ({flag})" for flag, p in self.files)
        return f"the files written before it are kept: {names}"

    def write(self, flag: str, path: str | Path, write: Callable[[], Any]) -> Any:
        """``write()`` the output ``path`` (of ``flag``); record it, or raise `OutputWriteError`
        naming ``path``, the cause and the files kept. ``write`` returns ``path`` or a mapping
        (the video's metrics, ``"output"`` its path)."""
        try:
            result = write()
        except OutputWriteError as exc:  # the video: it kept the latents itself
            also = f"; {self.kept()}" if self.files else ""
            raise OutputWriteError(f"{exc}{also}", exit_code=exc.exit_code, kept=exc.kept) from exc
        except Exception as exc:  # noqa: BLE001 - any failure of a write is reported, named
            code = int(getattr(exc, "exit_code", 1)) if isinstance(exc, CausalKVError) else 1
            raise OutputWriteError(
                f"could not write {str(path)!r} ({describe_exception(exc)}); {self.kept()}", exit_code=code
            ) from exc
        written = Path(result["output"]) if isinstance(result, Mapping) else Path(str(result))
        self.files.append((flag, written))
        if self.on_written is not None:
            self.on_written(written)
        return result


def keep_latents(
    output: str | Path, latents: torch.Tensor, cause: BaseException, *, metadata: Mapping[str, Any] | None = None
) -> OutputWriteError:
    """Save ``latents`` to `latents_path_for` ``(output)`` after ``output`` failed with
    ``cause``; the `OutputWriteError` to raise, naming both files (or both failures)."""
    kept = latents_path_for(output)
    try:
        save_latents(kept, latents, metadata)
    except Exception as exc:  # noqa: BLE001 - reported with the first failure
        return OutputWriteError(
            f"could not write {str(output)!r} ({describe_exception(cause)}) nor keep the latents in "
            f"{str(kept)!r} ({describe_exception(exc)}); free disk space or fix the folder and rerun"
        )
    return OutputWriteError(
        f"could not write {str(output)!r} ({describe_exception(cause)}); the generated latents are kept in "
        f"{str(kept)!r}",
        exit_code=int(getattr(cause, "exit_code", 2)) if isinstance(cause, CausalKVError) else 1,
        kept=kept,
    )


def load_latents(path: str | Path) -> tuple[torch.Tensor, dict[str, str]]:
    """The latents ``[B, C, F, h, w]`` and metadata of a file `save_latents` wrote."""
    # lazy: safetensors is needed only to read saved latents
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(LATENTS_KEY), dict(f.metadata() or {})
