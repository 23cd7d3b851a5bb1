"""Shared pieces of the fault tests (tests/test_cli_faults*.py): run the command line
in-process, count chunks, list files, assert a request was refused before anything loaded.

The fixtures built on them (``counter``, ``empty_home``, ``loads``) are in conftest.py.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from causalkv.cli import main
from causalkv.hooks import hookimpl
from causalkv.runtime.model_io import preset_configs, presets

#: the module (``causalkv.runtime.host.generate`` the attribute is the function of that name)
runtime_generate = importlib.import_module("causalkv.runtime.host.generate")
#: the pipeline's load and write steps (the modules the loading and writing functions live in)
runtime_load = importlib.import_module("causalkv.runtime.host.load_step")
runtime_write = importlib.import_module("causalkv.runtime.host.write_step")
ROOT = Path(__file__).resolve().parents[1]
ERROR = "causalkv generate: error: "
#: the bytes of "an older video": an MP4's first box (``ftyp``), so the check that an output
#: holds a file of its own kind (`causalkv.runtime.files.file_checks.describe_file`) lets a run replace it
OLD_VIDEO = b"\x00\x00\x00\x18ftypisom an older video"
#: what a traceback or a C++ stack dump prints; none may reach stderr without --debug
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s+File \"|frame #\d+|Exception raised from", re.M)


class ChunkCounter:
    """Counts the chunks a run finishes (``causalkv_chunk_done``)."""

    def __init__(self) -> None:
        self.chunks: list[int] = []

    @hookimpl
    def causalkv_chunk_done(self, chunk_index: int) -> None:
        self.chunks.append(chunk_index)


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # usage errors (argparse)
        return int(exc.code or 0)


def causalkv_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("causalkv")]


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def one_line(err: str) -> str:
    """The single line of ``err``; fails on none, several, or a traceback."""
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and not TRACEBACK.search(err), err
    return lines[0]


def assert_refused_up_front(
    argv: list[str], messages: list[str], tmp: Path, home: Path, counter: ChunkCounter,
    loads: list[str], capsys: pytest.CaptureFixture[str], *, code: int = 2,
) -> str:
    """Run ``causalkv generate argv``: exit ``code``, one stderr line holding each of
    ``messages`` (``{tmp}`` replaced), no chunk, no load, no preset, no file; the line."""
    before = files(tmp)
    if "--output" not in argv and "--no-video" not in argv:
        argv = [*argv, "--output", str(tmp / "v.mp4")]
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", *argv])
    err = capsys.readouterr().err
    assert rc == code, err
    line = one_line(err)
    assert line.startswith("causalkv generate: error: "), err
    for m in messages:
        assert m.replace("{tmp}", str(tmp)) in line, line
    assert counter.chunks == [] and loads == []
    assert files(home) == set(), "a refused request builds no preset"
    assert files(tmp) == before, "a refused request writes nothing"
    return line


def fake_model_folder(root: Path, causalkv: dict[str, Any] | None = None, **index: Any) -> Path:
    """A model folder with real configs and small, well-formed (but wrong) safetensors files:
    enough for every check that reads no weights. ``causalkv``: a causalkv.json to write;
    ``index``: model_index.json entries to override."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(
        json.dumps({**presets._model_index("SelfForcingWanPipeline"), **index})
    )
    for name, cfg in (("transformer", preset_configs.TINY_TRANSFORMER), ("vae", preset_configs.TINY_VAE),
                      ("text_encoder", preset_configs.TINY_TEXT_ENCODER)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        weights = "model" if name == "text_encoder" else "diffusion_pytorch_model"
        save_file({"w": torch.zeros(4, 4)}, str(root / name / f"{weights}.safetensors"))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    if causalkv is not None:
        (root / "causalkv.json").write_text(json.dumps(causalkv))
    return root


def processes_with(token: str) -> list[int]:
    """Pids of the live processes whose environment holds ``token`` (Linux ``/proc``): every
    process a test's command started, however deep, inherits the test's marker variable."""
    needle = token.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                stat = (entry / "stat").read_text()
                if stat.rsplit(")", 1)[-1].split()[0] != "Z":  # a zombie runs nothing
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_until_gone(token: str, timeout_s: float = 5.0) -> list[int]:
    """`processes_with` once none is left or after ``timeout_s`` (what is left then)."""
    import time

    deadline = time.monotonic() + timeout_s
    left = processes_with(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_with(token)
    return left
