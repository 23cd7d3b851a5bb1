"""Ulysses on 2 gloo processes: vLLM-Omni's own sequence parallelism runs LingBot-World's DiT on
a CPU, and with causalkv's store each rank caches its own head (head offset = rank)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tiny_lingbot as tl
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def one_rank(runtime):
    sys.path.insert(0, str(HERE))
    import ulysses_worker

    return {m: ulysses_worker.run(m, 1) for m in ("dense", "int2")}


@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks["outputs"]


def test_vllm_omnis_ulysses_runs_on_gloo_and_matches_one_process(two_ranks, one_rank):
    """Both ranks return the full output (vLLM-Omni's sp_output_gather), bit for bit one
    process's: the all-to-alls only move data, and each head's attention is the same."""
    ref = one_rank["dense"]["outs"]
    for r in range(2):
        got = two_ranks[("dense", r)]["outs"]
        assert got.shape == ref.shape
        assert torch.equal(got, ref)


def test_each_rank_caches_its_own_heads_and_matches_one_process(two_ranks, one_rank):
    """With causalkv's int2 store a rank caches head ``rank`` (of 2) and keys its codebooks by
    the global head index, so each rank packs exactly what one process packs for that head:
    the two-rank stream equals the one-process int2 stream bit for bit (and int2 does differ
    from the dense cache, so the comparison sees the packing)."""
    ref_q = one_rank["int2"]["outs"]
    assert not torch.equal(ref_q, one_rank["dense"]["outs"])
    for r in range(2):
        got = two_ranks[("int2", r)]
        assert got["head_offset"] == r
        assert torch.equal(got["outs"], ref_q)
    assert one_rank["int2"]["head_offset"] == 0
    assert tl.TINY["num_attention_heads"] == 2
