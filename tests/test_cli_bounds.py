"""Issue 24: every request is bounded before it costs memory or time, nothing a user asked
for is dropped silently, no command overwrites finished work, and every command ends with one
line and its documented exit status (docs/usage.md, "Errors and exit codes").

Each row reproduces one case of the issue. Refusals run in-process against an empty
CAUSALKV_HOME (`assert_refused_up_front`: exit 2, one line, no chunk, no load, no file); what
must run does so on the session's tiny presets. Signals during the imports need a process of
their own (the entry point is what is tested); the random combinations of numeric flags are
tests/test_cli_property.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_helpers import (
    ERROR,
    OLD_VIDEO,
    ROOT,
    ChunkCounter,
    assert_refused_up_front,
    fake_model_folder,
    files,
    one_line,
    run_cli,
    runtime_generate,
)
from runtime_helpers import make_options

from causalkv.caches.demo import DemoConfig
from causalkv.cli import Terminated
from causalkv.cli import demo as demo_cli
from causalkv.cli.commands import ENV_SWITCHES
from causalkv.env import check_switches
from causalkv.errors import ConfigError
from causalkv.runtime.files import file_checks
from causalkv.runtime.host import request_checks
from causalkv.runtime.host.generate import plan_generation, unused_cache_settings
from causalkv.runtime.model_io import presets
from causalkv.runtime.model_io.prompt_encoding import PromptEncoder, build_byte_tokenizer
from causalkv.runtime.tools import checkpoints

GIB = 2**30


# ---- 1. bounds before cost --------------------------------------------------------------------
def test_a_huge_frame_count_is_refused_before_the_chunk_list_is_built(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 999,999,999,999 frames are 333,333,333,333 chunks: a list of one prompt reference each
    # would be 2.7 TB; planning refuses it on the RoPE limit first, in a few MB
    tracemalloc.start()
    try:
        assert_refused_up_front(
            ["--frames", "999999999999", "--no-video"],
            ["--frames 999999999999 exceeds the RoPE limit: rope_max_seq_len=1024", "pass --frames 1023 or fewer"],
            tmp_path, empty_home, counter, loads, capsys,
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20


def test_the_memory_check_counts_the_preallocated_window(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the dense cache preallocates its whole window, whatever the video's 12 frames:
    # 2 layers x (K, V) x 10,000,000 frames x 16 tokens x 2 heads x 64 x 4 B = 305.18 GiB
    monkeypatch.setattr(request_checks, "host_memory_bytes", lambda: 16 * GIB)
    assert_refused_up_front(
        ["--window-frames", "10000000", "--no-video"],
        ["kv caches 305.18 GiB", "more than the 16.00 GiB of --device cpu", "(--window-frames)"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_a_window_longer_than_the_video_is_one_warning_with_its_cost(empty_home: Path, pm: Any) -> None:
    plan = plan_generation(make_options("tiny-wan", window_frames=100000), pm=pm)
    # 2 layers x 2 x 100,000 frames x 16 tokens x 2 heads x 64 x 4 B = 3,276,800,000 B = 3.05 GiB
    assert request_checks.memory_floor(plan)["kv_caches"] == 2 * 2 * 100000 * 16 * 2 * 64 * 4
    assert plan.warnings == [
        "--window-frames 100000 is longer than the video (12 frames): attention sees every frame, as "
        "with --window-frames 12, but the caches hold room for 100000 frames (3.05 GiB of KV); "
        "pass --window-frames 12 for the same video in less memory"
    ]
    assert plan_generation(make_options("tiny-wan", window_frames=12), pm=pm).warnings == []


def test_a_packed_cache_is_not_counted_as_preallocated(empty_home: Path, pm: Any) -> None:
    dense = plan_generation(make_options("tiny-wan", frames=3), pm=pm)  # 3 frames, cache 9
    packed = plan_generation(make_options("tiny-wan", frames=3, quant="int2"), pm=pm)
    assert request_checks.memory_floor(dense)["kv_caches"] == 2 * 2 * 9 * 16 * 2 * 64 * 4  # the window
    assert request_checks.memory_floor(packed)["kv_caches"] == 2 * 2 * 3 * 16 * 2 * 64 * 4  # one chunk


@pytest.mark.parametrize(("argv", "line"), [
    (["--chunks", "100000000"],
     "causalkv demo: error: --chunks 100000000: the walkthrough prints one line per chunk of one "
     "character per frame (800,000,000 here); pass --chunks 128 or fewer"),
    # a token costs 2 (K, V) x 4 heads x 8 x 2 B = 128 B; the floor is the cache and its view
    # (2 x 32 frames) plus half a chunk's K/V (4 frames): 68 frames x 128 B = 8,704 B per unit
    # of --tokens-per-frame, so 10**8 need 870,400,000,000 B and 1 GiB fits 2**30 // 8,704 = 123,361
    (["--tokens-per-frame", "100000000"],
     "causalkv demo: error: --tokens-per-frame 100,000,000: the cache and its view need at least "
     "870,400,000,000 bytes, more than the 1,073,741,824 bytes of memory here; pass "
     "--tokens-per-frame 123,361 or fewer"),
])
def test_demo_sizes_are_bounded_before_anything_is_built(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(demo_cli, "host_memory_bytes", lambda: GIB)
    built: list[Any] = []
    monkeypatch.setattr(demo_cli, "run_demo", lambda config: built.append(config) or [])
    rc = run_cli(["demo", *argv])
    captured = capsys.readouterr()
    assert (rc, captured.out, built) == (2, "", [])
    assert one_line(captured.err) == line


def test_demo_memory_floor_matches_its_formula() -> None:
    config = DemoConfig(tokens_per_frame=100)
    per_token = 2 * config.num_heads * config.head_dim * 2  # K and V, bf16
    want = 2 * config.window_frames * 100 * per_token + config.frames_per_chunk * 100 * per_token // 2
    assert demo_cli.demo_memory_floor(config) == want
    demo_cli.check_demo_sizes(config, want)  # exactly enough is enough
    with pytest.raises(ConfigError):
        demo_cli.check_demo_sizes(config, want - 1)


@pytest.mark.parametrize(("exc", "code", "line"), [
    (KeyboardInterrupt(), 130, "causalkv demo: interrupted; the report was not printed"),
    (Terminated(), 143, "causalkv demo: terminated; the report was not printed"),
    (MemoryError(), 1, "causalkv demo: error: out of memory; free memory or make the request smaller"),
])
def test_demo_ends_in_one_line_on_a_signal_or_no_memory(
    exc: BaseException, code: int, line: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def run_demo(config: Any) -> Any:
        raise exc

    monkeypatch.setattr(demo_cli, "run_demo", run_demo)
    rc = run_cli(["demo"])
    captured = capsys.readouterr()
    assert rc == code and captured.out == ""
    assert one_line(captured.err) == line


def test_demo_into_a_closed_pipe_exits_0_quietly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # 128 chunks print a frame map of 128 x 1,024 characters, more than a pipe holds (64 KiB):
    # the reader is gone before the report is written
    cmd = f"set -o pipefail; {sys.executable} -m causalkv demo --chunks 128 | head -1"
    p = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout.startswith("causalkv demo: ")


# ---- 2. no overwrite of finished work -----------------------------------------------------------
def _quick_checkpoints(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`_write` replaced by one that writes the marker only (the folder handling is tested)."""
    written: list[str] = []

    def quick(spec: Any, out: Path) -> None:
        written.append(spec.name)
        (out / "model_index.json").write_text(json.dumps({"_class_name": spec.pipeline_class}))
        (out / checkpoints._MARKER).write_text(
            json.dumps({"format": checkpoints.CHECKPOINT_FORMAT, "name": spec.name})
        )

    monkeypatch.setattr(checkpoints, "_write", quick)
    return written


def test_a_complete_checkpoint_of_another_pipeline_is_kept_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    written = _quick_checkpoints(monkeypatch)
    folder = tmp_path / "ckpt"
    assert run_cli(["sglang-checkpoint", "lingbot", str(folder)]) == 0
    before = (folder / "model_index.json").read_text()
    capsys.readouterr()
    rc = run_cli(["sglang-checkpoint", "longlive2", str(folder)])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert one_line(captured.err) == (
        f"causalkv sglang-checkpoint: error: sglang-checkpoint DIR '{folder}' holds a complete tiny "
        "lingbot sglang checkpoint, not longlive2; choose another folder, or pass --force to replace it "
        "(atomically)"
    )
    assert (folder / "model_index.json").read_text() == before and written == ["lingbot"]
    assert run_cli(["sglang-checkpoint", "longlive2", str(folder), "--force"]) == 0
    assert checkpoints.is_complete_checkpoint(folder, "longlive2") and written == ["lingbot", "longlive2"]
    assert {p.name for p in tmp_path.iterdir()} == {"ckpt"}  # no build, no lock file left behind


@pytest.mark.parametrize("kind", ["non-empty", "a preset", "a file", "not writable"])
def test_sglang_checkpoint_refusals_are_one_line_naming_what_is_there(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    written = _quick_checkpoints(monkeypatch)
    where = tmp_path / "dir"
    if kind == "non-empty":
        where.mkdir()
        (where / "notes.txt").write_text("mine\n")
        want = (f"sglang-checkpoint DIR '{where}' exists, holds 1 entry and is not a causalkv sglang "
                "checkpoint; choose a new or empty folder (it is never overwritten)")
    elif kind == "a preset":
        where.mkdir()
        (where / presets._MARKER).write_text(json.dumps({"format": presets.PRESET_FORMAT, "name": "tiny-wan"}))
        want = f"sglang-checkpoint DIR '{where}' exists, holds the causalkv preset 'tiny-wan' and is not"
    elif kind == "a file":
        where.write_text("a file\n")
        want = f"sglang-checkpoint DIR '{where}' is a file, not a folder; choose a new or empty folder"
    else:  # nothing can be created under /proc, by root either
        where = Path("/proc/causalkv-ckpt")
        want = ("sglang-checkpoint DIR '/proc/causalkv-ckpt': cannot create files in '/proc' (its file "
                "system takes no new files (a virtual file system such as /proc or /sys)); choose a folder "
                "where files can be created")
    before = files(tmp_path)
    rc = run_cli(["sglang-checkpoint", "longlive2", str(where)])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and written == []
    assert one_line(captured.err).startswith(f"causalkv sglang-checkpoint: error: {want}")
    assert files(tmp_path) == before


def test_a_checkpoint_build_that_cannot_write_is_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full_disk(spec: Any, out: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints, "_write", full_disk)
    rc = run_cli(["sglang-checkpoint", "longlive2", str(tmp_path / "ckpt")])
    line = one_line(capsys.readouterr().err)
    assert rc == 1
    assert line == (f"causalkv sglang-checkpoint: error: could not write the longlive2 checkpoint into "
                    f"'{tmp_path / 'ckpt'}' (no space left on its file system); nothing was changed there; "
                    "free some space or choose another folder")
    assert {p.name for p in tmp_path.iterdir()} == set()


def test_a_preset_folder_holding_another_preset_is_refused_not_rebuilt(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = fake_model_folder(empty_home / "presets" / "tiny-wan")
    (folder / presets._MARKER).write_text(json.dumps({"format": presets.PRESET_FORMAT, "name": "tiny-lingbot"}))
    before = files(empty_home)
    rc = run_cli(["generate", "--quiet", "--no-video"])
    line = one_line(capsys.readouterr().err)
    assert rc == 2 and loads == [] and files(empty_home) == before
    assert line == (f"{ERROR}{folder} holds the complete preset 'tiny-lingbot', not 'tiny-wan'; move it to "
                    f"'{folder.parent / 'tiny-lingbot'}' or delete the preset folder '{folder}'; it is rebuilt "
                    "on the next run")


def test_a_preset_build_that_cannot_write_is_one_line_exit_1(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full_disk(r: Any, out: Path) -> None:
        (out / "transformer").mkdir()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(presets, "_write_preset", full_disk)
    rc = run_cli(["generate", "--quiet", "--no-video"])
    line = one_line(capsys.readouterr().err)
    assert rc == 1 and counter.chunks == []
    assert line == (f"{ERROR}could not build the preset 'tiny-wan' in '{empty_home / 'presets'}' (no space left "
                    "on its file system); nothing was left there; free some space or set CAUSALKV_HOME to a "
                    "writable folder")
    assert files(empty_home) == {"presets"}  # no half-built preset, no lock file


@pytest.mark.parametrize(("code", "reason"), [
    (30, "a read-only file system"),  # EROFS
    (13, "permission denied"),  # EACCES
    (28, "no space left on its file system"),  # ENOSPC
    (2, "its file system takes no new files (a virtual file system such as /proc or /sys)"),  # ENOENT
    (5, "Input/output error"),  # EIO: the errno's own text
])
def test_file_system_errors_are_named_in_words_a_user_can_act_on(code: int, reason: str, tmp_path: Path) -> None:
    assert file_checks.fs_error_reason(OSError(code, os.strerror(code)), tmp_path) == reason


@pytest.mark.parametrize(("flag", "name", "content", "held", "expected"), [
    ("--metrics", "v.mp4", OLD_VIDEO, "an MP4 video", "causalkv metrics"),
    ("--metrics", "README.md", b"# my notes\n", "11 bytes of text", "causalkv metrics"),
    ("--output", "m.gif", b'{"model": "tiny-wan"}', "a JSON file", "a GIF image"),
    ("--save-latents", "w.safetensors", None, "a safetensors file", "saved latents (safetensors)"),
    ("--output", "v.mp4", b"GIF89a a gif renamed", "a GIF image", "an MP4 video"),
])
def test_an_output_holding_another_kind_of_file_is_refused_unless_forced(
    flag: str, name: str, content: bytes | None, held: str, expected: str, tmp_path: Path,
    empty_home: Path, counter: ChunkCounter, loads: list[str], capsys: pytest.CaptureFixture[str],
    pm: Any,
) -> None:
    target = tmp_path / name
    if content is None:  # a model's weights: safetensors without a "latents" tensor
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(2)}, str(target))
    else:
        target.write_bytes(content)
    before = target.read_bytes()
    argv = [flag, str(target)] if flag == "--output" else [flag, str(target), "--no-video"]
    assert_refused_up_front(
        argv, [f"{flag} '{target}' exists and holds {held}, not {expected}; choose another {flag}, or pass "
               "--force to replace it (atomically, once the run has its result)"],
        tmp_path, empty_home, counter, loads, capsys,
    )
    assert target.read_bytes() == before
    with pytest.raises(ConfigError, match="exists and holds"):
        file_checks.check_no_other_work(flag, target, force=False)
    file_checks.check_no_other_work(flag, target, force=True)  # --force: accepted


def test_the_previous_runs_files_are_replaced_without_force(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text(json.dumps({"model": "tiny-wan", "stage": "x", "chunks": 4}))
    (tmp_path / "v.mp4").write_bytes(OLD_VIDEO)
    (tmp_path / "empty.gif").write_bytes(b"")
    file_checks.check_output_files(output=tmp_path / "v.mp4", metrics=tmp_path / "m.json")
    file_checks.check_output_files(output=tmp_path / "empty.gif")


def test_force_is_a_documented_flag_of_generate(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["generate", "--help"]) == 0
    assert "--force" in capsys.readouterr().out
    assert "`--force`" in (ROOT / "docs" / "usage.md").read_text()


# ---- 3. nothing dropped silently ------------------------------------------------------------------
REFUSED: list[tuple[str, list[str], list[str]]] = [
    ("a fifth prompt on four chunks",
     ["--model", "tiny-longlive2", *[a for p in "abcde" for a in ("--prompt", p)]],
     ["5 shots on 4 chunks: shot 5 ('e') would get no chunk (the shots before it take all 4); pass "
      "--frames for at least 5 chunks, or fewer shots"]),
    # tiny-longlive2: 8 frames, 4 chunks; the first shot's 10 take them all: 10 + 1 = 11 chunks
    ("a second shot never reached", ["--model", "tiny-longlive2", "--prompt", "a", "--prompt", "b",
                                     "--shot-durations", "10,10"],
     ["2 shots on 4 chunks: shot 2 ('b') would get no chunk", "for at least 11 chunks, shorter --shot-durations"]),
    ("chunks per shot beside durations", ["--model", "tiny-longlive2", "--prompt", "a", "--prompt", "b",
                                          "--shot-durations", "2,2", "--chunks-per-shot", "1"],
     ["--chunks-per-shot 1 does nothing beside --shot-durations (the durations win); pass one of them"]),
    ("guidance 0", ["--model", "tiny-longlive2", "--guidance-scale", "0"],
     ["--guidance-scale 0 does nothing: stage 'longlive2' runs the negative CFG branch only above 1, so a "
      "scale <= 1 samples exactly as 1 (guidance off); pass a scale > 1, or 1 to turn guidance off"]),
    ("guidance 0.5", ["--model", "tiny-longlive2", "--guidance-scale", "0.5"], ["--guidance-scale 0.5 does nothing"]),
    # tiny-lingbot: window 12, chunk 3 -> 9 frames before a chunk at most
    ("recent window above the window", ["--model", "tiny-lingbot", "--recent-window-frames", "13"],
     ["--recent-window-frames 13 does nothing: a chunk sees at most the 9 frames before it that the "
      "12-frame window holds besides the chunk; pass --recent-window-frames 9 or fewer, or drop it"]),
    ("sink span with sink 0", ["--kv-cache-quant", "int2", "--kv-cache-quant-sink-span", "full"],
     ["--kv-cache-quant-sink-span sets how the cache keeps the sink, and this request has no sink (sink 0 "
      "frames on tiny-wan): it would do nothing; drop it or pass --sink-frames N"]),
    ("compare with quantization off", ["--compare-bf16"],
     ["--compare-bf16 compares the run with the same run without the cache's settings, and this request "
      "gives none (cache 'dense', kv-cache-quant off): both runs would be the same; pass --kv-cache-quant "
      "int4 or int2, or drop --compare-bf16"]),
    ("a CPU index", ["--device", "cpu:9"],
     ["--device 'cpu:9' is not available: the CPU is one device, cpu or cpu:0, not cpu:9; use --device cpu"]),
    # tiny-longlive2, 2 shots: chunk 3 (the last) of shot 1 starts at 3 x 2 + 1 x offset and must end
    # by 1024: offset <= 1024 - 6 - 2 = 1016
    ("a RoPE offset beyond the limit", ["--model", "tiny-longlive2", "--prompt", "a", "--prompt", "b",
                                        "--multi-shot-rope-offset", "1e9"],
     ["chunk 2 would use RoPE frames up to 1000000006", "lower the per-shot RoPE offset "
      "(--multi-shot-rope-offset, now 1e+09) to at most 1016, or pass fewer --frames or shots"]),
    ("a motion letter that is not one", ["--model", "tiny-lingbot", "--frames", "9", "--motion", "m,s,x"],
     ["got 'm,s,x' (e.g. --motion m,s,m)"]),
    ("output under /proc", ["--output", "/proc/x.mp4"],
     ["cannot create files in '/proc' (its file system takes no new files (a virtual file system such as "
      "/proc or /sys)); choose a writable folder for --output"]),
]


@pytest.mark.parametrize(("argv", "messages"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_request_that_would_change_nothing_is_refused(
    argv: list[str], messages: list[str], tmp_path: Path, empty_home: Path, counter: ChunkCounter,
    loads: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    if sys.platform != "linux" and "/proc/x.mp4" in argv:
        pytest.skip("/proc is Linux's")
    if "--output" not in argv:
        argv = [*argv, "--no-video"]
    assert_refused_up_front(argv, messages, tmp_path, empty_home, counter, loads, capsys)


def test_the_shot_and_offset_limits_themselves_plan(empty_home: Path, pm: Any) -> None:
    """The boundaries the messages name are accepted."""
    from causalkv.stages.families import ShotRequest

    five = make_options("tiny-longlive2", prompts=list("abcde"), frames=10)
    assert plan_generation(five, pm=pm).num_chunks == 5
    eleven = make_options("tiny-longlive2", prompts=["a", "b"], frames=22)
    eleven.server_args = replace(eleven.server_args, options=(ShotRequest(durations=(10, 10)),))
    assert plan_generation(eleven, pm=pm).num_chunks == 11
    offset = make_options("tiny-longlive2", prompts=["a", "b"])
    offset.server_args = replace(offset.server_args, options=(ShotRequest(multi_shot_rope_offset=1016.0),))
    assert max(request_checks.rope_frame_ends(plan_generation(offset, pm=pm))) == 1024


def test_guidance_below_one_in_the_models_config_is_refused(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = fake_model_folder(tmp_path / "model", causalkv={"guidance_scale": 0.5},
                             _class_name="LongLive2Pipeline")
    assert_refused_up_front(
        ["--model", str(root), "--frames", "8", "--no-video"],
        [f"guidance_scale 0.5 in {root}'s causalkv.json does nothing"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_cache_settings_that_pack_nothing_are_one_warning(
    causalkv_home: str, tmp_path: Path, counter: ChunkCounter, capsys: pytest.CaptureFixture[str],
) -> None:
    m = tmp_path / "m.json"
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "6", "--kv-cache-quant", "int2",
                  "--kv-cache-quant-keep-recent", "1000", "--no-video", "--metrics", str(m)])
    line = one_line(capsys.readouterr().err)
    assert rc == 0
    packing = json.loads(m.read_text())["kv_packing"]
    assert packing["chunks_packed"] == 0
    why = ", ".join(f"{n} {reason}" for reason, n in packing["chunks_dense"].items())
    assert line.startswith("causalkv: warning: the cache 'qvg' packed no chunk with its settings (qvg(int2, ")
    assert f"every chunk stayed unquantized (chunk writes kept dense: {why})" in line and "recent" in why


def test_the_packing_warning_names_the_caches_own_reasons(empty_home: Path, pm: Any) -> None:
    plan = plan_generation(make_options("tiny-wan", quant="int2"), pm=pm)
    stages = {"kv_packing": {"chunks_packed": 0, "chunks_dense": {"not smaller than dense": 4, "recent": 2}}}
    assert "kept dense: 4 not smaller than dense, 2 recent" in unused_cache_settings(plan, stages)
    assert unused_cache_settings(plan, {"kv_packing": {"chunks_packed": 1}}) is None
    assert unused_cache_settings(plan, {"kv_packing": None}) is None


@pytest.mark.parametrize(("var", "value"), [
    ("CAUSALKV_TRACE_PLUGINS", "2"),
    ("CAUSALKV_SGLANG_BRIDGE", "maybe"),
    ("CAUSALKV_DISABLE_PLUGIN_AUTOLOAD", "yes please"),
    ("CAUSALKV_SGLANG_LINGBOT_QVG", "mine"),
])
def test_an_environment_variable_takes_only_its_documented_values(
    var: str, value: str, tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(var, value)
    rc = run_cli(["generate", "--quiet", "--no-video"])
    line = one_line(capsys.readouterr().err)
    assert rc == 2 and loads == [] and files(empty_home) == set()
    assert line.startswith(f"causalkv: error: {var}={value!r} is not one of its values ("), line
    assert line.endswith("; set one of them or unset it")
    switch = next(sw for sw in ENV_SWITCHES if sw.name == var)
    monkeypatch.setenv(var, switch.values[0])  # a documented value is accepted
    check_switches(ENV_SWITCHES)
    monkeypatch.setenv(var, " ")  # blank is unset: its default
    check_switches(ENV_SWITCHES)


def test_the_sglang_bridge_warns_once_on_a_value_it_does_not_know(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import causalkv.sglang as bridge

    monkeypatch.setenv("CAUSALKV_SGLANG_BRIDGE", "maybe")
    with caplog.at_level(logging.WARNING, logger=bridge.logger.name):
        bridge.register()  # without sglang it registers nothing, after the warning
    said = [r.getMessage() for r in caplog.records if "CAUSALKV_SGLANG_BRIDGE" in r.getMessage()]
    assert said == ["causalkv: warning: CAUSALKV_SGLANG_BRIDGE='maybe' is not 0/false/off/no or 1/true/on/yes; "
                    "the sglang bridge stays on (set CAUSALKV_SGLANG_BRIDGE=0 to turn it off)"]


class _Encoder(torch.nn.Module):
    """A text encoder's interface: hidden states of the token ids (zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return type("Out", (), {"last_hidden_state": torch.zeros(ids.shape[0], ids.shape[1], 4)})()


def test_a_prompt_cut_to_the_encoders_length_says_how_many_tokens_were_kept() -> None:
    said: list[str] = []
    enc = PromptEncoder(build_byte_tokenizer(32), _Encoder(), max_length=32, warn=said.append)
    long = "x" * 120_000  # the byte tokenizer: one token per byte plus the end mark = 120,001
    assert enc(long).shape == (1, 32, 4)
    assert said == [
        "the prompt 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' is 120,001 tokens and the text encoder reads 32 "
        "(text_max_length): the first 32 are kept (the end mark included), 119,969 dropped; shorten the "
        "prompt to keep all of it"
    ]
    enc(long)  # memoized: said once
    enc("x" * 31)  # 31 bytes + the end mark = 32: nothing cut
    enc.quiet_texts = frozenset({"y" * 40})
    enc("y" * 40)
    assert len(said) == 1


# ---- 4. one line and the right exit code everywhere --------------------------------------------
IMPORT_SIGNAL = """
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive shell starts it

class SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "causalkv.cli.commands":  # the commands' import (torch, diffusers) begins
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        return None

sys.meta_path.insert(0, SignalOnImport())
from causalkv.cli import main
sys.exit(main(["generate", "--quiet"]))
"""


@pytest.mark.parametrize(("sig", "code", "line"), [
    ("SIGINT", 130, "causalkv: interrupted while starting (before any work); nothing written"),
    ("SIGTERM", 143, "causalkv: terminated while starting (before any work); nothing written"),
])
def test_a_signal_during_the_imports_is_one_line_and_its_status(sig: str, code: int, line: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAUSALKV_HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", IMPORT_SIGNAL, sig], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == code, p.stderr
    assert one_line(p.stderr) == line and p.stdout == ""
    assert files(tmp_path) == set()


@pytest.mark.parametrize(("step", "exc", "code", "line"), [
    ("plan_generation", KeyboardInterrupt(), 130,
     "causalkv generate: interrupted while planning the request, before loading anything; nothing written"),
    ("plan_generation", Terminated(), 143,
     "causalkv generate: terminated while planning the request, before loading anything; nothing written"),
    ("load_for_plan", KeyboardInterrupt(), 130,
     "causalkv generate: interrupted while loading the model, before chunk 1 of 4; nothing written"),
    ("load_for_plan", Terminated(), 143,
     "causalkv generate: terminated while loading the model, before chunk 1 of 4; nothing written"),
])
def test_a_signal_while_planning_or_loading_says_where_the_run_was(
    step: str, exc: BaseException, code: int, line: str, tmp_path: Path, empty_home: Path,
    counter: ChunkCounter, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(runtime_generate, step, interrupted)
    rc = run_cli(["generate", "--quiet", "--no-video", "--metrics", str(tmp_path / "m.json")])
    assert (rc, one_line(capsys.readouterr().err)) == (code, line)
    assert counter.chunks == [] and not (tmp_path / "m.json").exists()


def test_a_libraries_multi_line_warning_does_not_precede_the_error_line(
    causalkv_home: str, tmp_path: Path, pm: Any,
) -> None:
    # diffusers warns in two lines that blocks.2's weights "are newly initialized", then the
    # load fails: a fresh process, so diffusers configures its logging during the load
    folder = tmp_path / "model"
    shutil.copytree(presets.materialize_preset("tiny-wan", pm=pm), folder)
    (folder / presets._MARKER).unlink()  # a model folder of its own, not the preset
    cfg = folder / "transformer" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "num_layers": 3}))  # one layer more than saved
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "causalkv", "generate", "--quiet", "--dtype", "float32",
                        "--no-video", "--model", str(folder), "--frames", "3"],
                       env=env, capture_output=True, text=True, timeout=300)
    line = one_line(p.stderr)  # the whole stderr: diffusers' own lines included
    assert p.returncode == 2
    assert re.fullmatch(re.escape(f"{ERROR}cannot load transformer from '{folder}/transformer' (") + ".+"
                        + re.escape("); restore the component's files (re-download or re-convert the model)"), line)


def test_help_says_each_default_once_and_what_the_grid_changes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert re.findall(r"\(default: [^)]*\) \(default:", text) == []
    start = text.index("--kv-cache-quant-grid {reference,mse4} ")
    grid = text[start:text.index("--kv-cache-quant-keep-recent", start)]
    assert "int4" in grid and "2-bit residual grid" not in grid


@pytest.mark.parametrize(("free", "refused"), [(65536, False), (6859, True)])
def test_the_free_space_floor_is_the_videos_own(
    free: int, refused: bool, tmp_path: Path, empty_home: Path, pm: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # tiny-wan's 12 frames decode to 1 + 4 x 11 = 45 RGB frames of 64x64 (552,960 B raw): the floor
    # is a 200x compression plus a 4 KiB block, 4,096 + 2,764 = 6,860 B (the real mp4 is ~39 KB);
    # 64 KiB also hold the latents kept if the video fails (12 KiB + 4 KiB)
    monkeypatch.setattr(file_checks, "_free_bytes", lambda folder: free)
    options = make_options("tiny-wan")
    options.output = str(tmp_path / "v.mp4")
    if not refused:
        assert request_checks.video_nbytes_floor(plan_generation(options, pm=pm)) == 6860
        return
    with pytest.raises(ConfigError, match=re.escape(f"has {free:,} bytes free, the video needs at least 6,860")):
        plan_generation(options, pm=pm)


def test_every_exit_status_is_in_the_fault_table() -> None:
    table = (ROOT / "docs" / "usage.md").read_text()
    statuses = set(re.findall(r"^\| (\d+) \|", table, re.M))
    assert {"0", "1", "2", "3", "130", "143"} <= statuses
    for case in ("`causalkv demo`", "`causalkv sglang-checkpoint`", "--force", "while loading the model",
                 "while starting (before any work)", "CAUSALKV_TRACE_PLUGINS"):
        assert case in table, case


@pytest.fixture(autouse=True)
def _no_stray_signal_handlers() -> Any:
    before = signal.getsignal(signal.SIGTERM)
    yield
    assert signal.getsignal(signal.SIGTERM) == before
