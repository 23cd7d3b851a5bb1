"""`causalkv memory --host sglang` against the bridge's real cache (`SGLangQVGKVCache`).

The planner's sglang host models the bridge: sglang's slot arithmetic decides what a layer
holds, sglang's packing rule (`RECENT_NON_SINK`) which chunk is packed, the centroids as sglang's flags
give them. A bridge cache given no scratch holds the chunk being generated itself and packs at
the next advance, so after chunk i+1's first write it holds what the planner says one layer
holds after chunk i's context pass, plus chunk i+1 in bf16.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from causalkv.caches import intervals as iv
from causalkv.memory import (
    ROLLING_SLOT_CACHE,
    SETTINGS,
    MemoryRequest,
    ModelGeometry,
    plan_setting,
    positions,
    stream_layout,
)
from causalkv.sglang.cache import SGLangQVGKVCache

#: 2 layers x 2 heads x 64; 128 tokens per frame (64x128 px, VAE 8, 1x1 patches), 2-frame
#: chunks of 256 tokens (where 128 centroids pay at int2 and int4), a 1-chunk sink, 4 slots
TINY = ModelGeometry(
    "tiny-sglang", 2, 2, 64, vae_scale_spatial=8, vae_scale_temporal=4, patch=(1, 1),
    frames_per_chunk=2, sink_frames=2, global_sink_frames=2, window_frames=8, height=64,
    width=128, fps=16, default_frames=29, shot_sinks=True,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The caches here hold a few hundred KiB: torch's intra-op threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))


@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("name", ["off", "int4-default", "int4-recent0", "int2-default", "int2-recent0"])
def test_planner_equals_the_bridge_cache_without_a_scratch(name: str, sink: bool) -> None:
    lay = stream_layout(TINY, MemoryRequest(latent_frames=14, shots=2, sink=sink))
    assert lay.num_chunks == 7 and lay.pins == {4} and lay.chunk_tokens == 256
    states = positions(lay, ROLLING_SLOT_CACHE.positions)
    plan = plan_setting(TINY, lay, SETTINGS[name], cache=ROLLING_SLOT_CACHE, sink=sink, states=states)
    n, token = lay.chunk_tokens, 2 * 2 * 64 * 2
    cache = SGLangQVGKVCache(
        batch_size=1, cache_size=lay.cache_tokens, num_heads=2, head_dim=64,
        dtype=torch.bfloat16, device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
        local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=True,
        sink_tokens=lay.sink_tokens, attention_window_size=lay.cache_tokens,
        quant_args=SETTINGS[name].quant_args(sink=sink),
        global_sink_tokens=lay.global_sink_tokens,
    )
    measured = []
    for i in range(lay.num_chunks + 1):
        k, v = _kv(n, i)
        cache.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
        if i:
            held = cache.store.held()
            assert iv.subtract(held, ((i * n, (i + 1) * n),)) == states[i - 1].held
            measured.append(cache.resident_nbytes() - n * token)
        if i in lay.pins:
            cache.pin_current_chunk(n)
    assert tuple(measured) == plan.resident_per_chunk
    if name != "off":
        assert cache.quantize_calls > 0


@pytest.mark.parametrize(
    ("name", "cfg"),
    [*((n, False) for n in ("off", "int4-default", "int4-recent0", "int2-default",
                            "int2-recent0", "int2-recent-int4")), ("int2-recent-int4", True)],
)
def test_planner_equals_the_bridge_caches_with_a_scratch(name: str, cfg: bool) -> None:
    _check_marked(TINY, name, cfg=cfg, sink=True)


#: a sink that is not a whole number of chunks (3 frames of 2-frame chunks) whose global part
#: is 1 frame: after a pin, chunk 1 is held in part, and a packed part is kept whole
UNALIGNED = replace(TINY, name="tiny-unaligned", sink_frames=3, global_sink_frames=1,
                    window_frames=10)


@pytest.mark.parametrize("name", ["int2-recent-int4", "int4-default", "int2-recent0"])
def test_planner_equals_the_bridge_caches_at_an_unaligned_sink(name: str) -> None:
    _check_marked(UNALIGNED, name, cfg=False, sink=False)


@pytest.mark.parametrize("frames", [2, 4])
def test_planner_equals_the_bridge_caches_on_short_requests(frames: int) -> None:
    """One chunk (its window is the chunk alone: read as views, no buffer) and two."""
    _check_marked(TINY, "int2-default", cfg=True, sink=True, frames=frames)


def _check_marked(
    geom: ModelGeometry, name: str, *, cfg: bool, sink: bool, frames: int = 14
) -> None:
    """The exactness test through the bridge: 2 layers (x 2 CFG sets) sharing one `PassMarker`,
    per chunk a denoising pass (a probe) and the context pass (the commit, the pin announced),
    then the pin; the views are read as one buffer (sglang's attention), so the ledger sees the
    gathered window."""
    from causalkv.caches.passes import PassMarker

    shots = 2 if frames >= 4 * geom.frames_per_chunk else 1
    lay = stream_layout(geom, MemoryRequest(latent_frames=frames, shots=shots, cfg=cfg, sink=sink))
    plan = plan_setting(geom, lay, SETTINGS[name], cache=ROLLING_SLOT_CACHE, sink=sink)
    marker = PassMarker()
    n = lay.chunk_tokens
    caches = [
        SGLangQVGKVCache(
            batch_size=1, cache_size=lay.cache_tokens, num_heads=2, head_dim=64,
            dtype=torch.bfloat16, device="cpu", global_end_index=torch.zeros(1, dtype=torch.long),
            local_end_index=torch.zeros(1, dtype=torch.long), use_int_indices=True,
            sink_tokens=lay.sink_tokens, attention_window_size=lay.cache_tokens,
            quant_args=SETTINGS[name].quant_args(sink=sink),
            global_sink_tokens=lay.global_sink_tokens, marker=marker,
        )
        for _ in range(geom.num_layers * lay.sets)
    ]
    resident = []
    for i in range(lay.num_chunks):
        for p in range(2):
            k, v = _kv(n, 10 * i + p)
            with marker.committing(pin=i in lay.pins) if p else marker.probing():
                for c in caches:
                    c.update_and_get_attention_kv(key=k, value=v, current_chunk_start=i * n)
        if i in lay.pins:
            for c in caches:
                c.pin_current_chunk(n)
        resident.append(sum(c.resident_nbytes() for c in caches))
    assert resident == [len(caches) * r for r in plan.resident_per_chunk]
    assert max(resident) == plan.kv_bytes
    assert marker.ledger.peak_nbytes == plan.peak_bytes


def _benchmark():
    import importlib.util
    import sys
    from pathlib import Path

    name = "_causalkv_bench_sglang_bridge"
    if name not in sys.modules:  # its dataclasses look their module up there
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_bridge.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize(
    "setting", ["off", "int2-recent-int4", "int2-sink0", "fp8-default", "nvfp4-recent0"])
def test_planner_equals_the_benchmarks_all_layers_request(setting: str) -> None:
    """`benchmarks/sglang_bridge.py --layers` (its quick geometry: 3 blocks, 512-token chunks
    in 4 slots, 4 denoising passes and the context update, a shot pinned after chunk 2): its
    peak (the marker's ledger), its resident bytes at the end and sglang dense's allocation
    are the planner's."""
    bench = _benchmark()
    m = bench.QUICK_MODEL
    row = bench.request(m, setting, torch.device("cpu"))
    geom = ModelGeometry(
        "quick", m.layers, m.heads, m.head_dim, vae_scale_spatial=8, vae_scale_temporal=4,
        patch=(1, 1), frames_per_chunk=m.frames_per_chunk, sink_frames=m.sink_frames,
        global_sink_frames=m.sink_frames, window_frames=m.window_frames, height=128, width=128,
        shot_sinks=True,
    )
    assert geom.tokens_per_frame(128, 128) == m.tokens_per_frame
    lay = replace(stream_layout(geom, MemoryRequest(latent_frames=m.chunks * m.frames_per_chunk)),
                  pins=frozenset({m.pin_after}))
    plan = plan_setting(geom, lay, SETTINGS[setting], cache=ROLLING_SLOT_CACHE)
    assert row["peak_bytes"] == plan.peak_bytes
    assert row["resident_bytes"] == m.layers * plan.resident_per_chunk[-1]
    assert row["dense_bytes"] == plan.dense_bytes
