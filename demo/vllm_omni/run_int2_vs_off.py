"""causalkv inside vLLM-Omni on a CPU: LingBot-World's causal DiT (tiny, random weights) through
vLLM-Omni 0.30.0's own classes, vLLM-Omni's dense cache against causalkv's store (off, int4, int2).

What runs: vLLM-Omni's ``load_omni_general_plugins`` (it finds causalkv's entry point and
registers causalkv's LingBot-World pipeline), then vLLM-Omni's
``CausalLingBotWorldTransformer3DModel`` at a tiny geometry (2 layers x 2 heads x 64, 3-frame
blocks, sink 3 / window 9 frames) driven block by block with LingBot's DMD schedule (four noisy
probes with ``update_cache=False``, one committing pass), once with vLLM-Omni's own
``LingBotAttentionCache`` and once per setting with causalkv's store put on it by
``causalkv.vllm_omni.pipeline.install`` (what the registered pipeline does after it is built).
Why not the whole pipeline: docs/vllm_omni.md, "What runs on a CPU". Prints one table: the
cache class of each run, the KV bytes (peak and resident, all layers) against vLLM-Omni's dense
cache, and the latents' PSNR against the dense run, labelled as drift (random weights).

    PYTHONPATH=demo/vllm_omni/cpu_stand_ins .venv-vllm-omni/bin/python demo/vllm_omni/run_int2_vs_off.py
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_lingbot as tl  # noqa: E402

SETTINGS = ("off", "int4", "int2")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
                  ).rstrip()
        for r in rows
    )


def psnr(x, ref) -> float:
    """PSNR of ``x`` against ``ref`` over ``ref``'s value range (inf when identical)."""
    mse = float(((x.double() - ref.double()) ** 2).mean())
    span = float(ref.double().max() - ref.double().min())
    return math.inf if mse == 0 else 10 * math.log10(span * span / mse)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6, help="causal blocks of 3 latent frames (default 6)")
    blocks = parser.parse_args(argv).blocks
    tl.ensure_stand_ins()
    import torch
    from vllm_omni.diffusion import registry
    from vllm_omni.plugins import load_omni_general_plugins

    load_omni_general_plugins()
    cls = registry.DiffusionModelRegistry._try_load_model_cls("LingBotWorldCausalDMDPipeline")
    print(f"vLLM-Omni's plugin loader: LingBotWorldCausalDMDPipeline -> {cls.__module__}.{cls.__name__}")
    from causalkv.caches.qvg.options import QVGKVQuantArgs
    from causalkv.vllm_omni.pipeline import install

    dtype = torch.bfloat16
    h, w = tl.LATENT_HW
    runs = {}
    with tl.parallel_runtime():
        for mode in ("dense", *SETTINGS):
            model = tl.build_transformer(dtype=dtype)
            if mode != "dense":
                install(model, QVGKVQuantArgs.from_codec_name(mode))
            cache = model.allocate_cache(batch_size=1, latent_height=h, latent_width=w,
                                         device=torch.device("cpu"), dtype=dtype)
            outs = tl.run_blocks(model, cache, blocks, dtype=dtype)
            latents = torch.cat(outs[tl.PROBES::tl.PROBES + 1], dim=2)  # each block's final pass
            runs[mode] = (type(cache.self_attention[0]).__name__, latents,
                          getattr(model, "causalkv_ledger", None), cache)
    dense_cache = runs["dense"][3]
    dense = sum(c.key.nbytes + c.value.nbytes for c in dense_cache.self_attention)
    ref = runs["dense"][1]
    rows = [("", "vLLM-Omni dense", *SETTINGS)]
    rows.append(("KV cache class", runs["dense"][0],
                 *(f"{runs[m][0]} -> QVGPackedCausalKVCache" if m == "off" else "same" for m in SETTINGS)))
    rows.append(("KV bytes (peak: all layers + one call's", f"{dense + runs['off'][2].transient_bytes:,}",
                 *(f"{runs[m][2].peak_bytes:,}" for m in SETTINGS)))
    rows.append(("  visible K/V)", "", "", "", ""))
    rows.append(("KV bytes (resident, end)", f"{dense:,}",
                 *(f"{runs[m][2].resident_bytes:,}" for m in SETTINGS)))
    rows.append(("vLLM-Omni's dense cache allocates", f"{dense:,}", *(f"{dense:,}" for _ in SETTINGS)))
    rows.append(("resident / dense", "1.00", *(f"{runs[m][2].resident_bytes / dense:.2f}" for m in SETTINGS)))
    rows.append(("latent PSNR vs dense (*)", "-",
                 *("identical" if (p := psnr(runs[m][1], ref)) == math.inf else f"{p:.1f} dB"
                   for m in SETTINGS)))
    print(f"\ncausalkv inside vLLM-Omni 0.30.0: LingBot-World's causal DiT, tiny, RANDOM weights "
          f"({tl.TINY['num_layers']} layers x {tl.TINY['num_attention_heads']} heads x "
          f"{tl.TINY['attention_head_dim']}, {blocks} blocks of 3 latent frames, 16 tokens per "
          "frame, sink 3 / window 9 frames, bf16)")
    print(_table(rows))
    print("(*) the weights are random: the PSNR says how far each setting's latents drift from "
          "vLLM-Omni's dense cache on the same inputs, not how good a video is. At this size one "
          "packed chunk carries its codebook over 48 tokens; at LingBot-World's geometry see "
          "`causalkv memory lingbot --host vllm-omni`.")
    off = runs["off"][1]
    if not torch.equal(off, ref):
        print("error: quantization off differs from vLLM-Omni's dense cache", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
