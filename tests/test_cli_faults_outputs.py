"""Fault rows of a finished generation's outputs: a full disk for the video, the metrics and
the latents, encoders that fail (loudly or quietly), outputs interrupted half-way, latents
that become NaN, file modes.

The rule when an output fails (`causalkv.runtime.files.outputs.OutputLog`): the outputs are written
in order ``--save-latents``, ``--output``, ``--metrics``; the first that fails stops the run;
every file already complete stays and the one stderr line names each (and the latents kept
for a video that could not be encoded); no partial or undecodable file is ever renamed into
place, and no temporary file is left.

A full disk, without root and without a small file system to fill: the write is made past
the process's file-size limit (``RLIMIT_FSIZE``, the soft limit lowered around the one write
and restored). The kernel then fails the ``write(2)`` with ``EFBIG`` ("File too large")
exactly where a full disk fails it with ``ENOSPC``: the same system call returns the same
kind of error to the same code (Python raises ``OSError``, ffmpeg reports "Error writing
trailer" and exits non-zero), so the same handling runs; only the errno and its text differ.
Python ignores ``SIGXFSZ``; ffmpeg is run through a wrapper that ignores it too.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import imageio_ffmpeg
import pytest
import torch
from fault_helpers import ERROR, OLD_VIDEO, ChunkCounter, files, one_line, run_cli, runtime_write

from causalkv.runtime.files import outputs
from causalkv.runtime.files.outputs import load_latents

pytestmark = pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs POSIX RLIMIT_FSIZE")

BASE = ["generate", "--quiet", "--dtype", "float32", "--frames", "3"]


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past ``nbytes`` of any file fail with EFBIG while the block runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def limited(fn: Callable[..., Any], nbytes: int) -> Callable[..., Any]:
    """``fn`` run under `file_size_limit` (a fault-injecting wrapper around one write)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with file_size_limit(nbytes):
            return fn(*args, **kwargs)

    return wrapper


def ffmpeg_wrapper(tmp: Path, body: str) -> Path:
    """An ``IMAGEIO_FFMPEG_EXE`` script: ``body`` with ``$FFMPEG`` the real ffmpeg."""
    script = tmp / "ffmpeg-wrapper.sh"
    script.write_text(f"#!/bin/sh\nFFMPEG='{imageio_ffmpeg.get_ffmpeg_exe()}'\n{body}\n")
    script.chmod(0o755)
    return script


#: ffmpeg writing into a file system that fills after 2 KiB (``ulimit -f`` counts 512-byte
#: blocks in POSIX sh); the tiny video is about 5 KiB
FULL_DISK = "trap '' XFSZ\nulimit -f 4\nexec \"$FFMPEG\" \"$@\""
#: the same, as ffmpeg versions before 5 end it: the trailer error on stderr, exit status 0
FULL_DISK_STATUS_0 = "trap '' XFSZ\n(ulimit -f 4; \"$FFMPEG\" \"$@\")\nexit 0"
#: a clean exit, no error line, but the last argument (the file) cut to 1 KiB
QUIET_TRUNCATION = ('if [ "$1" = "-y" ]; then "$FFMPEG" "$@" || exit $?; for f; do :; done; '
                    'truncate -s 1024 "$f"; exit 0; fi\nexec "$FFMPEG" "$@"')


@pytest.mark.parametrize(("body", "cause"), [
    (FULL_DISK, r"EncoderError: ffmpeg exited with status \d+: \[out#0/mp4 @ 0x[0-9a-f]+\] Error closing file: File too large"),
    (FULL_DISK_STATUS_0, r"EncoderError: ffmpeg reported an error: \[out#0/mp4 @ 0x[0-9a-f]+\] Error closing file: File too large"),
    (QUIET_TRUNCATION, r"EncoderError: the file ffmpeg wrote does not decode \(ffmpeg reported an error: .+\)"),
], ids=["disk full", "disk full, status 0", "undecodable, status 0"])
def test_video_that_does_not_encode_is_never_renamed_into_place(
    body: str, cause: str, causalkv_home: str, tmp_path: Path, counter: ChunkCounter,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(ffmpeg_wrapper(tmp_path, body)))
    v, m, lat = out_dir / "v.mp4", out_dir / "m.json", out_dir / "l.safetensors"
    v.write_bytes(OLD_VIDEO)
    rc = run_cli([*BASE, "--output", str(v), "--metrics", str(m), "--save-latents", str(lat)])
    line = one_line(capsys.readouterr().err)
    kept = out_dir / "v.latents.safetensors"
    assert rc == 1
    assert re.fullmatch(
        re.escape(f"{ERROR}could not write '{v}' (") + cause
        + re.escape(f"); the generated latents are kept in '{kept}'; the files written before it are "
                    f"kept: '{lat}' (--save-latents)"), line), line
    assert files(out_dir) == {"v.mp4", "v.latents.safetensors", "l.safetensors"}  # no temporary, no metrics
    assert v.read_bytes() == OLD_VIDEO
    assert torch.equal(load_latents(kept)[0], load_latents(lat)[0])


def test_metrics_on_a_full_disk_keeps_and_names_the_outputs_before_it(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime_write, "write_json_atomic", limited(outputs.write_json_atomic, 512))
    v, m, lat = tmp_path / "v.mp4", tmp_path / "m.json", tmp_path / "l.safetensors"
    rc = run_cli([*BASE, "--output", str(v), "--metrics", str(m), "--save-latents", str(lat)])
    line = one_line(capsys.readouterr().err)
    assert rc == 1
    assert line == (f"{ERROR}could not write '{m}' (OSError: [Errno 27] File too large); the files written "
                    f"before it are kept: '{lat}' (--save-latents), '{v}' (--output)")
    assert files(tmp_path) == {"v.mp4", "l.safetensors"}
    assert v.read_bytes()[4:8] == b"ftyp" and load_latents(lat)[0].shape == (1, 4, 3, 8, 8)


def test_latents_on_a_full_disk_stop_before_anything_else_is_written(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime_write, "save_latents", limited(outputs.save_latents, 512))
    v, m, lat = tmp_path / "v.mp4", tmp_path / "m.json", tmp_path / "l.safetensors"
    rc = run_cli([*BASE, "--output", str(v), "--metrics", str(m), "--save-latents", str(lat)])
    line = one_line(capsys.readouterr().err)
    assert rc == 1
    assert line.startswith(f"{ERROR}could not write '{lat}' (") and "File too large" in line, line
    assert line.endswith("); nothing was written"), line
    assert files(tmp_path) == set()


def test_video_and_its_kept_latents_both_on_a_full_disk(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(ffmpeg_wrapper(tmp_path, FULL_DISK)))
    monkeypatch.setattr(outputs, "save_latents", limited(outputs.save_latents, 512))  # the kept latents
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    v = out_dir / "v.mp4"
    rc = run_cli([*BASE, "--output", str(v), "--metrics", str(out_dir / "m.json")])
    line = one_line(capsys.readouterr().err)
    assert rc == 1
    assert line.startswith(f"{ERROR}could not write '{v}' (EncoderError: ffmpeg exited with status"), line
    assert f"nor keep the latents in '{out_dir}/v.latents.safetensors' (" in line and "File too large" in line
    assert line.endswith("; free disk space or fix the folder and rerun"), line
    assert files(out_dir) == set()


def test_interrupted_while_writing_names_the_complete_files(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def ctrl_c(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime_write, "write_json_atomic", ctrl_c)
    v, lat = tmp_path / "v.gif", tmp_path / "l.safetensors"
    rc = run_cli([*BASE, "--output", str(v), "--metrics", str(tmp_path / "m.json"), "--save-latents", str(lat)])
    line = one_line(capsys.readouterr().err)
    assert rc == 130
    assert line == (f"causalkv generate: interrupted after chunk 1 of 1, while writing the outputs; kept the "
                    f"complete files '{lat}', '{v}'")
    assert files(tmp_path) == {"v.gif", "l.safetensors"}


def test_latents_that_become_nan_stop_the_run_with_exit_3(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    # float32 overflows: guidance 1e38 x (pos - neg) is inf in chunk 0's first step; a chunk's
    # latents are 4 channels x 2 frames x 8 x 8 = 512 values
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--model", "tiny-longlive2", "--frames", "4",
                  "--guidance-scale", "1e38", "--output", str(tmp_path / "v.mp4"),
                  "--metrics", str(tmp_path / "m.json"), "--save-latents", str(tmp_path / "l.safetensors")])
    line = one_line(capsys.readouterr().err)
    assert rc == 3
    assert re.fullmatch(
        re.escape(f"{ERROR}the latents of chunk 0 (0-based, of 2) are not finite (")
        + r"[\d,]+ of 512 values are NaN or inf"
        + re.escape("); the run stops and nothing is written; lower --guidance-scale (it is 1e+38)"), line), line
    assert counter.chunks == [] and files(tmp_path) == set()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_every_output_follows_the_umask(
    umask: int, causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    old = os.umask(umask)
    try:
        rc = run_cli([*BASE, "--output", str(tmp_path / "v.mp4"), "--metrics", str(tmp_path / "m.json"),
                      "--save-latents", str(tmp_path / "l.safetensors")])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr().err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(("v.mp4", "m.json", "l.safetensors"), 0o666 & ~umask)
