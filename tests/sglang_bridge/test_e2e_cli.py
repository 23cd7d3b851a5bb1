"""The ``sglang generate`` command line end to end (a subprocess on sglang's CPU platform) on the
tiny LongLive 2.0 checkpoint, two shots: causalkv is found through its entry point in the CLI
and in the worker it spawns. ``sglang generate`` exits 0 even when its request failed, so every
test reads the saved video and the worker's log.

Three ``sglang generate`` processes serve every test here: ``make run-sglang``'s own script
(``demo/sglang/run_int2_vs_off.py``, as a user runs it: it builds the checkpoint, runs
``--kv-cache-quant off`` and ``int2`` and prints its table, keeping each run's log and video),
and the same command with the bridge off (stock sglang) on the script's checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from e2e import planner_matches, serving_lines, summaries
from longlive2_request import GEOMETRY, psnr, read_video, run_cli

SHAPE = (GEOMETRY["num_frames"], GEOMETRY["height"], GEOMETRY["width"], 3)
DEMO = Path(__file__).resolve().parents[2] / "demo" / "sglang" / "run_int2_vs_off.py"


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """{"demo": its stdout, "off" / "int2": the script's runs, "stock": the bridge off}, each
    run as (rc, log, video)."""
    out = tmp_path_factory.mktemp("cli")
    demo = subprocess.run([sys.executable, str(DEMO), "--out", str(out)], capture_output=True,
                          text=True, timeout=1800)
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-4000:]
    runs = {"demo": demo.stdout}
    for mode in ("off", "int2"):
        runs[mode] = (demo.returncode, (out / f"{mode}.log").read_text(), out / f"{mode}.mp4")
    runs["stock"] = run_cli(out / "tiny-longlive2", out, "stock", "--kv-cache-quant", "int2",
                            env={"CAUSALKV_SGLANG_BRIDGE": "0"})
    return runs


def _row(out: str, label: str) -> list[str]:
    """The cells of the demo's table row that starts with ``label`` (two or more spaces apart)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(label)]
    return re.split(r"\s{2,}", line[len(label):].strip())


def test_run_sglang_demo_prints_its_table(cli_runs) -> None:
    """``make run-sglang``'s table: the two commands it ran, the cache class each ran on, fewer
    resident bytes at int2, the pinned shot sink, packing."""
    out = cli_runs["demo"]
    # the two commands it ran, as it printed them: sglang generate ... --kv-cache-quant MODE
    assert [ln.split()[-2:] for ln in out.splitlines() if ln.startswith("$ ")] == [
        ["--kv-cache-quant", "off"], ["--kv-cache-quant", "int2"]]
    assert _row(out, "KV cache class")[1] == "causalkv SGLangQVGKVCache"
    off, int2, ratio = _row(out, "KV bytes (resident, end)")
    assert int(int2.replace(",", "")) < int(off.replace(",", "")) and ratio.endswith("x smaller")
    dense = _row(out, "sglang's dense cache allocates")
    assert dense[0] == dense[1] and int(dense[0].replace(",", "")) > 0
    psnr_cell = _row(out, "frame PSNR vs off (*)")[1]
    assert psnr_cell == "identical" or re.fullmatch(r"\d+\.\d dB", psnr_cell), psnr_cell
    assert int(_row(out, "pinned shot sink (tokens)")[1]) > 0  # the second shot's cut, pinned
    assert int(_row(out, "packed chunks per layer")[1]) >= 1


def test_int2_runs_on_causalkvs_caches_and_the_log_says_so(cli_runs):
    rc, log, video = cli_runs["int2"]
    assert rc == 0, log[-3000:]
    lines = serving_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert "LongLive2CausalDenoisingStage KV cache causalkv.sglang.cache.SGLangQVGKVCache" in lines[0]
    assert "served by causalkv, qvg(int2," in lines[0] and "keep-recent 1" in lines[0]
    (s,) = summaries(log)
    assert s["cache"] == "SGLangQVGKVCache" and s["sets"] == "1" and s["layers"] == "2"
    assert int(s["resident_bytes"]) < int(s["dense_bytes"])
    assert int(s["packed_chunks"]) >= 1
    assert int(s["pinned_tokens"]) > 0  # the second shot's scene cut was pinned
    frames = read_video(video)
    assert frames.shape == SHAPE and frames.dtype == np.uint8 and frames.std() > 0


def test_causalkv_memory_on_the_folder_equals_the_int2_summary(cli_runs):
    """`causalkv memory` at sglang's defaults, from the folder's config, gives this run's
    logged peak, resident and dense bytes to the byte (keep-recent 0: test_e2e_api.py)."""
    rc, log, video = cli_runs["int2"]
    assert rc == 0, log[-3000:]
    planner_matches(video.parent / "tiny-longlive2", log, "int2-default")


def test_bridge_off_is_stock_sglang_silently_dense_and_causalkv_warns(cli_runs):
    """Stock sglang 0.5.23 accepts --kv-cache-quant int2 on LongLive 2.0 and keeps its dense
    cache (the measured fact); the bridge's off-switch observer warns in the worker's log."""
    rc, log, video = cli_runs["stock"]
    assert rc == 0, log[-3000:]
    assert summaries(log) == [] and serving_lines(log) == []
    assert "causalkv sglang bridge off: CAUSALKV_SGLANG_BRIDGE=0" in log  # the CLI process
    (warning,) = [line for line in log.splitlines() if "is not applied to" in line]
    assert "--kv-cache-quant int2 is not applied to LongLive2CausalDenoisingStage" in warning
    assert "unset CAUSALKV_SGLANG_BRIDGE" in warning
    stock = read_video(video)
    assert stock.shape == SHAPE
    int2 = read_video(cli_runs["int2"][2])
    assert not np.array_equal(int2, stock)  # the int2 run really packed
    # the bridge with quant off keeps sglang's own dense cache: stock's video, bit for bit
    assert np.array_equal(read_video(cli_runs["off"][2]), stock)
    print(f"sglang generate, LongLive 2.0, two shots: int2 vs stock PSNR {psnr(int2, stock):.2f} dB")
