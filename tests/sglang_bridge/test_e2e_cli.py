"""The ``sglang generate`` command line end to end (a subprocess on sglang's CPU platform) on the
tiny LongLive 2.0 checkpoint, two shots: causalkv is found through its entry point in the CLI
and in the worker it spawns. ``sglang generate`` exits 0 even when its request failed, so every
test reads the saved video and the worker's log."""

from __future__ import annotations

import numpy as np
import pytest
from e2e import planner_matches, serving_lines, summaries
from longlive2_request import GEOMETRY, psnr, read_video, run_cli

SHAPE = (GEOMETRY["num_frames"], GEOMETRY["height"], GEOMETRY["width"], 3)


@pytest.fixture(scope="module")
def cli_runs(longlive2_checkpoint, tmp_path_factory):
    """int2 through the bridge, and the same command with the bridge off (stock sglang)."""
    out = tmp_path_factory.mktemp("cli")
    return {
        "int2": run_cli(longlive2_checkpoint, out, "int2", "--kv-cache-quant", "int2"),
        "stock": run_cli(longlive2_checkpoint, out, "stock", "--kv-cache-quant", "int2",
                         env={"CAUSALKV_SGLANG_BRIDGE": "0"}),
    }


def test_int2_runs_on_causalkvs_caches_and_the_log_says_so(cli_runs):
    rc, log, video = cli_runs["int2"]
    assert rc == 0, log[-3000:]
    lines = serving_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert "LongLive2CausalDenoisingStage KV cache causalkv.sglang.cache.SGLangQVGKVCache" in lines[0]
    assert "codec causalkv, qvg(int2," in lines[0] and "keep-recent 1" in lines[0]
    (s,) = summaries(log)
    assert s["cache"] == "SGLangQVGKVCache" and s["sets"] == "1" and s["layers"] == "2"
    assert int(s["resident_bytes"]) < int(s["dense_bytes"])
    assert int(s["packed_chunks"]) >= 1
    assert int(s["pinned_tokens"]) > 0  # the second shot's scene cut was pinned
    frames = read_video(video)
    assert frames.shape == SHAPE and frames.dtype == np.uint8 and frames.std() > 0


def test_causalkv_memory_on_the_folder_equals_the_int2_summary(cli_runs, longlive2_checkpoint):
    """`causalkv memory` at sglang's defaults, from the folder's config, gives this run's
    logged peak, resident and dense bytes to the byte (keep-recent 0: test_e2e_api.py)."""
    rc, log, _ = cli_runs["int2"]
    assert rc == 0, log[-3000:]
    planner_matches(longlive2_checkpoint, log, "int2-default")


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
    print(f"sglang generate, LongLive 2.0, two shots: int2 vs stock PSNR {psnr(int2, stock):.2f} dB")
