"""Runs every parallel-test configuration in ONE torchrun job (tests/test_parallel.py starts it).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/parallel_driver.py OUTDIR

For each configuration of `CONFIGS` x quant off / int2, every rank plans and runs the same
float32 request with ``heads_sharded = world size``; rank 0 saves the latents
(``OUTDIR/<config>-<quant>.pt``) and every rank saves what its caches hold
(``OUTDIR/<config>-<quant>-rank<r>.json``). One job for all configurations: starting Python
and importing torch costs seconds per process on a small machine. The model components of a
configuration are loaded once and reused for both quant settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from causalkv.caches.qvg.options import QVGKVQuantArgs
from causalkv.config import ServerArgs
from causalkv.runtime.host.pipeline_records import GenerateOptions

#: name -> (preset, prompts, frames): every built-in stage; LongLive 2.0 also with a scene cut
#: (two shots: the second shot's first chunk is pinned)
CONFIGS: dict[str, tuple[str, list[str], int | None]] = {
    "wan": ("tiny-wan", ["a lighthouse on a cliff at dusk"], None),
    "longlive": ("tiny-longlive", ["a lighthouse on a cliff at dusk"], None),
    "longlive2": ("tiny-longlive2", ["a lighthouse on a cliff at dusk"], None),
    "longlive2-shots": ("tiny-longlive2", ["a forest", "a city"], 8),
    "lingbot": ("tiny-lingbot", ["a lighthouse on a cliff at dusk"], None),
}
QUANTS = ("off", "int2")


def options_for(config: str, quant: str, world_size: int) -> GenerateOptions:
    """The float32 request of ``config`` with ``quant`` on ``world_size`` ranks."""
    preset, prompts, frames = CONFIGS[config]
    args = ServerArgs(
        options=[QVGKVQuantArgs.from_codec_name(quant)],
        dtype="float32",
        heads_sharded=world_size,
    )
    return GenerateOptions(model=preset, prompts=prompts, frames=frames, server_args=args, quiet=True)


def cache_record(run: Any) -> dict[str, Any]:
    """What this rank's caches hold: heads, global head offset, bytes (all branches)."""
    kv = [c for cs in run.stage.cache_sets() for c in cs.kv]
    return {
        "num_heads": sorted({c.spec.num_heads for c in kv}),
        "head_offsets": sorted({c.spec.head_offset for c in kv}),
        "packed_head_offsets": sorted({c.head_offset for c in kv if hasattr(c, "head_offset")}),
        "cache_types": sorted({type(c).__name__ for c in kv}),
        "kv_resident_bytes_max": run.kv_resident_bytes_max,
        "kv_resident_bytes_final": run.kv_resident_bytes_final,
    }


def main(outdir: str) -> int:
    from causalkv.plugin.testing import fresh_plugin_manager
    from causalkv.runtime.host.load_step import load_for_plan
    from causalkv.runtime.host.plan_step import plan_generation
    from causalkv.runtime.host.report import run_report
    from causalkv.runtime.host.run_step import run_plan
    from causalkv.runtime.processes.distributed import init_parallel, shutdown

    ctx = init_parallel("cpu")
    out = Path(outdir)
    pm = fresh_plugin_manager()
    try:
        for config in CONFIGS:
            components = None
            for quant in QUANTS:
                plan = plan_generation(options_for(config, quant, ctx.world_size), pm=pm)
                if components is None:
                    components = load_for_plan(plan, pm=pm)
                run = run_plan(plan, pm=pm, components=components)
                metrics = run_report(plan, run)
                record = cache_record(run)
                record["metrics"] = {
                    k: metrics[k]
                    for k in ("world_size", "kv_heads_per_rank", "kv_resident_bytes_max",
                              "kv_resident_bytes_max_per_rank", "kv_resident_bytes_max_total")
                }
                name = f"{config}-{quant}"
                (out / f"{name}-rank{ctx.rank}.json").write_text(json.dumps(record))
                if ctx.is_main:
                    torch.save(run.latents, out / f"{name}.pt")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
