"""`benchmarks/gpu_attention.py --interpret` in the sglang environment: its ``sglang_bridge``
section runs sglang's ``CausalWanSelfAttention`` over a bridge cache with and without the
fused-attention route (the route forced on the CPU tensors, the packed-attention kernel in
Triton's interpreter), so the script the GPU run uses does not rot.

Oracles from the geometry (the smoke one: 4 chunks of 48 tokens, 2 heads x 64, bf16): sglang's
view decodes the window into one buffer of ``2 * visible * H * D * 2`` bytes; routed, the store
decodes nothing (the kernel reads packed chunks in place) and attend's decode path decodes
one chunk at a time; the routed outputs stay within the rounding bound of sglang's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_the_bridge_rows_routed_and_not(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_attention.py"), "--interpret",
         "--bits", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "CAUSALKV_SGLANG_FUSED_ATTENTION"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    section = data["sglang_bridge"]
    assert data["ok"] and section["measured"] is False and "interpreter" in section["reason"]
    assert section["setting"] == "CAUSALKV_SGLANG_FUSED_ATTENTION=1"
    (row,) = section["rows"]
    assert "unavailable" not in row, row
    visible, H, D = 4 * 48, 2, 64
    window = 2 * visible * H * D * 2
    assert row["visible_tokens"] == visible and row["window_buffer_bytes"] == window
    assert row["packed_chunks"] == 3 and row["ok"]
    assert row["store_decoded_bytes"] == {"sglang": window, "routed": 0,
                                          "routed_decode": 2 * 48 * H * D * 2}
    transient = row["attend_transient_bytes"]
    assert transient["sglang"] is None and 0 < transient["routed"] < transient["routed_decode"]
    assert transient["routed_decode"] < window
    assert all(e <= row["err_bound"] for e in row["max_abs_err"].values())
    assert row["goal_routed_no_slower"] is None  # no GPU: nothing to decide
    assert "sglang bridge: CausalWanSelfAttention over SGLangQVGKVCache" in proc.stdout
