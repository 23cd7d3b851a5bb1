"""Sequence parallel on 2 CPU processes (gloo): every stage, quant off and int2, equals one process.

One torchrun job (tests/parallel_driver.py) runs every configuration on 2 ranks; this process
runs the same requests on one process and compares: latents within 1e-3 of the largest
|value| (float32), each rank's caches hold H/2 heads starting at global head ``rank * H/2`` and
exactly half of one process's bytes. A job whose rank fails (a plugin's hook raises on rank 1
while rank 0 waits in the next chunk's all-to-all) ends at once with that one error:
tests/test_cli_faults_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from parallel_driver import CONFIGS, QUANTS, options_for

from causalkv.errors import ConfigError
from causalkv.runtime.host.load_step import load_for_plan
from causalkv.runtime.host.plan_step import plan_generation
from causalkv.runtime.host.run_step import run_plan
from causalkv.runtime.processes.distributed import check_parallel_request
from causalkv.runtime.processes.launch import torchrun_command

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
WORLD = 2


def _env(home: str) -> dict[str, str]:
    env = dict(os.environ, CAUSALKV_HOME=home, OMP_NUM_THREADS="1")
    paths = [str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


@pytest.fixture(scope="module")
def single(causalkv_home: str, pm) -> dict[str, dict]:
    """One-process runs of every configuration: latents and KV bytes."""
    out: dict[str, dict] = {}
    for config in CONFIGS:
        components = None
        for quant in QUANTS:
            plan = plan_generation(options_for(config, quant, 1), pm=pm)
            components = components or load_for_plan(plan, pm=pm)
            run = run_plan(plan, pm=pm, components=components)
            out[f"{config}-{quant}"] = {
                "latents": run.latents,
                "kv_resident_bytes_max": run.kv_resident_bytes_max,
                "num_heads": plan.model.num_heads,
            }
    return out


@pytest.fixture(scope="module")
def parallel(causalkv_home: str, single, tmp_path_factory) -> Path:
    """The 2-rank job's output folder (runs after `single`, so the presets exist)."""
    outdir = tmp_path_factory.mktemp("parallel")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(TESTS / "parallel_driver.py"), str(outdir)]
    proc = subprocess.run(cmd, env=_env(causalkv_home), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return outdir


@pytest.fixture(scope="module")
def pm():
    from causalkv.plugin.testing import fresh_plugin_manager

    return fresh_plugin_manager()


NAMES = [f"{c}-{q}" for c in CONFIGS for q in QUANTS]


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_process(name: str, single, parallel: Path) -> None:
    ref = single[name]["latents"]
    got = torch.load(parallel / f"{name}.pt")
    assert got.shape == ref.shape
    scale = float(ref.abs().max())
    diff = float((got - ref).abs().max())
    print(f"{name}: max |2 ranks - 1 process| = {diff:.3e} (largest |value| {scale:.3f})")
    assert diff <= 1e-3 * scale


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_caches_its_heads_and_half_the_bytes(name: str, single, parallel: Path) -> None:
    heads = single[name]["num_heads"]
    per_rank = [json.loads((parallel / f"{name}-rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, rec in enumerate(per_rank):
        assert rec["num_heads"] == [heads // WORLD]
        assert rec["head_offsets"] == [rank * heads // WORLD]
        if name.endswith("int2"):
            assert rec["cache_types"] == ["QVGPackedCausalKVCache"]
            assert rec["packed_head_offsets"] == [rank * heads // WORLD]
        assert 2 * rec["kv_resident_bytes_max"] == single[name]["kv_resident_bytes_max"]
        m = rec["metrics"]
        assert m["world_size"] == WORLD and m["kv_heads_per_rank"] == heads // WORLD
        assert m["kv_resident_bytes_max"] == rec["kv_resident_bytes_max"]
        assert m["kv_resident_bytes_max_per_rank"] == [r["kv_resident_bytes_max"] for r in per_rank]
        assert m["kv_resident_bytes_max_total"] == single[name]["kv_resident_bytes_max"]


def test_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match="does not divide the model's 2 attention heads"):
        check_parallel_request(3, num_heads=2, tokens_per_chunk=48, device="cpu")
    with pytest.raises(ConfigError, match="does not divide the chunk's 48 tokens"):
        check_parallel_request(5, num_heads=10, tokens_per_chunk=48, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda: (this torch build .* has no CUDA support|no CUDA device is visible)"):
            check_parallel_request(2, num_heads=2, tokens_per_chunk=48, device="cuda")
    with pytest.raises(ConfigError, match="cpu .gloo. or cuda .nccl."):
        check_parallel_request(2, num_heads=2, tokens_per_chunk=48, device="meta")
    check_parallel_request(2, num_heads=2, tokens_per_chunk=48, device="cpu")


def test_cli_refuses_before_launching(causalkv_home: str) -> None:
    from causalkv.cli import main

    # tiny-wan has 2 heads: 4 ranks cannot share them; refused in this process (exit 2)
    assert main(["generate", "--nproc-per-node", "4", "--no-video", "--quiet"]) == 2


def test_torchrun_command() -> None:
    cmd = torchrun_command(2, ["generate", "--model", "tiny-wan"])
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=2" in cmd and cmd[-4:] == ["causalkv", "generate", "--model", "tiny-wan"]

