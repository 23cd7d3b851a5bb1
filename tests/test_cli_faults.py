"""The ``causalkv generate`` fault matrix: every fault ends with its documented exit code, one
line on stderr naming the value and the fix, and only complete files left behind.

Faults knowable before the weights load run in-process against an empty CAUSALKV_HOME and
must leave it empty, run zero chunks and never reach the loader. Faults of a run use the
session's tiny presets. Ctrl-C, a closed stdout pipe and concurrent preset builds need real
processes: three start at once in one empty CAUSALKV_HOME (`children`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import causalkv.plugin.manager as plugin_manager
from causalkv.cli import main
from causalkv.errors import ConfigError
from causalkv.hooks import hookimpl
from causalkv.plugin.testing import fresh_plugin_manager
from causalkv.runtime import checks, presets, video
from causalkv.runtime.outputs import load_latents

#: the module (``causalkv.runtime.generate`` the attribute is the function of that name)
runtime_generate = importlib.import_module("causalkv.runtime.generate")
ROOT = Path(__file__).resolve().parents[1]
ERROR = "causalkv generate: error: "


class ChunkCounter:
    """Counts the chunks a run finishes (``causalkv_chunk_done``)."""

    def __init__(self) -> None:
        self.chunks: list[int] = []

    @hookimpl
    def causalkv_chunk_done(self, chunk_index: int) -> None:
        self.chunks.append(chunk_index)


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> ChunkCounter:
    """The command line's plugin manager: the built-in plugin plus a chunk counter."""
    pm = fresh_plugin_manager()
    c = ChunkCounter()
    pm.register_plugin(c, "chunk-counter")
    monkeypatch.setattr(plugin_manager, "_default", pm)
    return c


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # usage errors (argparse)
        return int(exc.code or 0)


def causalkv_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("causalkv")]


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


PAUSE_AT_FIRST_CHUNK = """
import pathlib, sys, time
from causalkv.cli import main
from causalkv.hooks import hookimpl
from causalkv.plugin import get_plugin_manager

class Pause:
    @hookimpl
    def causalkv_chunk_done(self, chunk_index):
        if chunk_index == 0:
            pathlib.Path(sys.argv[1]).touch()
            time.sleep(300)

get_plugin_manager().register_plugin(Pause(), "pause")
sys.exit(main(sys.argv[2:]))
"""


class Children:
    """Two ``causalkv generate`` processes started together in one empty CAUSALKV_HOME, so both
    build tiny-wan at the same time: ``pipe`` has its stdout closed after its first line (like
    ``| head -1``) and runs to the end; ``sigint`` gets SIGINT while it pauses after chunk 0
    of 3. They start with the module's first test and run while the in-process tests do;
    `results` waits for them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.home = tmp, tmp / "home"
        self.home.mkdir()
        env = {**os.environ, "CAUSALKV_HOME": str(self.home), "PYTHONPATH": str(ROOT)}
        env.pop("CAUSALKV_PLUGINS", None)
        base = ["generate", "--quiet", "--dtype", "float32"]
        self.outs = {name: tmp / name for name in ("pipe", "sigint")}
        for d in self.outs.values():
            d.mkdir()
        self.marker = tmp / "paused"
        argv = {
            "pipe": [sys.executable, "-m", "causalkv", *base, "--frames", "3",
                     "--output", str(self.outs["pipe"] / "v.gif"), "--metrics", str(self.outs["pipe"] / "m.json")],
            "sigint": [sys.executable, "-c", PAUSE_AT_FIRST_CHUNK, str(self.marker), *base, "--frames", "9",
                       "--output", str(self.outs["sigint"] / "v.mp4"), "--metrics", str(self.outs["sigint"] / "m.json")],
        }
        self.logs = {name: open(tmp / f"{name}.stderr", "w+") for name in argv}  # noqa: SIM115
        self.procs = {
            name: subprocess.Popen(
                cmd, env=env, text=True, stderr=self.logs[name],
                stdout=subprocess.PIPE if name == "pipe" else subprocess.DEVNULL,
            )
            for name, cmd in argv.items()
        }
        self.first_line = ""
        self._driver = threading.Thread(target=self._drive, daemon=True)
        self._driver.start()

    def _drive(self) -> None:
        pipe = self.procs["pipe"].stdout
        assert pipe is not None
        self.first_line = pipe.readline()
        pipe.close()  # the reader goes away
        deadline = time.monotonic() + 400
        while not self.marker.exists() and self.procs["sigint"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.marker.exists():
            self.procs["sigint"].send_signal(signal.SIGINT)

    def results(self) -> dict[str, dict[str, Any]]:
        self._driver.join(timeout=450)
        out = {}
        for name, p in self.procs.items():
            p.wait(timeout=400)
            self.logs[name].seek(0)
            out[name] = {"rc": p.returncode, "stderr": self.logs[name].read(), "out": self.outs[name]}
        return out

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Children]:
    c = Children(tmp_path_factory.mktemp("children"))
    try:
        yield c
    finally:
        c.close()


# ---- faults found before the weights load ------------------------------------------------------
PRELOAD: list[tuple[str, list[str], list[str]]] = [
    ("rope limit", ["--frames", "1032"],
     ["--frames 1032 exceeds the RoPE limit: rope_max_seq_len=1024 in tiny-wan's transformer/config.json",
      "pass --frames 1023 or fewer"]),
    ("huge frame count", ["--frames", "3000000"],
     ["--frames 3000000 exceeds the RoPE limit", "pass --frames 1023 or fewer"]),
    ("zero frames", ["--frames", "0"], ["frames must be a positive int, got 0; fix --frames"]),
    # 3 shots of tiny-longlive2 (2 frames per chunk, RoPE offset 2 per shot): the last chunk
    # of 1022 frames (chunk 510) sits at 1020 + 4 .. 1022 + 4 > 1024; (1024 - 4) // 2 * 2 = 1020
    ("per-shot RoPE offsets", ["--model", "tiny-longlive2", "--frames", "1022",
                               "--prompt", "a", "--prompt", "b", "--prompt", "c"],
     ["--frames 1022: chunk 510 would use RoPE frames up to 1026 (its frames plus a per-shot RoPE "
      "offset of 4), beyond rope_max_seq_len=1024", "pass --frames 1020 or fewer"]),
    ("seed out of range", ["--seed", str(2**64)], [f"--seed must be at most 2**64 - 1 = {2**64 - 1}"]),
    ("bogus device", ["--device", "bogus"],
     ["--device 'bogus' is not a torch device; use cpu, cuda, cuda:N or mps"]),
    ("absent device", ["--device", "cuda:99"], ["--device 'cuda:99' is not available: ", "; use --device cpu"]),
    ("meta device", ["--device", "meta"],
     ["--device 'meta' is not available: causalkv generates on cpu, cuda, mps or xpu"]),
    ("output is a folder", ["--output", "{tmp}"], ["--output '{tmp}' is a folder; name a file in it"]),
    ("output ends in a separator", ["--output", "{tmp}/new/"], ["--output '{tmp}/new/' is a folder"]),
    ("output under a file", ["--output", "{tmp}/notes.txt/v.mp4"],
     ["'{tmp}/notes.txt' is a file, not a folder; choose another --output"]),
    ("output not a regular file", ["--output", "{tmp}/fifo.mp4"],
     ["--output '{tmp}/fifo.mp4' exists and is not a regular file; name a regular file"]),
    ("output folder not writable", ["--output", "/proc/x.mp4"],
     ["--output '/proc/x.mp4': cannot create files in '/proc'", "choose a writable folder for --output"]),
    ("metrics folder not writable", ["--metrics", "/proc/m.json"],
     ["--metrics '/proc/m.json': cannot create files in '/proc'", "choose a writable folder for --metrics"]),
    ("metrics is a folder", ["--metrics", "{tmp}"], ["--metrics '{tmp}' is a folder"]),
    ("unknown video extension", ["--output", "{tmp}/x.xyz"],
     ["--output '{tmp}/x.xyz' has extension '.xyz', which no installed encoder writes; name a .mp4 or .gif file"]),
    ("webm", ["--output", "{tmp}/x.webm"], ["has extension '.webm', which no installed encoder writes"]),
    ("no extension", ["--output", "{tmp}/clip"], ["--output '{tmp}/clip' has no file extension; name a .mp4 or .gif file"]),
    ("output and metrics collide", ["--output", "{tmp}/a.mp4", "--metrics", "{tmp}/a.mp4"],
     ["--output and --metrics name the same file '{tmp}/a.mp4'; give them different names"]),
    ("metrics on the kept latents", ["--output", "{tmp}/a.mp4", "--metrics", "{tmp}/a.latents.safetensors"],
     ["--metrics and the latents kept if the video fails to encode name the same file"]),
    ("latents not safetensors", ["--save-latents", "{tmp}/l.pt"],
     ["--save-latents '{tmp}/l.pt' must end in .safetensors"]),
    ("output with --no-video", ["--no-video", "--output", "{tmp}/a.mp4"],
     ["--output '{tmp}/a.mp4' and --no-video contradict each other; drop one of them"]),
    ("not an int", ["--frames", "abc"],
     ["argument --frames: invalid int value: 'abc'; see causalkv generate --help"]),
    ("unknown model", ["--model", "tiny-wna"], ["unknown model 'tiny-wna': not a preset", "pass --model PRESET"]),
]


@pytest.fixture
def empty_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("CAUSALKV_HOME", str(home))
    return home


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every attempt to build a preset or load weights (it then fails)."""
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called for a request refused up front")

        return fn

    monkeypatch.setattr(runtime_generate, "load_components", refuse("load_components"))
    monkeypatch.setattr(runtime_generate, "materialize_preset", refuse("materialize_preset"))
    return calls


def assert_refused_up_front(
    argv: list[str], messages: list[str], tmp: Path, home: Path, counter: ChunkCounter,
    loads: list[str], capsys: pytest.CaptureFixture[str], *, code: int = 2,
) -> None:
    before = files(tmp)
    if "--output" not in argv and "--no-video" not in argv:
        argv = [*argv, "--output", str(tmp / "v.mp4")]
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", *argv])
    err = capsys.readouterr().err
    assert rc == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("causalkv generate: error: "), err
    for m in messages:
        assert m.format(tmp=tmp) in lines[0]
    assert counter.chunks == [] and loads == []
    assert files(home) == set(), "a refused request builds no preset"
    assert files(tmp) == before, "a refused request writes nothing"


@pytest.mark.parametrize(("argv", "messages"), [c[1:] for c in PRELOAD], ids=[c[0] for c in PRELOAD])
def test_refused_before_any_weights_load(
    argv: list[str], messages: list[str], tmp_path: Path, empty_home: Path, counter: ChunkCounter,
    loads: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    if sys.platform != "linux" and any(a.startswith("/proc") for a in argv):
        pytest.skip("/proc is Linux's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a file, not a folder\n")
    os.mkfifo(out / "fifo.mp4")
    argv = [a.format(tmp=out) for a in argv]
    assert_refused_up_front(argv, messages, out, empty_home, counter, loads, capsys)


def test_format_without_an_installed_encoder_is_refused(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    what, _ready, write = video._FORMATS[".mp4"]
    monkeypatch.setitem(video._FORMATS, ".mp4", (what, lambda: False, write))  # no ffmpeg found
    assert_refused_up_front(
        ["--output", str(tmp_path / "v.mp4")],
        [f"--output '{tmp_path}/v.mp4' has extension '.mp4', which no installed encoder writes; name a .gif file"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_latents_that_do_not_fit_in_memory_are_refused(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # tiny-wan latents: 4 channels x 8 x 8 float32 = 1 KiB per frame; noise + output for 12 frames
    # = 24 KiB > a machine of 16 KiB
    monkeypatch.setattr(checks, "_physical_memory_bytes", lambda: 16 * 1024)
    assert_refused_up_front(
        ["--frames", "12", "--no-video"],
        ["--frames 12 needs 0.0 GiB for the latents alone, more than this machine's 0.0 GiB of memory; "
         "pass fewer --frames"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_dtype_the_device_cannot_run_is_refused(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_ones = torch.ones

    def ones(*size: Any, dtype: Any = None, **kw: Any) -> torch.Tensor:
        if dtype == torch.float16:  # as a backend without half matmuls reports it
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real_ones(*size, dtype=dtype, **kw)

    monkeypatch.setattr(checks.torch, "ones", ones)
    assert_refused_up_front(
        ["--dtype", "float16", "--no-video"],
        ["--dtype float16 does not run on --device cpu (\"addmm_impl_cpu_\" not implemented for 'Half'); "
         "use --dtype float32"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_the_limits_themselves_are_accepted(empty_home: Path, pm: Any) -> None:
    """The boundaries the messages suggest plan fine (no weights are needed to know)."""
    from runtime_helpers import make_options

    from causalkv.runtime.generate import plan_generation

    assert plan_generation(make_options("tiny-wan", frames=1023), pm=pm).num_chunks == 341
    opts = make_options("tiny-longlive2", frames=1020, prompts=["a", "b", "c"])
    plan = plan_generation(opts, pm=pm)
    assert max(checks.rope_frame_ends(plan)) == 1024  # 1020 frames + 2 shots x 2 frames offset
    assert plan_generation(make_options("tiny-wan", seed=2**64 - 1), pm=pm).server_args.seed == 2**64 - 1
    assert files(empty_home) == set()


# ---- an unreadable model folder --------------------------------------------------------------
def fake_model_folder(root: Path) -> Path:
    """A model folder with real configs and small, well-formed (but wrong) safetensors files:
    enough for every check that reads no weights."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps(presets._model_index("SelfForcingWanPipeline")))
    for name, cfg in (("transformer", presets._TRANSFORMER), ("vae", presets._VAE),
                      ("text_encoder", presets._TEXT_ENCODER)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        weights = "model" if name == "text_encoder" else "diffusion_pytorch_model"
        save_file({"w": torch.zeros(4, 4)}, str(root / name / f"{weights}.safetensors"))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    return root


def _corrupt_json(root: Path) -> str:
    (root / "text_encoder" / "config.json").write_text('{"d_model": 32,')
    return f"{root}/text_encoder/config.json is not valid JSON"


def _truncate(root: Path) -> str:
    f = root / "transformer" / "diffusion_pytorch_model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 10)
    return f"{f} is truncated or corrupt: its header describes {size:,} bytes, the file has {size - 10:,}"


def _no_weights(root: Path) -> str:
    (root / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    return f"{root}/vae has no weights (no *.safetensors"


def _missing_shard(root: Path) -> str:
    index = {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (root / "text_encoder" / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model.safetensors.index.json lists shard(s) that are missing: model-00002-of-00002.safetensors"


def _not_safetensors(root: Path) -> str:
    (root / "text_encoder" / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")
    return f"{root}/text_encoder/model.safetensors is not a safetensors file"


@pytest.mark.parametrize("corrupt", [_corrupt_json, _truncate, _no_weights, _missing_shard, _not_safetensors])
def test_unreadable_model_folder_is_refused_before_loading(
    corrupt: Any, tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = fake_model_folder(tmp_path / "model")
    message = corrupt(root)
    assert_refused_up_front(
        ["--model", str(root), "--no-video"], [message, "; restore the file (re-download or re-convert the model)"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_corrupt_preset_folder_names_the_fix(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = fake_model_folder(empty_home / "presets" / "tiny-wan")
    (folder / presets._MARKER).write_text(json.dumps({"format": presets.PRESET_FORMAT}))
    message = _truncate(folder)
    before = files(empty_home)
    rc = run_cli(["generate", "--quiet", "--no-video"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert message in err and f"delete the preset folder '{folder}'; it is rebuilt on the next run" in err
    assert counter.chunks == [] and loads == [] and files(empty_home) == before


def test_weights_that_do_not_match_the_config_fail_at_load_with_exit_2(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    root = fake_model_folder(tmp_path / "model")  # every file well-formed, the weights wrong
    rc = run_cli(["generate", "--quiet", "--no-video", "--dtype", "float32", "--model", str(root), "--frames", "3"])
    lines = causalkv_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1
    assert re.fullmatch(
        ERROR + re.escape(f"cannot load transformer from '{root}/transformer' (ValueError: ")
        + r"\d+ parameter\(s\) of the config are missing from the weights, e\.g\. '[\w.]+'\); "
        + re.escape("restore the component's files (re-download or re-convert the model)"),
        lines[0],
    ), lines[0]
    assert counter.chunks == []


# ---- faults of a run -------------------------------------------------------------------------
def test_output_replaced_only_by_a_complete_file_and_latents_saved_on_request(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    out, m, lat = tmp_path / "v.mp4", tmp_path / "m.json", tmp_path / "run.safetensors"
    out.write_bytes(b"an older video")
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "3", "--output", str(out),
                  "--metrics", str(m), "--save-latents", str(lat)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert files(tmp_path) == {"v.mp4", "m.json", "run.safetensors"}  # no temporary file left
    assert out.read_bytes()[4:8] == b"ftyp"
    metrics = json.loads(m.read_text())
    assert (metrics["output"], metrics["latents"]) == (str(out), str(lat))
    latents, meta = load_latents(lat)
    assert latents.shape == (1, 4, 3, 8, 8) and latents.dtype == torch.float32
    assert (meta["model"], meta["seed"], meta["frames"]) == ("tiny-wan", "0", "3")
    assert counter.chunks == [0]


def test_encoding_failure_keeps_the_latents_and_the_old_file(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def dying_encoder(frames: np.ndarray, path: Path, fps: int) -> None:
        path.write_bytes(b"half a video")  # the encoder dies half-way
        raise RuntimeError("encoder died")

    monkeypatch.setattr(video, "_write_mp4", dying_encoder)
    out, requested = tmp_path / "v.mp4", tmp_path / "requested.safetensors"
    out.write_bytes(b"an older video")
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "3", "--output", str(out),
                  "--metrics", str(tmp_path / "m.json"), "--save-latents", str(requested)])
    lines = causalkv_lines(capsys.readouterr().err)
    kept = tmp_path / "v.latents.safetensors"
    assert rc == 1
    assert lines == [f"{ERROR}could not write '{out}' (RuntimeError: encoder died); the generated "
                     f"latents are kept in '{kept}'"]
    assert files(tmp_path) == {"v.mp4", "requested.safetensors", "v.latents.safetensors"}
    assert out.read_bytes() == b"an older video"
    assert torch.equal(load_latents(kept)[0], load_latents(requested)[0])


class RaisingObserver:
    def __init__(self, exc: BaseException) -> None:
        self.exc, self.calls = exc, 0

    @hookimpl
    def causalkv_chunk_done(self, chunk_index: int) -> None:
        self.calls += 1
        raise self.exc


def test_failing_observer_is_reported_once_and_skipped(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = RaisingObserver(ValueError("observer bug"))
    plugin_manager._default.register_plugin(bad, "flaky-metrics")
    m = tmp_path / "m.json"
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "6", "--no-video", "--metrics", str(m)])
    lines = causalkv_lines(capsys.readouterr().err)
    assert rc == 0
    assert lines == [
        "causalkv: warning: plugin 'flaky-metrics' failed in causalkv_chunk_done at chunk 0 (ValueError: "
        "observer bug); fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS=flaky-metrics; it is skipped "
        "for the rest of the run (--strict-plugins makes this fatal)"
    ]
    assert bad.calls == 1 and counter.chunks == [0, 1]  # the other plugin saw every chunk
    assert json.loads(m.read_text())["chunks"] == 2 and files(tmp_path) == {"m.json"}


def test_failing_observer_is_fatal_with_strict_plugins(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    plugin_manager._default.register_plugin(RaisingObserver(ValueError("observer bug")), "flaky-metrics")
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "6", "--strict-plugins",
                  "--output", str(tmp_path / "v.mp4"), "--metrics", str(tmp_path / "m.json")])
    lines = causalkv_lines(capsys.readouterr().err)
    assert rc == 2
    assert lines == [f"{ERROR}plugin 'flaky-metrics' failed in causalkv_chunk_done at chunk 0 (ValueError: "
                     "observer bug); fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS=flaky-metrics"]
    assert len(counter.chunks) <= 1 and files(tmp_path) == set()


def test_raising_configure_hook_stops_the_run_before_any_chunk(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    class BadConfig:
        @hookimpl
        def causalkv_configure_stage(self, stage: Any) -> None:
            raise KeyError("window")

    plugin_manager._default.register_plugin(BadConfig(), "bad-config")
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "3", "--output", str(tmp_path / "v.mp4")])
    lines = causalkv_lines(capsys.readouterr().err)
    assert rc == 2
    assert lines == [f"{ERROR}plugin 'bad-config' failed in causalkv_configure_stage (KeyError: 'window'); "
                     "fix it, or turn it off with CAUSALKV_DISABLE_PLUGINS=bad-config"]
    assert counter.chunks == [] and files(tmp_path) == set()


def test_keyboard_interrupt_exits_130_and_writes_nothing(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    plugin_manager._default.register_plugin(RaisingObserver(KeyboardInterrupt()), "ctrl-c")
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "6", "--output", str(tmp_path / "v.mp4"),
                  "--metrics", str(tmp_path / "m.json"), "--save-latents", str(tmp_path / "l.safetensors")])
    lines = causalkv_lines(capsys.readouterr().err)
    assert rc == 130
    assert lines == ["causalkv generate: interrupted after chunk 1 of 2; nothing written"]
    assert files(tmp_path) == set()


@pytest.mark.parametrize("debug", [False, True])
def test_unexpected_error_exits_1_with_the_traceback_only_under_debug(
    debug: bool, empty_home: Path, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(plan: Any) -> list[str]:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(runtime_generate, "describe_plan", broken)
    rc = run_cli(["generate", "--quiet", "--no-video", *(["--debug"] if debug else [])])
    err = capsys.readouterr().err
    assert rc == 1
    hint = "" if debug else "; rerun with --debug for the traceback"
    assert causalkv_lines(err) == [f"causalkv generate: unexpected error (ZeroDivisionError: a bug){hint}"]
    assert ("Traceback (most recent call last)" in err) == debug
    assert counter.chunks == [] and files(empty_home) == set()


# ---- writing files -----------------------------------------------------------------------------
def moving_square(n: int = 5) -> np.ndarray:
    frames = np.zeros((n, 16, 16, 3), dtype=np.uint8)
    for i in range(n):  # every frame differs
        frames[i, 4:12, 2 * i : 2 * i + 6, 0] = 255
    return frames


def test_write_video_gif_is_complete_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "clip.gif"
    path.write_bytes(b"old")
    assert video.write_video(moving_square(), path, fps=8) == path
    with Image.open(path) as im:
        assert im.n_frames == 5 and im.size == (16, 16)
    assert files(tmp_path) == {"clip.gif"}


def test_write_video_refuses_an_unknown_format_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "clip.gif").write_bytes(b"an unrelated gif")
    with pytest.raises(ConfigError, match=r"has extension '\.webm', which no installed encoder writes"):
        video.write_video(moving_square(), tmp_path / "clip.webm")
    assert files(tmp_path) == {"clip.gif"} and (tmp_path / "clip.gif").read_bytes() == b"an unrelated gif"


# ---- presets: killed and concurrent builds -----------------------------------------------------
def test_half_written_preset_and_dead_build_are_replaced(
    empty_home: Path, pm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Path] = []

    def quick_writer(r: Any, out: Path) -> None:  # what matters here is the folder handling
        written.append(out)
        (out / "model_index.json").write_text("{}")
        (out / presets._MARKER).write_text(json.dumps({"format": presets.PRESET_FORMAT, "name": r.preset.name}))

    monkeypatch.setattr(presets, "_write_preset", quick_writer)
    parent = empty_home / "presets"
    half = parent / "tiny-wan"
    (half / "transformer").mkdir(parents=True)  # a build of an older version, killed half-way
    (half / "transformer" / "config.json").write_text("{")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = parent / f".tiny-wan.build-{dead.pid}-x1y2"
    (stale / "vae").mkdir(parents=True)
    other = parent / ".tiny-longlive.build-1-keep"  # another preset's build: not this one's to remove
    other.mkdir()
    assert not presets.is_complete_preset(half)
    folder = presets.materialize_preset("tiny-wan", pm=pm)
    assert folder == half and presets.is_complete_preset(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted([presets._MARKER, "model_index.json"])
    assert not stale.exists() and other.exists()
    assert {p.name for p in parent.iterdir()} == {"tiny-wan", ".tiny-wan.lock", other.name}
    assert presets.materialize_preset("tiny-wan", pm=pm) == folder and len(written) == 1  # kept


def test_concurrent_processes_build_one_complete_preset(children: Children) -> None:
    # both built or waited for the preset, then loaded it: one ran to the end, the other
    # reached its first chunk (the interruption message counts it)
    r = children.results()
    assert r["pipe"]["rc"] == 0, r["pipe"]["stderr"]
    assert "interrupted after chunk 1 of 3" in r["sigint"]["stderr"]
    parent = children.home / "presets"
    assert {p.name for p in parent.iterdir()} == {"tiny-wan", ".tiny-wan.lock"}
    assert presets.is_complete_preset(parent / "tiny-wan")
    assert (parent / "tiny-wan" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_closed_stdout_still_writes_the_metrics(children: Children) -> None:
    r = children.results()["pipe"]
    assert children.first_line.startswith("model: tiny-wan")
    assert r["rc"] == 0 and "Traceback" not in r["stderr"] and "BrokenPipe" not in r["stderr"]
    metrics = json.loads((r["out"] / "m.json").read_text())
    assert metrics["chunks"] == 1 and metrics["output"] == str(r["out"] / "v.gif")
    assert files(r["out"]) == {"v.gif", "m.json"}


def test_sigint_exits_130_and_writes_nothing(children: Children) -> None:
    r = children.results()["sigint"]
    assert r["rc"] == 130, r["stderr"]
    assert causalkv_lines(r["stderr"]) == ["causalkv generate: interrupted after chunk 1 of 3; nothing written"]
    assert "Traceback" not in r["stderr"] and "KeyboardInterrupt" not in r["stderr"]
    assert files(r["out"]) == set()
