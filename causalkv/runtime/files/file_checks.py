"""Checks of the files a request writes or reads, before anything loads.

Called by `causalkv.runtime.host.request_checks.check_before_load` (and the sglang checkpoint writer):

- ``CAUSALKV_HOME``: a preset that is not built yet can be created there (`check_home`);
- output files (video, metrics, saved latents): not a folder, not a special file, in a
  folder that exists (or can be created), is writable and has room, distinct from each
  other, a video suffix an installed encoder writes, and no file of another kind replaced
  without ``--force`` (`check_output_files`);
- the model folder's files (for a preset: once it exists): every component it lists is there,
  every JSON file parses and every safetensors file is as long as its header says (a
  truncated download fails here, not after the text encoder has loaded) (`check_model_files`).

Each failure raises `ConfigError` (bad request) or `ModelFolderError` (unreadable model
folder), one line naming the value and the fix.
"""

import contextlib
import errno
import itertools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from causalkv.env import text as env_text
from causalkv.errors import ConfigError, first_line
from causalkv.runtime.files.outputs import latents_path_for
from causalkv.runtime.files.video import check_video_suffix
from causalkv.runtime.model_io.model_config import (
    REQUIRED_FILES,
    ModelFolderError,
    RuntimeModelInfo,
    read_json,
)
from causalkv.runtime.model_io.preset_configs import ENV_HOME, causalkv_home
from causalkv.runtime.model_io.presets import is_complete_preset, preset_name

__all__ = [
    "FILE_OVERHEAD_BYTES",
    "check_creatable_folder",
    "check_home",
    "check_model_files",
    "check_no_other_work",
    "check_output_files",
    "describe_file",
    "fs_error_reason",
]

#: files a component folder may keep its weights in
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")

_WEIGHTED_COMPONENTS = ("transformer", "vae", "text_encoder")


# ---- CAUSALKV_HOME ---------------------------------------------------------------------------
def check_home(info: RuntimeModelInfo) -> None:
    """A preset that still has to be built needs a ``CAUSALKV_HOME`` where folders can be
    created; `ConfigError` naming it otherwise (a file, a read-only file system, no rights)."""
    if info.preset is None or info.path is None or is_complete_preset(info.path):
        return
    folder = info.path.parent
    check_creatable_folder(
        folder, f"CAUSALKV_HOME={env_text(ENV_HOME) or str(causalkv_home())!r}",
        "set CAUSALKV_HOME to a writable folder (the presets are built there on first use)",
        cannot=f"cannot create the preset {info.preset!r} in {str(folder)!r}",
    )


# ---- output files ---------------------------------------------------------------------------
def fs_error_reason(exc: OSError, folder: str | Path) -> str:
    """Why a file could not be created in ``folder``, in words a user can act on: the
    errno's text, except where it misleads (``/proc`` answers "No such file or directory"
    for a folder that exists: a virtual file system that takes no new files)."""
    folder = Path(folder)
    code = exc.errno
    try:
        readonly = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        readonly = False
    if code == errno.EROFS or readonly:
        return "a read-only file system"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if code == errno.ENOENT and folder.is_dir():
        return "its file system takes no new files (a virtual file system such as /proc or /sys)"
    if code == errno.ENOSPC:
        return "no space left on its file system"
    return exc.strerror or str(exc)


def _nearest_existing(path: Path) -> Path:
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def check_creatable_folder(
    path: Path, what: str, fix: str, *, file_fix: str | None = None, cannot: str | None = None
) -> None:
    """`ConfigError` naming ``what`` (``"sglang-checkpoint DIR '...'"``), why and ``fix`` unless
    files can be created in the nearest existing folder of ``path`` (a folder can be created
    there, or is one, writable; probed by creating and removing a temporary file there;
    nothing is left behind). ``file_fix``: the fix when that is a file (default ``fix``);
    ``cannot``: what could not be done (default: create files there)."""
    folder = _nearest_existing(path)
    if not folder.is_dir():
        raise ConfigError(f"{what}: {str(folder)!r} is a file, not a folder; {file_fix or fix}")
    try:
        fd, name = tempfile.mkstemp(prefix=".causalkv-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        cannot = cannot or f"cannot create files in {str(folder)!r}"
        raise ConfigError(f"{what}: {cannot} ({fs_error_reason(exc, folder)}); {fix}") from None


def _check_writable_file(path: str | Path, flag: str) -> Path:
    """``path`` (absolute) if a file can be written there: not a folder or a special file,
    its folder exists or can be created, and a file can be created in it. Else `ConfigError`."""
    text = str(path)
    p = Path(os.path.abspath(Path(text).expanduser()))
    if text.endswith(("/", os.sep)) or p.is_dir():
        raise ConfigError(f"{flag} {text!r} is a folder; name a file in it")
    if p.exists() and not p.is_file():
        raise ConfigError(f"{flag} {text!r} exists and is not a regular file; name a regular file")
    check_creatable_folder(p.parent, f"{flag} {text!r}", f"choose a writable folder for {flag}",
                           file_fix=f"choose another {flag}")
    return p


#: bytes of every file's floor besides its content (a file system block, headers)
FILE_OVERHEAD_BYTES = 4096


def _check_free_space(path: Path, flag: str, need: int, what: str) -> None:
    folder = _nearest_existing(path.parent)
    free = _free_bytes(folder)
    if free is not None and free < need:
        raise ConfigError(
            f"{flag} {str(path)!r}: the file system of {str(folder)!r} has {free:,} bytes free, "
            f"{what} needs at least {need:,}; free some space or choose another folder for {flag}"
        )


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return int(st.f_bavail) * int(st.f_frsize)


def describe_file(path: str | Path) -> str | None:
    """What an existing, non-empty file holds, in words (``"an MP4 video"``, ``"a GIF
    image"``, ``"causalkv metrics"``, ``"saved latents (safetensors)"``, ``"a safetensors
    file"``, ``"a JSON file"``, ``"1,234 bytes of text"``...); None when there is no file or
    it is empty (nothing to lose)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size == 0 or not p.is_file():
            return None
        with open(p, "rb") as f:
            head = f.read(65536)
    except OSError:
        return None
    if head[4:8] == b"ftyp":
        return "an MP4 video"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "a GIF image"
    header = _safetensors_header(p, size)[1] if head[8:9] == b"{" else None
    if isinstance(header, dict):
        return "saved latents (safetensors)" if "latents" in header else "a safetensors file"
    if size <= 1 << 24:
        with contextlib.suppress(ValueError, UnicodeDecodeError, OSError):
            obj = json.loads(p.read_text(encoding="utf-8"))
            if isinstance(obj, dict) and {"model", "stage", "chunks"} <= set(obj):
                return "causalkv metrics"
            return "a JSON file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return f"{size:,} bytes of other data"
    return f"{size:,} bytes of text"


def check_no_other_work(flag: str, path: Path, *, force: bool) -> None:
    """Refuse to replace a file that holds something else than what ``flag`` writes (a video
    under ``--metrics``, a metrics file under ``--output``, a README, a model's weights):
    `ConfigError` naming the path and what it holds, unless ``force``. A file of the same
    kind (the previous run's video) is replaced, atomically, as before."""
    held = describe_file(path)
    if flag == "--metrics":
        expected = "causalkv metrics"
    elif "latents" in flag:
        expected = "saved latents (safetensors)"
    else:
        expected = {".mp4": "an MP4 video", ".gif": "a GIF image"}.get(path.suffix.lower(), "a video")
    if force or held is None or held == expected:
        return
    raise ConfigError(
        f"{flag} {str(path)!r} exists and holds {held}, not {expected}; choose another {flag}, "
        "or pass --force to replace it (atomically, once the run has its result)"
    )


def check_output_files(
    *,
    output: str | Path | None,
    metrics: str | Path | None = None,
    save_latents: str | Path | None = None,
    latents_nbytes: int = 0,
    video_nbytes: int = FILE_OVERHEAD_BYTES,
    metrics_nbytes: int = FILE_OVERHEAD_BYTES,
    force: bool = False,
) -> None:
    """Check the video (``--output``), metrics (``--metrics``) and ``--save-latents`` targets
    (`_check_writable_file`; the video's suffix must be one an installed encoder writes,
    saved latents end in ``.safetensors``), that no two name the same file, the file kept for
    the latents of a video that fails to encode included, that none would replace a file of
    another kind (`check_no_other_work`; ``force`` allows it), and that each file system has
    room for the file's floor (``video_nbytes``, ``metrics_nbytes``, ``latents_nbytes`` plus
    `FILE_OVERHEAD_BYTES`: a full disk is refused here, a disk that fills up during the run
    fails when the file is written)."""
    kept = "the latents kept if the video fails to encode"
    #: each file's flag -> (the flag its free space is asked of, its floor, what it is)
    floors = {"--output": ("--output", video_nbytes, "the video"),
              "--metrics": ("--metrics", metrics_nbytes, "the metrics file"),
              "--save-latents": ("--save-latents", FILE_OVERHEAD_BYTES + latents_nbytes, "the latents file"),
              kept: ("--output", FILE_OVERHEAD_BYTES + latents_nbytes, "the latents file")}
    named: list[tuple[str, Path]] = []
    for flag, path in (("--output", output), ("--metrics", metrics), ("--save-latents", save_latents)):
        if path is None:
            continue
        if flag == "--save-latents" and Path(path).suffix.lower() != ".safetensors":
            raise ConfigError(
                f"--save-latents {str(path)!r} must end in .safetensors (it is written as a safetensors file)"
            )
        named.append((flag, _check_writable_file(path, flag)))
        if flag == "--output":
            check_video_suffix(path)
    if output is not None:
        latents = Path(os.path.abspath(latents_path_for(Path(str(output)).expanduser())))
        if ("--save-latents", latents) not in named:
            named.append((kept, latents))
    for (flag_a, a), (flag_b, b) in itertools.combinations(named, 2):
        if a == b:
            raise ConfigError(f"{flag_a} and {flag_b} name the same file {str(a)!r}; give them different names")
    for flag, path in named:
        check_no_other_work(flag, path, force=force)
    for flag, path in named:
        _check_free_space(path, *floors[flag])


# ---- model files ----------------------------------------------------------------------------
def _safetensors_header(path: Path, size: int) -> tuple[int, Any]:
    """``(n, header)`` of a safetensors file of ``size`` bytes: its JSON header's length and
    the header parsed (None when it is not JSON or does not fit the file). OSError as raised."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            return n, json.loads(f.read(n)) if 0 <= n <= size - 8 else None
        except (ValueError, UnicodeDecodeError):
            return n, None


def _check_safetensors(path: Path, fix: str) -> None:
    try:
        size = path.stat().st_size
        n, header = _safetensors_header(path, size)
    except OSError as exc:
        raise ModelFolderError(f"cannot read {path} ({first_line(exc)}); {fix}") from None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path} is not a safetensors file (its header is unreadable); {fix}")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise ModelFolderError(f"{path} is not a safetensors file (its header is malformed); {fix}") from None
    if 8 + n + end != size:
        raise ModelFolderError(
            f"{path} is truncated or corrupt: its header describes {8 + n + end:,} bytes, the file "
            f"has {size:,}; {fix}"
        )


def _check_shards(index: Path, data: dict, fix: str) -> None:
    weight_map = data.get("weight_map")
    shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
    missing = [s for s in shards if not (index.parent / str(s)).is_file()]
    if missing:
        raise ModelFolderError(f"{index} lists shard(s) that are missing: {', '.join(missing)}; {fix}")


def check_model_files(info: RuntimeModelInfo) -> None:
    """Refuse a model folder whose files are unreadable (`ModelFolderError`): every JSON file
    of ``model_index.json`` and its component folders parses, every safetensors file is
    complete, the transformer, VAE and text encoder each have weights. A preset is checked
    once its folder is complete (before that, it is built on first use)."""
    folder = info.path
    if folder is None:
        return
    if info.preset is not None:
        if not is_complete_preset(folder):
            return
        fix = f"delete the preset folder {str(folder)!r}; it is rebuilt on the next run"
        held = preset_name(folder)
        if held not in (None, info.preset):  # a complete preset of another kind: never replaced
            raise ModelFolderError(
                f"{folder} holds the complete preset {held!r}, not {info.preset!r}; move it to "
                f"{str(folder.parent / held)!r} or {fix}"
            )
    else:
        fix = "restore the file (re-download or re-convert the model)"
    index = read_json(folder / "model_index.json", fix)
    wanted = [*REQUIRED_FILES, *(k for k, v in index.items() if isinstance(v, list))]
    missing = dict.fromkeys(  # a missing component folder is named once, as the folder
        f if (folder / f.split("/")[0]).exists() else f"{f.split('/')[0]}/"
        for f in wanted if not (folder / f).exists()
    )
    if missing:
        raise ModelFolderError(f"{folder} is missing {', '.join(missing)}; {fix}")
    for name in (k for k, v in index.items() if isinstance(v, list) and (folder / k).is_dir()):
        sub = folder / name
        files = sorted(f for f in sub.rglob("*") if f.is_file())
        for f in files:
            if f.suffix == ".json":
                shard_index = f.name.endswith(".index.json")  # an object: {"weight_map": ...}
                data = read_json(f, fix, any_value=not shard_index)
                if shard_index:
                    _check_shards(f, data, fix)
            elif f.suffix == ".safetensors":
                _check_safetensors(f, fix)
        if name in _WEIGHTED_COMPONENTS and not any(f.suffix in _WEIGHT_SUFFIXES for f in files):
            raise ModelFolderError(
                f"{sub} has no weights (no {', '.join('*' + s for s in _WEIGHT_SUFFIXES)} file); {fix}"
            )
