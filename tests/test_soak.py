"""CI-sized soak: a 2,000-chunk LongLive-2.0-like int2 stream with a scene cut every 4 chunks.

Once the window is full every advance evicts exactly what it adds, so the packed cache's
resident bytes must be exactly constant and no torch tensor may leak (the number of live
``torch.Tensor`` objects, counted with ``gc``, must not grow). The full-size run is
``benchmarks/soak.py`` (10,000 chunks of 7,040 tokens).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def _soak_module():
    spec = importlib.util.spec_from_file_location("causalkv_bench_soak", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_soak_resident_bytes_exactly_flat_and_no_tensor_leak():
    soak = _soak_module()
    cfg = soak.SoakConfig(
        chunks=2000, sample_every=250, tokens_per_frame=16, frames_per_chunk=2, sink_frames=2,
        global_sink_frames=2, window_frames=8, heads=2, head_dim=64, pin_every=4, bits=2, pool=4,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest and keeps the test on one core
    try:
        result = soak.run_soak(cfg, count_tensors=True)
    finally:
        torch.set_num_threads(threads)
    after = result.after_fill()
    assert [s.chunk for s in after] == list(range(250, 2001, 250))
    assert len({s.resident_bytes for s in after}) == 1, [s.resident_bytes for s in after]
    tensors = [s.live_tensors for s in after]
    assert max(tensors) <= tensors[0], tensors
    # packing kept happening all along: every pinned chunk is packed once it is cold
    assert result.quantize_calls >= cfg.chunks // cfg.pin_every - 1
    assert result.packing["chunks_packed"] + result.packing["chunks_kept_dense"] == cfg.chunks - 1


@pytest.mark.slow
def test_soak_at_longlive2_chunk_size_stays_flat_over_1000_chunks():
    """`make test-long` only: 1,000 chunks at LongLive 2.0's real chunk size (7,040 tokens, an
    8-frame global sink plus the pinned shot sink, a 32-frame window, one head of 128), a scene
    cut every 4 chunks: resident bytes exactly flat once the window is full, the process RSS
    within the benchmark's tolerance, no tensor leak (docs/packed_cache.md, "Soak")."""
    soak = _soak_module()
    cfg = soak.SoakConfig(chunks=1000, sample_every=100)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = soak.run_soak(cfg, count_tensors=True)
    finally:
        torch.set_num_threads(threads)
    after = result.after_fill()
    assert len({s.resident_bytes for s in after}) == 1, [s.resident_bytes for s in after]
    assert result.drift("rss_bytes") <= 0.05, [s.rss_bytes for s in after]
    tensors = [s.live_tensors for s in after]
    assert max(tensors) <= tensors[0], tensors
