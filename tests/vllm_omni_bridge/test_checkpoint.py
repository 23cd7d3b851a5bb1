"""``causalkv vllm-omni-checkpoint``'s folder read back by vLLM-Omni's own loading code: its
config discovery, ``DiffusersPipelineLoader`` into the DiT's ``load_weights`` (a forward equal
to the in-memory weights'), and ``LingBotWorldCausalDMDPipeline.__init__``, which loads the
tokenizer, text encoder and VAE and then refuses the tiny DiT with its own error."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import tiny_lingbot as tl
import torch
from torch import nn

from causalkv.runtime.tools.checkpoints import CHECKPOINTS, is_complete_checkpoint

#: the checkpoint's ``transformer/config.json`` (without ``_class_name``)
TRANSFORMER = CHECKPOINTS["lingbot-world"].dit_config

#: vLLM-Omni's error for the tiny geometry (``from_config``'s first contract key that differs)
REFUSAL = "LingBot checkpoint config num_attention_heads must be 40, got 2."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The folder as the command line builds it (``causalkv vllm-omni-checkpoint DIR``)."""
    from causalkv.cli.commands import main

    out = tmp_path_factory.mktemp("vo-ckpt") / "lingbot"
    assert main(["vllm-omni-checkpoint", str(out)]) == 0
    assert is_complete_checkpoint(out, "lingbot-world")
    return out


def _dit_kwargs(config: dict) -> dict:
    """``config.json``'s keys the DiT's constructor takes (what ``from_config`` passes on)."""
    from vllm_omni.diffusion.models.lingbot_world.transformer import (
        CausalLingBotWorldTransformer3DModel,
    )

    names = inspect.signature(CausalLingBotWorldTransformer3DModel.__init__).parameters
    kwargs = {k: v for k, v in config.items() if k in names}
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    return kwargs


def test_vllm_omni_reads_the_folders_pipeline_and_configs(folder, capsys):
    """``OmniDiffusionConfig.enrich_config`` names the pipeline from ``model_index.json``;
    ``load_transformer_config`` and the scheduler check read their files as the pipeline does;
    a second build keeps the complete folder."""
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.models.lingbot_world import pipeline as lp

    config = OmniDiffusionConfig(model=str(folder))
    config.enrich_config()
    assert config.model_class_name == "LingBotWorldCausalDMDPipeline"
    tf = lp.load_transformer_config(str(folder), "transformer", True)
    assert tf["_class_name"] == "CausalLingBotWorldTransformer3DModel"
    assert {k: v for k, v in tf.items() if not k.startswith("_")} == TRANSFORMER
    lp._validate_scheduler_config(lp._load_json(str(folder), "scheduler/scheduler_config.json", True))
    # the demo's and the tests' tiny DiT is this geometry
    assert {k: (tuple(v) if k == "patch_size" else v) for k, v in TRANSFORMER.items()
            if k in tl.TINY} == tl.TINY

    from causalkv.cli.commands import main

    capsys.readouterr()
    assert main(["vllm-omni-checkpoint", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("found complete tiny lingbot-world checkpoint")


def test_the_dit_loads_the_written_weights_through_vllm_omnis_loader(folder, runtime):
    """vLLM-Omni's ``DiffusersPipelineLoader.load_weights`` (strict: every parameter must be
    loaded) reads ``transformer/`` as the pipeline's ``weights_sources`` names it (prefix
    ``transformer.``) into the pipeline's own ``load_weights`` (``AutoWeightsLoader`` -> the
    DiT's, which fuses q/k/v), on ``CausalLingBotWorldTransformer3DModel`` built at the
    checkpoint's tiny geometry. Its outputs over LingBot's DMD schedule (probes and commits,
    past the window) equal those of the same class given the file's tensors (read by safetensors itself),
    parameter by parameter (q/k/v concatenated), bit for bit."""
    from safetensors.torch import load_file
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.lingbot_world import pipeline as lp
    from vllm_omni.diffusion.models.lingbot_world.transformer import (
        CausalLingBotWorldTransformer3DModel,
    )

    kwargs = _dit_kwargs(lp.load_transformer_config(str(folder), "transformer", True))

    class Holder(nn.Module):  # the pipeline's weight-loading surface, without its components
        load_weights = lp.LingBotWorldCausalDMDPipeline.load_weights

        def __init__(self) -> None:
            super().__init__()
            self.transformer = CausalLingBotWorldTransformer3DModel(**kwargs)
            self.weights_sources = [DiffusersPipelineLoader.ComponentSource(
                model_or_path=str(folder), subfolder="transformer", revision=None,
                prefix="transformer.", fall_back_to_pt=True)]

    holder = Holder()
    loader = DiffusersPipelineLoader(LoadConfig(), SimpleNamespace(
        quantization_config=None, parallel_config=None))
    loader.load_weights(holder)
    disk = holder.transformer

    memory = CausalLingBotWorldTransformer3DModel(**kwargs)
    weights = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    used = set()
    with torch.no_grad():
        for name, param in memory.named_parameters():
            if ".self_attn.qkv." in name:
                parts = [name.replace(".qkv.", f".{p}.") for p in "qkv"]
                param.copy_(torch.cat([weights[p] for p in parts]))
                used.update(parts)
            else:
                param.copy_(weights[name])
                used.add(name)
    assert used == set(weights)

    outs = []
    for model in (disk, memory):
        for module in model.modules():  # what vLLM's loader runs after loading
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        model.eval()
        h, w = tl.LATENT_HW
        cache = model.allocate_cache(batch_size=1, latent_height=h, latent_width=w,
                                     device=torch.device("cpu"), dtype=torch.float32)
        outs.append(tl.run_blocks(model, cache, 4))
    assert len(outs[0]) == 4 * (tl.PROBES + 1)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][0].abs().max() > 0


@pytest.mark.parametrize("bridge", [None, "int2"])
def test_the_pipeline_loads_the_other_components_then_refuses_the_tiny_dit(folder, runtime, bridge):
    """``LingBotWorldCausalDMDPipeline(od_config)`` on the folder (the stock class, and
    causalkv's registered subclass with ``causalkv_kv_cache: int2``) loads the tokenizer, the
    UMT5 text encoder and the Wan VAE from it, then raises vLLM-Omni's own ValueError for the
    DiT's geometry in ``CausalLingBotWorldTransformer3DModel.from_config``: the full pipeline
    cannot load a tiny checkpoint. The components it had loaded work: a prompt encodes to
    ``[1, 512, text_dim]`` and a 64x64 frame to 16 latent channels at 8x8."""
    from vllm_omni.diffusion.models.lingbot_world import pipeline as lp
    from vllm_omni.diffusion.models.lingbot_world import transformer as lt

    from causalkv.vllm_omni.pipeline import CausalKVLingBotWorldPipeline

    cls = lp.LingBotWorldCausalDMDPipeline if bridge is None else CausalKVLingBotWorldPipeline
    model_config = {} if bridge is None else {"causalkv_kv_cache": {"kv_cache_quant": bridge}}
    od = SimpleNamespace(model=str(folder), model_config=model_config, dtype=torch.float32,
                         parallel_config=None, quantization_config=None,
                         engine_backend="default", step_execution=False)
    with pytest.raises(ValueError) as info:
        cls(od_config=od)
    assert str(info.value) == REFUSAL
    assert info.traceback[-1].frame.code.raw is lt.CausalLingBotWorldTransformer3DModel.from_config.__func__.__code__
    init = next(e for e in info.traceback
                if e.frame.code.raw is lp.LingBotWorldCausalDMDPipeline.__init__.__code__)
    pipe = init.frame.f_locals["self"]
    assert type(pipe.text_encoder).__name__ == "UMT5EncoderModel"
    assert type(pipe.vae).__name__ == "DistributedAutoencoderKLWan"
    assert not hasattr(pipe, "transformer")
    with torch.no_grad():
        ids = pipe.tokenizer("a fox in the snow", padding="max_length", max_length=512,
                             truncation=True, return_tensors="pt", return_attention_mask=True)
        text = pipe.text_encoder(ids.input_ids, ids.attention_mask).last_hidden_state
        assert text.shape == (1, 512, TRANSFORMER["text_dim"])
        frame = torch.rand(1, 3, 1, 64, 64) * 2 - 1
        latent = pipe.vae.encode(frame).latent_dist.mode()
        assert latent.shape == (1, TRANSFORMER["out_channels"], 1, 8, 8)
        assert torch.isfinite(text).all() and torch.isfinite(latent).all()


def test_the_command_refuses_a_folder_that_holds_something_else(tmp_path, capsys):
    """A non-empty folder without a complete checkpoint, or a file, is refused in one line
    (exit 2) and left as it was."""
    from causalkv.cli.commands import main

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for where, want in (
        (busy, f"vllm-omni-checkpoint DIR '{busy}' exists, holds 1 entry and is not a "
               "causalkv vLLM-Omni checkpoint; choose a new or empty folder (it is never overwritten)"),
        (a_file, f"vllm-omni-checkpoint DIR '{a_file}' is a file, not a folder; choose a new or "
                 "empty folder"),
    ):
        capsys.readouterr()
        assert main(["vllm-omni-checkpoint", str(where)]) == 2
        assert capsys.readouterr().err == f"causalkv vllm-omni-checkpoint: error: {want}\n"
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and a_file.read_text() == "x"
