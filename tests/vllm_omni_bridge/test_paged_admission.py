"""Admission on vLLM-Omni's paged AR-diffusion engine, with no tensors: the engine's own code
(``ARDiffusionModelRunner._preallocate_kv_cache`` on LingBot's own ``ar_diffusion_kv_cache_spec``,
the DiT and the VAE built on the meta device, the cache with ``device=None``) against the
planner's formula (`causalkv.vllm_omni.admission`, what ``causalkv memory lingbot --host
vllm-omni`` prints), byte for byte, at LingBot-World's real geometry and at the tiny one.

The oracles: vLLM-Omni's ``ARDiffusionKVCache`` for its own pool (stock); for causalkv's pages
the cache the runner builds for causalkv's pipeline, which must admit what the command prints.
"""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.errors import ConfigError
from causalkv.memory.records import SETTINGS
from causalkv.vllm_omni.admission import (
    LINGBOT_STOCK_CAPACITY,
    ROWS,
    EngineGeometry,
    admit,
    causalkv_layout,
    lingbot_engine,
    lingbot_model_state_bytes,
    plan_admission,
    stock_layout,
)

GiB = 1 << 30
BUDGETS = [40 * GiB, 80 * GiB, 96 * GiB, 160 * GiB, 640 * GiB]


def _meta_pipeline(*, height: int, width: int, dtype: torch.dtype, dit: dict | None = None,
                   vae: dict | None = None, quant: QVGKVQuantArgs | None = None):
    """vLLM-Omni's LingBot-World pipeline object whose DiT and VAE are built on the meta device
    (no weights, no tensors), with the attributes its AR-diffusion spec reads; with ``quant``,
    causalkv's paged pipeline (`install_paged`)."""
    from vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_wan import (
        DistributedAutoencoderKLWan,
    )
    from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline
    from vllm_omni.diffusion.models.lingbot_world.transformer import (
        CausalLingBotWorldTransformer3DModel,
    )

    from causalkv.vllm_omni.paged_pipeline import install_paged

    with torch.device("meta"):
        transformer = CausalLingBotWorldTransformer3DModel(**(dit or {})).to(dtype)
        autoencoder = DistributedAutoencoderKLWan(**(vae or {})).to(dtype)
    p = LingBotWorldCausalDMDPipeline.__new__(LingBotWorldCausalDMDPipeline)
    torch.nn.Module.__init__(p)
    p.transformer, p.vae = transformer, autoencoder
    p.vae_scale_factor_temporal, p.vae_scale_factor_spatial = 4, 8
    p._ar_height, p._ar_width = height, width
    p.device = torch.device("cpu")
    p._streaming_decode_unsupported, p._cached_streaming_decoder = False, None
    p._vae_shard_split_dim = None
    p.od_config = SimpleNamespace(parallel_config=SimpleNamespace(ulysses_degree=1), dtype=dtype,
                                  step_execution=False, max_num_seqs=1,
                                  model_config={"ar_diffusion_kv_config": {"gpu_memory_fraction": 1.0}})
    if quant is not None:
        install_paged(p, quant)
    return p


def _runner(pipeline, available: int, fraction: float = 1.0):
    """vLLM-Omni's ``ARDiffusionModelRunner._preallocate_kv_cache`` on ``pipeline`` with
    ``device=None`` (no tensors): the engine's admission as it runs at load."""
    from vllm_omni.experimental.ar_diffusion.runner import (
        ARDiffusionModelRunner,
        resolve_ar_diffusion_kv_config,
    )

    runner = ARDiffusionModelRunner.__new__(ARDiffusionModelRunner)
    runner.od_config = SimpleNamespace(**{**vars(pipeline.od_config), "model_config": {
        "ar_diffusion_kv_config": {"gpu_memory_fraction": fraction}}})
    runner.pipeline, runner.device = pipeline, None
    runner.ar_diffusion_kv_config = resolve_ar_diffusion_kv_config(runner.od_config)
    runner._preallocate_kv_cache(available_bytes=available)
    return runner


@pytest.fixture(autouse=True)
def _free_memory(monkeypatch):
    """The CPU platform reports the test's free memory (causalkv's spec declares what fits)."""
    import vo_cpu_omni_platform

    holder = {"free": 80 * GiB}
    monkeypatch.setattr(vo_cpu_omni_platform.CPUOmniPlatform, "get_free_memory",
                        classmethod(lambda cls, device=None: holder["free"]))
    return holder


@pytest.mark.parametrize(("height", "width"), [(480, 832), (64, 64), (256, 448)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lingbot_spec_is_the_planners_engine_geometry(runtime, height, width, dtype):
    spec = _meta_pipeline(height=height, width=width, dtype=dtype).ar_diffusion_kv_cache_spec()
    item = torch.empty((), dtype=dtype).element_size()
    assert spec.model_owned_state_bytes_per_session == lingbot_model_state_bytes(height, width, itemsize=item)
    eng = lingbot_engine(height, width, dtype={2: "bfloat16", 4: "float32"}[item])
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.tokens_per_frame,
            spec.frames_per_block, spec.sink_frames, spec.window_frames) == (
        eng.num_layers, eng.num_kv_heads, eng.head_size, eng.tokens_per_frame,
        eng.frames_per_block, eng.sink_frames, eng.window_frames)
    assert tuple((c.num_tokens, c.num_kv_heads) for c in spec.cross_attention) == eng.cross_attention
    assert spec.session_capacity == LINGBOT_STOCK_CAPACITY
    assert eng.model_state_bytes == spec.model_owned_state_bytes_per_session


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.1])
def test_stock_admission_is_the_engines_own(runtime, budget, fraction):
    from vllm_omni.experimental.ar_diffusion.kv_cache.manager import ARDiffusionKVCache

    pipe = _meta_pipeline(height=480, width=832, dtype=torch.bfloat16)
    eng = lingbot_engine()
    try:
        want = admit(eng, stock_layout(eng), available_bytes=budget, gpu_memory_fraction=fraction,
                     requested_capacity=LINGBOT_STOCK_CAPACITY)
    except ConfigError:
        with pytest.raises(ValueError, match="cannot fit one session"):
            _runner(pipe, budget, fraction)
        return
    runner = _runner(pipe, budget, fraction)
    cache = runner.kv_cache
    assert type(cache) is ARDiffusionKVCache and not cache._k_pools  # no tensors
    assert runner._session_capacity == cache.session_capacity == want.capacity
    assert cache.num_blocks == want.pool_blocks
    assert cache.memory_budget_bytes == want.memory_budget_bytes
    assert cache.configured_memory_budget_bytes == want.configured_budget_bytes
    assert cache.scratch_reserved_bytes + 2 * cache.spec.page_size_bytes * eng.num_layers \
        + eng.frames_per_block * eng.page_bytes == want.fixed_bytes


def _cli_rows(budget: str) -> dict[str, dict]:
    from causalkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", "lingbot", "--host", "vllm-omni", "--budget", budget, "--json"]) == 0
    return {r["setting"]: r for r in json.loads(out.getvalue())}


MEASURED: dict[str, dict] = {}


@pytest.mark.parametrize("row", [*ROWS])
def test_causalkv_admission_with_no_tensors_is_what_the_command_prints(runtime, row, _free_memory):
    """The runner builds causalkv's cache for causalkv's pipeline (no tensors) and admits, byte
    for byte, what ``causalkv memory lingbot --host vllm-omni --budget 80GiB`` prints."""
    from causalkv.vllm_omni.paged_cache import CausalKVPagedKVCache

    quant = SETTINGS[ROWS[row]].quant_args()
    pipe = _meta_pipeline(height=480, width=832, dtype=torch.bfloat16, quant=quant)
    spec = pipe.ar_diffusion_kv_cache_spec()
    runner = _runner(pipe, 80 * GiB)
    cache = runner.kv_cache
    assert type(cache) is CausalKVPagedKVCache and not cache._k_pools  # no tensors
    cli = _cli_rows("80GiB")[row]
    (plan,) = plan_admission(80 * GiB, rows=(row,))
    assert spec.session_capacity == cli["sessions"] == runner._session_capacity == cache.session_capacity
    assert cache.num_blocks == cli["pool_blocks"] == plan.pool_blocks
    assert cache.memory_budget_bytes == cli["memory_budget_bytes"] == 80 * GiB
    assert cache.admission.session_bytes == cli["session_bytes"]
    assert cache.admission.fixed_bytes == cli["fixed_bytes"]
    assert cache.layout.packed_bytes == cli["packed_bytes_per_session"]
    assert cache.layout.bf16_frames * cache.geometry.page_bytes == cli["pool_bytes_per_session"]
    # the pool holds the admitted sessions' bf16 groups and the in-flight tick
    assert cache.num_blocks >= cache.session_capacity * cache.layout.bf16_frames + 3 + 2
    MEASURED[row] = cli


def test_int2_admits_at_least_two_and_a_half_times_stocks_sessions_at_80GiB(runtime):
    rows = _cli_rows("80GiB")
    stock, int2, int4, off = (rows[r]["sessions"] for r in ("stock", "int2", "int4", "off"))
    assert (stock, off, int4, int2) == (2, 2, 4, 5)  # the table docs/vllm_omni.md shows
    assert int2 >= 2.5 * stock
    # stock without LingBot's cap of 2 fits no more at 80 GiB (its bytes alone decide)
    eng = lingbot_engine()
    uncapped = admit(eng, stock_layout(eng), available_bytes=80 * GiB, gpu_memory_fraction=1.0)
    assert uncapped.capacity == stock
    # the bytes: a session at int2 is its 3 bf16 frames, 4 packed groups, text K/V, model state
    assert rows["int2"]["pool_bytes_per_session"] == 3 * eng.page_bytes == 3_833_856_000
    assert rows["stock"]["pool_bytes_per_session"] == 18 * eng.page_bytes == 23_003_136_000
    assert rows["off"]["pool_bytes_per_session"] == 15 * eng.page_bytes  # no dead group


def test_no_dead_group_is_held_or_counted():
    """A forward reads sink + window frames, its own tick included: between ticks a session
    needs sink + window - one tick. causalkv's layouts hold at most that; stock holds one tick
    more (3 of LingBot's 18 frames)."""
    for eng in (lingbot_engine(), _tiny_engine()):
        read = eng.sink_frames + eng.window_frames - eng.frames_per_block
        assert stock_layout(eng).bf16_frames == read + eng.frames_per_block
        off = causalkv_layout(eng, QVGKVQuantArgs())
        assert off.bf16_frames == read and off.packed_bytes == 0
        for tiers in off.tiers:  # groups held after each tick: at most what the next one reads
            assert len(tiers) * eng.frames_per_block <= read
        int2 = causalkv_layout(eng, SETTINGS["int2-default"].quant_args())
        assert all(len(t) * eng.frames_per_block <= read for t in int2.tiers)


def _tiny_engine(dtype: str = "float32", model_state: int = 0) -> EngineGeometry:
    return EngineGeometry("tiny", 2, 2, 64, dtype, 16, 3, 3, 6, cross_attention=((512, 2),),
                          model_state_bytes=model_state)


TINY_DIT = dict(num_attention_heads=2, attention_head_dim=64, in_channels=36, out_channels=16,
                text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=256,
                sink_size=3, num_frames_per_block=3, sliding_window_num_frames=9)


@pytest.mark.parametrize("budget", [64 << 20, 256 << 20, 1 << 30])
@pytest.mark.parametrize("row", ["stock", "int2"])
def test_tiny_geometry_admission_with_no_tensors(runtime, budget, row, _free_memory):
    """The tiny DiT (2 x 2 x 64, 16 tokens per frame, sink 3 + window 6) and the tiny
    checkpoint's VAE, float32 as the CPU runs it: the runner's admission equals the formula's."""
    from causalkv.runtime.tools.checkpoints import CHECKPOINTS

    VAE = CHECKPOINTS["lingbot-world"].vae

    quant = None if row == "stock" else SETTINGS["int2-default"].quant_args()
    pipe = _meta_pipeline(height=64, width=64, dtype=torch.float32, dit=TINY_DIT, vae=VAE, quant=quant)
    _free_memory["free"] = budget
    spec = pipe.ar_diffusion_kv_cache_spec() if quant is not None else None
    runner = _runner(pipe, budget)
    eng = _tiny_engine(model_state=runner.kv_cache.model_owned_state_bytes_per_session)
    layout = stock_layout(eng) if row == "stock" else causalkv_layout(eng, quant)
    want = admit(eng, layout, available_bytes=budget, gpu_memory_fraction=1.0,
                 requested_capacity=LINGBOT_STOCK_CAPACITY if row == "stock" else None)
    assert runner._session_capacity == want.capacity
    assert runner.kv_cache.num_blocks == want.pool_blocks
    if spec is not None:
        assert spec.session_capacity == want.capacity
        # per session: 3 bf16 frames of 9 in the pool, the sink group and one more packed
        assert layout.bf16_frames == 3 and layout.packed_bytes > 0


def test_the_pool_dtypes_are_the_request_dtypes():
    """The paged engine counts a pool of each dtype a request may name (`causalkv.config.DTYPES`)
    under that name, and no other."""
    from causalkv.vllm_omni.paged_cache import _DTYPES

    assert _DTYPES == {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
