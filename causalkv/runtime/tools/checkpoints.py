"""Tiny checkpoints in a host's own format: seeded random weights the host loads natively.

`build_checkpoint(name, folder)` writes a folder that a host's own loader resolves to its
native pipeline and DiT: ``model_index.json``'s ``_class_name`` names the host's pipeline
class, ``transformer/config.json``'s its DiT class, the transformer's safetensors keys are
the names that DiT loads, and every component the pipeline reads is there (text encoder,
tokenizer, VAE, transformer, scheduler). The checkpoints (`CHECKPOINTS`):

- sglang 0.5.23's diffusion runtime: ``longlive2``, ``wan-causal``, ``lingbot``
  (``causalkv sglang-checkpoint NAME DIR``; `generate_command` is the ``sglang generate``
  line that runs one);
- vLLM-Omni 0.30.0: ``lingbot-world`` (``causalkv vllm-omni-checkpoint DIR``), the folder
  ``LingBotWorldCausalDMDPipeline`` and vLLM-Omni's config discovery read (the UniPC
  scheduler config ``_validate_scheduler_config`` requires, self-attention ``q``/``k``/``v``
  separate, which ``CausalLingBotWorldTransformer3DModel.load_weights`` fuses). Its pipeline
  refuses the tiny geometry (``from_config`` takes LingBot-World v2's 40 x 40 x 128 only) after
  loading the tokenizer, text encoder and VAE; the DiT's own class loads ``transformer/``
  (``tests/vllm_omni_bridge/test_checkpoint.py``; docs/vllm_omni.md).

Nothing is downloaded and no host is imported: the weights come from the same seeded tiny
diffusers/transformers components as causalkv's presets (`causalkv.runtime.model_io.presets`),
the transformer's keys renamed to the checkpoint's layout. Builds are atomic and cached like
the presets (`causalkv.runtime.model_io.presets.build_atomically`): a complete folder is
returned as it is.

The weights are RANDOM: the videos are noise-like. The folders exercise a host's loading,
pipeline and KV-cache paths (and causalkv's bridge inside them), not image quality.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from causalkv.errors import ConfigError
from causalkv.runtime.files.file_checks import check_creatable_folder, fs_error_reason
from causalkv.runtime.files.outputs import OutputWriteError
from causalkv.runtime.model_io import preset_configs, presets

if TYPE_CHECKING:  # torch, PIL and safetensors load to build a checkpoint, not for --help
    import torch

__all__ = [
    "CHECKPOINTS",
    "HOSTS",
    "Checkpoint",
    "build_checkpoint",
    "describe_folder",
    "generate_command",
    "is_complete_checkpoint",
]

#: bump when a checkpoint definition changes: old folders are rebuilt
CHECKPOINT_FORMAT = 3
_MARKER = ".causalkv-checkpoint.json"

#: each host's name in the messages
HOSTS = {"sglang": "sglang", "vllm-omni": "vLLM-Omni"}

#: diffusers' Wan transformer names -> LongLive's original names (what sglang's
#: ``LongLive2ArchConfig.param_names_mapping`` maps from)
_LONGLIVE_KEYS: tuple[tuple[str, str], ...] = (
    (r"^patch_embedding\.", "model.patch_embedding."),
    (r"^condition_embedder\.(text|time)_embedder\.linear_1\.", r"model.\1_embedding.0."),
    (r"^condition_embedder\.(text|time)_embedder\.linear_2\.", r"model.\1_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "model.time_projection.1."),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"model.blocks.\1.modulation"),
    (r"^blocks\.(\d+)\.attn1\.(?:to_)?([qkv]|norm_[qk])\.", r"model.blocks.\1.self_attn.\2."),
    (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"model.blocks.\1.self_attn.o."),
    (r"^blocks\.(\d+)\.attn2\.(?:to_)?([qkv]|norm_[qk])\.", r"model.blocks.\1.cross_attn.\2."),
    (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"model.blocks.\1.cross_attn.o."),
    (r"^blocks\.(\d+)\.norm2\.", r"model.blocks.\1.norm3."),
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"model.blocks.\1.ffn.0."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"model.blocks.\1.ffn.2."),
    (r"^scale_shift_table$", "model.head.modulation"),
    (r"^proj_out\.", "model.head.head."),
)

#: LingBot-World's checkpoint keys are Wan's original names without LongLive's ``model.``
_WAN_ORIGINAL_KEYS = tuple((pat, rep.replace("model.", "", 1)) for pat, rep in _LONGLIVE_KEYS)

#: a tiny Wan 2.2 VAE (residual, 2x2 patchified, 16x spatial like Wan 2.2 TI2V's, which
#: sglang's LongLive 2.0 config assumes)
_VAE_22: dict[str, Any] = {
    **preset_configs.TINY_VAE, "base_dim": 16, "decoder_base_dim": 16, "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
}

_PROMPT = "A red fox trots through fresh snow in a pine forest at dawn"

#: vLLM-Omni's LingBot-World scheduler, diffusers' UniPC over flow sigmas with the flow shift it
#: reads (``flow_shift``); ``save_pretrained`` writes every key its ``_validate_scheduler_config``
#: checks (those not given here at diffusers' defaults, which are the values it requires)
_UNIPC_SCHEDULER = ("UniPCMultistepScheduler",
                    {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 5.0})


@dataclass(frozen=True)
class Checkpoint:
    """One tiny host-native checkpoint: what the host resolves and what it loads.

    Attributes:
        name: the checkpoint's name (``causalkv sglang-checkpoint``'s choice).
        host: the host whose format it is (a key of `HOSTS`).
        pipeline_class: the host's pipeline class (``model_index.json`` ``_class_name``).
        dit_class: the host's DiT class (``transformer/config.json`` ``_class_name``).
        description: one line for the folder's README.
        model_id: sglang's registered model whose configs it uses (``--model-id``): sglang
            resolves a local folder's pipeline config only by a registered name or detector.
        transformer: overrides of the presets' tiny ``WanTransformer3DModel`` config.
        vae: the tiny ``AutoencoderKLWan`` config (``None``: the presets' Wan 2.1-like one).
        native: host-only fields of ``transformer/config.json`` (causal geometry).
        keys: ``(regex, replacement)`` renames of diffusers' transformer keys into the
            checkpoint's layout; every key must match one.
        request: the tiny request the printed command runs (``sglang generate`` flags;
            ``{dir}`` is the folder, which holds the request's input files, if any).
        camera: add LingBot-World's camera-control weights (plucker patch embedding, the
            camera MLP and each block's camera injector, scale and shift layers).
        null_components: components the pipeline lists that the checkpoint ships as ``null``
            (diffusers' JSON for an absent optional component).
        scheduler: the diffusers scheduler class and its arguments, saved as ``scheduler/``
            (default: ``FlowMatchEulerDiscreteScheduler(shift=5.0)``).
        text_max_length: the tokenizer's sequence length (the pipeline pads prompts to it).
        known_failure: what the host cannot do with the folder, or "" when it runs it.
        seed: weight seed.
    """

    name: str
    host: str
    pipeline_class: str
    dit_class: str
    description: str
    model_id: str = ""
    transformer: Mapping[str, Any] = field(default_factory=dict)
    vae: Mapping[str, Any] | None = None
    native: Mapping[str, Any] = field(default_factory=dict)
    #: default: diffusers' Wan names, what sglang's ``WanVideoArchConfig.param_names_mapping`` maps from
    keys: tuple[tuple[str, str], ...] = ((r"^(.*)$", r"\1"),)
    request: tuple[str, ...] = ()
    camera: bool = False
    null_components: tuple[str, ...] = ()
    scheduler: tuple[str, Mapping[str, Any]] = ("FlowMatchEulerDiscreteScheduler", {"shift": 5.0})
    text_max_length: int = preset_configs.TINY_COMMON["text_max_length"]
    known_failure: str = ""
    seed: int = 0

    @property
    def dit_config(self) -> dict[str, Any]:
        """``transformer/config.json`` without ``_class_name`` and ``_diffusers_version``."""
        return {**preset_configs.TINY_TRANSFORMER, **self.transformer, **self.native}


def _causal(*, block: int, sink: int, window: int, local_attn: int = -1, **more: Any) -> dict[str, Any]:
    """The host's causal geometry fields of ``transformer/config.json``, in latent frames:
    ``block`` frames per chunk, a ``sink``, a ``window`` (``sliding_window_num_frames``) and
    ``local_attn`` (``local_attn_size``; -1: attention over the whole window), plus ``more``."""
    return {"num_frames_per_block": block, "sink_size": sink, "local_attn_size": local_attn,
            "sliding_window_num_frames": window, **more}


_TINY_REQUEST = ("--height", "256", "--width", "256", "--num-frames", "29", "--seed", "0")

#: the checkpoints by name
CHECKPOINTS: Mapping[str, Checkpoint] = {
    c.name: c
    for c in (
        Checkpoint(
            name="longlive2",
            host="sglang",
            pipeline_class="LongLive2Pipeline",
            dit_class="LongLive2Transformer3DModel",
            model_id="LongLive-2.0-5B",
            description="LongLive 2.0 (sglang's LongLive2Pipeline): 2 blocks x 2 heads x 64, "
            "1x1 patches and a 16x Wan 2.2 VAE (256 tokens per latent frame at 256x256), "
            "2-frame chunks, 2-frame sink, 8-frame window",
            transformer={"patch_size": [1, 1, 1]},
            vae=_VAE_22,
            native=_causal(block=2, sink=2, window=8, local_attn=8, independent_first_frame=False),
            keys=_LONGLIVE_KEYS,
            request=(*_TINY_REQUEST, "--prompt", _PROMPT, "--kv-cache-quant", "int2"),
            seed=1,
        ),
        Checkpoint(
            name="wan-causal",
            host="sglang",
            pipeline_class="WanCausalDMDPipeline",
            dit_class="CausalWanTransformer3DModel",
            model_id="Wan2.1-T2V-1.3B-Diffusers",
            description="Wan causal DMD / Self-Forcing (sglang's WanCausalDMDPipeline): 2 blocks "
            "x 2 heads x 64, 2-frame chunks, global attention over an 8-frame cache",
            native=_causal(block=2, sink=0, window=8),
            request=(*_TINY_REQUEST, "--prompt", _PROMPT, "--kv-cache-quant", "int2"),
            known_failure=(
                "sglang 0.5.23 cannot run WanCausalDMDPipeline: (1) no registered model or "
                "detector resolves it to SelfForcingWanT2V480PConfig (configs/pipeline_configs/"
                "wan.py defines it, no register_configs() call registers it), and every "
                "registered Wan config lacks warp_denoising_step, which causal_denoising.py:215 "
                "reads (AttributeError: 'WanT2V480PConfig' object has no attribute "
                "'warp_denoising_step'); (2) with the config passed in Python "
                "(DiffGenerator.from_pretrained(..., pipeline_config=SelfForcingWanT2V480PConfig())) "
                "CausalWanTransformerBlock.forward (models/dits/causal_wanvideo.py:457) calls "
                "WanT2VCrossAttention with crossattn_cache= (TypeError: "
                "WanT2VCrossAttention.forward() got an unexpected keyword argument "
                "'crossattn_cache')"
            ),
            seed=2,
        ),
        Checkpoint(
            name="lingbot",
            host="sglang",
            pipeline_class="LingBotWorldCausalDMDPipeline",
            dit_class="CausalLingBotWorldTransformer3DModel",
            model_id="lingbot-world-fast-diffusers",
            description="LingBot-World fast (sglang's LingBotWorldCausalDMDPipeline): image to "
            "video with camera actions, 2 blocks x 2 heads x 64, 1x1 patches (256 tokens per "
            "latent frame at 128x128), 3-frame chunks (sglang's LingBot default, which its "
            "realtime server takes as the chunk size), a 3-frame sink and a 12-frame cache (the "
            "sink and three chunks: in a 5-chunk realtime stream cold chunks pack and the window "
            "rolls); the noise (4 channels) is concatenated with the image condition (4 mask + "
            "4 latent channels)",
            transformer={"in_channels": 12, "out_channels": 4, "patch_size": [1, 1, 1]},
            native=_causal(block=3, sink=3, window=12),
            keys=_WAN_ORIGINAL_KEYS,
            camera=True,
            null_components=("image_encoder", "image_processor"),
            request=("--height", "128", "--width", "128", "--num-frames", "9", "--seed", "0",
                     "--prompt", _PROMPT, "--image-path", "{dir}/first_frame.png",
                     "--config", "{dir}/camera_actions.json", "--kv-cache-quant", "int2"),
            seed=3,
        ),
        Checkpoint(
            name="lingbot-world",
            host="vllm-omni",
            pipeline_class="LingBotWorldCausalDMDPipeline",
            dit_class="CausalLingBotWorldTransformer3DModel",
            description="LingBot-World (vLLM-Omni 0.30.0's LingBotWorldCausalDMDPipeline): the keys "
            "of CausalLingBotWorldTransformer3DModel.from_config's contract at 2 layers x 2 heads "
            "x 64 (4x4 tokens per latent frame at 64x64 pixels), 3-frame blocks, sink 3 / window 9 "
            "frames; 16 noisy latent + 4 mask + 16 first-frame latent channels in, and a tiny Wan "
            "VAE with 16 latent channels",
            transformer={"in_channels": 36, "out_channels": 16, "rope_max_seq_len": 256,
                         "image_dim": None, "added_kv_proj_dim": None, "pos_embed_seq_len": None},
            vae={**preset_configs.TINY_VAE, "z_dim": 16, "latents_mean": [0.0] * 16,
                 "latents_std": [1.0] * 16},
            native=_causal(block=3, sink=3, window=9),
            keys=_WAN_ORIGINAL_KEYS,
            camera=True,
            scheduler=_UNIPC_SCHEDULER,
            text_max_length=512,
            known_failure=(
                "vLLM-Omni's LingBotWorldCausalDMDPipeline loads this folder's tokenizer, text "
                "encoder and VAE, then refuses the tiny DiT (CausalLingBotWorldTransformer3DModel."
                "from_config takes LingBot-World v2's 40 layers x 40 heads x 128 only); the DiT class "
                "built at this geometry loads transformer/ through vLLM-Omni's DiffusersPipelineLoader "
                "(docs/vllm_omni.md)"
            ),
        ),
    )
}


def _spec(name: str, host: str) -> Checkpoint:
    spec = CHECKPOINTS.get(name)
    if spec is None or spec.host != host:
        names = [n for n, c in CHECKPOINTS.items() if c.host == host]
        raise ConfigError(f"unknown {HOSTS[host]} checkpoint {name!r}; choose one of: {', '.join(names)}")
    return spec


def is_complete_checkpoint(folder: str | Path, name: str | None = None) -> bool:
    """True when ``folder`` holds a complete checkpoint of this format (of ``name`` if given)."""
    meta = presets.json_object(Path(folder) / _MARKER)
    return (meta.get("format") == CHECKPOINT_FORMAT and meta.get("name") in CHECKPOINTS
            and (name is None or meta.get("name") == name))


def describe_folder(folder: Path) -> str:
    """What an existing, listable folder without a checkpoint holds, for a refusal: a causalkv
    preset, a diffusers model folder, or how many entries."""
    if preset := presets.json_object(folder / presets._MARKER):
        return f"the causalkv preset {preset.get('name', '?')!r}"
    if index := presets.json_object(folder / "model_index.json"):
        return f"a model folder ({index.get('_class_name', 'model_index.json')})"
    n = sum(1 for _ in folder.iterdir())
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def build_checkpoint(name: str, folder: str | Path, *, host: str = "sglang", force: bool = False) -> Path:
    """Build ``host``'s checkpoint ``name`` into ``folder`` (atomically; a complete one is kept).

    ``force``: replace a complete checkpoint of another name (or format), atomically.

    Raises:
        ConfigError: for an unknown ``name``; a ``folder`` that holds a complete checkpoint
            of another name (without ``force``); one that exists, is not empty and holds no
            causalkv checkpoint (never overwritten, ``force`` or not); a place where no
            folder can be created (a file, a read-only or unwritable file system), each
            naming the path, what it holds and the fix.
        OutputWriteError: the build failed to write (a full disk): the folder is as it was.
    """
    spec = _spec(name, host)
    folder = Path(folder).expanduser().absolute()
    where = f"{host}-checkpoint DIR {str(folder)!r}"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{where} is a file, not a folder; choose a new or empty folder")
    if folder.exists() and not (folder / _MARKER).exists():
        if any(folder.iterdir()):
            raise ConfigError(
                f"{where} exists, holds {describe_folder(folder)} and is not a causalkv "
                f"{HOSTS[host]} checkpoint; choose a new or empty folder (it is never overwritten)"
            )
        folder.rmdir()
    elif is_complete_checkpoint(folder) and not is_complete_checkpoint(folder, name) and not force:
        held = CHECKPOINTS[presets.json_object(folder / _MARKER)["name"]]
        raise ConfigError(
            f"{where} holds a complete tiny {held.name} {HOSTS[held.host]} checkpoint, not {name}; "
            "choose another folder, or pass --force to replace it (atomically)"
        )
    check_creatable_folder(folder, where, "choose a folder where files can be created")
    try:
        return presets.build_atomically(
            folder, lambda out: _write(spec, out), lambda f: is_complete_checkpoint(f, name)
        )
    except OSError as exc:
        raise OutputWriteError(
            f"could not write the {name} checkpoint into {str(folder)!r} ({fs_error_reason(exc, folder.parent)}); "
            "nothing was changed there; free some space or choose another folder"
        ) from None


def generate_command(name: str, folder: str | Path, *extra: str) -> str:
    """The ``sglang generate`` line that runs sglang's checkpoint ``name`` in ``folder``."""
    spec = _spec(name, "sglang")
    request = [a.replace("{dir}", str(folder)) for a in spec.request]
    return shlex.join(["sglang", "generate", "--model-path", str(folder), "--model-id", spec.model_id,
                       "--num-gpus", "1", *request, *extra])


def _rename(key: str, keys: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in keys:
        new, hits = re.subn(pattern, replacement, key)
        if hits:
            return new
    raise ConfigError(f"transformer key {key!r} has no name in the checkpoint's layout")


def _camera_weights(config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """LingBot-World's camera-control weights, in its checkpoint's names and shapes.

    The plucker embedding (6 x 64 channels per latent pixel) is patchified like the video
    (``patch_size``) and projected to the model width; ``c2ws_hidden_states_layer1/2`` is the
    camera MLP; per block ``cam_injector_layer1/2``, ``cam_scale_layer``, ``cam_shift_layer``.
    """
    import torch

    dim = config["num_attention_heads"] * config["attention_head_dim"]
    pt, ph, pw = config["patch_size"]
    shapes = {"patch_embedding_wancamctrl": 6 * 64 * pt * ph * pw,
              "c2ws_hidden_states_layer1": dim, "c2ws_hidden_states_layer2": dim,
              **{f"blocks.{i}.{name}": dim for i in range(config["num_layers"])
                 for name in ("cam_injector_layer1", "cam_injector_layer2", "cam_scale_layer", "cam_shift_layer")}}
    g = torch.Generator().manual_seed(seed + 1000)
    weights = {}
    for name, fan_in in shapes.items():
        bound = fan_in**-0.5  # nn.Linear's default init range
        weights[f"{name}.weight"] = (torch.rand(dim, fan_in, generator=g) * 2 - 1) * bound
        weights[f"{name}.bias"] = (torch.rand(dim, generator=g) * 2 - 1) * bound
    return weights


def _write(spec: Checkpoint, out: Path) -> None:
    # torch, diffusers and PIL load to build, not for `causalkv plugins` / `--help`
    import diffusers
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    config = {**preset_configs.TINY_TRANSFORMER, **spec.transformer}
    transformer = presets.write_tiny_model(out, config, spec.vae or preset_configs.TINY_VAE,
                                           seed=spec.seed, text_max_length=spec.text_max_length)
    weights = {_rename(k, spec.keys): v.contiguous() for k, v in transformer.state_dict().items()}
    if spec.camera:
        weights.update(_camera_weights(config, spec.seed))
    presets.write_json(out / "transformer" / "config.json", {  # creates transformer/
        "_class_name": spec.dit_class, "_diffusers_version": diffusers.__version__, **spec.dit_config,
    })
    save_file(weights, str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    scheduler, arguments = spec.scheduler
    getattr(diffusers, scheduler)(**arguments).save_pretrained(out / "scheduler")
    presets.write_json(out / "model_index.json", presets._model_index(
        spec.pipeline_class, spec.dit_class, scheduler=["diffusers", scheduler],
        **{name: [None, None] for name in spec.null_components},
    ))
    if spec.camera and spec.request:  # the request's inputs: a 128x128 first frame, WASD/IJKL camera actions
        g = torch.Generator().manual_seed(spec.seed)
        pixels = (torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(out / "first_frame.png")
        actions = {"actions": [["w"], ["w", "j"], ["w"], ["l"], ["w"]]}
        (out / "camera_actions.json").write_text(json.dumps(actions) + "\n")
    run = (f" Run (DIR: this folder):\n\n    {generate_command(spec.name, 'DIR')}\n"
           if spec.request else "\n")
    failure = f"\nKnown limit: {spec.known_failure}.\n" if spec.known_failure else ""
    (out / "README.md").write_text(
        f"# tiny {spec.name} (causalkv {HOSTS[spec.host]} checkpoint)\n\n{spec.description}.\n\n"
        f"The weights are RANDOM (seed {spec.seed}); the videos are not meaningful.{run}{failure}"
    )
    presets.write_json(out / _MARKER, {"format": CHECKPOINT_FORMAT, "name": spec.name})
