"""Step 4 of `causalkv.runtime.host.generate` (``--compare-bf16``): the same request without the
cache's settings (quantization off) and with bf16 caches (or the reference dtype the request
names, ``--compare-dtype``), on the same seed and components, how far apart the two runs'
latents and KV bytes are, and how long a chunk takes with each setting, timed fairly.

The timing: the run and its reference are the warm-up; then `TIMING_REPEATS` more runs of
each setting, alternating (this setting, the reference, this setting, ...) in this one
process on the same components, and each setting's least total over its repeats, per chunk
(``seconds_per_chunk_best``), with every timed run's figure (``seconds_per_chunk_runs``) so
the table shows the spread. One run each, timed once, says little: the first run in a process
pays for warming up and whatever else the machine runs lands on one of the two.
`compare_table` is the end-of-run summary the command line prints.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from causalkv.memory.records import format_bytes, format_columns
from causalkv.options import CacheOptions
from causalkv.runtime.host.pipeline_records import GenerationRun, Plan
from causalkv.runtime.host.resolve import resolve
from causalkv.runtime.host.run_step import run_plan

__all__ = ["REFERENCE_DTYPE", "TIMING_REPEATS", "compare_table", "compare_unquantized", "latent_psnr_db"]

#: timed runs of each setting after the warm-up pair (`compare_unquantized`)
TIMING_REPEATS = 3
#: the reference run's KV-cache dtype unless the request names another (``--compare-dtype``)
REFERENCE_DTYPE = "bfloat16"


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


def cache_class(run: GenerationRun) -> str:
    """``module:qualname`` of the KV cache class ``run`` ran on (its first layer's)."""
    cls = type(run.stage.caches.kv[0])
    return f"{cls.__module__}:{cls.__qualname__}"


def compare_unquantized(
    plan: Plan, run: GenerationRun, *, pm: Any = None, repeats: int = TIMING_REPEATS,
    reference_dtype: str = REFERENCE_DTYPE,
) -> dict[str, Any]:
    """Rerun ``plan`` without any cache's settings and without a forced cache (so with
    quantization off), with ``reference_dtype`` caches (bf16 unless named: the run's own
    ``--dtype float32`` would double the reference's bytes), same seed, same components; then
    ``repeats`` timed runs of each setting, alternating (``0``: no timing, ``None`` for the
    best times); the comparison metrics. The timed runs are full runs of the request
    (``causalkv_chunk_done`` sees their chunks)."""
    plugins = plan.plugin_set(pm)
    ref_args = replace(plan.server_args.without_options(CacheOptions), cache=None,
                       kv_cache_dtype=reference_dtype)
    ref_res = resolve(plan.model, ref_args, pm=plugins.pm, stage=plan.resolution.stage_name,
                      registry=plugins.registry)
    settings = {False: {}, True: {"server_args": ref_args, "resolution": ref_res}}

    def again(reference: bool) -> GenerationRun:
        return run_plan(plan, pm=plugins.pm, components=run.components, **settings[reference])

    ref = again(True)
    timed: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for reference in (False, True):
            timed[reference].append(again(reference).seconds_per_chunk_mean)
    best = {k: min(v) if v else None for k, v in timed.items()}
    psnr = latent_psnr_db(run.latents, ref.latents)
    return {
        "random_weights": plan.info.preset is not None,
        "reference_cache": ref_res.cache_factory.name,
        "reference_kv_cache_dtype": reference_dtype,
        "cache_class": cache_class(run),
        "reference_cache_class": cache_class(ref),
        "latent_psnr_db": psnr,
        "latent_identical": psnr is None,
        "latent_max_abs_diff": float((run.latents - ref.latents).abs().max()),
        "reference_kv_resident_bytes_max": ref.kv_resident_bytes_max,
        "reference_kv_peak_bytes": ref.stage.kv_peak_nbytes(),
        "reference_seconds_per_chunk_mean": ref.seconds_per_chunk_mean,
        "timing_repeats": repeats,
        "seconds_per_chunk_best": best[False],
        "reference_seconds_per_chunk_best": best[True],
        "seconds_per_chunk_runs": timed[False],
        "reference_seconds_per_chunk_runs": timed[True],
        "kv_compression_vs_reference": ref.kv_resident_bytes_max / max(1, run.kv_resident_bytes_max),
    }


def bytes_ratio(reference: int, measured: int) -> str:
    """``"4.00x smaller"`` when ``measured`` holds less than ``reference``, ``"1.07x larger"``
    when more (a peak that one call's buffer lifts above the reference on a model of few
    layers), ``"same"`` when equal."""
    if measured == reference:
        return "same"
    if measured < reference:
        return f"{reference / max(1, measured):.2f}x smaller"
    return f"{measured / max(1, reference):.2f}x larger"


def _spread(seconds: list[float]) -> str:
    return f"{min(seconds):.3f}-{max(seconds):.3f}"


def compare_table(metrics: dict[str, Any]) -> str:
    """The end-of-run summary of a ``--compare-bf16`` run: the cache each setting ran on, KV
    bytes, latent PSNR and seconds per chunk of the quantized run next to the unquantized
    reference (same seed), and what the PSNR means on a preset's random weights.

    Reads ``model``, ``random_weights``, ``cache``/``reference_cache``, ``cache_class``/``reference_cache_class``,
    ``reference_kv_cache_dtype`` (the reference column's title: ``off (bfloat16)``),
    ``kv_resident_bytes_max``, ``reference_kv_resident_bytes_max``, ``kv_peak_bytes``,
    ``reference_kv_peak_bytes``, ``latent_psnr_db``, ``timing_repeats``,
    ``seconds_per_chunk_best``, ``reference_seconds_per_chunk_best`` and their timed runs
    ``seconds_per_chunk_runs`` / ``reference_seconds_per_chunk_runs`` (the spread row); no
    time rows without timed repeats. Bytes in binary units (`format_bytes`, as ``causalkv
    memory``), the ratios from the exact counts.
    """
    quant = str((metrics.get("cache_settings") or {}).get("kv_cache_quant") or "quantized")
    ref_name = f"off ({metrics.get('reference_kv_cache_dtype', REFERENCE_DTYPE)})"
    ref_b, q_b = metrics["reference_kv_resident_bytes_max"], metrics["kv_resident_bytes_max"]
    ref_p, q_p = metrics["reference_kv_peak_bytes"], metrics["kv_peak_bytes"]
    psnr = metrics["latent_psnr_db"]

    def cache(prefix: str) -> str:
        cls = str(metrics.get(f"{prefix}cache_class", "?")).rsplit(":", 1)[-1]
        return f"{metrics.get(f'{prefix}cache', '?')}: {cls}"

    rows = [
        ("", ref_name, quant, "ratio"),
        ("causalkv cache", cache("reference_"), cache(""), ""),
        ("KV bytes (max resident)", format_bytes(ref_b), format_bytes(q_b), bytes_ratio(ref_b, q_b)),
        ("KV bytes (peak: all layers, one call's buffer)", format_bytes(ref_p),
         format_bytes(q_p), bytes_ratio(ref_p, q_p)),
        ("latent PSNR vs off (*)", "-", "identical" if psnr is None else f"{psnr:.1f} dB", ""),
    ]
    ref_s, q_s = metrics.get("reference_seconds_per_chunk_best"), metrics.get("seconds_per_chunk_best")
    if ref_s is not None and q_s is not None:
        n = metrics["timing_repeats"]
        rows.append((f"seconds per chunk (least of {n} warm runs, alternating)",
                     f"{ref_s:.3f}", f"{q_s:.3f}", f"{q_s / max(ref_s, 1e-9):.2f}x time"))
        ref_runs, q_runs = metrics.get("reference_seconds_per_chunk_runs"), metrics.get("seconds_per_chunk_runs")
        if ref_runs and q_runs:
            rows.append((f"  spread of the {n} warm runs (least-most)", _spread(ref_runs),
                         _spread(q_runs), ""))
    table = "\n".join(format_columns(rows))
    model = metrics.get("model", "the model")
    weights = "a preset: RANDOM weights" if metrics.get("random_weights") else "its own weights"
    note = (f"(*) the weights are random: the PSNR says how far the {quant} run's latents drift "
            f"from the off run's, not how good either video is" if metrics.get("random_weights")
            else f"(*) how far the {quant} run's latents drift from the off run's")
    return f"causalkv generate --compare-bf16 on {model} ({weights}), same seed:\n{table}\n{note}"
