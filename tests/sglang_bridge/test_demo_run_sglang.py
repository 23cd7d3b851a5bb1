"""``make run-sglang``'s script, ``demo/sglang/run_int2_vs_off.py``, as a user runs it: it builds
the tiny LongLive 2.0 checkpoint, runs ``sglang generate`` with ``--kv-cache-quant off`` and
``int2`` (two shots) on ports of their own, and prints one table. The end-to-end tests share
its request (`longlive2_request`); this runs the script itself, table included."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / "demo" / "sglang" / "run_int2_vs_off.py"


def _row(out: str, label: str) -> list[str]:
    """The cells of the table row that starts with ``label`` (two or more spaces apart)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(label)]
    return re.split(r"\s{2,}", line[len(label):].strip())


def test_run_sglang_demo_prints_its_table(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(DEMO), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = proc.stdout
    # the two commands it ran, as it printed them: sglang generate ... --kv-cache-quant MODE
    assert [ln.split()[-2:] for ln in out.splitlines() if ln.startswith("$ ")] == [
        ["--kv-cache-quant", "off"], ["--kv-cache-quant", "int2"]]
    assert _row(out, "KV cache class")[1] == "causalkv SGLangQVGKVCache"
    off, int2, ratio = _row(out, "KV bytes (resident, end)")
    assert int(int2.replace(",", "")) < int(off.replace(",", "")) and ratio.endswith("x smaller")
    dense = _row(out, "sglang's dense cache allocates")
    assert dense[0] == dense[1] and int(dense[0].replace(",", "")) > 0
    psnr = _row(out, "frame PSNR vs off (*)")[1]
    assert psnr == "identical" or re.fullmatch(r"\d+\.\d dB", psnr), psnr
    assert int(_row(out, "pinned shot sink (tokens)")[1]) > 0  # the second shot's cut, pinned
    assert int(_row(out, "packed chunks per layer")[1]) >= 1
    assert (tmp_path / "off.mp4").exists() and (tmp_path / "int2.mp4").exists()
