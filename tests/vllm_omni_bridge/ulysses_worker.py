"""One rank of the Ulysses test (test_ulysses.py): vLLM-Omni's tiny LingBot-World DiT with
vLLM-Omni's own sequence-parallel hooks (``apply_sequence_parallel`` with the transformer's
``_sp_plan``: tokens split over the ranks, heads exchanged by all-to-all in self-attention) on
gloo, LingBot's DMD schedule over four blocks, vLLM-Omni's dense cache or causalkv's store.

    python ulysses_worker.py RANK WORLD MODES OUT_DIR PORT   (MODES: e.g. dense,int2)
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

        install(model, QVGKVQuantArgs.from_bits_name(mode))
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


def main(rank: int, world: int, modes: list[str], out: str, port: int) -> None:
    import torch

    with tl.parallel_runtime(world, rank, ulysses=world, port=port):
        for mode in modes:
            torch.save(run(mode, world), os.path.join(out, f"{mode}-{world}-{rank}.pt"))


if __name__ == "__main__":
    r, wsize, m, o, p = sys.argv[1:6]
    main(int(r), int(wsize), m.split(","), o, int(p))
