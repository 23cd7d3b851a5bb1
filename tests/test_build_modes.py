"""A built folder (a preset, an sglang checkpoint: `causalkv.runtime.model_io.presets.build_atomically`)
has the modes the user's umask gives new files and folders, whatever mode its writer used
(safetensors writes 0600), and leaves no lock file behind."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from causalkv.runtime.model_io import presets


@pytest.fixture
def umask_027() -> Iterator[None]:
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _write(out: Path) -> None:
    """What a model writer leaves: a 0600 weight file in a 0700 folder, a plain file."""
    (out / "transformer").mkdir(mode=0o700)
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\0" * 8)
    weights.chmod(0o600)
    (out / "model_index.json").write_text("{}")


def test_a_build_honours_the_umask_and_leaves_no_lock(tmp_path: Path, umask_027: None) -> None:
    folder = presets.build_atomically(tmp_path / "m", _write, lambda f: (f / "model_index.json").exists())
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [folder, *folder.rglob("*")]}
    # umask 027: folders 0777 & ~027 = 0750, files 0666 & ~027 = 0640
    assert modes == {"m": 0o750, "m/transformer": 0o750, "m/model_index.json": 0o640,
                     "m/transformer/diffusion_pytorch_model.safetensors": 0o640}
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no .m.lock, no probe, no build


def test_a_second_build_waits_on_no_stale_lock(tmp_path: Path) -> None:
    """A lock file left by an older version is taken and removed like a fresh one."""
    (tmp_path / ".m.lock").write_text("")
    presets.build_atomically(tmp_path / "m", _write, lambda f: (f / "model_index.json").exists())
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
