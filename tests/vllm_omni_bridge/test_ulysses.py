"""Ulysses on 2 gloo processes: vLLM-Omni's own sequence parallelism runs LingBot-World's DiT on
a CPU, and with causalkv's store each rank caches its own head (head offset = rank)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_lingbot as tl
import torch

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, str(HERE / "ulysses_worker.py"), str(r), "2",
                               "dense,int2", str(out), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return {(m, r): torch.load(out / f"{m}-2-{r}.pt") for m in ("dense", "int2") for r in range(2)}


@pytest.fixture(scope="module")
def one_rank(runtime):
    sys.path.insert(0, str(HERE))
    import ulysses_worker

    return {m: ulysses_worker.run(m, 1) for m in ("dense", "int2")}


def test_vllm_omnis_ulysses_runs_on_gloo_and_matches_one_process(two_ranks, one_rank):
    """Both ranks return the full output (vLLM-Omni's sp_output_gather), equal to one
    process's up to float rounding (the projections run on half the tokens per rank)."""
    ref = one_rank["dense"]["outs"]
    for r in range(2):
        got = two_ranks[("dense", r)]["outs"]
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_each_rank_caches_its_own_heads_and_matches_one_process(two_ranks, one_rank):
    """With causalkv's int2 store a rank caches head ``rank`` (of 2): its codebooks keyed by the
    global head index, so the two-rank stream stays with the one-process stream; int2's drift
    from the dense cache is far larger than the two-rank/one-process difference."""
    ref_q = one_rank["int2"]["outs"]
    drift = float((ref_q - one_rank["dense"]["outs"]).abs().max())
    for r in range(2):
        got = two_ranks[("int2", r)]
        assert got["head_offset"] == r
        diff = float((got["outs"] - ref_q).abs().max())
        assert diff <= 0.05 * drift, (diff, drift)
    assert one_rank["int2"]["head_offset"] == 0
    assert tl.TINY["num_attention_heads"] == 2
