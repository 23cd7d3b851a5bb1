"""One rank of the Ulysses test (test_ulysses.py), a fresh process: first vLLM-Omni's own plugin
loader (``load_omni_general_plugins``; what LingBot-World's pipeline then resolves to is
written to ``discovery-RANK.json`` for test_discovery.py), then vLLM-Omni's tiny LingBot-World DiT with
vLLM-Omni's own sequence-parallel hooks (``apply_sequence_parallel`` with the transformer's
``_sp_plan``: tokens split over the ranks, heads exchanged by all-to-all in self-attention) on
gloo, LingBot's DMD schedule over four blocks, vLLM-Omni's dense cache or causalkv's store.

    python ulysses_worker.py RANK WORLD MODES OUT_DIR RENDEZVOUS_FILE   (MODES: e.g. dense,int2)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "demo", "vllm_omni"))

import tiny_lingbot as tl  # noqa: E402

BLOCKS = 4


def run(mode: str, world: int) -> dict:
    """One stream on this rank: every output, and the head offset its store caches."""
    import torch
    from vllm_omni.diffusion.distributed.sp_plan import (
        SequenceParallelConfig,
        get_sp_plan_from_model,
    )
    from vllm_omni.diffusion.forward_context import get_forward_context, set_forward_context
    from vllm_omni.diffusion.hooks.sequence_parallel import apply_sequence_parallel

    model = tl.build_transformer()
    if mode != "dense":
        from causalkv.caches.qvg.options import QVGKVQuantArgs
        from causalkv.vllm_omni.pipeline import install

        install(model, QVGKVQuantArgs.from_codec_name(mode))
    if world > 1:
        apply_sequence_parallel(model, SequenceParallelConfig(ulysses_degree=world),
                                get_sp_plan_from_model(model))
    h, w = tl.LATENT_HW
    cache = model.allocate_cache(batch_size=1, latent_height=h, latent_width=w,
                                 device=torch.device("cpu"), dtype=torch.float32)
    with set_forward_context(omni_diffusion_config=None):
        get_forward_context().sp_plan_hooks_applied = world > 1
        outs = tl.run_blocks(model, cache, BLOCKS)
    layer = cache.self_attention[0]
    offset = layer.spec.head_offset if mode != "dense" else -1
    return {"outs": torch.stack(outs), "head_offset": offset}


def discover(out: str, rank: int) -> None:
    """vLLM-Omni's loader, then the class its registry gives LingBot-World's pipeline."""
    import json

    tl.ensure_stand_ins()
    from vllm_omni.diffusion import registry
    from vllm_omni.diffusion.models.lingbot_world.pipeline import LingBotWorldCausalDMDPipeline
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    name = "LingBotWorldCausalDMDPipeline"
    cls = registry.DiffusionModelRegistry._try_load_model_cls(name)
    with open(os.path.join(out, f"discovery-{rank}.json"), "w") as f:
        json.dump({"module": cls.__module__, "name": cls.__name__,
                   "subclass": issubclass(cls, LingBotWorldCausalDMDPipeline),
                   "entry": list(registry._DIFFUSION_MODELS[name]),
                   "pre": registry._DIFFUSION_PRE_PROCESS_FUNCS[name],
                   "post": registry._DIFFUSION_POST_PROCESS_FUNCS[name]}, f)


def main(rank: int, world: int, modes: list[str], out: str, rendezvous: str) -> None:
    import torch

    discover(out, rank)
    with tl.parallel_runtime(world, rank, ulysses=world, rendezvous=rendezvous):
        for mode in modes:
            torch.save(run(mode, world), os.path.join(out, f"{mode}-{world}-{rank}.pt"))


if __name__ == "__main__":
    r, wsize, m, o, p = sys.argv[1:6]
    main(int(r), int(wsize), m.split(","), o, p)
