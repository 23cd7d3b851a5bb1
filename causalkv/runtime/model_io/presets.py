"""Tiny presets: real diffusers/transformers components with seeded RANDOM weights.

Presets are declared by the stage registrations (`causalkv.hooks.Preset`; the built-in ones
are ``tiny-wan``, ``tiny-longlive``, ``tiny-longlive2``, ``tiny-lingbot``), so a plugin adds
one with its model family. This module builds each into a complete diffusers-format model
folder: a 2-layer ``WanTransformer3DModel`` (2 heads x 64,
so QVG's 64-channel blocks fit), a small ``AutoencoderKLWan``, a 2-layer
``UMT5EncoderModel`` and a byte-level tokenizer built in code. On first use the components
are created from a fixed seed and written with ``save_pretrained`` into
``$CAUSALKV_HOME/presets/<name>`` (default ``~/.cache/causalkv``); every run then loads
them with ``from_pretrained``, so the real loading path runs every time. Nothing is
downloaded. The weights are random: the videos are noise-like patterns, useful to exercise
the caches, the stages and the loading code, not to look at.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from causalkv.hooks import Preset
from causalkv.plugin.registry import Registry
from causalkv.runtime.model_io.model_config import CAUSALKV_FILE, resolve_preset
from causalkv.runtime.model_io.preset_configs import (
    TINY_TEXT_ENCODER,
    TINY_VAE,
    PresetSpec,
    preset_dir,
)
from causalkv.runtime.model_io.prompt_encoding import build_byte_tokenizer

if TYPE_CHECKING:  # torch loads to build a model, not for `causalkv plugins` / `--help`
    import torch

__all__ = [
    "build_atomically",
    "is_complete_preset",
    "materialize_preset",
    "preset_name",
    "write_json",
    "write_preset_folder",
    "write_tiny_model",
]

#: bump when the preset definitions change: old cache folders are rebuilt
PRESET_FORMAT = 2
_MARKER = ".causalkv-preset.json"


def _model_index(model_class: str, dit_class: str = "WanTransformer3DModel", **more: Any) -> dict[str, Any]:
    """``model_index.json`` of a tiny model folder: ``model_class``'s components (``more``: others,
    such as a scheduler)."""
    return {
        "_class_name": model_class,
        "_diffusers_version": version("diffusers"),  # its metadata: diffusers itself stays unloaded
        "transformer": ["diffusers", dit_class],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        **more,
    }


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented JSON in ``path`` (its folder created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (a completion marker, a ``model_index.json``); ``{}`` when
    the file is absent, unreadable or holds no object."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def is_complete_preset(folder: Path) -> bool:
    """True when ``folder`` holds a preset written completely by this preset format."""
    return json_object(folder / _MARKER).get("format") == PRESET_FORMAT


def preset_name(folder: Path) -> str | None:
    """The name a preset folder's completion marker records, or None (no marker, or one
    written before markers held names)."""
    name = json_object(folder / _MARKER).get("name")
    return name if isinstance(name, str) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:  # PermissionError: exists, owned by someone else
        return not isinstance(exc, ProcessLookupError)
    return True


def _remove_stale_builds(name: str, parent: Path) -> None:
    """Remove ``.<name>.build-<pid>-*`` folders whose process is gone (killed mid-build)."""
    prefix = f".{name}.build-"
    for tmp in parent.glob(f"{prefix}*"):
        pid = tmp.name[len(prefix) :].split("-", 1)[0]
        if tmp.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _build_lock(parent: Path, name: str) -> Iterator[None]:
    """An exclusive lock on ``parent/.<name>.lock`` for one build (``fcntl.flock``; processes
    wait for each other), removed when the build ends: nothing stays next to the folder. A
    process that waited on a lock file its holder then removed takes the lock again on the
    file now at that path (so two builders never both hold one). Without ``fcntl`` (Windows)
    no lock is taken: the atomic rename in `materialize_preset` still keeps exactly one
    complete folder."""
    try:
        import fcntl  # POSIX only: without it (Windows) no lock is taken
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = parent / f".{name}.lock"
    while True:
        with open(path, "a+") as f:  # closed after the unlink
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
            except FileNotFoundError:  # its holder removed it while this one waited
                same = False
            if not same:
                continue
            try:
                yield
            finally:
                path.unlink(missing_ok=True)  # still held: no one else can be inside
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return


def materialize_preset(name: str, *, pm: Any = None, registry: Registry | None = None) -> Path:
    """Create the preset's folder on first use (seeded random weights); return its path.

    The preset is looked up in ``registry`` (default: collected from ``pm``, default the
    process-wide manager). Built with `build_atomically` (lock, temporary sibling, rename),
    so the preset folder is either absent or complete; a folder without the completion marker
    (a build of an older version killed half-way, or a stale preset format) is replaced.
    """
    p = resolve_preset(name, pm=pm, registry=registry)
    return build_atomically(preset_dir(name), lambda out: _write_preset(p, out), is_complete_preset)


def build_atomically(
    folder: Path, write: Callable[[Path], None], is_complete: Callable[[Path], bool]
) -> Path:
    """Build ``folder`` with ``write(tmp)`` unless ``is_complete(folder)``; return ``folder``.

    Safe against concurrent and killed builds: the build holds a lock file next to the folder
    (a second process waits, then finds the folder complete and returns it), is written into
    a temporary sibling ``.<name>.build-<pid>-*`` and renamed into place, so the folder is
    either absent or complete. An existing folder that ``is_complete`` rejects is replaced;
    build folders of processes that no longer exist are removed.
    """
    folder = Path(folder)
    name = folder.name
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder.parent, name):
        if is_complete(folder):  # built by another process while this one waited
            return folder
        _remove_stale_builds(name, folder.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.build-{os.getpid()}-", dir=folder.parent))
        try:
            write(tmp)
            honour_umask(tmp)
            if folder.exists():  # incomplete or stale: move aside first, so the rename is atomic
                old = Path(tempfile.mkdtemp(prefix=f".{name}.build-{os.getpid()}-old-", dir=folder.parent))
                folder.rename(old / "preset")
                shutil.rmtree(old, ignore_errors=True)
            try:
                tmp.rename(folder)
            except OSError:  # another process won the race (only without a lock)
                if not is_complete(folder):  # pragma: no cover - only without a lock
                    raise
        finally:  # renamed into place, or a failed (or lost) build's folder removed
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def honour_umask(tree: Path) -> None:
    """Give ``tree`` and everything under it the mode the umask gives a new folder or file
    (``0o777`` / ``0o666`` less the umask): ``mkdtemp`` creates its folder ``0o700`` and
    safetensors writes its weight files ``0o600``, where the rest of a saved model folder is
    the umask's. The umask is read back from a probe folder, not set (setting it to read it
    would race with other threads)."""
    probe = tree.parent / f".{tree.name}.umask-{os.getpid()}-{os.urandom(4).hex()}"
    os.mkdir(probe, 0o777)
    try:
        folder_mode = stat.S_IMODE(os.stat(probe).st_mode)
    finally:
        os.rmdir(probe)
    for path in [tree, *tree.rglob("*")]:
        if not path.is_symlink():
            path.chmod(folder_mode if path.is_dir() else folder_mode & 0o666)


def write_preset_folder(preset: Preset, registration: Any, folder: str | Path) -> Path:
    """Write ``preset`` as a model folder of ``registration``'s family into ``folder``.

    For presets that are not registered (benchmarks, tests): the folder is what
    `materialize_preset` writes for a registered one (``models[0]`` as the pipeline class,
    the family's defaults under the preset's settings), loadable by its path.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_preset(PresetSpec(preset, registration), folder)
    return folder


def write_tiny_model(
    out: Path, transformer: Mapping[str, Any], vae: Mapping[str, Any], *, seed: int, text_max_length: int
) -> torch.nn.Module:
    """Create the tiny components from ``seed`` (a ``WanTransformer3DModel`` of config
    ``transformer``, an ``AutoencoderKLWan`` of config ``vae``, the tiny ``UMT5EncoderModel``),
    save the VAE, the text encoder and the byte tokenizer (``text_max_length``) into ``out``, and
    return the transformer for its caller to save in its own layout."""
    # torch, diffusers and transformers load with a model, not for `causalkv plugins` / `--help`
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**transformer)
        vae_model = AutoencoderKLWan(**vae)
        text_encoder = UMT5EncoderModel(UMT5Config(**TINY_TEXT_ENCODER))
    vae_model.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    build_byte_tokenizer(text_max_length).save_pretrained(out / "tokenizer")
    return model


def _write_preset(r: PresetSpec, out: Path) -> None:
    p = r.preset
    model = write_tiny_model(out, r.transformer, TINY_VAE, seed=p.seed,
                             text_max_length=r.settings["text_max_length"])
    model.save_pretrained(out / "transformer")
    write_json(out / "model_index.json", _model_index(r.model_class))
    write_json(out / CAUSALKV_FILE, r.settings)
    (out / "README.md").write_text(
        f"# {p.name} (causalkv preset)\n\n{p.description}.\n\n"
        f"The weights are RANDOM (seed {p.seed}): this folder exercises the loading path and "
        "the caches; its videos are not meaningful.\n"
    )
    write_json(out / _MARKER, {"format": PRESET_FORMAT, "name": p.name})
