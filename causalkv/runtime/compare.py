"""Step 4 of `causalkv.runtime.generate` (``--compare-bf16``): the same request without the
cache's settings (quantization off), on the same seed and components, and how far apart the
two runs' latents and KV bytes are.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from causalkv.options import CacheOptions
from causalkv.plugin import resolve
from causalkv.runtime.records import GenerationRun, Plan
from causalkv.runtime.run import run_plan

__all__ = ["compare_unquantized", "latent_psnr_db"]


def latent_psnr_db(latents: torch.Tensor, reference: torch.Tensor) -> float | None:
    """PSNR of ``latents`` against ``reference`` in dB (None when they are identical).

    Peak = ``reference.max() - reference.min()``; PSNR = 10 log10(peak^2 / MSE), in float64.
    """
    ref = reference.double()
    mse = float(((latents.double() - ref) ** 2).mean())
    if mse == 0.0:
        return None
    peak = float(ref.max() - ref.min())
    return 10.0 * math.log10(peak * peak / mse)


def compare_unquantized(plan: Plan, run: GenerationRun, *, pm: Any = None) -> dict[str, Any]:
    """Rerun ``plan`` without any cache's settings and without a forced cache (so with
    quantization off), same seed, same components; the comparison metrics."""
    plugins = plan.plugin_set(pm)
    ref_args = replace(plan.server_args.without_options(CacheOptions), cache=None)
    ref_res = resolve(plan.model, ref_args, pm=plugins.pm, stage=plan.stage_name, registry=plugins.registry)
    ref = run_plan(plan, pm=plugins.pm, components=run.components, server_args=ref_args, resolution=ref_res)
    psnr = latent_psnr_db(run.latents, ref.latents)
    return {
        "reference_cache": ref_res.cache_factory.name,
        "latent_psnr_db": psnr,
        "latent_identical": psnr is None,
        "latent_max_abs_diff": float((run.latents - ref.latents).abs().max()),
        "reference_kv_resident_bytes_max": ref.kv_resident_bytes_max,
        "reference_kv_peak_bytes": ref.stage.kv_peak_nbytes(),
        "reference_seconds_per_chunk_mean": ref.seconds_per_chunk_mean,
        "kv_compression_vs_reference": ref.kv_resident_bytes_max / max(1, run.kv_resident_bytes_max),
    }
