"""Settings where they enter, the tiny checkpoints' format, the test environment's CPU ops and
the two QVG codecs LingBot-World can use. In process, no worker: fast."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from safetensors import safe_open
from sglang.multimodal_gen.configs.quantization.qvg_kv import QVGKVQuantArgs

from causalkv.errors import ConfigError
from causalkv.sglang import ENV_LINGBOT_QVG
from causalkv.sglang.settings import check_settings, sglang_quant_args


# ---- (c) a dict kv_cache_quant_config -------------------------------------------------------
@pytest.mark.parametrize(("value", "bits", "centroids"), [
    ({"bits": 4}, 4, 128),
    ({"bits": "int2", "centroids": 64}, 2, 64),
    ({"kv_cache_quant": "int2", "kv_cache_quant_centroids": 32}, 2, 32),
    ({}, None, 128),
])
def test_a_dict_becomes_sglangs_quant_args(value, bits, centroids):
    args = sglang_quant_args(value)
    assert type(args) is QVGKVQuantArgs and args.bits == bits and args.centroids == centroids


@pytest.mark.parametrize(("value", "match"), [
    ({"bitz": 4}, r"unknown key\(s\) \['bitz'\]; valid keys: \['bits', "),
    ({"bits": 3}, "kv-cache-quant bits must be 2 or 4"),
    ({"bits": "int8"}, "kv-cache-quant must be one of"),
    ({"bits": 2, "kv_cache_quant_centroids": 8}, "mixes flag names"),
    ("int2", "must be sglang's QVGKVQuantArgs or a dict"),
])
def test_a_bad_dict_is_refused_with_the_reason(value, match):
    with pytest.raises(ConfigError, match=match):
        sglang_quant_args(value)


def test_diffgenerator_kwargs_dict_is_converted_at_start_up(longlive2_checkpoint):
    """``DiffGenerator.from_pretrained(..., kv_cache_quant_config={...})`` builds ServerArgs
    with ``from_kwargs``, which keeps a dict as it is; the bridge's start-up hook converts it
    (the worker then allocates causalkv's caches, see test_e2e_api) or refuses it."""
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    args = ServerArgs.from_kwargs(model_path=str(longlive2_checkpoint), model_id="LongLive-2.0-5B",
                                  num_gpus=1, kv_cache_quant_config={"bits": 4})
    assert type(args.kv_cache_quant_config) is QVGKVQuantArgs
    assert args.kv_cache_quant_config.bits == 4
    with pytest.raises(ConfigError, match="kv-cache-quant-centroids must be <= 256"):
        ServerArgs.from_kwargs(model_path=str(longlive2_checkpoint), model_id="LongLive-2.0-5B",
                               num_gpus=1, kv_cache_quant_config={"bits": 2, "centroids": 512})


# ---- (d) every limit, with the flag and the fix ----------------------------------------------
@pytest.mark.parametrize(("quant", "match"), [
    (QVGKVQuantArgs(bits=2, centroids=512), "kv-cache-quant-centroids must be <= 256"),
    (QVGKVQuantArgs(bits=2, block_size=6), "block-size 6 x 2 bits is not a whole number of bytes"),
    (QVGKVQuantArgs(bits=4, block_size=48), r"block-size 48 does not divide head_dim=64; choose "),
])
@pytest.mark.parametrize("pipeline", ["LongLive2Pipeline", "WanCausalDMDPipeline"])
def test_limits_are_refused_naming_the_flag(quant, match, pipeline):
    with pytest.raises(ConfigError, match=f"causalkv sglang bridge, {pipeline}: .*{match}"):
        check_settings(pipeline, quant, head_dim=64)


@pytest.mark.parametrize(("quant", "match"), [
    (QVGKVQuantArgs(bits=2, centroids=512), "kv-cache-quant-centroids must be <= 256"),
    (QVGKVQuantArgs(bits=4, block_size=48), "kv-cache-quant-block-size 48 does not divide head_dim=64"),
])
def test_the_worker_refuses_a_limit_when_the_pipeline_reads_its_config(
        longlive2_checkpoint, quant, match):
    """sglang's own ``LongLive2Pipeline._load_config`` (the first step of building the
    pipeline, before any weight loads) with the bridge's hook: the head_dim comes from the
    folder's ``transformer/config.json``. The ServerArgs were built before the plugin loaded,
    as in the ``sglang generate`` CLI process, so nothing was checked at start-up."""
    from sglang.multimodal_gen.runtime.pipelines.longlive2_pipeline import LongLive2Pipeline
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    args = ServerArgs.from_kwargs(model_path=str(longlive2_checkpoint),
                                  model_id="LongLive-2.0-5B", num_gpus=1)
    args.kv_cache_quant_config = quant  # what ServerArgs.from_cli_args gave the CLI
    pipe = LongLive2Pipeline.__new__(LongLive2Pipeline)
    pipe.server_args, pipe.model_path = args, str(longlive2_checkpoint)
    with pytest.raises(ConfigError, match=f"causalkv sglang bridge, LongLive2Pipeline: {match}"):
        pipe._load_config()
    args.kv_cache_quant_config = QVGKVQuantArgs(bits=2)
    assert pipe._load_config()["_class_name"] == "LongLive2Pipeline"


def test_limits_leave_what_the_bridge_does_not_serve_to_sglang(monkeypatch):
    bad = QVGKVQuantArgs(bits=2, centroids=512)
    check_settings("FluxPipeline", bad, head_dim=64)  # not served: sglang decides
    check_settings("LongLive2Pipeline", QVGKVQuantArgs(), head_dim=64)  # quant off
    # LingBot: a block size that does not divide head_dim falls back to sglang's own cache
    check_settings("LingBotWorldCausalDMDPipeline", QVGKVQuantArgs(bits=2, block_size=48), 64)
    with pytest.raises(ConfigError, match="centroids must be <= 256"):
        check_settings("LingBotWorldCausalDMDPipeline", bad, head_dim=64)
    monkeypatch.setenv(ENV_LINGBOT_QVG, "sglang")
    check_settings("LingBotWorldCausalDMDPipeline", bad, head_dim=64)  # sglang's codec decides
    monkeypatch.setenv(ENV_LINGBOT_QVG, "quant-videogen")
    with pytest.raises(ConfigError, match=r"CAUSALKV_SGLANG_LINGBOT_QVG='quant-videogen': choose"):
        check_settings("LingBotWorldCausalDMDPipeline", QVGKVQuantArgs(bits=2), head_dim=64)


# ---- the checkpoints are in sglang's own format ---------------------------------------------
def test_longlive2_checkpoint_keys_are_the_ones_sglangs_dit_maps(longlive2_checkpoint):
    """Every stored key matches one of sglang's ``LongLive2Transformer3DModel``
    ``param_names_mapping`` patterns (diffusers names are refused by its loader), and the
    mapping covers every parameter of sglang's DiT built from the folder's config."""
    from sglang.multimodal_gen.configs.models.dits.longlive2 import LongLive2VideoConfig

    mapping = LongLive2VideoConfig().arch_config.param_names_mapping
    path = longlive2_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
    mapped = set()
    for key in keys:
        hits = [re.sub(p, r, key) for p, r in mapping.items() if re.match(p, key)]
        assert len(hits) == 1, key
        mapped.add(hits[0])
    assert len(mapped) == len(keys)
    config = json.loads((longlive2_checkpoint / "transformer" / "config.json").read_text())
    index = json.loads((longlive2_checkpoint / "model_index.json").read_text())
    assert config["_class_name"] == "LongLive2Transformer3DModel"
    assert index["_class_name"] == "LongLive2Pipeline"
    assert set(index) >= {"transformer", "vae", "text_encoder", "tokenizer", "scheduler"}


def test_the_folders_resolve_to_sglangs_native_pipelines(longlive2_checkpoint,
                                                         wan_causal_checkpoint):
    from sglang.multimodal_gen.registry import get_model_info

    ll2 = get_model_info(str(longlive2_checkpoint), model_id="LongLive-2.0-5B")
    assert ll2.pipeline_cls.__name__ == "LongLive2Pipeline"
    assert ll2.pipeline_config_cls.__name__ == "LongLive2T2VConfig"
    wan = get_model_info(str(wan_causal_checkpoint), model_id="Wan2.1-T2V-1.3B-Diffusers")
    assert wan.pipeline_cls.__name__ == "WanCausalDMDPipeline"
    # sglang 0.5.23: the only config it resolves has no warp_denoising_step, which its causal
    # stage reads (so `sglang generate` cannot run this pipeline; see test_e2e_api)
    assert not hasattr(wan.pipeline_config_cls(), "warp_denoising_step")


def test_the_cli_prints_the_command_last(tmp_path, capsys):
    """The last line is the command that runs the folder; a second build keeps the complete
    folder; a folder of the user's is refused (exit 2, one line) and left as it was."""
    from causalkv.cli import main

    assert main(["sglang-checkpoint", "longlive2", str(tmp_path / "ll2")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"sglang generate --model-path {tmp_path / 'll2'} --model-id "
                           "LongLive-2.0-5B ")
    assert main(["sglang-checkpoint", "longlive2", str(tmp_path / "ll2")]) == 0  # cached
    assert capsys.readouterr().out.startswith("found complete tiny longlive2 checkpoint")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["sglang-checkpoint", "longlive2", str(tmp_path / "mine")]) == 2
    assert "is not a causalkv sglang checkpoint" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---- the test environment's CPU ops against sglang's own forward_native ----------------------
@pytest.mark.parametrize(("norm_type", "affine"), [("layer", False), ("layer", True), ("rms", True)])
def test_cpu_norm_ops_match_sglangs_forward_native(monkeypatch, norm_type, affine):
    """sglang's ``forward_native`` calls its CUDA/Triton scale-shift kernel; on a CPU it runs
    with sglang's own PyTorch fallback of that kernel (``fuse_scale_shift_kernel_native``)."""
    from sglang.kernels.ops.diffusion.common.fallback_torch import fuse_scale_shift_kernel_native
    from sglang.multimodal_gen.runtime.layers import layernorm as ln

    monkeypatch.setattr(ln, "fuse_scale_shift_kernel", fuse_scale_shift_kernel_native)
    g = torch.Generator().manual_seed(0)
    b, frames, per_frame, c = 1, 2, 8, 64
    x = torch.randn(b, frames * per_frame, c, generator=g).to(torch.bfloat16)
    res = torch.randn(b, frames * per_frame, c, generator=g).to(torch.bfloat16)
    scale, shift, gate = (torch.randn(b, frames, 1, c, generator=g) for _ in range(3))
    single = ln.LayerNormScaleShift if norm_type == "layer" else ln.RMSNormScaleShift
    fused = (ln.ScaleResidualLayerNormScaleShift if norm_type == "layer"
             else ln.ScaleResidualRMSNormScaleShift)
    kw = {"elementwise_affine": affine} if norm_type == "layer" else {}
    one, two = single(c, eps=1e-6, **kw), fused(c, eps=1e-6, **kw)
    for mod in (one, two):
        for p in mod.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        want = one.forward_native(x, shift, scale)
        got = one.forward_cpu(x, shift, scale)
        assert got.dtype == want.dtype and torch.equal(got, want)
        for g_ in (gate, 1):
            want_m, want_r = two.forward_native(res, x, g_, shift, scale)
            got_m, got_r = two.forward_cpu(res, x, g_, shift, scale)
            assert torch.equal(got_r, want_r)
            torch.testing.assert_close(got_m.float(), want_m.float(), rtol=0, atol=0)


# ---- (f) LingBot-World: the two codecs on the same K/V ----------------------------------------
_QVG = importlib.util.find_spec("quant_videogen") is not None


@pytest.mark.skipif(not (_QVG and torch.cuda.is_available()),
                    reason="sglang's own QVG cache packs with quant-videogen's kernels, which "
                    "need the quant_videogen package and CUDA; neither is on this machine")
def test_lingbot_codecs_error_on_the_same_kv():
    """The bridge's codec (default for LingBot-World) against sglang's own
    ``QVGPackedCausalKVCache`` (``CAUSALKV_SGLANG_LINGBOT_QVG=sglang``): same settings, same
    stream, relative error of each view against the K/V written."""
    from sglang.multimodal_gen.runtime.layers.kvcache.qvg_packed_cache import (
        QVGPackedCausalKVCache,
    )

    from causalkv.sglang.cache import SGLangQVGKVCache

    dev, chunk, heads, dim = torch.device("cuda"), 1560, 4, 128
    quant = QVGKVQuantArgs(bits=2, keep_recent_chunks=0)
    kw = dict(batch_size=1, cache_size=4 * chunk, num_heads=heads, head_dim=dim,
              dtype=torch.bfloat16, device=dev, sink_tokens=chunk, quant_args=quant)
    caches = {
        "causalkv": SGLangQVGKVCache(global_end_index=torch.zeros(1, dtype=torch.long, device=dev),
                                     local_end_index=torch.zeros(1, dtype=torch.long, device=dev),
                                     **kw),
        "sglang": QVGPackedCausalKVCache(
            global_end_index=torch.zeros(1, dtype=torch.long, device=dev),
            local_end_index=torch.zeros(1, dtype=torch.long, device=dev), **kw),
    }
    g = torch.Generator(device=dev).manual_seed(0)
    written = [torch.randn(2, 1, chunk, heads, dim, generator=g, device=dev).to(torch.bfloat16)
               for _ in range(4)]
    errors = {}
    for name, cache in caches.items():
        for i, kv in enumerate(written):
            view = cache.update_and_get_attention_kv(key=kv[0], value=kv[1],
                                                     current_chunk_start=i * chunk)
        ref = torch.cat([kv[0] for kv in written], dim=1).float()
        errors[name] = float((view.k.float() - ref).norm() / ref.norm())
    print("LingBot-World codecs, int2 relative K error:", errors)
    assert all(0 < e < 1 for e in errors.values())
