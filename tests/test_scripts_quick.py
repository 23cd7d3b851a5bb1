"""What users run is what the suite runs: every script of ``benchmarks/`` runs its default mode
at a small size here (``--quick`` where the default is long), and the test reads what it
prints: the rows and keys of its table or JSON.

Scripts that drive the library from their own process run in this one (`run_here`: the
script as ``__main__``, its argv, a temporary working folder; the process state it touches,
torch's grad mode and threads, ``sys.path``, the modules of ``benchmarks/`` it imported, the
environment, is put back).
Those that run the command line in-process (``flag_path.py``), load peers that patch torch
(``codec.py``'s HQQ, torchao, quanto), time fresh processes per mode (``generate.py``) or
refuse to run here run as a subprocess, as a user starts them. ``report.py`` draws from the
JSON that ``codec.py`` and ``generate.py`` wrote in this module, as ``make bench`` hands it.

Elsewhere: ``gpu_attention.py`` (without CUDA: one line, exit 2; ``--interpret``: every path
on the CPU) in tests/test_packed_attention.py; ``gpu_codec.py --device cpu --smoke`` in
tests/test_codec_triton.py (its no-CUDA line is here); ``sglang_bridge.py`` in the sglang
environment (tests/sglang_bridge/test_bench_sglang_bridge.py, test_memory_planner_bridge.py,
and gpu_attention.py's bridge part in test_bench_gpu_attention_bridge.py; its refusal here is
checked below); ``demo/sglang/run_int2_vs_off.py`` (``make run-sglang``) in the sglang
environment (tests/sglang_bridge/test_e2e_cli.py); ``demo/vllm_omni/run_offline.py``
and ``run_paged.py`` (``make run-vllm-omni``) in the vLLM-Omni environment
(tests/vllm_omni_bridge/test_offline.py, test_paged_demo.py);
``benchmarks/soak.py``'s loop at CI size in tests/test_soak.py. The demos' helpers
(``demo/sglang/longlive2_request.py``, ``demo/vllm_omni/tiny_lingbot.py``, ``tiny_pipeline.py``,
``paged_sessions.py``)
are modules those tests import.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run_here(script: str, *args: str, cwd: Path) -> tuple[int, str, str]:
    """``python benchmarks/SCRIPT ARGS`` in this process: (exit status, stdout, stderr)."""
    saved = (list(sys.argv), list(sys.path), set(sys.modules), dict(os.environ), os.getcwd(),
             torch.is_grad_enabled(), torch.get_num_threads())
    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    try:
        os.chdir(cwd)
        sys.argv = [str(BENCH / script), *args]
        sys.path.insert(0, str(BENCH))  # as `python benchmarks/SCRIPT` puts its folder first
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(BENCH / script), run_name="__main__")
            except SystemExit as exc:
                code = exc.code
    finally:
        argv, path, modules, environ, here, grad, threads = saved
        sys.argv, sys.path[:] = argv, path
        for name in set(sys.modules) - modules:  # the scripts' own: `cache`, plugins.py's fakes
            file = getattr(sys.modules[name], "__file__", None) or ""
            if file.startswith(str(BENCH)) or name.startswith("causalkv_bench_"):
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(here)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    return status, out.getvalue(), err.getvalue()


def run_process(script: str, *args: str, cwd: Path, env: dict[str, str] | None = None,
                timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/SCRIPT ARGS`` in a fresh process (this checkout first on the path; torch
    on one thread, as the suite's ``OMP_NUM_THREADS`` from tests/conftest.py is inherited)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CAUSALKV_HOME": str(cwd / "home"), **(env or {})}
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def subcommands() -> set[str]:
    from causalkv.cli.commands import build_parser

    return set(build_parser()._subparsers._group_actions[0].choices)


# ---- the scripts that run in this process -------------------------------------------------------
def check_cache(out: str) -> None:
    """Both streams, every QVG setting, one row each; the long run stays flat."""
    rows = [line for line in out.splitlines() if line.startswith(("lingbot-world ", "longlive2 "))]
    labels = ("int2 reference", "int4 reference", "int2 span=5", "int2 cb=4 c64 mse4", "int2 cb=3 c96 mse4")
    assert [(r.split()[0], r[15:33].strip()) for r in rows] == [
        (cfg, label) for cfg in ("lingbot-world", "longlive2") for label in labels], out
    for r in rows:
        window = float(re.search(r"window\s+([\d.]+)x", r).group(1))
        assert window >= 1.0 and "err K" in r and "advance" in r, r
        if "reference" in r:  # every stream packs at the reference settings
            assert window > 1.2, r
    (long,) = [line for line in out.splitlines() if line.startswith("longlive2-long:")]
    assert "24 chunks x 128 tokens int2" in long and long.endswith("(flat)"), long


def check_soak(out: str) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("soak: 400 chunks x 128 tokens"), lines[0]
    samples = [line.split() for line in lines if re.match(r"^\s+\d+\s", line)]
    assert [int(s[0]) for s in samples] == list(range(50, 401, 50))
    assert len({s[1] for s in samples}) == 1  # resident bytes flat from the first sample (window full at 10)
    assert lines[-1] == "OK", lines[-2:]


def check_plugins(out: str) -> None:
    lines = out.splitlines()
    assert lines[0] == "plugin discovery + resolution, 50 plugins, 3 runs (torch import excluded)"
    phases = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[2:7]}
    assert list(phases) == ["scan_ms", "load_ms", "collect_ms", "resolve3_ms", "total_ms"]
    assert all(len(v) == 3 and min(v) > 0 for v in phases.values()), phases
    assert re.fullmatch(r"target <= 20 ms \(median total\): (met|MISSED)", lines[-1]), lines[-1]


def check_loc(out: str) -> None:
    rows = [line.split() for line in out.splitlines()[:-1] if not line.startswith("files over")]
    per = {pkg: int(n) for n, pkg in rows if not pkg.endswith(".py")}
    assert {"causalkv", "causalkv/cli", "causalkv/caches/qvg"} <= set(per), per
    total = out.splitlines()[-1].split()
    assert total[1] == "total" and int(total[0]) == sum(per.values()) > 10_000


def check_cli_startup(out: str) -> None:
    rows = [line for line in out.splitlines() if line.startswith("causalkv ")]
    helped = {r.split()[1] for r in rows if r.split()[2] == "--help"}
    assert helped == subcommands(), "every subcommand's --help is timed"
    assert {r.split()[1] for r in rows} >= {"--version", "--help"}
    for r in rows:  # least, median, cpu seconds; no heavy import
        assert r.endswith("  none") and float(r.split()[-4]) > 0, r
    assert out.splitlines()[-1].startswith("1 runs per command")


def check_parallel(out: str) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("cpu float32: 2 layers, 4 heads x 64, 768 tokens/chunk") and "2 chunks" in lines[0]
    rows = {int(line.split()[0]): line.split() for line in lines[2:]}
    assert set(rows) == {1, 2}, out
    one, two = rows[1], rows[2]
    assert two[4] == "0.50"  # each of 2 ranks holds half the heads' KV
    assert int(two[3].replace(",", "")) * 2 == int(one[3].replace(",", ""))
    assert two[5] == two[6] != "0"  # the all-to-all bytes counted equal the formula
    assert float(two[7]) < 1e-4  # same output on 2 ranks as on 1


HERE = {
    "cache.py": (["--quick"], check_cache),
    "soak.py": (["--quick"], check_soak),
    "plugins.py": (["--quick"], check_plugins),
    "loc.py": (["--packages", "causalkv"], check_loc),  # as documented, from the checkout: a second
    "cli_startup.py": (["--quick"], check_cli_startup),
    "parallel.py": (["--quick"], check_parallel),
}


@pytest.mark.parametrize("script", list(HERE))
def test_script_runs_its_default_mode_small(script: str, tmp_path: Path) -> None:
    args, check = HERE[script]
    code, out, err = run_here(script, *args, cwd=ROOT if script == "loc.py" else tmp_path)
    assert code == 0, (out + err)[-3000:]
    check(out)


# ---- the scripts that run as their own process ----------------------------------------------------
def test_flag_path(tmp_path: Path) -> None:
    """The flag's path from the command line to the first cache write, and the counts the
    header states match the path it prints."""
    p = run_process("flag_path.py", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    head, counts, path = p.stdout.splitlines()[:3]
    assert head.startswith("causalkv generate --model tiny-wan --kv-cache-quant int2")
    modules = path.strip().split(" -> ")
    stays, distinct, returns = map(int, re.search(
        r"\((\d+) stays, (\d+) modules, (\d+) returns", counts).groups())
    assert (stays, distinct) == (len(modules), len(set(modules)))
    assert returns == sum(1 for i, m in enumerate(modules) if m in modules[:i])
    assert modules[0] == "cli.generate" and modules[-1] == "caches.qvg.packed"
    assert not (tmp_path / "out").exists()  # the run stops at the cache write: nothing written


CODEC_METHODS = {"rtn-sym", "rtn-asym", "kivi", "prq-ref", "prq-mse4", "prq-asym", "prq-b32-mse4",
                 "prq-2stage", "prq-k64", "prq-k64-mse4", "prq-b128-k96-mse4", "prq-b128-k64-mse4",
                 "prq-b128-k32-mse4"}


@pytest.fixture(scope="module")
def codec_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``codec.py --quick`` (tables, and the JSON report.py reads)."""
    tmp = tmp_path_factory.mktemp("codec")
    p = run_process("codec.py", "--quick", "--threads", "1", "--json", str(tmp / "codec.json"), cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    for title in ("quality: [B, H, S, D] = [1, 2, 512, 128]", "targets (structured):",
                  "throughput on this CPU: [1, 12, 512, 128] bf16", "| model | codec | bits/el |"):
        assert title in p.stdout, title
    return tmp / "codec.json"


def test_codec(codec_json: Path) -> None:
    res = json.loads(codec_json.read_text())
    assert res["schema"] == "causalkv.codec-bench/2" and res["config"]["quick"]
    peers = [name for name, info in res["peers"].items() if info["available"]]
    assert set(res["peers"]) == {"hqq", "torchao", "quanto"}
    # a peer that is not installed (the `bench` extra) is reported with why, not fatal
    assert all(info["available"] or info["reason"] for info in res["peers"].values()), res["peers"]
    for data in ("structured", "gaussian"):
        for bits in (2, 4):
            for tensor in ("K", "V"):
                got = {r["method"] for r in res["quality"]
                       if (r["data"], r["bits"], r["tensor"]) == (data, bits, tensor)}
                want = CODEC_METHODS | set(peers) | ({"fp8", "nvfp4"} if bits == 4 else set())
                assert got == want, (data, bits, tensor, got ^ want)
    assert all(0 < r["rel_err"] < 1.5 and r["bits_stored"] > 0 for r in res["quality"])
    assert len(res["targets"]) == 4 * len(peers)  # K and V, 2 and 4 bits, per peer that ran
    assert set(res["throughput"]) >= {"int4", "int2", "fp8", "nvfp4"}
    assert all(res["throughput"][c]["decode_into_gbps"] > 0 for c in ("int4", "int2", "fp8", "nvfp4"))
    assert [(r["model"], r["codec"]) for r in res["compare"]] == [
        (m, c) for m in ("longlive2", "lingbot", "self-forcing") for c in ("int4", "int2", "fp8", "nvfp4")]
    for r in res["compare"]:  # fewer bytes than sglang's dense cache, attention close to exact
        assert 0 < r["peak_ratio_recent0"] <= r["peak_ratio_default"] < 1 and r["attn_rel_err"] < 0.5, r


#: two of the four stages (each mode a fresh process, 6 processes): LongLive 2.0 (two shots, a
#: pinned chunk, CFG) and LingBot-World (a recent window); the other two take the same path
#: through `bench_stage` with neither. `make bench` runs all four.
GENERATE_STAGES = {"longlive2", "lingbot-world"}
GENERATE_NUMBERS = ("seconds_per_chunk", "kv_peak_bytes", "rss_peak_bytes", "time_ratio", "kv_ratio",
                    "rss_ratio")


@pytest.fixture(scope="module")
def generate_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``generate.py --quick --json`` (the end-to-end benchmark's schema, not its timings)."""
    tmp = tmp_path_factory.mktemp("generate")
    p = run_process("generate.py", "--quick", "--json",
                    *(a for stage in sorted(GENERATE_STAGES) for a in ("--stage", stage)), cwd=tmp,
                    timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (tmp / "generate.json").write_text(p.stdout)
    return tmp / "generate.json"


def test_generate(generate_json: Path) -> None:
    results = json.loads(generate_json.read_text())
    assert set(results) == GENERATE_STAGES
    for stage, r in results.items():
        assert {"off", "int4", "int2", "geometry"} <= set(r), stage
        assert r["geometry"]["tokens_per_chunk"] == r["geometry"]["tokens_per_frame"] * r["geometry"][
            "frames_per_chunk"]
        for mode in ("off", "int4", "int2"):
            row = r[mode]
            for key in GENERATE_NUMBERS:
                assert isinstance(row[key], (int, float)) and row[key] > 0, (stage, mode, key, row[key])
            assert row["cache"] == ("dense" if mode == "off" else "qvg"), (stage, mode)
        # ratios are to `off` of the same run
        assert r["off"]["time_ratio"] == r["off"]["kv_ratio"] == r["off"]["rss_ratio"] == 1.0
        for mode in ("int4", "int2"):
            assert r[mode]["kv_ratio"] == pytest.approx(r[mode]["kv_peak_bytes"] / r["off"]["kv_peak_bytes"])
            assert r[mode]["kv_ratio"] < 1.0, (stage, mode)
    # LongLive 2.0 runs two shots: the second shot's first chunk is pinned in every mode
    assert all(results["longlive2"][m]["pinned_chunks"] == [2] for m in ("off", "int4", "int2"))


def test_report(codec_json: Path, generate_json: Path, tmp_path: Path) -> None:
    """The four figures of docs/benchmarks.md, drawn from the JSON above (``make bench`` hands
    report.py the same files' contents through its own runs)."""
    code, out, err = run_here("report.py", "--quick", "--codec-json", str(codec_json),
                              "--generate-json", str(generate_json), "--out", str(tmp_path / "figures"),
                              cwd=tmp_path)
    assert code == 0, (out + err)[-3000:]
    names = ["codec_error_vs_bits.png", "resident_kv_per_chunk.png", "attention_temp_memory.png",
             "e2e_time_ratio.png"]
    assert out.split() == [str(tmp_path / "figures" / n) for n in names]
    for n in names:
        data = (tmp_path / "figures" / n).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, n


# ---- the scripts that refuse to run here, in one line -------------------------------------------
def test_gpu_codec_without_cuda_says_so_in_one_line(tmp_path: Path) -> None:
    p = run_process("gpu_codec.py", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("gpu_codec: no CUDA device here") and "--device cpu" in line


def test_sglang_bridge_outside_the_sglang_environment_says_so_in_one_line(tmp_path: Path) -> None:
    assert not _has_sglang(), "the main environment has sglang: this test expects the refusal"
    p = run_process("sglang_bridge.py", "--quick", cwd=tmp_path)
    assert p.returncode == 1 and p.stdout == "", p.stdout + p.stderr
    (line,) = p.stderr.splitlines()
    assert "needs the sglang environment" in line and "make venv-sglang" in line


def _has_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None
