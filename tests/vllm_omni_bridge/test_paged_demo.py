"""``make run-vllm-omni``'s sessions table (``demo/vllm_omni/run_paged.py``, a fresh process, as
the Makefile runs it): at the memory where int2 admits exactly as many sessions as at
LingBot-World's geometry at 80 GiB, vLLM-Omni's paged AR-diffusion engine with its own pool
(stock) and with causalkv's pages (off, int2), each running as many sessions as it admits, pool
bytes per session read from the runner's cache. The oracle for the bytes: the tiny checkpoint's
geometry (2 layers x 2 heads x 64, float32, 16 tokens per frame, sink 3 + window 6 frames): a
page is 2 x 16 x 2 x 64 x 4 bytes in each of 2 layers; stock holds 9 pages, off 6 (the frames
the next tick reads), int2 3 and the sink tick packed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "demo" / "vllm_omni" / "run_paged.py"
PAGE = 2 * 16 * 2 * 64 * 4 * 2  # 32,768


def test_run_paged_prints_the_sessions_table(tmp_path):
    out = tmp_path / "paged.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                             "MASTER_PORT", "CAUSALKV_VLLM_OMNI")}
    proc = subprocess.run([sys.executable, str(DEMO), "--settings", "off,int2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    runs = {r["setting"]: r for r in result["runs"]}
    assert list(runs) == ["stock", "off", "int2"]
    assert runs["stock"]["cache"] == "ARDiffusionKVCache"
    assert runs["off"]["cache"] == runs["int2"]["cache"] == "CausalKVPagedKVCache"
    stock_n, n = result["wanted"]["stock"], result["wanted"]["int2"]
    assert n >= 2.5 * stock_n
    solo = result["solo"]
    assert len(solo["sessions"]) == 1
    assert result["budget"] == solo["fixed_bytes"] + n * solo["session_bytes"]
    assert runs["stock"]["capacity"] == stock_n and runs["int2"]["capacity"] == n
    for setting, pages in (("stock", 9), ("off", 6), ("int2", 3)):
        run = runs[setting]
        assert run["free_memory"] == result["budget"]
        assert len(run["sessions"]) == min(run["capacity"], n)  # every admitted session ran
        for s, got in run["sessions"].items():
            assert got["pages"] == pages and got["pool_bytes"] == pages * PAGE, (setting, s, got)
    for got in runs["int2"]["sessions"].values():
        assert got["packed_groups"] == 1 and 0 < got["packed_bytes"] < PAGE
        assert got["pool_bytes"] + got["packed_bytes"] <= 0.5 * 9 * PAGE
    assert result["drift"]["off"] == 0.0 and 0.0 < result["drift"]["int2"] < 0.1
    assert all(result["sessions_equal"].values())
    assert result["alone"] == {"int2": 0.0}  # every int2 session as it runs alone
    header, *rows = result["rows"]
    assert [r[0] for r in rows] == ["stock", "off", "int2"] and header[0] == "setting"
    text = proc.stdout
    assert "session cache" in text and "CausalKVPagedKVCache" in text
    assert text.rstrip().endswith("not how good a video is.")
