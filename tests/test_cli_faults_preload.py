"""Fault rows refused before any weights load that need a set-up (a model folder, an env var,
a stdout): each exits 2 with one stderr line naming the value and the fix, runs no chunk,
builds no preset, loads nothing and writes no file. The rows that are just flags are in
test_cli_faults.py's ``PRELOAD`` table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fault_helpers import (
    ChunkCounter,
    assert_refused_up_front,
    fake_model_folder,
    files,
    one_line,
    run_cli,
)

import causalkv.plugin.manager as plugin_manager
from causalkv.runtime.files import file_checks
from causalkv.runtime.model_io import presets

NAN = float("nan")

#: (id, causalkv.json or a transformer-config change, the line's parts); {root} is the folder
FOLDER_VALUES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("shift NaN", {"causalkv": {"shift": NAN}},
     ["{root}/causalkv.json: shift must be a finite number > 0, got nan; fix it in {root}/causalkv.json"]),
    ("shift zero", {"causalkv": {"shift": 0}}, ["shift must be a finite number > 0, got 0"]),
    ("no timesteps", {"causalkv": {"timesteps": []}},
     ["timesteps must be a non-empty list of numbers in (0, 1000], got []"]),
    ("negative timestep", {"causalkv": {"timesteps": [1000, -5]}},
     ["timesteps must be a non-empty list of numbers in (0, 1000], got [1000, -5]"]),
    ("rising timesteps", {"causalkv": {"timesteps": [500, 750]}},
     ["timesteps must be strictly decreasing (the noise level falls at every step), got [500, 750]"]),
    ("fps zero", {"causalkv": {"fps": 0}}, ["fps must be a positive int, got 0"]),
    ("frames per chunk as text", {"causalkv": {"frames_per_chunk": "3"}},
     ["frames_per_chunk must be a positive int, got '3'"]),
    ("context noise out of range", {"causalkv": {"context_noise": 2000}},
     ["context_noise must be a finite number >= 0 and <= 1000, got 2000"]),
    ("negative prompt not text", {"causalkv": {"negative_prompt": 7}}, ["negative_prompt must be text, got 7"]),
    ("guidance on a stage without CFG", {"causalkv": {"guidance_scale": 3}},
     ["guidance_scale in causalkv.json set(s) classifier-free guidance, which stage 'self-forcing-wan'"]),
    # 262144 px / (VAE 8 x patch 2) = 16384 -> 16384^2 = 268,435,456 tokens per frame; the KV of
    # 3 frames alone is 2 layers x (K, V) x 805M tokens x 2 heads x 64 x 2 B (bf16) = 824 GB
    ("height and width beyond memory", {"causalkv": {"height": 262144, "width": 262144}},
     ["the request needs at least ", "lower height and width (262144x262144, 268,435,456 tokens per frame)"]),
    # cos + sin tables, 10**12 positions x 64 x 4 B = 5.12e14 B = 465.66 TiB
    ("RoPE tables beyond memory", {"transformer": {"rope_max_seq_len": 10**12}},
     ["rope tables 465.66 TiB", "lower rope_max_seq_len in {root}'s transformer/config.json"]),
    ("patch size malformed", {"transformer": {"patch_size": [1, 2]}},
     ["{root}/transformer/config.json: patch_size must be 3 positive ints, got [1, 2]"]),
    ("heads not an int", {"transformer": {"num_attention_heads": 1.5}},
     ["{root}/transformer/config.json: num_attention_heads must be a positive int, got 1.5"]),
]


@pytest.mark.parametrize(("change", "messages"), [c[1:] for c in FOLDER_VALUES], ids=[c[0] for c in FOLDER_VALUES])
def test_model_folder_values_are_refused_before_loading(
    change: dict[str, Any], messages: list[str], tmp_path: Path, empty_home: Path,
    counter: ChunkCounter, loads: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    root = fake_model_folder(tmp_path / "model", causalkv=change.get("causalkv"))
    if "transformer" in change:
        cfg = root / "transformer" / "config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **change["transformer"]}))
    out = tmp_path / "out"
    out.mkdir()
    assert_refused_up_front(
        ["--model", str(root), "--frames", "3", "--no-video"], [m.replace("{root}", str(root)) for m in messages],
        out, empty_home, counter, loads, capsys,
    )


@pytest.mark.parametrize("content", ["[]", '"SelfForcingWanPipeline"', "3"])
def test_model_index_that_is_not_an_object_is_refused(
    content: str, tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = fake_model_folder(tmp_path / "model")
    (root / "model_index.json").write_text(content)
    kind = type(json.loads(content)).__name__
    assert_refused_up_front(
        ["--model", str(root), "--no-video"],
        [f"{root}/model_index.json must hold a JSON object ({{...}}), it holds a {kind}; restore the file"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_preset_missing_a_component_names_it_not_the_hub(
    empty_home: Path, tmp_path: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    folder = fake_model_folder(empty_home / "presets" / "tiny-wan")
    (folder / presets._MARKER).write_text(json.dumps({"format": presets.PRESET_FORMAT}))
    shutil.rmtree(folder / "transformer")
    before = files(empty_home)
    rc = run_cli(["generate", "--quiet", "--no-video"])
    line = one_line(capsys.readouterr().err)
    assert rc == 2
    assert line == (f"causalkv generate: error: {folder} is missing transformer/; delete the preset "
                    f"folder '{folder}'; it is rebuilt on the next run")
    assert counter.chunks == [] and loads == [] and files(empty_home) == before


# ---- the environment ------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "message"), [
    ("bogus", "CAUSALKV_QVG_BACKEND='bogus': QVG codec backend must be one of ['auto', 'torch', 'triton'], "
              "got 'bogus'; set CAUSALKV_QVG_BACKEND to auto (or unset it)"),
    ("triton", "CAUSALKV_QVG_BACKEND='triton': QVG codec backend 'triton' "),
])
def test_qvg_backend_that_cannot_run_is_refused(
    value: str, message: str, tmp_path: Path, empty_home: Path, counter: ChunkCounter,
    loads: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CAUSALKV_QVG_BACKEND", value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton runs on CPU tensors only with it
    assert_refused_up_front(["--kv-cache-quant", "int2", "--no-video"], [message], tmp_path, empty_home,
                            counter, loads, capsys)


def test_qvg_backend_is_not_checked_when_quantization_is_off(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, pm: Any,
) -> None:
    from runtime_helpers import make_options

    from causalkv.runtime.host.plan_step import plan_generation

    monkeypatch.setenv("CAUSALKV_QVG_BACKEND", "triton")  # exported for GPU runs; harmless here
    assert plan_generation(make_options("tiny-wan"), pm=pm).num_chunks == 4


@pytest.mark.skipif(sys.platform != "linux", reason="/proc is Linux's")
@pytest.mark.parametrize("kind", ["a file", "not writable"])
def test_causalkv_home_that_cannot_hold_a_preset_is_refused(
    kind: str, tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if kind == "a file":
        home = tmp_path / "home.txt"
        home.write_text("not a folder\n")
        message = f"CAUSALKV_HOME='{home}': '{home}' is a file, not a folder; set CAUSALKV_HOME to a writable folder"
    else:  # nothing can be created under /proc, by root either (a read-only file system, for this check)
        home = Path("/proc/causalkv-home")
        message = ("CAUSALKV_HOME='/proc/causalkv-home': cannot create the preset 'tiny-wan' in "
                   "'/proc/causalkv-home/presets' (")
    monkeypatch.setenv("CAUSALKV_HOME", str(home))
    assert_refused_up_front(["--no-video"], [message, "set CAUSALKV_HOME to a writable folder"], out,
                            empty_home, counter, loads, capsys)


def test_a_full_file_system_is_refused_before_loading(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what statvfs reports for a full disk; the disk that fills up during a run is
    # test_cli_faults_outputs.py's
    monkeypatch.setattr(file_checks, "_free_bytes", lambda folder: 0)
    assert_refused_up_front(
        ["--no-video", "--metrics", str(tmp_path / "m.json")],
        # the metrics floor: 4,096 B (a block) + 5 per-chunk lists x 8 B x 4 chunks = 4,256
        [f"--metrics '{tmp_path}/m.json': the file system of '{tmp_path}' has 0 bytes free, the metrics file "
         "needs at least 4,256; free some space or choose another folder for --metrics"],
        tmp_path, empty_home, counter, loads, capsys,
    )


def test_stdout_that_cannot_be_written_is_refused_before_loading(
    tmp_path: Path, empty_home: Path, counter: ChunkCounter, loads: list[str],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    full = open("/dev/full", "w")  # noqa: SIM115 - the test's stdout, closed below
    try:
        monkeypatch.setattr(sys, "stdout", full)
        assert_refused_up_front(
            ["--no-video"],
            ["cannot write to stdout (OSError: [Errno 28] No space left on device); redirect it to a "
             "file, a pipe or /dev/null"],
            tmp_path, empty_home, counter, loads, capsys,
        )
    finally:
        monkeypatch.undo()
        full.close()


# ---- plugin env vars -------------------------------------------------------------------------------
def _real_manager(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """The command line builds its plugin manager from these env vars (autoload on)."""
    for var in ("CAUSALKV_PLUGINS", "CAUSALKV_DISABLE_PLUGINS", "CAUSALKV_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(plugin_manager, "_default", None)


def test_no_preset_left_says_why_not_an_empty_list(
    tmp_path: Path, empty_home: Path, loads: list[str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _real_manager(monkeypatch, CAUSALKV_DISABLE_PLUGINS="causalkv.builtin")
    rc = run_cli(["generate", "--quiet", "--no-video"])
    line = one_line(capsys.readouterr().err)
    assert rc == 2 and loads == [] and files(empty_home) == set()
    assert line.startswith("causalkv generate: error: unknown model 'tiny-wan': not a preset (no preset is "
                           "registered: the plugins that declare presets are blocked or not installed"), line
    assert "choose one of: )" not in line


@pytest.mark.parametrize(("var", "effect"), [
    ("CAUSALKV_DISABLE_PLUGINS", "blocking it does nothing"),
    ("CAUSALKV_PLUGINS", "only the installed plugins it names load"),
])
def test_unknown_plugin_name_in_the_env_is_a_warning_listing_the_known(
    var: str, effect: str, causalkv_home: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _real_manager(monkeypatch, **{var: "nosuch"})
    rc = run_cli(["generate", "--quiet", "--dtype", "float32", "--frames", "3", "--no-video",
                  "--metrics", str(tmp_path / "m.json")])
    line = one_line(capsys.readouterr().err)
    assert rc == 0 and files(tmp_path) == {"m.json"}
    assert line.startswith(f"causalkv: warning: {var} names 'nosuch', which no plugin is called ({effect}); "
                           "known plugins: "), line
    if var == "CAUSALKV_DISABLE_PLUGINS":
        assert "known plugins: causalkv.builtin" in line
