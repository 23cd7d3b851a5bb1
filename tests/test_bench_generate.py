"""`benchmarks/generate.py --quick --json`: the end-to-end benchmark's schema (not its timings).

Two of the four stages run (each mode in a fresh process, 6 processes): LongLive 2.0 (two shots,
a pinned chunk, CFG) and LingBot-World (a recent window); the other two take the same path
through `bench_stage` with neither. `make bench` runs all four.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"longlive2", "lingbot-world"}
NUMBERS = ("seconds_per_chunk", "kv_peak_bytes", "rss_peak_bytes", "time_ratio", "kv_ratio", "rss_ratio")


def test_generate_benchmark_quick_json_schema(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--quick", "--json",
         *(a for stage in sorted(STAGES) for a in ("--stage", stage))],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert set(results) == STAGES
    for stage, r in results.items():
        assert {"off", "int4", "int2", "geometry"} <= set(r), stage
        assert r["geometry"]["tokens_per_chunk"] == r["geometry"]["tokens_per_frame"] * r["geometry"][
            "frames_per_chunk"]
        for mode in ("off", "int4", "int2"):
            row = r[mode]
            for key in NUMBERS:
                assert isinstance(row[key], (int, float)) and row[key] > 0, (stage, mode, key, row[key])
            assert row["cache"] == ("dense" if mode == "off" else "qvg"), (stage, mode)
        # ratios are to `off` of the same run
        assert r["off"]["time_ratio"] == r["off"]["kv_ratio"] == r["off"]["rss_ratio"] == 1.0
        for mode in ("int4", "int2"):
            assert r[mode]["kv_ratio"] == pytest.approx(r[mode]["kv_peak_bytes"] / r["off"]["kv_peak_bytes"])
    # LongLive 2.0 runs two shots: the second shot's first chunk is pinned in every mode
    assert all(results["longlive2"][m]["pinned_chunks"] == [2] for m in ("off", "int4", "int2"))
