"""(b) sglang's own stage classes with int2 on: the guard passes, their caches pin and compress;
(e) with the bridge off the seed errors come back; a chunk loop through LongLive 2.0's own
``forward`` (multi-shot, scene-cut pins, global sink) on the bridge's caches.

Stages are built with ``__new__`` plus the attributes their methods read, as sglang's own
unit tests build them (no weights, no distributed setup).
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import MethodType, SimpleNamespace

import pytest
import torch
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.layers.kvcache.causal_attention_cache import (
    CausalAttentionKVView,
    CausalSelfAttentionKVCache,
)
from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import QVGPackedCausalKVCache
from sglang.multimodal_gen.runtime.pipelines_core.stages import causal_denoising
from sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising import (
    CAUSAL_BLOCK_PROMPTS_KEY,
    CAUSAL_SCENE_CUT_MASK_KEY,
    CAUSAL_SHOT_INDICES_KEY,
    CausalDMDDenoisingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world.lingbot_world_causal_denoising import (
    LingBotWorldCausalDMDDenoisingStage,
)
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import (
    LongLive2CausalDenoisingStage,
)

from causalkv.caches.qvg.segments import PackedKV
from causalkv.sglang.cache import SGLangQVGKVCache

STAGES = (CausalDMDDenoisingStage, LongLive2CausalDenoisingStage, LingBotWorldCausalDMDDenoisingStage)
INT2 = QVGKVQuantArgs(bits=2, centroids=8, block_size=16)
HEADS, HEAD_DIM, CHUNK = 2, 32, 16


def _server_args(quant=INT2):
    return SimpleNamespace(pipeline_config=SimpleNamespace(), kv_cache_quant_config=quant)


def _stage(cls):
    stage = cls.__new__(cls)
    stage.sink_size = 1
    stage.sliding_window_num_frames = 4
    stage.num_transformer_blocks = 2
    stage.transformer = SimpleNamespace()  # LingBot reads transformer.config.arch_config
    return stage


def _allocate(stage, **kw):
    args = dict(batch_size=1, kv_cache_size=4 * CHUNK, num_attention_heads=HEADS,
                attention_head_dim=HEAD_DIM, dtype=torch.bfloat16, device=torch.device("cpu"),
                sink_tokens=CHUNK)
    args.update(kw)
    return stage._allocate_causal_kv_cache(**args)


def stored_after_seven_chunks(cache) -> list:
    """Write seven chunks into ``cache`` (three unmarked writes each: denoise steps, then the
    context update; seeded K/V) and return its packed segments' storage (`PackedKV`)."""
    gen = torch.Generator().manual_seed(0)
    for chunk in range(7):
        for _ in range(3):
            kv = torch.randn(2, 1, CHUNK, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
            cache.update_and_get_attention_kv(key=kv[0], value=kv[1], current_chunk_start=chunk * CHUNK)
    return [s.storage for s in cache.store.segments if isinstance(s.storage, PackedKV)]


@pytest.mark.parametrize("cls", STAGES)
def test_guard_passes_and_the_request_quant_reaches_the_stage(cls):
    stage = _stage(cls)
    assert stage._supports_qvg_kv_cache_quantization() is True
    stage._apply_causal_cache_overrides(SimpleNamespace(), _server_args())  # sglang's guard
    assert stage._kv_quant_args is INT2


def test_offline_forward_context_carries_the_quant(monkeypatch):
    """The offline paths never reach sglang's guard; the forward context hook carries it."""
    stage = _stage(LongLive2CausalDenoisingStage)
    monkeypatch.setattr(causal_denoising, "get_local_torch_device", lambda: torch.device("cpu"))
    stage.attn_backend = SimpleNamespace(get_enum=lambda: None)
    for name, fn in {
        "_get_causal_dmd_scheduler": lambda self, b, s: None,
        "_get_causal_dmd_latents": lambda self, b: torch.zeros(1, 2, 2, 2, 2),
        "_prepare_frame_seq_length": lambda self, h, w: 4,
        "_prepare_causal_dmd_timesteps": lambda self, b, s, sch, d: torch.tensor([1]),
        "_prepare_causal_dmd_pos_cond_kwargs": lambda self, b, s, t: {},
        "_prepare_causal_dmd_prompt_embeds": lambda self, b, s, t: [],
        "_autocast_enabled": lambda self, t, s: False,
    }.items():
        setattr(stage, name, MethodType(fn, stage))
    stage._prepare_causal_dmd_forward_context(SimpleNamespace(), _server_args())
    assert stage._kv_quant_args is INT2


@pytest.mark.parametrize("cls", STAGES)
def test_caches_pin_compress_and_return_sglang_views(cls):
    stage = _stage(cls)
    stage._kv_quant_args = INT2
    caches = _allocate(stage, global_sink_tokens=CHUNK)  # LongLive 2.0 multi-shot sink
    assert len(caches) == 2
    assert all(type(c) is SGLangQVGKVCache and isinstance(c, QVGPackedCausalKVCache) for c in caches)
    cache = caches[0]
    dense_nbytes = 2 * cache.cache_size * HEADS * HEAD_DIM * 2  # sglang's K and V buffers, bf16
    gen = torch.Generator().manual_seed(0)
    for chunk in range(7):
        for _ in range(3):  # denoise steps, then the context update
            kv = torch.randn(2, 1, CHUNK, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
            view = cache.update_and_get_attention_kv(
                key=kv[0], value=kv[1], current_chunk_start=chunk * CHUNK)
        assert type(view) is CausalAttentionKVView
        assert view.k.shape == (1, min(chunk + 1, 4) * CHUNK, HEADS, HEAD_DIM)
        if chunk in (1, 4):
            cache.pin_current_chunk(CHUNK)  # a scene cut: sglang's seed crash
    assert cache.packed_chunks() >= 2
    assert cache.resident_nbytes() < dense_nbytes


@pytest.mark.parametrize("cls", STAGES)
def test_quant_off_keeps_sglangs_dense_cache(cls):
    stage = _stage(cls)
    stage._kv_quant_args = QVGKVQuantArgs()
    caches = _allocate(stage, global_sink_tokens=CHUNK)
    assert all(type(c) is CausalSelfAttentionKVCache for c in caches)


def test_head_dim_below_the_block_defers_or_names_the_fix():
    lingbot = _stage(LingBotWorldCausalDMDDenoisingStage)
    lingbot._kv_quant_args = QVGKVQuantArgs(bits=4)  # block_size 64 > head_dim 4
    caches = _allocate(lingbot, attention_head_dim=4)
    assert all(type(c) is QVGPackedCausalKVCache for c in caches)  # sglang's own, as in its test
    base = _stage(CausalDMDDenoisingStage)
    base._kv_quant_args = QVGKVQuantArgs(bits=4)
    with pytest.raises(ValueError, match=r"cannot pack this KV cache: kv-cache-quant-block-size 64 does not divide head_dim=4; choose one of \[2, 4\]"):
        _allocate(base, attention_head_dim=4)


_BRIDGE_OFF = """
import sys, types
sys.path.insert(0, {here!r})
import tvshim; tvshim.install()
from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry, apply_plugin_hooks, load_plugins
load_plugins(); apply_plugin_hooks()
from causalkv.sglang.hooks import OFF_HOOKS
patched = {{t for t in HookRegistry._patched if "causal" in t}}
assert patched == {{t for t, _ in OFF_HOOKS}}, patched  # the warning observer only
import torch
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs
from sglang.multimodal_gen.runtime.pipelines_core.stages.causal_denoising import CausalDMDDenoisingStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.longlive2 import LongLive2CausalDenoisingStage
from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.lingbot_world.lingbot_world_causal_denoising import LingBotWorldCausalDMDDenoisingStage
args = types.SimpleNamespace(pipeline_config=types.SimpleNamespace(), kv_cache_quant_config=QVGKVQuantArgs(bits=2))
for cls in (CausalDMDDenoisingStage, LongLive2CausalDenoisingStage):
    stage = cls.__new__(cls); stage.sink_size = 1; stage.sliding_window_num_frames = 4
    try:
        stage._apply_causal_cache_overrides(types.SimpleNamespace(), args)
    except ValueError as e:
        print("SEED", e)
stage = LingBotWorldCausalDMDDenoisingStage.__new__(LingBotWorldCausalDMDDenoisingStage)
stage._kv_quant_args = QVGKVQuantArgs(bits=2, block_size=16); stage.num_transformer_blocks = 1
kw = dict(batch_size=1, kv_cache_size=64, num_attention_heads=2, attention_head_dim=32,
          dtype=torch.bfloat16, device=torch.device("cpu"), sink_tokens=16)
try:
    stage._allocate_causal_kv_cache(global_sink_tokens=16, **kw)
except NotImplementedError as e:
    print("SEED", e)
cache = stage._allocate_causal_kv_cache(**kw)[0]
try:
    cache.pin_current_chunk(16)
except NotImplementedError as e:
    print("SEED", e)
"""


def test_bridge_off_brings_the_seed_errors_back():
    env = dict(os.environ, CAUSALKV_SGLANG_BRIDGE="0", HF_HUB_OFFLINE="1")
    here = str(Path(__file__).resolve().parents[2] / "demo" / "sglang" / "cpu_stand_ins")
    out = subprocess.run([sys.executable, "-c", _BRIDGE_OFF.format(here=here)], env=env,
                         capture_output=True, text=True, check=True).stdout
    seeds = [line for line in out.splitlines() if line.startswith("SEED ")]
    assert seeds == [
        "SEED CausalDMDDenoisingStage does not support QVG KV-cache quantization",
        "SEED LongLive2CausalDenoisingStage does not support QVG KV-cache quantization",
        "SEED QVG packed KV cache supports only the LingBot realtime sliding-window and sink path",
        "SEED QVGPackedCausalKVCache does not support pinned-sink (longlive2); packed KV quant is "
        "scoped to the LingBot realtime path.",
    ]


# ---- a chunk loop through LongLive 2.0's own forward -------------------------------------
class _DiT:
    """Stands in for the DiT around sglang's own causal self-attention layer: per block, a
    fixed projection to q/k/v, then sglang's ``CausalWanSelfAttention`` (its rotary embedding,
    its ``can_direct_current_attention`` / ``update_and_get_attention_kv`` call site and its
    torch-SDPA attention over the cache view), then a fixed output projection."""

    independent_first_frame = False
    num_attention_heads = HEADS
    attention_head_dim = HEAD_DIM

    def __init__(self, channels: int, blocks: int) -> None:
        from sglang.multimodal_gen.runtime.models.dits.causal_wanvideo import (
            CausalWanSelfAttention,
        )

        g = torch.Generator().manual_seed(1)
        self.proj = torch.randn(3, channels, HEADS * HEAD_DIM, generator=g) / channels**0.5
        self.out = torch.randn(HEADS * HEAD_DIM, channels, generator=g) / HEAD_DIM
        self.attn = [CausalWanSelfAttention(dim=HEADS * HEAD_DIM, num_heads=HEADS)
                     for _ in range(blocks)]
        self.config = SimpleNamespace(patch_size=(1, 1, 1))

    def forward(self, x, prompt_embeds, timestep, kv_cache=None, crossattn_cache=None,
                current_start=0, start_frame=0):
        b, c, t, h, w = x.shape
        tokens = x.float().flatten(2).transpose(1, 2)  # [B, n, C]
        q, k, v = (tokens @ p for p in self.proj)
        q, k, v = (z.unflatten(2, (HEADS, HEAD_DIM)).to(torch.bfloat16) for z in (q, k, v))
        pos = torch.arange(current_start, current_start + q.shape[1], dtype=torch.float32)
        freqs = pos[:, None] / 10000 ** (torch.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
        out = torch.zeros_like(tokens)
        for attn, cache in zip(self.attn, kv_cache):
            y = attn(q, k, v, (freqs.cos(), freqs.sin()), None, kv_cache=cache,
                     current_start=current_start)
            out = out + y.float().flatten(2) @ self.out
        return out.transpose(1, 2).reshape(b, c, t, h, w).to(x.dtype)

    __call__ = forward


class _Scheduler:
    def set_timesteps(self, n, device=None, shift=None):
        self.timesteps = torch.linspace(1000, 250, n)

    def step(self, pred, t, sample, return_dict=False):
        return (sample - 0.25 * pred,)


def _longlive2_run(quant, monkeypatch):
    from sglang.multimodal_gen.runtime.server_args import server_args as sgl_server_args

    monkeypatch.setattr(causal_denoising, "get_local_torch_device", lambda: torch.device("cpu"))
    # sglang's attention layer picks its backend from the global server args: torch SDPA
    monkeypatch.setattr(sgl_server_args, "_global_server_args", SimpleNamespace(
        attention_backend="torch_sdpa", is_arg_explicitly_set=lambda name: True))
    stage = LongLive2CausalDenoisingStage.__new__(LongLive2CausalDenoisingStage)
    channels, frames_per_block, blocks, hw = 4, 2, 6, 4
    stage.transformer = _DiT(channels, blocks=2)
    stage.num_transformer_blocks = 2
    stage.num_frames_per_block = frames_per_block
    stage.sliding_window_num_frames = 4 * frames_per_block
    stage.local_attn_size = -1
    stage.sink_size = frames_per_block  # 8 tokens: one block
    stage.causal_kv_cache = stage.crossattn_cache = None
    stage.causal_kv_cache_neg = stage.crossattn_cache_neg = None
    stage._rope_temporal_offset = 0.0
    stage._i2v_image_latent = None
    stage._causal_attn_metadata_builder_cls = stage._causal_attn_metadata_builder = None
    stage._extra_func_kwarg_names_cache = {}
    stage.attn_backend = SimpleNamespace(get_enum=lambda: None)
    stage._get_causal_dmd_scheduler = MethodType(lambda self, b, s: _Scheduler(), stage)
    stage._denoise_step_profiler = lambda *a: nullcontext()
    stage.progress_bar = lambda *a, **k: nullcontext(None)
    shots = [0, 0, 1, 1, 1, 2]  # scene cuts at blocks 2 and 5
    batch = SimpleNamespace(
        latents=torch.randn(1, channels, blocks * frames_per_block, hw, hw,
                            generator=torch.Generator().manual_seed(2)),
        prompt_embeds=[torch.zeros(blocks, 3, 8)], prompt_attention_mask=None,
        image_latent=None, num_inference_steps=3, do_classifier_free_guidance=False,
        extra={CAUSAL_BLOCK_PROMPTS_KEY: ["p"] * blocks,
               CAUSAL_SCENE_CUT_MASK_KEY: [i > 0 and shots[i] != shots[i - 1] for i in range(blocks)],
               CAUSAL_SHOT_INDICES_KEY: shots},
        multi_shot_sink=True, multi_shot_rope_offset=0.0,
    )
    text = SimpleNamespace(arch_config=SimpleNamespace(text_len=3))
    server_args = SimpleNamespace(
        pipeline_config=SimpleNamespace(flow_shift=5.0, text_encoder_configs=[text], context_noise=0),
        kv_cache_quant_config=quant, disable_autocast=True,
    )
    out = stage.forward(batch, server_args).latents.clone()
    return stage, out


def test_longlive2_forward_chunk_loop_on_the_bridge_caches(monkeypatch):
    """sglang's LongLive 2.0 forward (blocks, denoise steps, context updates, scene-cut pins,
    global sink) through sglang's own causal self-attention layer on the bridge's caches:
    int2 with nothing packed yet equals sglang's dense cache bit for bit; int2 with packing
    pins, compresses and stays close."""
    dense_stage, dense = _longlive2_run(QVGKVQuantArgs(), monkeypatch)
    assert type(dense_stage.causal_kv_cache[0]) is CausalSelfAttentionKVCache
    unpacked_stage, unpacked = _longlive2_run(
        QVGKVQuantArgs(bits=2, block_size=16, keep_recent_chunks=99, sink=False), monkeypatch)
    cache = unpacked_stage.causal_kv_cache[0]
    assert type(cache) is SGLangQVGKVCache and cache.global_sink_tokens == 2 * 16
    assert cache.packed_chunks() == 0
    assert torch.equal(unpacked, dense)
    packed_stage, packed = _longlive2_run(QVGKVQuantArgs(bits=2, block_size=16, centroids=8),
                                          monkeypatch)
    cache = packed_stage.causal_kv_cache[0]
    assert cache.has_pinned() and cache.packed_chunks() >= 2
    assert cache.resident_nbytes() < 2 * cache.cache_size * HEADS * HEAD_DIM * 2
    assert torch.isfinite(packed).all()
    err = (packed.float() - dense.float()).norm() / dense.float().norm()
    assert 0 < err < 0.5


def test_the_stage_blocks_share_one_marker_and_take_the_recency_tier_from_the_environment(
        monkeypatch):
    """``CAUSALKV_SGLANG_RECENT_TIER`` reaches the caches a served stage allocates (sglang's QVG
    settings have no such field), and every block of the stage shares one `PassMarker`, the
    CFG set too; a value the bridge does not know, or a tier with nothing to hold, is refused
    where the settings are checked (`check_settings`, before any weight loads)."""
    from causalkv.errors import ConfigError
    from causalkv.sglang.settings import check_settings

    monkeypatch.setenv("CAUSALKV_SGLANG_RECENT_TIER", "int4")
    stage = _stage(LongLive2CausalDenoisingStage)
    stage._kv_quant_args = INT2
    positive, negative = _allocate(stage, global_sink_tokens=CHUNK), _allocate(stage)
    blocks = [*positive, *negative]
    assert all(c.quant.recent_tier == "int4" for c in blocks)
    assert len({id(c.marker) for c in blocks}) == 1 and blocks[0].marker is not None
    check_settings("LongLive2Pipeline", INT2, HEAD_DIM)  # keep-recent 1: the tier holds a chunk
    with pytest.raises(ConfigError, match="recent-tier int4 .* there are none"):
        check_settings("LongLive2Pipeline", QVGKVQuantArgs(bits=2, keep_recent_chunks=0), HEAD_DIM)
    monkeypatch.setenv("CAUSALKV_SGLANG_RECENT_TIER", "int8")
    with pytest.raises(ConfigError, match="CAUSALKV_SGLANG_RECENT_TIER='int8': choose one of"):
        check_settings("LongLive2Pipeline", INT2, HEAD_DIM)


def test_causalkvs_codec_setting_picks_the_bridges_codec_and_the_summary_names_it(monkeypatch):
    """``CAUSALKV_SGLANG_CODEC`` (causalkv's setting) packs with any causalkv codec while
    sglang's ``--kv-cache-quant int2`` turns QVG on (sglang's choices unchanged): the caches a
    served stage allocates pack with it, the summary line names it, and a name the bridge does
    not know (or ``fp8`` as sglang's own ``bits``) is refused naming the variable."""
    from causalkv.errors import ConfigError
    from causalkv.sglang.settings import check_settings, sglang_quant_args
    from causalkv.sglang.stages import summary_line

    monkeypatch.setenv("CAUSALKV_SGLANG_CODEC", "nvfp4")
    monkeypatch.setenv("CAUSALKV_SGLANG_RECENT_TIER", "fp8")
    stage = _stage(LongLive2CausalDenoisingStage)
    stage._kv_quant_args = QVGKVQuantArgs(bits=2)  # PRQ's knobs at their defaults: nvfp4 reads none
    blocks = _allocate(stage)
    assert {(c.quant.codec, c.quant.recent_tier) for c in blocks} == {("nvfp4", "fp8")}
    codecs = {s.codec.name for s in stored_after_seven_chunks(blocks[0])}
    assert codecs == {"nvfp4", "fp8"}
    assert "codec=nvfp4 recent_tier=fp8" in summary_line(stage, [blocks])
    # sglang's PRQ knobs with a codec that reads none of them: refused at start-up, by flag
    with pytest.raises(ConfigError, match="--kv-cache-quant-centroids 8: --kv-cache-quant nvfp4"):
        check_settings("LongLive2Pipeline", INT2, HEAD_DIM)
    monkeypatch.setenv("CAUSALKV_SGLANG_CODEC", "int3")
    with pytest.raises(ConfigError, match="CAUSALKV_SGLANG_CODEC='int3': choose one of"):
        check_settings("LongLive2Pipeline", INT2, HEAD_DIM)
    with pytest.raises(ConfigError, match="CAUSALKV_SGLANG_CODEC=fp8"):
        sglang_quant_args({"bits": "fp8"})
