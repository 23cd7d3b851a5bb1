"""`benchmarks/gpu_attention.py --interpret` in the vLLM-Omni environment: its ``vllm_omni_paged``
section drives one layer of `CausalKVPagedKVCache` through vLLM-Omni's own session state
(``ARDiffusionKVState``: committing ticks, then a probe forward) and attends it four ways:
``bf16_pages`` (causalkv's pages with packing off), ``buffer`` (packed groups decoded into one
transient buffer, vLLM-Omni's paged attention over it: the reference path), ``routed``
(`causalkv.caches.attend` as the product runs it on CUDA, forced on the CPU tensors: the
packed-attention kernel in Triton's interpreter) and ``routed_decode`` (attend's decode path).

Oracles from the geometry (the smoke one: 16-token frames, 3-frame ticks, sink 3 + window 9
frames, 2 heads x 64, bf16): the probe reads the sink tick, two window ticks and its own, 12
frames; the sink tick and the older window tick are packed (keep-recent 1), the kernel reads
both in place; the buffer holds ``2 * visible * H * D * 2`` bytes and each routed path holds
less; the routed outputs stay within the rounding bound of the buffer path's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_the_paged_rows_routed_and_not(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_attention.py"), "--interpret",
         "--bits", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    section = data["vllm_omni_paged"]
    assert data["ok"] and section["measured"] is False and "interpreter" in section["reason"]
    (row,) = section["rows"]
    assert "unavailable" not in row, row
    frame, H, D = 16, 2, 64
    visible = 12 * frame
    window = 2 * visible * H * D * 2
    assert row["visible_tokens"] == visible and row["window_buffer_bytes"] == window
    assert row["packed_groups"] == 2 and row["fused_segments"] == 2 and row["ok"]
    transient = row["attend_transient_bytes"]
    assert 0 < transient["routed"] < transient["routed_decode"] < window
    assert all(e <= row["err_bound"] for e in row["max_abs_err"].values())
    assert row["goal_routed_no_slower"] is None  # no GPU: nothing to decide
    assert "vLLM-Omni paged engine: one LingBot self-attention layer" in proc.stdout
