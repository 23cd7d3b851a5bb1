"""`benchmarks/sglang_bridge.py --quick --json` in the sglang environment: its rows and the
memory facts its figures must show (not its timings).

Oracles from the geometry: a view of the full window is ``2 * B * cache * H * D * 2`` bytes
(K and V, bf16); sglang's dense cache returns slices of its buffer (no transient on a
rewrite), its packed cache and the bridge fill one window buffer (the bridge's codec tables
on top are a few KB); sglang's dense cache holds its whole buffer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bridge_benchmark_quick_rows_and_memory_facts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sglang_bridge.py"), "--quick", "--json",
         "--repeat", "1"],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    g = result["geometry"]
    rows = {r["cache"]: r for r in result["rows"]}
    assert list(rows) == ["sglang dense", "sglang QVG off", "bridge int4", "bridge int2",
                          "bridge int4, probe + commit", "bridge int2, probe + commit"]
    assert all("unavailable" not in r for r in rows.values())
    window = 2 * g["cache_tokens"] * g["heads"] * g["head_dim"] * 2
    dense, own = rows["sglang dense"], rows["sglang QVG off"]
    assert dense["resident_kv_bytes"] == window and dense["peak_transient_rewrite_bytes"] == 0
    assert own["peak_transient_rewrite_bytes"] == window  # one buffer of the whole window
    for name in ("bridge int4", "bridge int2"):
        r = rows[name]
        assert window <= r["peak_transient_rewrite_bytes"] <= window + 65_536, name
        assert r["resident_kv_bytes"] < dense["resident_kv_bytes"], name
        assert 0 < r["k_rel_err"] < 0.5, name
        assert r["resident_kv_bytes_vs_dense"] == r["resident_kv_bytes"] / window
    assert rows["bridge int2"]["resident_kv_bytes"] < rows["bridge int4"]["resident_kv_bytes"]
    assert rows["bridge int4"]["k_rel_err"] < rows["bridge int2"]["k_rel_err"]
    for bits in ("int4", "int2"):  # probes and commits change no view, and hold no more
        plain, staged = rows[f"bridge {bits}"], rows[f"bridge {bits}, probe + commit"]
        assert staged["k_rel_err"] == plain["k_rel_err"]
        assert staged["resident_kv_bytes"] <= plain["resident_kv_bytes"]
    assert result["sdpa_full_window_s"] > 0 and len(result["load_average"]) == 3


@pytest.fixture(scope="module")
def layers_rows(tmp_path_factory) -> dict[str, dict]:
    """``--layers --quick --json``, every setting, run once for the tests below."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sglang_bridge.py"), "--layers", "--quick",
         "--json"],
        capture_output=True, text=True, cwd=tmp_path_factory.mktemp("layers"), check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["setting"]: r for r in json.loads(proc.stdout)}


def test_the_whole_request_view_by_the_byte_formula(layers_rows: dict[str, dict]) -> None:
    """``--layers --quick --json``: one row per setting with the issue's fields; quant off is
    lossless, and its bytes are the layout's arithmetic: every layer holds 3 of its 4 chunk
    slots (the chunk being generated is stored by no layer: its denoising passes are probes),
    and the peak adds one layer's gathered window (4 chunks)."""
    rows = layers_rows
    assert {"off", "int2-default", "int2-recent0", "int2-recent-int4", "int4-recent0"} <= set(rows)
    for r in rows.values():
        assert {"geometry", "setting", "peak_ratio", "resident_ratio", "attn_rel_err"} <= set(r)
    off, layers = rows["off"], rows["off"]["layers"]
    assert off["attn_rel_err"] == 0
    assert off["resident_ratio"] == (3 * layers) / (4 * layers)
    assert off["peak_ratio"] == (3 * layers + 4) / (4 * layers)
    for name in ("int2-default", "int2-recent0", "int2-recent-int4", "int4-recent0"):
        assert rows[name]["peak_ratio"] < off["peak_ratio"], name
        assert 0 < rows[name]["attn_rel_err"] < 0.5, name
    assert rows["int2-recent0"]["peak_ratio"] < rows["int2-recent-int4"]["peak_ratio"] \
        < rows["int2-default"]["peak_ratio"]


def test_causalkvs_codecs_rows_come_through_causalkvs_setting(layers_rows: dict[str, dict]) -> None:
    """The fp8 and nvfp4 rows of ``--layers`` are built as a user asks sglang for
    them (``--kv-cache-quant int4`` turns QVG on, ``CAUSALKV_SGLANG_CODEC`` picks the codec,
    the bridge's own conversion in between): their cache packs with that codec, holds less
    than quant off at peak and at the end, and the codecs' bit widths order them (nvfp4 ~4.5
    bits holds less than fp8 ~8.25, fp8 errs less)."""
    rows = layers_rows
    off = rows["off"]
    assert (off["codec"], off["sglang"]) == ("off", "--kv-cache-quant off")
    for codec in ("fp8", "nvfp4"):
        for keep in ("default", "recent0"):
            r = rows[f"{codec}-{keep}"]
            assert r["codec"] == codec and r["recent_tier"] == "bf16"
            assert r["sglang"].startswith(f"CAUSALKV_SGLANG_CODEC={codec} --kv-cache-quant int4")
            assert r["peak_ratio"] < off["peak_ratio"] and r["resident_ratio"] < off["resident_ratio"]
            assert 0 < r["attn_rel_err"] < 0.5
        assert rows[f"{codec}-recent0"]["peak_ratio"] < rows[f"{codec}-default"]["peak_ratio"]
    assert rows["nvfp4-default"]["peak_ratio"] < rows["fp8-default"]["peak_ratio"]
    assert rows["fp8-default"]["attn_rel_err"] < rows["nvfp4-default"]["attn_rel_err"]
    assert rows["fp8-default"]["attn_rel_err"] < rows["int4-default"]["attn_rel_err"]
