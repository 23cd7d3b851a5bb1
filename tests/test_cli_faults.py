"""The ``causalkv generate`` fault matrix: every fault ends with its documented exit code, one
line on stderr naming the value and the fix, and only complete files left behind.

Faults knowable before the weights load run in-process against an empty CAUSALKV_HOME and
must leave it empty, run zero chunks and never reach the loader. Faults of a run use the
session's tiny presets. SIGINT, SIGTERM, a closed stdout (pipe or descriptor) and concurrent
preset builds need real processes: four start at once in one empty CAUSALKV_HOME
(`children`). More rows: test_cli_faults_preload.py (values refused before the load),
test_cli_faults_outputs.py (disk full, encoders, file modes, stdout),
test_cli_faults_parallel.py (--nproc-per-node 2).
"""

from __future__ import annotations

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
from fault_helpers import (
    ERROR,
    OLD_VIDEO,
    ROOT,
    ChunkCounter,
    assert_refused_up_front,
    causalkv_lines,
    fake_model_folder,
    files,
    run_cli,
    runtime_generate,
)

import causalkv.plugin.manager as plugin_manager
from causalkv.errors import ConfigError
from causalkv.hooks import hookimpl
from causalkv.runtime.files import video
from causalkv.runtime.files.outputs import load_latents
from causalkv.runtime.host import request_checks
from causalkv.runtime.model_io import presets

PAUSE_AT_FIRST_CHUNK = """
import pathlib, signal, sys, time
# a background job of a non-interactive shell starts with SIGINT ignored, and so would this
# child under `make test &`: the command keeps an inherited SIG_IGN, the test wants Ctrl-C
signal.signal(signal.SIGINT, signal.default_int_handler)
from causalkv.cli import main
from causalkv.hooks import hookimpl
from causalkv.plugin import get_plugin_manager

class Pause:
    @hookimpl
    def causalkv_chunk_done(self, chunk_index):
        if chunk_index == 0:
            pathlib.Path(sys.argv[1]).touch()
            time.sleep(120)  # the signal ends this; if it never comes, fail fast
            sys.exit(99)

get_plugin_manager().register_plugin(Pause(), "pause")
sys.exit(main(sys.argv[2:]))
"""

#: seconds a child may take (tiny-wan, a few chunks, on 2 busy cores)
CHILD_TIMEOUT_S = 300


class Children:
    """``causalkv generate`` processes started together in one empty CAUSALKV_HOME, so they
    build tiny-wan at the same time. ``pipe`` has its stdout closed after its first line (like
    ``| head -1``) and ``closed`` starts with file descriptor 1 closed (``>&-``); both run to
    the end. ``sigint`` and ``sigterm`` get their signal while they pause after chunk 0 of 3.
    They start with the module's first test and run while the in-process tests do; `results`
    waits for them. The concurrency test reads only the two that run to the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.home = tmp, tmp / "home"
        self.home.mkdir()
        env = {**os.environ, "CAUSALKV_HOME": str(self.home), "PYTHONPATH": str(ROOT)}
        env.pop("CAUSALKV_PLUGINS", None)
        base = ["generate", "--quiet", "--dtype", "float32"]
        names = ("pipe", "closed", "sigint", "sigterm")
        self.outs = {name: tmp / name for name in names}
        for d in self.outs.values():
            d.mkdir()
        self.markers = {name: tmp / f"paused-{name}" for name in ("sigint", "sigterm")}

        def plain(name: str) -> list[str]:
            return [sys.executable, "-m", "causalkv", *base, "--frames", "3", "--output",
                    str(self.outs[name] / "v.gif"), "--metrics", str(self.outs[name] / "m.json")]

        def paused(name: str) -> list[str]:
            return [sys.executable, "-c", PAUSE_AT_FIRST_CHUNK, str(self.markers[name]), *base,
                    "--frames", "9", "--output", str(self.outs[name] / "v.mp4"),
                    "--metrics", str(self.outs[name] / "m.json")]

        argv = {"pipe": plain("pipe"), "closed": plain("closed"),
                "sigint": paused("sigint"), "sigterm": paused("sigterm")}
        self.logs = {name: open(tmp / f"{name}.stderr", "w+") for name in argv}  # noqa: SIM115
        self.procs = {
            name: subprocess.Popen(
                cmd, env=env, text=True, stderr=self.logs[name],
                stdout=subprocess.PIPE if name == "pipe" else subprocess.DEVNULL,
                preexec_fn=(lambda: os.close(1)) if name == "closed" else None,
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
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        todo = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
        while todo and time.monotonic() < deadline:
            for name, sig in list(todo.items()):
                if self.markers[name].exists():
                    self.procs[name].send_signal(sig)
                    del todo[name]
                elif self.procs[name].poll() is not None:
                    del todo[name]
            time.sleep(0.1)

    def results(self) -> dict[str, dict[str, Any]]:
        self._driver.join(timeout=CHILD_TIMEOUT_S + 30)
        out = {}
        for name, p in self.procs.items():
            p.wait(timeout=CHILD_TIMEOUT_S)
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
    ("served name, no weights", ["--model", "SelfForcingWanPipeline"],
     ["model 'SelfForcingWanPipeline' is a name stage 'self-forcing-wan' (plugin 'causalkv.builtin') "
      "serves, but no plugin declares a preset of that name", "pass --model a model folder"]),
    # QVG: 12 channels x 2 bits are 3 whole bytes, but 12 does not divide head_dim 64
    ("block size vs head_dim", ["--kv-cache-quant", "int2", "--kv-cache-quant-block-size", "12"],
     ["kv-cache-quant-block-size 12 does not divide head_dim=64; choose one of [4, 8, 16, 32, 64]"]),
    ("block size not whole bytes", ["--kv-cache-quant", "int2", "--kv-cache-quant-block-size", "7"],
     ["kv-cache-quant-block-size 7 x 2 bits is not a whole number of bytes"]),
    ("QVG setting with quant off", ["--kv-cache-quant-centroids", "64"],
     ["--kv-cache-quant-centroids set(s) QVG quantization, which is off; pass --kv-cache-quant "
      "with a codec (int4, int2, fp8, nvfp4), or drop them"]),
    ("guidance on a stage without CFG", ["--guidance-scale", "3"],
     ["--guidance-scale set(s) classifier-free guidance, which stage 'self-forcing-wan' "
      "(WanCausalDMDStage) does not run; drop it"]),
    ("negative prompt on a stage without CFG", ["--model", "tiny-lingbot", "--negative-prompt", "blur"],
     ["--negative-prompt set(s) classifier-free guidance, which stage 'lingbot-world'"]),
    ("negative prompt with CFG off", ["--model", "tiny-longlive2", "--guidance-scale", "1", "--negative-prompt", "x"],
     ["--negative-prompt is used by the negative CFG branch, which is off at guidance scale 1"]),
    ("shot flags on one shot", ["--model", "tiny-longlive2", "--shot-durations", "4"],
     ["shot flags (--shot-durations", "this one has a single shot; drop them or pass one --prompt per shot"]),
    ("shot flags on a single-shot stage", ["--scene-cut-prefix", "Cut. "],
     ["shot flags (--shot-durations", "apply to multi-shot stages, not to WanCausalDMDStage"]),
    ("motion on a stage without a motion window", ["--motion", "m,s,s,m"],
     ["--motion applies to LingBot-World's interactive window, not to WanCausalDMDStage"]),
    ("prompt not UTF-8", ["--prompt", os.fsdecode(b"caf\xe9 au lait")],
     ["--prompt b'caf\\xe9 au lait' is not valid UTF-8 text (byte b'\\xe9' at byte 3)"]),
    ("negative prompt not UTF-8", ["--model", "tiny-longlive2", "--negative-prompt", os.fsdecode(b"\xff")],
     ["--negative-prompt b'\\xff' is not valid UTF-8 text"]),
    ("cuda processes without CUDA", ["--device", "cuda", "--nproc-per-node", "2"], ["--device cuda: "]),
]


@pytest.mark.parametrize(("argv", "messages"), [c[1:] for c in PRELOAD], ids=[c[0] for c in PRELOAD])
def test_refused_before_any_weights_load(
    argv: list[str], messages: list[str], tmp_path: Path, empty_home: Path, counter: ChunkCounter,
    loads: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    if sys.platform != "linux" and any(a.startswith("/proc") for a in argv):
        pytest.skip("/proc is Linux's")
    if "cuda" in argv and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the CUDA devices the row says it lacks")
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


def test_a_request_that_does_not_fit_in_memory_is_refused(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # tiny-wan, 12 frames, float32 (the memory floor's parts, from their formulas):
    # latents: noise + output, 4 B x 12 frames x 4 channels x 8 x 8 = 2 x 12 KiB
    # KV: 9 cached frames x 16 tokens x 2 layers x (K, V) x 2 heads x 64 x 4 B = 288 KiB
    # activations: q, k, v, out of a 48-token chunk x 2 heads x 64 x 4 B = 96 KiB
    # RoPE tables: cos + sin, 1024 positions x 64 x 4 B = 512 KiB; on a machine of 16 KiB
    monkeypatch.setattr(request_checks, "_physical_memory_bytes", lambda: 16 * 1024)
    assert_refused_up_front(
        ["--frames", "12", "--no-video"],
        ["the request needs at least 920.00 KiB of memory (latents 24.00 KiB, kv caches "
         "288.00 KiB, activations 96.00 KiB, rope tables 512.00 KiB), more than the 16.00 KiB of "
         "--device cpu; lower rope_max_seq_len in tiny-wan's transformer/config.json"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_a_cuda_index_beyond_the_machine_s_devices_is_refused_as_absent(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a machine with one CUDA device, ``--device cuda:1`` gets the absent-device line (exit
    2): the memory check, which runs before the device check, asks only a device that exists
    for its memory (torch's ``get_device_properties`` asserts on any other index)."""

    def properties(index: int) -> Any:
        assert index < 1, "Invalid device id"  # as torch.cuda.get_device_properties does
        return type("Props", (), {"total_memory": 80 * 2**30})()

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert_refused_up_front(
        ["--device", "cuda:1", "--no-video"],
        ["--device 'cuda:1' is not available: this machine has 1 CUDA device(s); use --device cpu"],
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

    monkeypatch.setattr(torch, "ones", ones)
    assert_refused_up_front(
        ["--dtype", "float16", "--no-video"],
        ["--dtype float16 does not run on --device cpu (\"addmm_impl_cpu_\" not implemented for 'Half'); "
         "use --dtype float32"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_the_limits_themselves_are_accepted(empty_home: Path, pm: Any) -> None:
    """The boundaries the messages suggest plan fine (no weights are needed to know)."""
    from runtime_helpers import make_options

    from causalkv.runtime.host.plan_step import plan_generation

    assert plan_generation(make_options("tiny-wan", frames=1023), pm=pm).num_chunks == 341
    opts = make_options("tiny-longlive2", frames=1020, prompts=["a", "b", "c"])
    plan = plan_generation(opts, pm=pm)
    assert max(request_checks.rope_frame_ends(plan)) == 1024  # 1020 frames + 2 shots x 2 frames offset
    assert plan_generation(make_options("tiny-wan", seed=2**64 - 1), pm=pm).server_args.seed == 2**64 - 1
    assert files(empty_home) == set()


# ---- an unreadable model folder --------------------------------------------------------------
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


def _shard_index_not_an_object(root: Path) -> str:
    (root / "text_encoder" / "model.safetensors.index.json").write_text("[]")
    return "model.safetensors.index.json must hold a JSON object ({...}), it holds a list"


def _not_safetensors(root: Path) -> str:
    (root / "text_encoder" / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")
    return f"{root}/text_encoder/model.safetensors is not a safetensors file"


@pytest.mark.parametrize("corrupt", [
    _corrupt_json, _truncate, _no_weights, _missing_shard, _shard_index_not_an_object, _not_safetensors,
])
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
    out.write_bytes(OLD_VIDEO)
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
    out.write_bytes(OLD_VIDEO)
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "3", "--output", str(out),
                  "--metrics", str(tmp_path / "m.json"), "--save-latents", str(requested)])
    lines = causalkv_lines(capsys.readouterr().err)
    kept = tmp_path / "v.latents.safetensors"
    assert rc == 1
    assert lines == [f"{ERROR}could not write '{out}' (RuntimeError: encoder died); the generated "
                     f"latents are kept in '{kept}'; the files written before it are kept: "
                     f"'{requested}' (--save-latents)"]
    assert files(tmp_path) == {"v.mp4", "requested.safetensors", "v.latents.safetensors"}
    assert out.read_bytes() == OLD_VIDEO
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
    assert {p.name for p in parent.iterdir()} == {"tiny-wan", other.name}
    assert presets.materialize_preset("tiny-wan", pm=pm) == folder and len(written) == 1  # kept


def test_concurrent_processes_build_one_complete_preset(children: Children) -> None:
    # the two children that run to the end both built or waited for the preset, then loaded
    # it (the signalled ones share the home too, but this test does not depend on them)
    r = children.results()
    for name in ("pipe", "closed"):
        assert r[name]["rc"] == 0, r[name]["stderr"]
        assert json.loads((r[name]["out"] / "m.json").read_text())["chunks"] == 1
    parent = children.home / "presets"
    assert {p.name for p in parent.iterdir()} == {"tiny-wan"}  # the build lock is removed
    assert presets.is_complete_preset(parent / "tiny-wan")
    assert (parent / "tiny-wan" / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_closed_stdout_pipe_still_writes_the_metrics(children: Children) -> None:
    r = children.results()["pipe"]
    assert children.first_line.startswith("model: tiny-wan")
    assert r["rc"] == 0 and r["stderr"] == ""
    metrics = json.loads((r["out"] / "m.json").read_text())
    assert metrics["chunks"] == 1 and metrics["output"] == str(r["out"] / "v.gif")
    assert files(r["out"]) == {"v.gif", "m.json"}


def test_stdout_closed_from_the_start_runs_and_writes(children: Children) -> None:
    r = children.results()["closed"]  # `causalkv generate ... >&-`
    assert r["rc"] == 0 and r["stderr"] == ""
    assert files(r["out"]) == {"v.gif", "m.json"}


@pytest.mark.parametrize(("name", "code", "line"), [
    ("sigint", 130, "causalkv generate: interrupted after chunk 1 of 3; nothing written"),
    ("sigterm", 143, "causalkv generate: terminated after chunk 1 of 3; nothing written"),
])
def test_signal_exits_with_its_status_and_writes_nothing(children: Children, name: str, code: int, line: str) -> None:
    r = children.results()[name]
    assert r["rc"] == code, r["stderr"]
    assert r["stderr"].splitlines() == [line]
    assert files(r["out"]) == set()
