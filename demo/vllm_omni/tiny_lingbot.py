"""A tiny random-weight LingBot-World through vLLM-Omni 0.30.0's own classes, on a CPU.

Used by the tests (``tests/vllm_omni_bridge``: the DiT, its store and Ulysses without the
engine; ``make run-vllm-omni`` runs the whole of vLLM-Omni instead, ``run_offline.py``); needs
the CPU stand-ins of ``cpu_stand_ins/`` (on ``PYTHONPATH``, or run by `ensure_stand_ins`).

- `parallel_runtime`: vLLM's and vLLM-Omni's process groups on gloo (what vLLM-Omni's diffusion
  worker sets up before it builds a model), for ``world_size`` processes with Ulysses degree
  ``ulysses``.
- `TINY`: the geometry: 2 layers x 2 heads x 64, 3 latent frames per block, 4x4 tokens per
  frame (8x8 latents, patch 1x2x2), sink 3 frames, window 9 frames (max_tokens 144).
- `build_transformer`: vLLM-Omni's ``CausalLingBotWorldTransformer3DModel`` at `TINY` with
  seeded random weights, ``process_weights_after_loading`` run as vLLM's loader runs it.
- `block_inputs` / `run_blocks`: seeded inputs of one block, and LingBot's DMD schedule over
  several blocks (noisy probes with ``update_cache=False``, one committing pass each), the way
  ``LingBotDMDBlockRunner`` drives the transformer.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
STAND_INS = os.path.join(_HERE, "cpu_stand_ins")

#: the tiny transformer's constructor arguments (vLLM-Omni's names)
TINY: dict[str, Any] = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=36,
    out_channels=16, text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2, rope_max_seq_len=256,
    sink_size=3, num_frames_per_block=3, sliding_window_num_frames=9,
)
#: latent height/width of one frame (4x4 tokens after the 1x2x2 patch)
LATENT_HW = (8, 8)
#: noisy DMD probes per block before the committing pass (LingBot's four-step schedule)
PROBES = 4


def ensure_stand_ins() -> None:
    """Run the CPU stand-ins in this process if PYTHONPATH did not (idempotent)."""
    if STAND_INS not in sys.path:
        runpy.run_path(os.path.join(STAND_INS, "sitecustomize.py"))
        sys.path.insert(0, STAND_INS)


@contextlib.contextmanager
def parallel_runtime(world_size: int = 1, rank: int = 0, *, ulysses: int = 1,
                     rendezvous: str | None = None) -> Iterator[None]:
    """vLLM's and vLLM-Omni's process groups on gloo for this process, torn down after.

    ``rendezvous``: the path of the file every rank of the group meets at (torch.distributed's
    ``file://`` rendezvous; it must not exist before the first rank starts). None for a
    one-process group takes a fresh file of its own. No rendezvous port is taken, so nothing
    else on the machine (a second clone testing at once, an outgoing connection given that
    port) can take it between the draw and the bind."""
    ensure_stand_ins()
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.distributed import parallel_state as ps

    with contextlib.ExitStack() as stack:
        if rendezvous is None:
            if world_size != 1:
                raise ValueError("parallel_runtime: a group of several ranks needs the rendezvous "
                                 "file they share")
            rendezvous = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "rdzv")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                            distributed_init_method=f"file://{rendezvous}",
                                            backend="gloo")
            ps.initialize_model_parallel(sequence_parallel_size=ulysses, ulysses_degree=ulysses,
                                         backend="gloo")
            try:
                yield
            finally:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()


def build_transformer(seed: int = 0, dtype=None):
    """vLLM-Omni's causal LingBot-World DiT at `TINY` with seeded N(0, 0.05) weights (RMSNorm
    weights 1), inside `parallel_runtime`."""
    import torch
    from vllm_omni.diffusion.models.lingbot_world.transformer import (
        CausalLingBotWorldTransformer3DModel,
    )

    dtype = dtype or torch.float32
    model = CausalLingBotWorldTransformer3DModel(**TINY)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or ".norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.05)
    for module in model.modules():  # what vLLM's weight loader does after loading
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model.to(dtype).eval()


def block_inputs(block: int, step: int, seed: int = 0, dtype=None) -> dict[str, Any]:
    """Seeded inputs of one transformer call (block ``block``, DMD step ``step``; step
    `PROBES` is the committing pass at t=0)."""
    import torch

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(seed * 100_003 + block * 101 + step)
    frames = TINY["num_frames_per_block"]
    h, w = LATENT_HW
    t = 0.0 if step == PROBES else 1000.0 * (1 - step / PROBES)
    return dict(
        hidden_states=torch.randn(1, TINY["in_channels"], frames, h, w, generator=gen).to(dtype),
        timestep=torch.full((1, frames), t).to(dtype),
        encoder_hidden_states=torch.randn(1, 8, TINY["text_dim"], generator=gen).to(dtype),
        camera_hidden_states=torch.randn(1, 6 * 8 * 8, frames, h, w, generator=gen).to(dtype),
    )


def run_blocks(model, cache, blocks: int, *, seed: int = 0, dtype=None) -> list:
    """LingBot's DMD schedule over ``blocks`` blocks on ``cache``: `PROBES` noisy probes
    (``update_cache=False``) then one committing pass per block; every output, in order."""
    import torch

    frames = TINY["num_frames_per_block"]
    outs = []
    with torch.no_grad():
        for b in range(blocks):
            for step in range(PROBES + 1):
                outs.append(model(**block_inputs(b, step, seed, dtype), cache=cache,
                                  start_frame=b * frames, update_cache=step == PROBES))
    return outs
