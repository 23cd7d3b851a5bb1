"""A tiny random-weight LingBot-World checkpoint in vLLM-Omni 0.30.0's own folder format.

`write_checkpoint(out)` fills an empty folder with what ``LingBotWorldCausalDMDPipeline``
(``vllm_omni/diffusion/models/lingbot_world/pipeline.py``) and vLLM-Omni's config discovery read:

- ``model_index.json``: ``_class_name`` ``LingBotWorldCausalDMDPipeline`` (how
  ``OmniDiffusionConfig`` names the pipeline of a folder) and the diffusers component list;
- ``transformer/config.json`` (``load_transformer_config``; ``_class_name``
  ``CausalLingBotWorldTransformer3DModel`` and the keys of ``from_config``'s checkpoint
  contract) and ``transformer/diffusion_pytorch_model.safetensors``: the DiT's weights under
  the names ``CausalLingBotWorldTransformer3DModel.load_weights`` takes (self-attention
  ``q``/``k``/``v`` separate, fused into ``qkv`` by the loader; camera-control layers),
  read by ``DiffusersPipelineLoader`` (``weights_sources``: subfolder ``transformer``);
- ``scheduler/scheduler_config.json``: what ``_validate_scheduler_config`` requires
  (``UniPCMultistepScheduler``, flow prediction, flow sigmas, ...) and ``flow_shift``;
- ``tokenizer/`` (``AutoTokenizer``: a byte-level fast tokenizer), ``text_encoder/``
  (``UMT5EncoderModel``, ``d_model`` = the DiT's ``text_dim``), ``vae/``
  (``AutoencoderKLWan`` config and weights, 16 latent channels, loaded as vLLM-Omni's
  ``DistributedAutoencoderKLWan``), each as ``save_pretrained`` writes it.

The geometry is tiny (`TRANSFORMER`: 2 layers x 2 heads x 64, sink 3 / window 9 frames), so
vLLM-Omni's whole pipeline refuses it: ``from_config`` enforces LingBot-World v2's 14B
contract (40 x 40 x 128, ...) after the tokenizer, text encoder and VAE have loaded. The DiT's
own class takes the tiny geometry and its ``load_weights`` reads the files (tested in
``tests/vllm_omni_bridge/test_checkpoint.py``; docs/vllm_omni.md).

Imports no vLLM or vLLM-Omni: torch and safetensors to write the DiT, transformers, tokenizers
and diffusers (lazily) to write the other components. The weights are RANDOM (seeded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a checkpoint is written, not when this module imports
    import torch

__all__ = [
    "CHECKPOINT_FORMAT",
    "DIT_CLASS",
    "MARKER",
    "PIPELINE_CLASS",
    "SCHEDULER",
    "TEXT_ENCODER",
    "TRANSFORMER",
    "VAE",
    "is_complete_checkpoint",
    "transformer_weights",
    "write_checkpoint",
]

#: bump when the folder's contents change: old folders are rebuilt
CHECKPOINT_FORMAT = 1
#: the file that marks a complete folder (written last)
MARKER = ".causalkv-vllm-omni-checkpoint.json"
PIPELINE_CLASS = "LingBotWorldCausalDMDPipeline"
DIT_CLASS = "CausalLingBotWorldTransformer3DModel"

#: ``transformer/config.json`` without ``_class_name``: the keys of vLLM-Omni's
#: ``CausalLingBotWorldTransformer3DModel.from_config`` contract at a tiny geometry (4x4 tokens
#: per latent frame at 64x64 pixels, 3-frame blocks)
TRANSFORMER: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 64,
    "in_channels": 36,  # 16 noisy latent + 4 mask + 16 first-frame latent channels
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 256,
    "num_layers": 2,
    "cross_attn_norm": True,
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 256,
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "sink_size": 3,
    "num_frames_per_block": 3,
    "sliding_window_num_frames": 9,
    "local_attn_size": -1,
}

#: ``vae/config.json``: diffusers' ``AutoencoderKLWan``, tiny, the 16 latent channels
#: LingBot-World's DiT takes, 4x temporal and 8x spatial compression
VAE: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 16,
    "dim_mult": [1, 2, 2, 2],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "latents_mean": [0.0] * 16,
    "latents_std": [1.0] * 16,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}

_SPECIALS = ("<pad>", "</s>", "<unk>")

#: ``text_encoder/config.json``: transformers' ``UMT5EncoderModel``, ``d_model`` = ``text_dim``
TEXT_ENCODER: dict[str, Any] = {
    "vocab_size": len(_SPECIALS) + 256,  # the byte-level tokenizer's
    "d_model": TRANSFORMER["text_dim"],
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 32,
    "feed_forward_proj": "gated-gelu",
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}

#: ``scheduler/scheduler_config.json``: every key ``_validate_scheduler_config`` checks, the
#: UniPC keys the pipeline passes on, and the flow shift it reads (``flow_shift``)
SCHEDULER: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "predict_x0": True,
    "use_flow_sigmas": True,
    "use_dynamic_shifting": False,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
    "solver_order": 2,
    "solver_type": "bh2",
    "lower_order_final": True,
    "disable_corrector": [],
    "thresholding": False,
    "steps_offset": 0,
    "flow_shift": 5.0,
}

#: the tokenizer's sequence length (the pipeline pads prompts to it)
_TEXT_MAX_LENGTH = 512


def _transformer_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor ``CausalLingBotWorldTransformer3DModel.load_weights`` reads, by its name in
    the checkpoint, with its shape, for ``config`` (``transformer/config.json``'s keys)."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    pt, ph, pw = config["patch_size"]
    patch = pt * ph * pw
    ffn = config["ffn_dim"]

    def linear(name: str, out: int, inp: int) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (out, inp), f"{name}.bias": (out,)}

    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (dim, config["in_channels"], pt, ph, pw),
        "patch_embedding.bias": (dim,),
        # the plucker camera embedding: 6 x 64 channels per latent pixel, patchified
        **linear("patch_embedding_wancamctrl", dim, 6 * 64 * patch),
        **linear("c2ws_hidden_states_layer1", dim, dim),
        **linear("c2ws_hidden_states_layer2", dim, dim),
        **linear("text_embedding.0", dim, config["text_dim"]),
        **linear("text_embedding.2", dim, dim),
        **linear("time_embedding.0", dim, config["freq_dim"]),
        **linear("time_embedding.2", dim, dim),
        **linear("time_projection.1", 6 * dim, dim),
    }
    for i in range(config["num_layers"]):
        b = f"blocks.{i}"
        shapes[f"{b}.modulation"] = (1, 6, dim)
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                shapes.update(linear(f"{b}.{attn}.{proj}", dim, dim))
            shapes[f"{b}.{attn}.norm_q.weight"] = (dim,)
            shapes[f"{b}.{attn}.norm_k.weight"] = (dim,)
        shapes[f"{b}.norm3.weight"] = (dim,)
        shapes[f"{b}.norm3.bias"] = (dim,)
        shapes.update(linear(f"{b}.ffn.0", ffn, dim))
        shapes.update(linear(f"{b}.ffn.2", dim, ffn))
        for cam in ("cam_injector_layer1", "cam_injector_layer2", "cam_scale_layer", "cam_shift_layer"):
            shapes.update(linear(f"{b}.{cam}", dim, dim))
    shapes["head.modulation"] = (1, 2, dim)
    shapes.update(linear("head.head", config["out_channels"] * patch, dim))
    return shapes


def transformer_weights(config: dict[str, Any] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """The DiT's seeded random weights in the checkpoint's names (float32): N(0, 0.05), every
    norm weight 1 (the RMS norms of q/k and ``norm3``), ``norm3``'s bias 0."""
    import torch

    config = TRANSFORMER if config is None else config
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in _transformer_shapes(config).items():
        if ".norm" in name:
            out[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.05
    return out


def _byte_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` (3 specials + 256 bytes, ``</s>`` appended)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=_TEXT_MAX_LENGTH)


def _json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_checkpoint(out: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint into ``out`` (an empty or new folder); returns ``out``.

    The marker (`MARKER`) is written last, so a folder without it is incomplete. Folder
    policy (reuse, refusal, atomic rename) is the caller's (``causalkv vllm-omni-checkpoint``).
    """
    # lazy: diffusers and transformers load only to write a checkpoint
    import diffusers
    import torch
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file
    from transformers import UMT5Config, UMT5EncoderModel
    from transformers.utils import logging as hf_logging

    version = diffusers.__version__
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = transformer_weights(TRANSFORMER, seed)
    (out / "transformer").mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()},
              str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    _json(out / "transformer" / "config.json",
          {"_class_name": DIT_CLASS, "_diffusers_version": version, **TRANSFORMER})
    _json(out / "scheduler" / "scheduler_config.json",
          {"_class_name": SCHEDULER["_class_name"], "_diffusers_version": version, **SCHEDULER})

    hf_logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(**VAE)
        text_encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER))
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    _byte_tokenizer().save_pretrained(out / "tokenizer")
    _json(out / "model_index.json", {
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": version,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", DIT_CLASS],
        "vae": ["diffusers", "AutoencoderKLWan"],
    })
    (out / "README.md").write_text(
        "# tiny LingBot-World (causalkv vllm-omni checkpoint)\n\n"
        f"vLLM-Omni 0.30.0's LingBot-World folder layout with RANDOM weights (seed {seed}): "
        f"{TRANSFORMER['num_layers']} layers x {TRANSFORMER['num_attention_heads']} heads x "
        f"{TRANSFORMER['attention_head_dim']}, sink {TRANSFORMER['sink_size']} / window "
        f"{TRANSFORMER['sliding_window_num_frames']} frames, 3-frame blocks.\n\n"
        "vLLM-Omni's `LingBotWorldCausalDMDPipeline` loads the tokenizer, text encoder and VAE, "
        "then refuses this geometry (`CausalLingBotWorldTransformer3DModel.from_config` takes "
        "LingBot-World v2's 40 x 40 x 128 only). `CausalLingBotWorldTransformer3DModel` built "
        "at this geometry loads `transformer/` through vLLM-Omni's `DiffusersPipelineLoader`.\n"
    )
    _json(out / MARKER, {"format": CHECKPOINT_FORMAT, "name": "lingbot-world",
                         "pipeline": PIPELINE_CLASS, "seed": seed})
    return out


def is_complete_checkpoint(folder: str | Path) -> bool:
    """True when ``folder`` holds a complete checkpoint of this format."""
    try:
        meta = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == CHECKPOINT_FORMAT
